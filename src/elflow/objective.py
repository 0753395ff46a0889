"""The ELF training objective (paper §3; ELF_SPEC §3, §9).

:func:`elf_loss` is a deterministic function of the batch and of explicit random draws
(:class:`Draws`); :func:`sample_draws` is the thin layer that makes the draws from a generator.
Two procedures compute the same loss and gradients:

- ``"reference"``: the authors' procedure: a no-grad unconditional pass and a no-grad
  self-conditioned pass over every row, and the V-way decoder head on every row of every pass
  (the authors' forward always evaluates both heads, ELF_SPEC §9).
- ``"efficient"`` (default): the no-grad pass only for denoiser rows that use self-conditioning,
  the trained pass's own detached output as v_cond when dropout is 0 (its input is exactly the
  self-conditioned input), and the decoder head only on decoder rows.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from elflow.config import ObjectiveConfig
from elflow.errors import ELFError, check_finite
from elflow.flow import interpolate, log_uniform_scale, logit_normal, velocity

PROCEDURES = ("efficient", "reference")
Forward = Callable[..., tuple[Tensor, "Tensor | None"]]
"""``forward(x_in, t, w, gate, head_rows=None) -> (x_pred, logits)``: one network call; logits
of the decoder head for ``head_rows`` (None: none computed)."""


@dataclass
class Batch:
    """One training batch of clean, normalised latents and their tokens."""

    x: Tensor
    """(B, L, E) clean latents, already normalised (encoder output / latent_std)."""
    input_ids: Tensor
    """(B, L) token ids (the decoder branch's targets)."""
    attention_mask: Tensor
    """(B, L) 1 at real tokens."""
    cond_mask: Tensor | None = None
    """(B, L) 1 at condition (source) positions; None for unconditional data."""
    label_drop: Tensor | None = None
    """(B,) 1 where the condition is dropped (classifier-free guidance training)."""


@dataclass
class Draws:
    """Every random draw of one objective evaluation (names follow the reference fixtures)."""

    t: Tensor
    """(B,) denoising time, already logit-normal."""
    noise: Tensor
    """(B, L, E) standard normal path noise (scaled by ``noise_scale`` inside)."""
    decoder_active: Tensor
    """(B,) 1 = decoder (cross-entropy) branch at t = 1."""
    decoder_lambda: Tensor
    """(B, L, 1) per-token mixing weight of the decoder branch's corrupted input."""
    decoder_noise: Tensor
    """(B, L, E) standard normal (scaled by ``decoder_noise_scale`` inside)."""
    use_self_cond: Tensor
    """(B,) 1 = the trained pass receives the detached self-conditioning prediction."""
    w: Tensor
    """(B,) SC-CFG scale."""


@dataclass
class LossOutput:
    loss: Tensor
    """(l2_sum + ce_sum) / denom: the scalar to back-propagate on one process."""
    l2_loss: Tensor
    """Token-mean denoiser loss over denoiser rows (logging)."""
    ce_loss: Tensor
    """Token-mean cross-entropy over decoder rows (logging)."""
    l2_sum: Tensor
    ce_sum: Tensor
    denom: Tensor
    """Sum of the loss mask over all rows (all-reduce it for multi-process training)."""
    num_nograd_rows: int
    """Rows that went through a no-grad forward (instrumentation)."""


def sample_draws(
    batch: int,
    length: int,
    dim: int,
    cfg: ObjectiveConfig,
    generator: torch.Generator | None = None,
    device: torch.device | str | None = None,
) -> Draws:
    """Draw every random quantity of the objective from ``generator``."""
    kw = {"generator": generator, "device": device}
    return Draws(
        t=logit_normal(torch.randn(batch, **kw), cfg.time_mean, cfg.time_std),
        noise=torch.randn(batch, length, dim, **kw),
        decoder_active=(torch.rand(batch, **kw) < cfg.decoder_prob).float(),
        decoder_lambda=logit_normal(
            torch.randn(batch, length, 1, **kw), cfg.decoder_mean, cfg.decoder_std
        ),
        decoder_noise=torch.randn(batch, length, dim, **kw),
        use_self_cond=(torch.rand(batch, **kw) < cfg.self_cond_prob).float(),
        w=log_uniform_scale(torch.rand(batch, **kw), cfg.w_min, cfg.w_max),
    )


def example_generator(seed: int, key: int, device: torch.device | str = "cpu") -> torch.Generator:
    """The generator of training example ``key`` (its global stream position) in run ``seed``."""
    digest = hashlib.sha256(f"elflow-train:{seed}:{key}".encode()).digest()
    return torch.Generator(device=device).manual_seed(int.from_bytes(digest[:8], "little") >> 1)


def sample_draws_keyed(
    keys: Sequence[int],
    length: int,
    dim: int,
    cfg: ObjectiveConfig,
    seed: int,
    device: torch.device | str = "cpu",
) -> Draws:
    """Draws for examples identified by their global index: each row's draws depend only on
    (seed, key), so N processes or gradient accumulation see the draws of one process
    (ELF_SPEC §10 "Distributed equality")."""
    rows = [
        sample_draws(1, length, dim, cfg, example_generator(seed, int(k), device), device)
        for k in keys
    ]
    return Draws(
        **{f: torch.cat([getattr(r, f) for r in rows]) for f in Draws.__dataclass_fields__}
    )


def network_traits(forward: Forward) -> tuple[bool, bool]:
    """(deterministic, sees_w) of a forward function, read from its attributes (a DDP wrapper's
    from its ``module``): ``deterministic`` (no active dropout: the trained pass's output can
    stand for a second no-grad pass; default False, always correct) and ``sees_w`` (the network
    has SC-CFG scale tokens; default True). :class:`elflow.network.TrainForward` sets both."""
    inner = getattr(forward, "module", forward)
    return bool(getattr(inner, "deterministic", False)), bool(getattr(inner, "sees_w", True))


def elf_loss(
    forward: Forward,
    batch: Batch,
    draws: Draws,
    cfg: ObjectiveConfig,
    procedure: str = "efficient",
) -> LossOutput:
    """The ELF loss of one batch for the given draws (ELF_SPEC §3 steps 2–10).

    Kept as one function: it reads as the spec's steps in their order (noising, the no-grad pass,
    the trained pass, the SC-CFG target, the losses), which is what a reviewer checks it against.

    Args:
        forward: the network's forward function (:class:`elflow.network.TrainForward`, possibly
            wrapped in DDP or FSDP2: every network call then goes through the wrapper).
    """
    if procedure not in PROCEDURES:
        raise ELFError(f"procedure must be one of {PROCEDURES}, got {procedure!r}")
    reference = procedure == "reference"
    x = batch.x.float()
    check_finite(x, "the batch's latents")
    B, L, _ = x.shape
    cond = (
        batch.cond_mask.bool()
        if batch.cond_mask is not None
        else torch.zeros(B, L, dtype=torch.bool, device=x.device)
    )
    cond3 = cond[..., None]  # (B, L, 1)
    if batch.label_drop is not None:
        # Dropped condition: x (hence z_t, z_dec, the SC halves and v*) is zero at the source.
        x = x.masked_fill(cond3 & batch.label_drop.bool()[:, None, None], 0.0)
    t, w = draws.t.float(), draws.w.float()
    dec = draws.decoder_active.bool()
    sc = draws.use_self_cond.bool() & ~dec  # rows whose target needs the no-grad passes

    z_t = torch.where(cond3, x, interpolate(x, draws.noise, t, cfg.noise_scale))  # (B, L, E)
    lam = draws.decoder_lambda
    z_dec = lam * x + (1.0 - lam) * cfg.decoder_noise_scale * draws.decoder_noise
    x_cond_only = torch.where(cond3, x, 0.0)  # Z0: zeros with x at the condition positions

    # 1) No-grad unconditional pass at (z_t, t, w) -> x_hat_u.
    deterministic, sees_w = network_traits(forward)
    nograd_rows = torch.ones_like(sc) if reference else sc
    x_hat_u = nograd_prediction(forward, z_t, x_cond_only, t, w, nograd_rows, with_head=reference)
    sc_half = torch.where(cond3, x, x_hat_u)  # the self-conditioning input (condition reset)

    # 2) Trained pass: denoiser rows [z_t, SC half or Z0] at t; decoder rows [z_dec, 0] at t = 1.
    den_in = torch.cat([z_t, torch.where(sc[:, None, None], sc_half, x_cond_only)], dim=-1)
    dec_in = torch.cat([z_dec, torch.zeros_like(z_dec)], dim=-1)
    x_in = torch.where(dec[:, None, None], dec_in, den_in)  # (B, L, 2E)
    t_in = torch.where(dec, torch.ones_like(t), t)
    # Decoder head on every row (reference) or on decoder rows only, inside the same forward.
    x_pred, logits = forward(x_in, t_in, w, dec.float(), torch.ones_like(dec) if reference else dec)

    # 3) SC-CFG target: v* + (1 - 1/w)(v_cond - v_u) on self-conditioned rows, v* elsewhere.
    num_nograd = int(nograd_rows.sum()) if not reference else B
    if reference:
        x_hat_c = nograd_prediction(
            forward, z_t, sc_half, t, w, torch.ones_like(sc), with_head=True
        )
        num_nograd += B
    elif deterministic:
        # Same input as the trained pass for these rows, so the same output: reuse it.
        x_hat_c = x_pred.detach()
    else:
        x_hat_c = nograd_prediction(forward, z_t, sc_half, t, w, sc)
        num_nograd += int(sc.sum())
    v_star = velocity(x, z_t, t, cfg.t_eps)
    if not sees_w:
        # A network without scale tokens cannot see w: its one consistent target is v* (w = 1).
        w = torch.ones_like(w)
    guidance = (1.0 - 1.0 / w)[:, None, None] * (
        velocity(x_hat_c, z_t, t, cfg.t_eps) - velocity(x_hat_u, z_t, t, cfg.t_eps)
    )
    target = torch.where(sc[:, None, None], v_star + guidance, v_star).detach()

    # 4) Losses, normalised by the loss mask summed over all rows.
    valid = torch.ones_like(cond) if cfg.pad_with_eos else batch.attention_mask.bool()
    mask = (valid & ~cond).float()  # (B, L)
    v_hat = velocity(x_pred.float(), z_t, t, cfg.t_eps)
    l2_tok = (v_hat - target).pow(2).mean(-1)  # (B, L)
    den_mask = mask * (~dec).float()[:, None]
    l2_sum = torch.where(den_mask > 0, l2_tok * den_mask, 0.0).sum()
    ids = batch.input_ids.long()
    if reference:
        ce_tok = token_cross_entropy(logits, ids)  # (B, L)
        dec_mask = mask * dec.float()[:, None]
    else:
        ce_tok = token_cross_entropy(logits, ids[dec])  # (B_dec, L)
        dec_mask = mask[dec]
    ce_sum = (ce_tok * dec_mask).sum()
    dec_count = dec_mask.sum()
    denom = mask.sum()
    return LossOutput(
        loss=(l2_sum + ce_sum) / denom.clamp_min(1.0),
        l2_loss=(l2_sum / den_mask.sum().clamp_min(1.0)).detach(),
        ce_loss=(ce_sum / dec_count.clamp_min(1.0)).detach(),
        l2_sum=l2_sum,
        ce_sum=ce_sum,
        denom=denom,
        num_nograd_rows=num_nograd,
    )


def token_cross_entropy(logits: Tensor, ids: Tensor) -> Tensor:
    """Per-token cross-entropy with the log-softmax in fp32: (..., L, V), (..., L) -> (..., L)."""
    V = logits.shape[-1]
    ce = F.cross_entropy(logits.float().reshape(-1, V), ids.reshape(-1), reduction="none")
    return ce.view(ids.shape)


@torch.no_grad()
def nograd_prediction(
    forward: Forward,
    z: Tensor,
    sc_half: Tensor,
    t: Tensor,
    w: Tensor,
    rows: Tensor,
    with_head: bool = False,
) -> Tensor:
    """x-prediction at (z, t, w) in denoise mode, computed only for ``rows`` (zeros elsewhere).

    ``with_head`` also evaluates (and discards) the decoder head, as the reference forward does.
    The network runs even when ``rows`` selects none (on an empty batch): each forward of an
    FSDP2-sharded network gathers its shards collectively, so a rank that skipped it would leave
    the others waiting for ever.
    """
    out = torch.zeros_like(z)
    if bool(rows.all()):
        x_in = torch.cat([z, sc_half], dim=-1)
        out = forward(x_in, t, w, 0.0, torch.ones_like(rows) if with_head else None)[0].float()
    else:  # NOTE: also with no rows: under FSDP2 every rank must run the same forwards
        x_in = torch.cat([z[rows], sc_half[rows]], dim=-1)
        n = x_in.shape[0]
        head_rows = x_in.new_ones(n, dtype=torch.bool) if with_head else None
        out[rows] = forward(x_in, t[rows], w[rows], 0.0, head_rows)[0].float()
    return out
