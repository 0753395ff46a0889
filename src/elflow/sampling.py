"""Generation: guided predictions, sampler steps and the full loop (paper §3.3; ELF_SPEC §5, §10).

The step functions are pure: they take a ``denoise(z, x_prev, t) -> (x_hat, v_hat)`` callable
(built by :func:`make_denoiser` from the network, the SC-CFG scale w, classifier-free guidance and
the condition) and explicit noise. :func:`sample` integrates from noise to t = 1 with per-sample
generators (a sample depends on (seed, index) only, never on the batch it is in), then decodes once
in decode mode. With ``trajectory=True`` it also returns each step's decoded x_hat.

Projected sampling (an elflow addition, ``sampler.project_from < 1``; README "Projected sampling")
replaces each late x_hat by the frozen encoder's latents of the text x_hat decodes to, so that the
steps that commit to words move towards latents of real token sequences.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from elflow.config import SamplerConfig
from elflow.errors import ELFError, check_finite
from elflow.flow import (
    euler_step,
    logit_normal_grid,
    sde_backtrack,
    uniform_grid,
    velocity,
)
from elflow.model import ELF

Denoiser = Callable[[Tensor, Tensor, Tensor], tuple[Tensor, Tensor]]
Encode = Callable[[Tensor, Tensor], Tensor]
"""``encode(ids, mask) -> latents``: (B, L) token rows to normalised (B, L, E) latents."""


@dataclass
class Condition:
    """Clean condition latents for conditional generation."""

    latents: Tensor
    """(B, L, E) clean latents, meaningful at condition positions."""
    mask: Tensor
    """(B, L) 1 at condition (source) positions."""


def make_denoiser(
    model: ELF,
    w: float | Tensor | None,
    t_eps: float,
    cond: Condition | None = None,
    cfg: float = 1.0,
    key_mask: Tensor | None = None,
) -> Denoiser:
    """``denoise(z, x_prev, t) -> (x_hat, v_hat)`` with condition reset and guidance.

    With a condition and ``cfg != 1`` the conditional and the unconditional evaluation (z and x_prev
    zeroed at the condition, zero condition latents) go through ONE batched forward, and
    v = v_u + cfg (v_c - v_u), likewise for x_hat.
    """

    def denoise(z: Tensor, x_prev: Tensor, t: Tensor) -> tuple[Tensor, Tensor]:
        B = z.shape[0]
        if cond is None:
            x_hat = model(torch.cat([z, x_prev], -1), t, w, 0.0, key_mask)[0].float()
            return x_hat, velocity(x_hat, z, t, t_eps)
        c3 = cond.mask.bool()[..., None]
        if cfg == 1.0:
            x_hat = model(torch.cat([z, x_prev], -1), t, w, 0.0, key_mask)[0].float()
        else:
            z_u, x_prev_u = z.masked_fill(c3, 0.0), x_prev.masked_fill(c3, 0.0)
            x_in = torch.cat([torch.cat([z, x_prev], -1), torch.cat([z_u, x_prev_u], -1)])
            t = t.expand(B) if t.dim() == 0 else t  # per row, so that it can be repeated
            km = None if key_mask is None else key_mask.repeat(2, 1)
            w2 = w.repeat(2) if isinstance(w, Tensor) and w.dim() > 0 else w
            x_both = model(x_in, t.repeat(2), w2, 0.0, km)[0].float()
            x_c = torch.where(c3, cond.latents, x_both[:B])
            x_u = x_both[B:].masked_fill(c3, 0.0)
            x_hat = x_u + cfg * (x_c - x_u)
        x_hat = torch.where(c3, cond.latents, x_hat)
        return x_hat, velocity(x_hat, z, t, t_eps).masked_fill(c3, 0.0)

    return denoise


@dataclass
class Projection:
    """What projected sampling needs besides the network: the model's frozen encoder (with its
    latent normalisation) and the ids that end and pad a training row."""

    encode: Encode
    eos_id: int
    pad_id: int
    """The id the training rows were padded with (EOS for models trained on EOS padding)."""


def text_rows(tokens: Tensor, eos_id: int, pad_id: int) -> tuple[Tensor, Tensor]:
    """Decoded tokens as training rows: (ids, mask), (B, L), valid up to and including the first
    EOS and padded with ``pad_id`` after it; a row without EOS is valid throughout."""
    L = tokens.shape[1]
    is_eos = tokens == eos_id
    last = torch.where(is_eos.any(1), is_eos.int().argmax(1), L - 1)  # (B,) last valid position
    valid = torch.arange(L, device=tokens.device)[None] <= last[:, None]
    return tokens.masked_fill(~valid, pad_id), valid.long()


def project_denoiser(
    denoise: Denoiser,
    model: ELF,
    w: float | Tensor | None,
    t_eps: float,
    projection: Projection,
    project_from: float,
) -> Denoiser:
    """Wrap ``denoise``: rows whose time is >= ``project_from`` get x_hat replaced by the latents
    of its decode-mode argmax text (one decode pass and one encoder pass over those rows), and the
    velocity recomputed from it. Earlier rows pass through unchanged."""

    def denoise_projected(z: Tensor, x_prev: Tensor, t: Tensor) -> tuple[Tensor, Tensor]:
        x_hat, v = denoise(z, x_prev, t)
        rows = (t.expand(z.shape[0]) if t.dim() == 0 else t) >= project_from
        projected = project_rows(model, x_hat, rows, w, projection)
        if projected is x_hat:  # no row projected
            return x_hat, v
        return projected, velocity(projected, z, t, t_eps)

    return denoise_projected


def project_rows(
    model: ELF, x_hat: Tensor, rows: Tensor, w: float | Tensor | None, projection: Projection
) -> Tensor:
    """A copy of x_hat with ``rows`` ((B,) bool) projected (:func:`project_latents`; ``w`` a
    scalar or per row); x_hat itself when no row is selected."""
    if not bool(rows.any()):
        return x_hat
    w_rows = w[rows] if isinstance(w, Tensor) and w.dim() > 0 else w
    out = x_hat.clone()
    out[rows] = project_latents(model, x_hat[rows], w_rows, projection)
    return out


def project_latents(
    model: ELF, x_hat: Tensor, w: float | Tensor | None, projection: Projection
) -> Tensor:
    """x_hat's projection: the encoder's latents of its decode-mode argmax text, cut after the
    first EOS and padded as training rows (in x_hat's dtype). One decode and one encoder pass."""
    tokens = decode_tokens(model, x_hat, w)
    latents = projection.encode(*text_rows(tokens, projection.eos_id, projection.pad_id))
    return latents.to(x_hat.dtype)


def ode_step(
    denoise: Denoiser, z: Tensor, x_prev: Tensor, t: Tensor, t_next: Tensor
) -> tuple[Tensor, Tensor]:
    """Euler step; returns (z_next, x_hat) where x_hat is the next self-conditioning input."""
    x_hat, v = denoise(z, x_prev, t)
    return euler_step(z, v, t, t_next), x_hat


def sde_step(
    denoise: Denoiser,
    z: Tensor,
    x_prev: Tensor,
    t: Tensor,
    t_next: Tensor,
    gamma: float,
    noise: Tensor,
    noise_scale: float,
    cond: Condition | None = None,
) -> tuple[Tensor, Tensor]:
    """gamma-SDE step: re-inject noise back to t_back = alpha t, then Euler to t_next."""
    z_back, t_back = sde_backtrack(z, t, t_next, gamma, noise, noise_scale)
    if cond is not None:
        z_back = torch.where(cond.mask.bool()[..., None], cond.latents, z_back)
    x_hat, v = denoise(z_back, x_prev, t_back)
    return euler_step(z_back, v, t_back, t_next), x_hat


def heun_step(
    denoise: Denoiser, z: Tensor, x_prev: Tensor, t: Tensor, t_next: Tensor
) -> tuple[Tensor, Tensor]:
    """Heun (second order): Euler predictor, corrector at (z_pred, t_next) self-conditioned on the
    predictor's x_hat, velocities averaged (ELF_SPEC §10)."""
    x_hat, v = denoise(z, x_prev, t)
    z_pred = euler_step(z, v, t, t_next)
    x_hat2, v2 = denoise(z_pred, x_hat, t_next)
    return euler_step(z, 0.5 * (v + v2), t, t_next), x_hat2


def sample_seed(seed: int, index: int) -> int:
    """A 63-bit seed for sample ``index`` of a run seeded with ``seed`` (stable across runs)."""
    digest = hashlib.sha256(f"elflow:{seed}:{index}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


def sample_generators(
    seed: int, indices: Sequence[int], device: torch.device | str = "cpu"
) -> list[torch.Generator]:
    """One generator per sample, seeded by (seed, sample index)."""
    return [torch.Generator(device=device).manual_seed(sample_seed(seed, i)) for i in indices]


def _randn(gens: Sequence[torch.Generator], shape: tuple[int, ...], device) -> Tensor:
    return torch.stack([torch.randn(shape, generator=g, device=device) for g in gens])


def nfe(sampler: str, steps: int) -> int:
    """Network evaluations per sample (excluding the final decode; x2 rows under CFG)."""
    return 2 * steps - 1 if sampler == "heun" else steps


@dataclass
class SampleOutput:
    tokens: Tensor
    """(B, L) argmax tokens of the final decode."""
    z: Tensor
    """(B, L, E) final state."""
    trajectory: Tensor | None = None
    """(N, B, L) decode-mode argmax of each step's x_hat, when asked for."""


@torch.no_grad()
def decode_tokens(
    model: ELF, z: Tensor, w: float | Tensor | None, t: float | Tensor = 1.0
) -> Tensor:
    """Decode mode (at t = 1 in sampling) on [z, 0] -> argmax tokens (B, L)."""
    _, hidden = model(torch.cat([z, torch.zeros_like(z)], -1), t, w, 1.0)
    return model.decode_logits(hidden).argmax(-1)


@torch.no_grad()
def sample(
    model: ELF,
    generators: Sequence[torch.Generator],
    length: int,
    sampler: SamplerConfig,
    noise_scale: float = 2.0,
    t_eps: float = 0.05,
    cond: Condition | None = None,
    trajectory: bool = False,
    projection: Projection | None = None,
) -> SampleOutput:
    """Integrate from noise to t = 1 and decode (ELF_SPEC §5). One generator per sample.

    ``projection`` is required when ``sampler.project_from < 1`` (unconditional models only).
    """
    if sampler.project_from < 1.0 and (projection is None or cond is not None):
        raise ELFError(
            "projected sampling (sampler.project_from < 1) needs an unconditional model and its "
            "encoder (sample(..., projection=pipe.projection())); project_from 1 turns it off"
        )
    device = next(model.parameters()).device
    B, E, N = len(generators), model.cfg.encoder_dim, sampler.steps
    if sampler.time_grid == "uniform":
        grid = uniform_grid(N, B, device)
    else:
        grid = logit_normal_grid(
            _randn(generators, (N - 1,), device), sampler.time_mean, sampler.time_std
        )  # (B, N + 1)
    z = noise_scale * _randn(generators, (length, E), device)
    x_prev = torch.zeros_like(z)
    if cond is not None:
        check_finite(cond.latents, "the condition latents")
        c3 = cond.mask.bool()[..., None]
        z, x_prev = torch.where(c3, cond.latents, z), torch.where(c3, cond.latents, x_prev)
    w = sampler.w if model.cfg.num_scale_tokens > 0 else None
    denoise = make_denoiser(model, w, t_eps, cond, sampler.cfg)
    if sampler.project_from < 1.0:
        denoise = project_denoiser(denoise, model, w, t_eps, projection, sampler.project_from)
    frames = []
    for k in range(N):
        t, t_next = grid[:, k], grid[:, k + 1]
        if k == N - 1 or sampler.sampler == "ode":  # the last step is always Euler
            z, x_prev = ode_step(denoise, z, x_prev, t, t_next)
        elif sampler.sampler == "sde":
            noise = _randn(generators, (length, E), device)
            z, x_prev = sde_step(
                denoise, z, x_prev, t, t_next, sampler.gamma, noise, noise_scale, cond
            )
        else:
            z, x_prev = heun_step(denoise, z, x_prev, t, t_next)
        if trajectory:
            frames.append(decode_tokens(model, x_prev, w))
    tokens = decode_tokens(model, z, w)
    return SampleOutput(tokens, z, torch.stack(frames) if trajectory else None)
