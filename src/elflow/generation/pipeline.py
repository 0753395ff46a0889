"""A small generation API: network + tokenizer (+ encoder for conditional models) + config.

``ELFPipeline.from_pretrained(source)`` takes any model source of ELF_SPEC §10 (an elflow folder, a
run folder, an authors' checkpoint or a Hub id). ``generate`` runs the sampler of ``sampling.py``
with per-sample generators, so text ``i`` of a run depends on (seed, i) only, never on the batch
size; conditional models run the frozen encoder once on the sources.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from elflow.config import SamplerConfig
from elflow.encoder import FrozenEncoder, resolve_pretrained
from elflow.errors import ELFError
from elflow.io.artifact import ArtifactConfig, load_resolved, read_config, resolve_source
from elflow.model import ELF
from elflow.network import sample_model
from elflow.projection import Projection
from elflow.sampling import Condition, sample_generators
from elflow.tokens import (
    TokenSpec,
    build_unconditional_row,
    detokenize,
    shift_out_source,
    token_spec,
    tokenize,
    vocab_hash,
)


@dataclass
class Generation:
    texts: list[str]
    """One decoded text per sample."""
    tokens: Tensor
    """(n, L_out) generated token ids (source removed for conditional models)."""
    trajectory: list[list[str]] | None = None
    """trajectory[k][i]: sample i's decoded x_hat after step k (when asked for)."""


TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "vocab.txt",
    "vocab.json",
    "spiece.model",
    "tokenizer.model",
    "sentencepiece.bpe.model",
)
"""A folder holding none of these is not a tokenizer (transformers would build an empty one)."""


def load_tokenizer(name_or_path: str | Path):
    """A fast Hugging Face tokenizer, with a one-line error when it is unavailable.

    Takes a Hub id, a tokenizer folder, the offline alias ``minilm``, or an elflow model,
    checkpoint or run folder (its shipped ``tokenizer/`` files, else the tokenizer its config
    names). Remote code is never trusted.
    """
    from transformers import AutoTokenizer

    name = resolve_pretrained(str(name_or_path))
    folder = Path(name).expanduser()
    if folder.exists():
        name = str(folder)  # "~/tok" is a folder here, not a Hub id
    if folder.is_dir() and not any((folder / f).is_file() for f in TOKENIZER_FILES):
        name = _model_tokenizer(folder)
    try:
        return AutoTokenizer.from_pretrained(name, use_fast=True, trust_remote_code=False)
    except (OSError, ValueError) as e:
        reason = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise ELFError(
            f"cannot load tokenizer {str(name_or_path)!r} ({reason}); it must be a local "
            "folder or a Hub id reachable from here (unset HF_HUB_OFFLINE to download)"
        ) from None


def _model_tokenizer(folder: Path) -> str:
    """The tokenizer of an elflow model, checkpoint or run folder: its shipped files, else the
    name its config records; a one-line error for any other folder without tokenizer files."""
    try:
        resolved = resolve_source(folder)
    except ELFError:
        resolved = None
    if resolved is None or resolved.kind != "elflow":
        raise ELFError(
            f"folder {folder} holds no tokenizer files ({', '.join(TOKENIZER_FILES[:3])}, ...) "
            "and no elflow model; pass a tokenizer's folder or Hub id"
        )
    return resolve_pretrained(model_tokenizer(resolved.path, read_config(resolved.path)))


def model_tokenizer(path: Path, config: ArtifactConfig) -> str:
    """A model's tokenizer: the ``tokenizer/`` files shipped in its folder (small models ship
    their vocabulary), else the one its config names."""
    shipped = path / "tokenizer"
    return str(shipped) if shipped.is_dir() else config.tokenizer


def check_tokenizer(tokenizer, config: ArtifactConfig) -> None:
    """The tokenizer must match the decoder head (and the stored vocabulary hash, if any)."""
    n = len(tokenizer)
    if n != config.model.vocab_size:
        raise ELFError(
            f"tokenizer has {n} tokens but the model's decoder head has {config.model.vocab_size}; "
            "pass the tokenizer the model was trained with"
        )
    if config.tokenizer_hash and vocab_hash(tokenizer) != config.tokenizer_hash:
        raise ELFError(
            "tokenizer vocabulary differs from the one the model was trained with (hash mismatch); "
            "pass the model's own tokenizer"
        )


def model_encoder(config: ArtifactConfig) -> FrozenEncoder:
    """The frozen encoder a model was trained with: its encoder, layer and latent normalisation."""
    return FrozenEncoder.from_pretrained(
        config.encoder,
        latent_mean=config.latent_mean,
        latent_std=config.latent_std,
        layer=config.encoder_layer,
    )


def check_sde_gamma(base: SamplerConfig, sampler: str | None, gamma: float | None) -> None:
    """An SDE asked for over a model whose default gamma is 0 (the conditional presets' ODE)
    would silently be that ODE: the gamma must be given."""
    if sampler == "sde" and gamma is None and base.gamma == 0.0:
        raise ELFError(
            "the SDE with this model's default gamma 0 is the ODE; give --gamma (gamma=), e.g. "
            "1.5, the paper's unconditional value"
        )


def check_encoder(encoder: FrozenEncoder, config: ArtifactConfig, device: torch.device) -> None:
    """A given encoder must have the model's latent width, layer and normalisation, and sit on
    its device. (Which encoder it is cannot be checked: the config records only its name.)"""
    given = (encoder.hidden_size, encoder.layer, encoder.latent_mean, encoder.latent_std)
    wanted = (config.model.encoder_dim, config.encoder_layer, config.latent_mean, config.latent_std)
    if given != wanted:
        raise ELFError(
            f"the encoder given has width, layer, latent_mean, latent_std {given}, but the model "
            f"was trained on {wanted}; build it with elflow.generation.pipeline.model_encoder(config), or "
            "pass none"
        )
    at = next(encoder.model.parameters()).device
    if at != device:
        raise ELFError(f"the encoder is on {at} but the model on {device}; move it (.to(device))")


class ELFPipeline:
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
        L = self.config.model.max_length
        ids = tokenize(self.tokenizer, list(texts))
        rows = [build_unconditional_row(i, L, self.row_pad_id) for i in ids]
        return torch.tensor([r[0] for r in rows]), torch.tensor([r[1] for r in rows])

    def projection(self) -> Projection:
        """What projected sampling needs: the model's frozen encoder (loaded from its config on
        first use, or the one given) and the ids that end and pad its rows."""
        if self.config.conditional:
            raise ELFError(
                "projected sampling (--project-from, sampler.project_from < 1) applies to "
                "unconditional models; use --project-from 1 for this one"
            )
        if self.config.packed:
            raise ELFError(
                "projected sampling (--project-from, sampler.project_from < 1) re-encodes one "
                "text per row, but this model was trained on packed rows; use --project-from 1"
            )
        if self.encoder is None:
            try:
                self.encoder = model_encoder(self.config).to(self.device)
            except ELFError as e:
                raise ELFError(
                    f"{e} (this model's sampler projects through its encoder; --project-from 1, "
                    "project_from=1.0, samples without it)"
                ) from None
        check_encoder(self.encoder, self.config, self.device)
        return Projection(self.encoder, self.tokens.eos_id, self.row_pad_id)

    def sampler_config(self, **overrides: Any):
        """The model's sampler defaults with the non-None ``overrides`` applied."""
        check_sde_gamma(self.config.sampler, overrides.get("sampler"), overrides.get("gamma"))
        return replace(self.config.sampler, **{k: v for k, v in overrides.items() if v is not None})

    def encode_sources(self, sources: Sequence[str]) -> tuple[Condition, Tensor]:
        """Tokenise and encode sources -> (clean condition latents, (B, L) condition mask)."""
        cfg = self.config
        if not cfg.conditional:
            raise ELFError(
                "this model is unconditional: it takes no sources (--source, --sources); "
                "ask for a number of samples instead"
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

    @torch.no_grad()
    def generate_full(
        self,
        n: int | None = None,
        *,
        sources: Sequence[str] | None = None,
        seed: int = 0,
        batch_size: int = 32,
        length: int | None = None,
        trajectory: bool = False,
        first_index: int = 0,
        **sampler_overrides: Any,
    ) -> Generation:
        """Like :meth:`generate`, returning tokens and (optionally) the per-step trajectory."""
        cfg = self.config
        scfg = self.sampler_config(**sampler_overrides)
        dtype = next(self.model.parameters()).dtype
        if dtype != torch.float32:
            raise ELFError(
                f"the model's weights are {dtype}; sampling takes fp32 weights (as loaded) and "
                "gets bf16 speed from autocast (elflow sample --bf16, or torch.autocast around "
                "generate)"
            )
        if isinstance(sources, str):  # would give one sample per character
            raise ELFError("sources must be a list of strings; wrap a single source in a list")
        if sources is not None:
            for i, source in enumerate(sources):
                if not isinstance(source, str):
                    raise ELFError(f"source {i} is a {type(source).__name__}, not a string")
            if n is not None and n != len(sources):
                raise ELFError(
                    f"asked for {n} samples with {len(sources)} sources: a conditional model "
                    "writes one sample per source; drop n (-n)"
                )
            n = len(sources)
        if n is None or n < 1:
            raise ELFError(
                f"asked for {n} samples; ask for at least 1 (-n), or give at least one source"
            )
        if cfg.conditional and sources is None:
            raise ELFError(
                "this model is conditional: give source texts (sources=[...]; elflow generate "
                "--source TEXT, elflow sample --sources FILE)"
            )
        if batch_size < 1:
            raise ELFError(f"batch size must be >= 1, got {batch_size}")
        guidance = sampler_overrides.get("cfg")
        if guidance not in (None, 1.0) and not cfg.conditional:
            raise ELFError("cfg (classifier-free guidance) applies to conditional models only")
        if cfg.conditional and length is not None:
            raise ELFError(
                "length applies to unconditional models; a conditional model writes its "
                "max_length - max_input_length target tokens"
            )
        L = cfg.model.max_length if length is None else length
        if L < 1:
            raise ELFError(f"length must be >= 1, got {L}")
        if L > cfg.model.max_length:
            raise ELFError(f"length {L} exceeds the model's max_length {cfg.model.max_length}")
        projection = self.projection() if scfg.project_from < 1.0 else None  # after the checks
        texts: list[str] = []
        token_rows: list[Tensor] = []
        frames: list[list[str]] | None = [] if trajectory else None
        for start in range(0, n, batch_size):
            idx = list(range(start, min(n, start + batch_size)))
            gens = sample_generators(seed, [first_index + i for i in idx], self.device)
            cond, cond_mask = (None, None)
            if sources is not None:
                cond, cond_mask = self.encode_sources([sources[i] for i in idx])
            out = sample_model(
                self.model,
                gens,
                L,
                scfg,
                cfg.noise_scale,
                cfg.t_eps,
                cond,
                trajectory=trajectory,
                projection=projection,
            )
            tokens = self._strip_source(out.tokens, cond_mask)
            texts += detokenize(self.tokenizer, tokens, self.tokens.eos_id, self.tokens.pad_id)
            token_rows.append(tokens.cpu())
            if frames is not None:
                for k, frame in enumerate(out.trajectory):
                    step_texts = detokenize(
                        self.tokenizer,
                        self._strip_source(frame, cond_mask),
                        self.tokens.eos_id,
                        self.tokens.pad_id,
                    )
                    if len(frames) <= k:
                        frames.append([])
                    frames[k] += step_texts
        return Generation(texts, torch.cat(token_rows), frames)

    def generate(
        self,
        n: int | None = None,
        *,
        sources: Sequence[str] | None = None,
        steps: int | None = None,
        sampler: str | None = None,
        gamma: float | None = None,
        w: float | None = None,
        cfg: float | None = None,
        time_grid: str | None = None,
        time_mean: float | None = None,
        time_std: float | None = None,
        project_from: float | None = None,
        seed: int = 0,
        batch_size: int = 32,
        length: int | None = None,
    ) -> list[str]:
        """Generate ``n`` texts (unconditional) or one text per source (conditional).

        Unset sampler arguments take the model's defaults (e.g. ELF-B: 32-step SDE, gamma 1.5,
        w 3, logit-normal(-1.5, 0.8) time grid; conditional: 64-step ODE, cfg 2, w 1).
        ``project_from`` < 1 turns on projected sampling (an elflow addition; 1 turns it off).
        """
        return self.generate_full(
            n,
            sources=sources,
            seed=seed,
            batch_size=batch_size,
            length=length,
            steps=steps,
            sampler=sampler,
            gamma=gamma,
            w=w,
            cfg=cfg,
            time_grid=time_grid,
            time_mean=time_mean,
            time_std=time_std,
            project_from=project_from,
        ).texts

    def _strip_source(self, tokens: Tensor, cond_mask: Tensor | None) -> Tensor:
        if cond_mask is None:
            return tokens
        keep = self.config.model.max_length - self.config.max_input_length
        return shift_out_source(tokens, cond_mask, keep, self.tokens.pad_id)
