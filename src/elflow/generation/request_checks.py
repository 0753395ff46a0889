"""One-line checks of what a generation call is given (an elflow addition): the device, the
seeds, the batch size, the number of samples or the sources, a given encoder, and a sampler's
``length_range`` against the model's rows. Each failure is an :class:`~elflow.errors.ELFError`
saying what to fix."""

from __future__ import annotations

import operator
from collections.abc import Sequence
from typing import Any

import torch

from elflow.config import SamplerConfig, length_bounds
from elflow.errors import ELFError
from elflow.generation.infill import words_to_tokens
from elflow.io.artifact import ArtifactConfig
from elflow.sampling import Seeds
from elflow.text.encoder import FrozenEncoder
from elflow.text.tokens import tokenize


def check_encoder(encoder: FrozenEncoder, config: ArtifactConfig, device: torch.device) -> None:
    """A given encoder must have the model's latent width, layer and normalisation, and sit on
    its device. (Which encoder it is cannot be checked: the config records only its name.)"""
    given = (encoder.hidden_size, encoder.layer, encoder.latent_mean, encoder.latent_std)
    wanted = (config.model.encoder_dim, config.encoder_layer, config.latent_mean, config.latent_std)
    if given != wanted:
        raise ELFError(
            f"the encoder given has width, layer, latent_mean, latent_std {given}, but the model "
            f"was trained on {wanted}; build it with "
            "elflow.generation.pipeline.model_encoder(config), or pass none"
        )
    at = next(encoder.model.parameters()).device
    if at != device:
        raise ELFError(f"the encoder is on {at} but the model on {device}; move it (.to(device))")


def check_seeds(seed: Seeds, n: int) -> None:
    """``seed`` is one int, or one int per sample."""
    if isinstance(seed, bool) or not isinstance(seed, int):
        if isinstance(seed, (str, bytes)) or not all(
            isinstance(s, int) and not isinstance(s, bool) for s in seed
        ):
            raise ELFError(f"seed must be an int or a list of ints, got {seed!r}")
        if len(seed) != n:
            raise ELFError(f"{len(seed)} seeds for {n} samples; give one seed, or one per sample")


def check_device(device: torch.device | str) -> torch.device:
    """``device`` as a device this process has, or a one-line error (not torch's traceback)."""
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        raise ELFError(
            f"device {device!r} is not a device; use 'cpu', 'cuda' or 'cuda:K'"
        ) from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ELFError(f"device {device!r}: no CUDA device is available here; use 'cpu'")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise ELFError(
                f"device {device!r}: there are {torch.cuda.device_count()} CUDA devices "
                f"(cuda:0 to cuda:{torch.cuda.device_count() - 1})"
            )
    elif dev.type != "cpu":
        backend = getattr(torch, dev.type, None) or getattr(torch.backends, dev.type, None)
        available = getattr(backend, "is_available", None)
        if available is None or not available():
            raise ELFError(f"device {device!r} is not available here; use 'cpu' or 'cuda'")
    return dev


def _is_count(n: Any) -> bool:
    """An integer (a Python or NumPy one), not a bool."""
    if isinstance(n, bool):
        return False
    try:
        operator.index(n)
    except TypeError:
        return False
    return True


def check_batch_size(batch_size: int) -> None:
    if batch_size < 1:
        raise ELFError(f"batch_size= must be >= 1, got {batch_size}")


def check_sample_count(config: ArtifactConfig, n: int | None, sources: Sequence[str] | None) -> int:
    """The number of samples a call asks for: ``n`` (unconditional) or one per source
    (conditional), checked against the model's kind."""
    if isinstance(sources, str):  # would give one sample per character
        raise ELFError("sources must be a list of strings; wrap a single source in a list")
    if sources is not None:
        for i, source in enumerate(sources):
            if not isinstance(source, str):
                raise ELFError(f"source {i} is a {type(source).__name__}, not a string")
        if n is not None and n != len(sources):
            raise ELFError(
                f"asked for {n} samples with {len(sources)} sources: a conditional model "
                "writes one sample per source; drop n="
            )
        n = len(sources)
    elif n is not None and not _is_count(n):
        hint = ""
        if isinstance(n, str):
            hint = (
                "; a source goes in sources=[...]"
                if config.conditional
                else ("; text with gaps to fill goes to pipe.infill([...])")
            )
        raise ELFError(f"n= is the number of samples, an int; got {type(n).__name__} {n!r}{hint}")
    if config.conditional and sources is None:
        raise ELFError("this model is conditional: give source texts (sources=)")
    if not config.conditional and sources is not None:
        raise ELFError(
            "this model is unconditional: it takes no sources (sources=); ask for a number "
            "of samples (n=) instead"
        )
    if n is None or n < 1:
        raise ELFError(
            f"asked for {n} samples; ask for at least 1 (n=), or give at least one source"
        )
    return n


def check_length_range(config: ArtifactConfig, tokenizer: Any, sampler: SamplerConfig) -> None:
    """A token or word ``length_range`` must fit the rows with the tokenizer's special
    tokens (its texts are one-gap templates: a longer draw would fail mid-run)."""
    if sampler.length_range in ("", "data") or config.conditional:
        return
    _, hi, words = length_bounds(sampler.length_range)
    most = words_to_tokens(hi, config.tokens_per_word) if words else hi
    special = len(tokenize(tokenizer, [""])[0])
    room = config.model.max_length - special
    if most > room:
        raise ELFError(
            f"sampler.length_range {sampler.length_range} reaches {most} tokens of text; "
            f"this model's rows hold at most {room} ({config.model.max_length} less "
            f"{special} special tokens)"
        )
