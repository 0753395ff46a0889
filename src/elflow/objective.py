"""The ELF training objective (paper §3; ELF_SPEC §3, §9).

:func:`elf_loss` is a deterministic function of the batch and of explicit random draws
(:class:`Draws`); :func:`sample_draws` makes the draws from a generator, and
:func:`sample_draws_keyed` (training) draws them for a batch of stream positions in a few batched
calls, each row's a function of (seed, position) alone (:mod:`elflow.runtime.keyed_random`).
Which rows take which branch is a :class:`RowPlan` of host index arrays, so that a training
step selects rows without reading the device. Two procedures compute the same loss and gradients:

- ``"reference"``: the authors' procedure: a no-grad unconditional pass and a no-grad
  self-conditioned pass over every row, and the V-way decoder head on every row of every pass
  (the authors' forward always evaluates both heads, ELF_SPEC §9).
- ``"efficient"`` (default): the no-grad pass only for denoiser rows that use self-conditioning,
  the trained pass's own detached output as v_cond when dropout is 0 (its input is exactly the
  self-conditioned input), and the decoder head only on decoder rows.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from elflow.config.objective_config import ObjectiveConfig
from elflow.errors import ELFError, check_finite
from elflow.flow import interpolate, velocity
from elflow.train.objective_draws import (
    BranchRows,
    Draws,
    RowPlan,
)

PROCEDURES = ("efficient", "reference")
Forward = Callable[..., tuple[Tensor, "Tensor | None"]]
"""``forward(x_in, t, w, gate, head_rows=None, targets=None, weights=None) -> (x_pred, out)``: one
network call; ``out`` is the decoder head's logits for ``head_rows`` (None: none computed), or,
given the rows' ``targets`` and per-token ``weights``, its cross-entropy sum(weights x CE)
(:class:`elflow.train.forward.TrainForward`)."""


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
    loss_tokens: float | None = None
    """The loss mask's total when the host knows it (the trainer's batches), else None."""


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


def network_traits(forward: Forward) -> tuple[bool, bool]:
    """(deterministic, sees_w) of a forward function, read from its attributes (a DDP wrapper's
    from its ``module``): ``deterministic`` (no active dropout: the trained pass's output can
    stand for a second no-grad pass; default False, always correct) and ``sees_w`` (the network
    has SC-CFG scale tokens; default True). :class:`elflow.train.forward.TrainForward` sets both."""
    inner = getattr(forward, "module", forward)
    return bool(getattr(inner, "deterministic", False)), bool(getattr(inner, "sees_w", True))


def elf_loss(
    forward: Forward,
    batch: Batch,
    draws: Draws,
    cfg: ObjectiveConfig,
    procedure: str = "efficient",
    check_inputs: bool = True,
) -> LossOutput:
    """The ELF loss of one batch for the given draws (ELF_SPEC §3 steps 2–10): the draws' row
    plan made into index tensors, then :func:`branch_loss`.

    Args:
        forward: the network's forward function (:class:`elflow.train.forward.TrainForward`,
            possibly wrapped in DDP or FSDP2: every network call then goes through the wrapper).
        check_inputs: refuse non-finite latents at once (a device read; the trainer checks
            them with its other metrics instead).
    """
    if procedure not in PROCEDURES:
        raise ELFError(f"procedure must be one of {PROCEDURES}, got {procedure!r}")
    if check_inputs:
        check_finite(batch.x.float(), "the batch's latents")
    B = batch.x.shape[0]
    plan = draws.plan if draws.plan is not None else RowPlan.of(draws)
    reference = procedure == "reference"
    out = branch_loss(forward, batch, draws, BranchRows.of(plan, batch.x.device), cfg, reference)
    if reference:
        out.num_nograd_rows = 2 * B
    else:
        out.num_nograd_rows = plan.real_self_cond * (1 if network_traits(forward)[0] else 2)
    return out


def branch_loss(
    forward: Forward,
    batch: Batch,
    draws: Draws,
    rows: BranchRows,
    cfg: ObjectiveConfig,
    reference: bool = False,
) -> LossOutput:
    """:func:`elf_loss` with its rows given as index tensors: no host work, nothing that reads
    the device, so that ``train.compile=step`` compiles it whole (``num_nograd_rows`` is left 0).

    Kept as one function: it reads as the spec's steps in their order (noising, the no-grad pass,
    the trained pass, the SC-CFG target, the losses), which is what a reviewer checks it against.
    """
    x, cond = batch_latents(batch)
    B = x.shape[0]
    dec_rows, sc_rows = rows.decoder, rows.self_cond
    cond3 = cond[..., None]  # (B, L, 1)
    t, w = draws.t.float(), draws.w.float()
    dec = draws.decoder_active.bool()
    sc = draws.use_self_cond.bool() & ~dec  # rows whose target needs the no-grad passes

    z_t = torch.where(cond3, x, interpolate(x, draws.noise, t, cfg.noise_scale))  # (B, L, E)
    lam = draws.decoder_lambda
    z_dec = lam * x + (1.0 - lam) * cfg.decoder_noise_scale * draws.decoder_noise
    x_cond_only = torch.where(cond3, x, 0.0)  # Z0: zeros with x at the condition positions

    # The loss mask, normalised later by its sum over all rows; the decoder's share per head row.
    valid = torch.ones_like(cond) if cfg.pad_with_eos else batch.attention_mask.bool()
    mask = (valid & ~cond).float()  # (B, L)
    ids = batch.input_ids.long()
    head_rows = torch.arange(B, device=x.device) if reference else dec_rows
    if reference:
        head_weights = mask * dec.float()[:, None]  # the reference's head runs on every row
    else:
        head_weights = mask.index_select(0, dec_rows)  # (R, L)
        if rows.decoder_keep is not None:
            head_weights = head_weights * rows.decoder_keep[:, None]  # padding rows weigh 0

    # 1) No-grad unconditional pass at (z_t, t, w) -> x_hat_u (None: every row).
    deterministic, sees_w = network_traits(forward)
    nograd_rows = None if reference else sc_rows
    x_hat_u = nograd_prediction(forward, z_t, x_cond_only, t, w, nograd_rows, with_head=reference)
    sc_half = torch.where(cond3, x, x_hat_u)  # the self-conditioning input (condition reset)

    # 2) Trained pass: denoiser rows [z_t, SC half or Z0] at t; decoder rows [z_dec, 0] at t = 1;
    # the decoder head's weighted cross-entropy on the head rows, inside the same forward.
    den_in = torch.cat([z_t, torch.where(sc[:, None, None], sc_half, x_cond_only)], dim=-1)
    dec_in = torch.cat([z_dec, torch.zeros_like(z_dec)], dim=-1)
    x_in = torch.where(dec[:, None, None], dec_in, den_in)  # (B, L, 2E)
    t_in = torch.where(dec, torch.ones_like(t), t)
    head_ids = ids.index_select(0, head_rows)
    x_pred, ce_sum = forward(x_in, t_in, w, dec.float(), head_rows, head_ids, head_weights)

    # 3) SC-CFG target: v* + (1 - 1/w)(v_cond - v_u) on self-conditioned rows, v* elsewhere.
    if reference:
        x_hat_c = nograd_prediction(forward, z_t, sc_half, t, w, None, with_head=True)
    elif deterministic:
        # Same input as the trained pass for these rows, so the same output: reuse it.
        x_hat_c = x_pred.detach()
    else:
        x_hat_c = nograd_prediction(forward, z_t, sc_half, t, w, sc_rows)
    v_star = velocity(x, z_t, t, cfg.t_eps)
    if not sees_w:
        # A network without scale tokens cannot see w: its one consistent target is v* (w = 1).
        w = torch.ones_like(w)
    guidance = (1.0 - 1.0 / w)[:, None, None] * (
        velocity(x_hat_c, z_t, t, cfg.t_eps) - velocity(x_hat_u, z_t, t, cfg.t_eps)
    )
    target = torch.where(sc[:, None, None], v_star + guidance, v_star).detach()

    # 4) Losses, normalised by the loss mask summed over all rows.
    v_hat = velocity(x_pred.float(), z_t, t, cfg.t_eps)
    l2_tok = (v_hat - target).pow(2).mean(-1)  # (B, L)
    den_mask = mask * (~dec).float()[:, None]
    l2_sum = torch.where(den_mask > 0, l2_tok * den_mask, 0.0).sum()
    dec_count = head_weights.sum()
    denom = mask.sum()
    return LossOutput(
        loss=(l2_sum + ce_sum) / denom.clamp_min(1.0),
        l2_loss=(l2_sum / den_mask.sum().clamp_min(1.0)).detach(),
        ce_loss=(ce_sum / dec_count.clamp_min(1.0)).detach(),
        l2_sum=l2_sum,
        ce_sum=ce_sum,
        denom=denom,
        num_nograd_rows=0,
    )


def batch_latents(batch: Batch) -> tuple[Tensor, Tensor]:
    """(x (B, L, E) in fp32, cond (B, L) bool) of a batch; where a row's condition is dropped
    (label drop, ELF_SPEC §3 step 10), x is zero at its source, so every later use (z_t, z_dec,
    the self-conditioning halves, the targets) sees the zeroed values."""
    x = batch.x.float()
    B, L, _ = x.shape
    if batch.cond_mask is None:
        return x, torch.zeros(B, L, dtype=torch.bool, device=x.device)
    cond = batch.cond_mask.bool()
    if batch.label_drop is not None:
        x = x.masked_fill(cond[..., None] & batch.label_drop.bool()[:, None, None], 0.0)
    return x, cond


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
    rows: Tensor | None,
    with_head: bool = False,
) -> Tensor:
    """x-prediction at (z, t, w) in denoise mode, computed only for ``rows`` (zeros elsewhere).

    ``rows``: an index tensor (or None: every row; a boolean mask costs a device read).
    ``with_head`` also evaluates (and discards) the decoder head, as the reference forward does.
    The network runs even when ``rows`` selects none (on an empty batch): each forward of an
    FSDP2-sharded network gathers its shards collectively, so a rank that skipped it would leave
    the others waiting for ever.
    """
    B = z.shape[0]
    if rows is not None and rows.dtype == torch.bool:
        rows = rows.nonzero().squeeze(1)
    # Every row, in order (indices are sorted); a compiled step always selects (the test would
    # be a guard on a dynamic size).
    if rows is None or (not torch.compiler.is_compiling() and rows.numel() == B):
        x_in = torch.cat([z, sc_half], dim=-1)
        head_rows = torch.arange(B, device=z.device) if with_head else None
        return forward(x_in, t, w, 0.0, head_rows)[0].float()
    # NOTE: also with no rows: under FSDP2 every rank must run the same forwards
    x_in = torch.cat([z.index_select(0, rows), sc_half.index_select(0, rows)], dim=-1)
    head_rows = torch.arange(rows.numel(), device=z.device) if with_head else None
    pred = forward(x_in, t.index_select(0, rows), w.index_select(0, rows), 0.0, head_rows)[0]
    return torch.zeros_like(z).index_copy_(0, rows, pred.float())
