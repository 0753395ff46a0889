"""A small generation API: network + tokenizer (+ encoder for conditional models) + config.

``ELFPipeline.from_pretrained(source)`` takes any model source of ELF_SPEC §10 (an elflow folder, a
run folder, an authors' checkpoint or a Hub id). ``generate`` runs the sampler of ``sampling.py``
with per-sample generators, so text ``i`` of a run depends on (seed, i) only, never on the batch
size; conditional models run the frozen encoder once on the sources.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from elflow.config import SamplerConfig
from elflow.errors import ELFError
from elflow.generation.engine import infill_batch, make_rows, run_rows
from elflow.generation.infill import InfillRequest, as_requests
from elflow.generation.infill_texts import fill_vocabulary
from elflow.generation.outputs import Generation, Infilled
from elflow.generation.pipeline_export import ModelFolderMixin
from elflow.generation.request_checks import (
    check_batch_size,
    check_device,
    check_encoder,
    check_length_range,
    check_sample_count,
    check_seeds,
)
from elflow.io.artifact import ArtifactConfig, load_resolved
from elflow.io.model_sources import resolve_source
from elflow.model import ELF
from elflow.sampling import Condition, Seeds, StepCallback, seeds_of
from elflow.sampling.infill_maths import FillVocabulary
from elflow.sampling.projection import Projection
from elflow.text.encoder import FrozenEncoder
from elflow.text.tokenizer import check_tokenizer, load_tokenizer, model_tokenizer
from elflow.text.tokens import (
    TokenSpec,
    build_unconditional_row,
    detokenize,
    shift_out_source,
    token_spec,
    tokenize,
)


def model_encoder(config: ArtifactConfig) -> FrozenEncoder:
    """The frozen encoder a model was trained with: its encoder, layer and latent normalisation."""
    return FrozenEncoder.from_pretrained(
        config.encoder,
        latent_mean=config.latent_mean,
        latent_std=config.latent_std,
        layer=config.encoder_layer,
    )


class ELFPipeline(ModelFolderMixin):
    """Generate text with an ELF model."""

    def __init__(
        self,
        model: ELF,
        config: ArtifactConfig,
        tokenizer: Any,
        encoder: FrozenEncoder | None = None,
    ) -> None:
        check_tokenizer(tokenizer, config)
        if config.conditional and encoder is None:
            raise ELFError("a conditional model needs its frozen encoder to encode the sources")
        if encoder is not None and config.conditional:  # an unconditional model never uses it
            check_encoder(encoder, config, next(model.parameters()).device)
        self.model = model.eval()
        self.config = config
        self.tokenizer = tokenizer
        self.encoder = encoder
        self.tokens: TokenSpec = token_spec(tokenizer)
        self._lock = threading.Lock()
        self._valid_samplers: set[SamplerConfig] = set()

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @classmethod
    def from_pretrained(
        cls,
        source: str | Path,
        *,
        device: torch.device | str = "cpu",
        use_ema: bool = True,
        task: str | None = None,
        tokenizer: Any = None,
        encoder: FrozenEncoder | None = None,
    ) -> ELFPipeline:
        """Build from any model source; the tokenizer/encoder come from its config unless given
        (a given encoder is moved to ``device`` and must match the model's latent space).

        A ``tokenizer/`` folder inside an elflow model folder is preferred over ``config.tokenizer``
        (so small models can ship their vocabulary).
        """
        device = check_device(device)
        resolved = resolve_source(source)
        model, config = load_resolved(resolved, use_ema, device, task)
        if tokenizer is None:
            tokenizer = load_tokenizer(model_tokenizer(resolved.path, config))
        elif isinstance(tokenizer, (str, Path)):
            tokenizer = load_tokenizer(tokenizer)
        if encoder is None and config.conditional:
            encoder = model_encoder(config)
        return cls(model, config, tokenizer, None if encoder is None else encoder.to(device))

    @property
    def row_pad_id(self) -> int:
        """The id ``elflow train`` padded this model's rows with (EOS under EOS padding)."""
        return self.tokens.row_pad_id(self.config.pad_with_eos)

    def training_rows(self, texts: Sequence[str]) -> tuple[Tensor, Tensor]:
        """Texts as unconditional rows, truncated to the model's length and padded as ``elflow
        train`` pads them (EOS when the model was trained on EOS padding): (ids, mask), (B, L)."""
        return self.rows_of(tokenize(self.tokenizer, list(texts)))

    def rows_of(self, ids: Sequence[Sequence[int]]) -> tuple[Tensor, Tensor]:
        """:meth:`training_rows` of texts already tokenised (with the special tokens)."""
        L = self.config.model.max_length
        rows = [build_unconditional_row(i, L, self.row_pad_id) for i in ids]
        return torch.tensor([r[0] for r in rows]), torch.tensor([r[1] for r in rows])

    @property
    def sampler(self) -> SamplerConfig:
        """The model's sampler defaults; change fields with ``dataclasses.replace``."""
        return self.config.sampler

    def frozen_encoder(self, what: str) -> FrozenEncoder:
        """The model's frozen encoder (loaded from its config on first use, or the one given),
        which ``what`` needs (an unconditional model samples without it otherwise)."""
        with self._lock:  # two threads' first uses load it once
            if self.encoder is None:
                try:
                    self.encoder = model_encoder(self.config).to(self.device)
                except ELFError as e:
                    raise ELFError(f"{e} ({what} needs this model's encoder)") from None
        check_encoder(self.encoder, self.config, self.device)
        return self.encoder

    def projection(self) -> Projection:
        """What projected sampling needs: the model's frozen encoder and the ids that end and pad
        its rows."""
        self.config.check_projectable("sampler.project_from < 1")
        what = "projected sampling; sampler.project_from=1.0 samples without it, and"
        encoder = self.frozen_encoder(what)
        return Projection(encoder, self.tokens.eos_id, self.row_pad_id)

    @functools.cached_property
    def fill_vocabulary(self) -> FillVocabulary:
        """What an infilling gap may not hold (special tokens; word continuations after a
        kept word)."""
        return fill_vocabulary(self.tokenizer)

    def encode_sources(self, sources: Sequence[str]) -> tuple[Condition, Tensor]:
        """Tokenise and encode sources -> (clean condition latents, (B, L) condition mask)."""
        cfg = self.config
        if not cfg.conditional:
            raise ELFError(
                "this model is unconditional: it takes no sources (sources=); ask for a number "
                "of samples (n=) instead"
            )
        # Slice like the training rows (tokens.build_conditional_row), not HF truncation, which
        # would keep the EOS and so encode over-long sources differently than in training.
        ids = [row[: cfg.max_input_length] for row in tokenize(self.tokenizer, list(sources))]
        L, B = cfg.model.max_length, len(ids)
        input_ids = torch.full((B, L), self.tokens.pad_id, dtype=torch.long)
        cond_mask = torch.zeros(B, L, dtype=torch.long)
        for i, row in enumerate(ids):
            input_ids[i, : len(row)] = torch.tensor(row)
            cond_mask[i, : len(row)] = 1
        input_ids, cond_mask = input_ids.to(self.device), cond_mask.to(self.device)
        latents = self.encoder(input_ids, cond_mask, cond_mask)  # source attends to source only
        return Condition(latents.to(self.device), cond_mask), cond_mask

    def prepare(
        self, sampler: SamplerConfig | None, n: int | None, sources: Sequence[str] | None
    ) -> tuple[SamplerConfig, int, Projection | None]:
        """Check a request once, before any work: (the sampler, the number of samples, the
        projection it needs). The settings are checked by ``ArtifactConfig.check_sampler``."""
        sampler = self._checked(sampler)
        n = check_sample_count(self.config, n, sources)
        projection = None
        if sampler.length_range:  # kept latents and projection go through the encoder
            self.frozen_encoder("length control (sampler.length_range)")
        elif sampler.project_from < 1.0:
            projection = self.projection()
        return sampler, n, projection

    def check_sampler(self, sampler: SamplerConfig) -> SamplerConfig:
        """``sampler`` checked against this model (``ArtifactConfig.check_sampler``) once: a
        sampler that passed is remembered, so a run's batches and seeds do not check it again."""
        if sampler not in self._valid_samplers:
            self.config.check_sampler(sampler)
            check_length_range(self.config, self.tokenizer, sampler)
            if len(self._valid_samplers) >= 256:  # a server sees many; keep the memory bounded
                self._valid_samplers.clear()
            self._valid_samplers.add(sampler)
        return sampler

    def _checked(self, sampler: SamplerConfig | None) -> SamplerConfig:
        """``sampler`` (default: the model's) checked against the model, and the weights fp32."""
        if sampler is None:
            sampler = self.sampler
        elif not isinstance(sampler, SamplerConfig):
            raise ELFError(
                f"sampler must be a SamplerConfig, got {type(sampler).__name__} {sampler!r}; e.g. "
                "dataclasses.replace(pipe.sampler, sampler='sde', steps=32)"
            )
        self.check_sampler(sampler)
        dtype = next(self.model.parameters()).dtype
        if dtype != torch.float32:
            raise ELFError(
                f"the model's weights are {dtype}; sampling takes fp32 weights (as loaded) and "
                "gets bf16 speed from autocast (torch.autocast around generate)"
            )
        return sampler

    @torch.no_grad()
    def sample_batch(
        self,
        indices: Sequence[int],
        sampler: SamplerConfig,
        *,
        sources: Sequence[str] | None = None,
        seed: Seeds = 0,
        trajectory: bool = False,
        projection: Projection | None = None,
        callback_on_step_end: StepCallback | None = None,
        cuda_graphs: bool | None = None,
    ) -> Generation:
        """Samples ``indices`` (one per source when conditional) in one batch, unchecked: call
        :meth:`prepare` once first. Sample i depends on (its seed, i) only, whatever else is in
        the batch; ``seed`` is one for all or one per sample (:mod:`elflow.generation.engine`)."""
        out = run_rows(
            self,
            make_rows(indices, seed=seed, sources=sources),
            sampler,
            projection=projection,
            trajectory=trajectory,
            callback_on_step_end=callback_on_step_end,
            cuda_graphs=cuda_graphs,
        )
        return Generation(out.texts, out.tokens, out.trajectory)  # length control: infilled

    def generate_full(
        self,
        n: int | None = None,
        *,
        sources: Sequence[str] | None = None,
        sampler: SamplerConfig | None = None,
        seed: Seeds = 0,
        batch_size: int = 32,
        trajectory: bool = False,
        callback_on_step_end: StepCallback | None = None,
        cuda_graphs: bool | None = None,
    ) -> Generation:
        """``pipe(n)`` / ``pipe(sources=[...])``, the transformers and diffusers way: like
        :meth:`generate`, returning a :class:`Generation` with ``texts``, ``tokens`` and, when
        asked for, the per-step ``trajectory``; ``callback_on_step_end`` gets each batch's
        :class:`elflow.sampling.sample_loop.StepState` after every step. ``seed``: one for every
        sample (sample i depends on (seed, i)), or a list of one per sample. ``cuda_graphs``: each
        step replays a captured CUDA graph (None: on CUDA, eager elsewhere; False: eager; True
        off CUDA: an error; docs/sampling.md)."""
        sampler, n, projection = self.prepare(sampler, n, sources)
        check_batch_size(batch_size)
        check_seeds(seed, n)
        parts = []
        for start in range(0, n, batch_size):
            idx = range(start, min(n, start + batch_size))
            batch_sources = None if sources is None else [sources[i] for i in idx]
            parts.append(
                self.sample_batch(
                    idx,
                    sampler,
                    sources=batch_sources,
                    seed=seeds_of(seed, idx.start, idx.stop),
                    trajectory=trajectory,
                    projection=projection,
                    callback_on_step_end=callback_on_step_end,
                    cuda_graphs=cuda_graphs,
                )
            )
        return Generation.joined(parts)

    def to(self, device: torch.device | str) -> ELFPipeline:
        """Move the model (and the encoder, if loaded) to ``device``; returns the pipeline.
        Sampling precision is chosen per call (``elflow.runtime.hardware``'s bf16 autocast on
        CUDA), so the weights stay fp32."""
        device = check_device(device)
        self.model.to(device)
        if self.encoder is not None:
            self.encoder = self.encoder.to(device)
        return self

    __call__ = generate_full

    def generate(
        self,
        n: int | None = None,
        *,
        sources: Sequence[str] | None = None,
        sampler: SamplerConfig | None = None,
        seed: Seeds = 0,
        batch_size: int = 32,
        cuda_graphs: bool | None = None,
    ) -> list[str]:
        """Generate ``n`` texts (unconditional) or one text per source (conditional).

        ``sampler`` defaults to the model's (:attr:`sampler`; e.g. ELF-B: 32-step SDE, gamma 1.5,
        w 3, logit-normal(-1.5, 0.8) time grid; conditional: 64-step ODE, cfg 2, w 1); change
        fields with ``dataclasses.replace(pipe.sampler, steps=8)``; ``cuda_graphs`` as
        :meth:`generate_full`.
        """
        return self.generate_full(
            n,
            sources=sources,
            sampler=sampler,
            seed=seed,
            batch_size=batch_size,
            cuda_graphs=cuda_graphs,
        ).texts

    def infill(
        self,
        requests: Sequence[str | InfillRequest | dict],
        *,
        sampler: SamplerConfig | None = None,
        seed: Seeds = 0,
        batch_size: int = 32,
        trajectory: bool = False,
        cuda_graphs: bool | None = None,
    ) -> Infilled:
        """Fill the gaps of ``requests``: templates (``"In the beginning [___] the earth."``,
        gaps ``[___]``, ``[___N]``, ``[___A-B]`` tokens), :class:`InfillRequest` objects, or
        JSONL-style dicts (a template in ``text``, or ``ids`` and ``keep``; ``source`` for a
        conditional model). Kept tokens are held at clean latents at every step (an elflow
        addition; ``sampler.refresh_from`` recomputes them from the current fill).
        ``cuda_graphs`` as :meth:`generate_full` (a refresh runs eagerly)."""
        sampler = self._checked(sampler)
        if sampler.length_range:
            raise ELFError("sampler.length_range applies to generate; an infill's gaps set theirs")
        check_batch_size(batch_size)
        if isinstance(requests, (str, dict, InfillRequest)):  # one request, not a list of them
            raise ELFError("requests must be a list; wrap a single template in a list")
        parsed = as_requests(requests)
        check_seeds(seed, len(parsed))
        self.frozen_encoder("infilling")
        parts = [
            infill_batch(
                self,
                parsed[start : start + batch_size],
                sampler,
                seed=seeds_of(seed, start, start + batch_size),
                indices=range(start, min(len(parsed), start + batch_size)),
                trajectory=trajectory,
                cuda_graphs=cuda_graphs,
            )
            for start in range(0, len(parsed), batch_size)
        ]
        return Infilled.joined(parts)

    def strip_source(self, tokens: Tensor, cond_mask: Tensor | None) -> Tensor:
        """A conditional model's target tokens (each row shifted past its source)."""
        if cond_mask is None:
            return tokens
        keep = self.config.model.max_length - self.config.max_input_length
        return shift_out_source(tokens, cond_mask, keep, self.tokens.pad_id)

    def detokenize(self, tokens: Tensor, cond_mask: Tensor | None = None) -> list[str]:
        """Texts of generated rows: the target cut at its first EOS, special tokens dropped."""
        target = self.strip_source(tokens, cond_mask)
        return detokenize(self.tokenizer, target, self.tokens.eos_id, self.tokens.pad_id)
