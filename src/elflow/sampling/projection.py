"""Projected sampling, an elflow addition (off in the paper): an opt-in wrapper around a denoiser.

A clean estimate x_hat made at t >= ``project_from`` is replaced by the frozen encoder's latents
of the text it decodes to (decode-mode argmax, cut after the first EOS, padded as the training
rows), and the velocity is recomputed from it, so that the steps that commit to words move
towards latents of real token sequences. Everything here takes callables: ``decode(z, w) ->
tokens`` and the encoder's ``encode(ids, mask) -> latents``; :mod:`elflow.sampling.denoiser`
supplies them for a model. Unconditional models with one text per row only.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from elflow.flow import velocity
from elflow.sampling.step_context import Denoiser

Encode = Callable[[Tensor, Tensor], Tensor]
"""``encode(ids, mask) -> latents``: (B, L) token rows to normalised (B, L, E) latents."""
DecodeW = Callable[[Tensor, "float | Tensor | None"], Tensor]
"""``decode(z, w) -> tokens``: decode-mode argmax (B, L) of (B, L, E) latents at scale ``w``."""
Project = Callable[[Tensor, Tensor, Tensor], Tensor]
"""(x_hat (B, L, E), rows (B,) bool, w (B,)) -> x_hat with those rows projected (a copy)."""


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


def project_latents(
    decode: DecodeW, x_hat: Tensor, w: float | Tensor | None, projection: Projection
) -> Tensor:
    """x_hat's projection: the encoder's latents of its decoded text, cut after the first EOS and
    padded as training rows (in x_hat's dtype). One decode and one encoder pass."""
    tokens = decode(x_hat, w)
    latents = projection.encode(*text_rows(tokens, projection.eos_id, projection.pad_id))
    return latents.to(x_hat.dtype)


def project_rows(
    decode: DecodeW, x_hat: Tensor, rows: Tensor, w: float | Tensor | None, projection: Projection
) -> Tensor:
    """A copy of x_hat with ``rows`` ((B,) bool) projected (:func:`project_latents`; ``w`` a
    scalar or per row); x_hat itself when no row is selected."""
    if not bool(rows.any()):
        return x_hat
    w_rows = w[rows] if isinstance(w, Tensor) and w.dim() > 0 else w
    out = x_hat.clone()
    out[rows] = project_latents(decode, x_hat[rows], w_rows, projection)
    return out


def project_denoiser(
    denoise: Denoiser,
    decode: DecodeW,
    w: float | Tensor | None,
    t_eps: float,
    projection: Projection,
    project_from: float,
) -> Denoiser:
    """Wrap ``denoise``: rows whose time is >= ``project_from`` get x_hat replaced by its
    projection and the velocity recomputed from it. Earlier rows pass through unchanged."""

    def denoise_projected(z: Tensor, x_prev: Tensor, t: Tensor) -> tuple[Tensor, Tensor]:
        x_hat, v = denoise(z, x_prev, t)
        rows = (t.expand(z.shape[0]) if t.dim() == 0 else t) >= project_from
        projected = project_rows(decode, x_hat, rows, w, projection)
        if projected is x_hat:  # no row projected (project_rows returns its input then)
            return x_hat, v
        return projected, velocity(projected, z, t, t_eps)

    return denoise_projected
