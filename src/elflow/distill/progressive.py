"""The progressive-distillation objective (ELF_SPEC §8): few-step students from a frozen teacher.

One round trains an N-step student: per example, decoder rows exactly as in §3 (cross-entropy at
t = 1), other rows a student step t_s -> t_t = t_s + 1/N whose x-target makes one student Euler step
land where the frozen teacher gets with K Euler sub-steps. :func:`distill_loss` is a deterministic
function of the batch and of explicit draws (:class:`DistillDraws`), like
:func:`elflow.objective.elf_loss`; :func:`distill_targets` is the teacher's part on its own. Unlike
§3 each row contributes its own masked token mean and the loss is the plain mean over rows.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from elflow.config.objective_config import ObjectiveConfig
from elflow.distill.distill_config import DistillConfig
from elflow.errors import ELFError, check_finite
from elflow.flow import euler_step, interpolate, logit_normal, velocity
from elflow.objective import Batch, Forward, batch_latents, nograd_prediction, token_cross_entropy
from elflow.runtime.keyed_random import host_normal
from elflow.sampling.projection import Project
from elflow.train.objective_draws import (
    Draws,
    RowPlan,
    host_index,
    sample_draws,
    sample_draws_keyed,
)

MIN_SPAN = 1e-3
"""Below this student step size the x-target is the teacher's last x-prediction (ELF_SPEC §8)."""
MIN_TS_SCALE = 1e-6
"""t_s = u * max(1 - delta, MIN_TS_SCALE): keeps t_s a (tiny) draw in the one-step round."""


@dataclass
class DistillDraws:
    """Every random draw of one distillation-objective evaluation."""

    u: Tensor
    """(B,) logit-normal(time_mean, time_std) draw, already through the sigmoid: t_s = u max(1 -
    delta, 1e-6)."""
    noise: Tensor
    """(B, L, E) standard normal path noise (scaled by ``noise_scale`` inside)."""
    decoder_active: Tensor
    """(B,) 1 = decoder (cross-entropy) branch at t = 1."""
    decoder_lambda: Tensor
    """(B, L, 1) per-token mixing weight of the decoder branch's corrupted input."""
    decoder_noise: Tensor
    """(B, L, E) standard normal (scaled by ``decoder_noise_scale`` inside)."""
    use_self_cond: Tensor
    """(B,) 1 = the self-conditioning half is the teacher's unconditional x-prediction."""
    w: Tensor
    """(B,) SC-CFG scale."""
    inner_u: Tensor
    """(B, K - 1) logit-normal draws in (0, 1), any order: the teacher's interior sub-step times
    are t_s + sort(inner_u) (t_t - t_s)."""
    plan: RowPlan | None = None
    """The rows of each branch on the host (None: read from the tensors when needed)."""


@dataclass
class DistillLossOutput:
    loss: Tensor
    """row_sum / num_rows: the scalar to back-propagate on one process."""
    row_sum: Tensor
    """Sum of the per-row losses (all-reduce it with ``num_rows`` across processes and
    accumulation steps: the global loss is sum(row_sum) / sum(num_rows))."""
    num_rows: int
    """B, the rows of this batch."""
    row_loss: Tensor
    """(B,) each row's masked token mean, detached (logging and tests)."""
    l2_loss: Tensor
    """Mean row loss over the student-step rows, detached (logging)."""
    ce_loss: Tensor
    """Mean row loss over the decoder rows, detached (logging)."""
    x_target: Tensor
    """(B, L, E) the student's x-target (zeros on decoder rows), detached."""


def sample_distill_draws(
    batch: int,
    length: int,
    dim: int,
    cfg: ObjectiveConfig,
    K: int,
    generator: torch.Generator | None = None,
    device: torch.device | str | None = None,
) -> DistillDraws:
    """Draw every random quantity of the distillation objective from ``generator``.

    The §3 draws come first, in :func:`elflow.train.objective_draws.sample_draws`'s order (its t is
    u here), then the K - 1 interior sub-step times.
    """
    d = sample_draws(batch, length, dim, cfg, generator, device)
    inner = torch.randn(batch, K - 1, generator=generator, device=device)
    return _with_inner(d, logit_normal(inner, cfg.time_mean, cfg.time_std))


def _with_inner(d: Draws, inner_u: Tensor) -> DistillDraws:
    """The §3 draws ``d`` (its t as u) with the interior times."""
    fields = {f: getattr(d, f) for f in Draws.__dataclass_fields__ if f != "t"}
    return DistillDraws(u=d.t, inner_u=inner_u, **fields)


def sample_distill_draws_keyed(
    positions: Sequence[int] | np.ndarray,
    length: int,
    dim: int,
    cfg: ObjectiveConfig,
    K: int,
    seed: int,
    device: torch.device | str = "cpu",
) -> DistillDraws:
    """Draws for the examples at stream ``positions``: each row's depend only on (seed, its
    position), so N processes or gradient accumulation see the draws of one process (ELF_SPEC
    §10): :func:`~elflow.train.objective_draws.sample_draws_keyed`'s, and the K - 1 interior
    times."""
    pos = np.asarray(positions, dtype=np.int64).reshape(-1)
    d = sample_draws_keyed(pos, length, dim, cfg, seed, device)
    inner = np.zeros((len(pos), K - 1), dtype=np.float32)
    for k in range(K - 1):
        inner[:, k] = host_normal(pos, seed, f"inner/{k}")
    inner_u = torch.from_numpy(inner).to(device, non_blocking=True)
    return _with_inner(d, logit_normal(inner_u, cfg.time_mean, cfg.time_std))


@torch.no_grad()
def distill_targets(
    teacher: Forward,
    z_s: Tensor,
    sc_half: Tensor,
    x: Tensor,
    cond: Tensor,
    t_s: Tensor,
    t_t: Tensor,
    inner_u: Tensor,
    w: Tensor,
    t_eps: float,
    project: Project | None = None,
    project_from: float = 1.0,
) -> tuple[Tensor, Tensor, Tensor]:
    """The teacher's K Euler sub-steps from t_s to t_t and the student's x-target (ELF_SPEC §8).

    Args:
        teacher: the frozen teacher's forward function (called in denoise mode).
        z_s: (B, L, E) z_{t_s}, condition positions already equal to x.
        sc_half: (B, L, E) the self-conditioning half the student gets (condition reset).
        x: (B, L, E) clean latents (zeroed at the condition of label-dropped rows).
        cond: (B, L) bool condition mask.
        t_s, t_t, w: (B,) per row.
        inner_u: (B, K - 1) interior times as fractions of the span, any order.
        project: with ``project_from`` < 1, replaces each sub-step's x_hat at t >= project_from
            (:func:`elflow.sampling.denoiser.projector`; projected sampling's step, an elflow
            addition).

    Returns:
        (x_target, z_{t_t}, the teacher's last x-prediction), each (B, L, E).

    NOTE: the target z_s + ((1 - t_s) / (t_t - t_s)) (z_tt - z_s) makes the student's Euler step
    z_s + (t_t - t_s) (x_target - z_s) / max(1 - t_s, t_eps) land exactly on z_tt only while the
    clamp is inactive, 1 - t_s >= t_eps. With t_s <= 1 - delta that holds whenever delta >= t_eps
    (N <= 20 at t_eps = 0.05, so every round of the paper); for larger N the rows with
    1 - t_s < t_eps get a step that stops short, by the factor (1 - t_s) / t_eps. With K = 1 the
    formula equals the teacher's x-prediction when the clamp is inactive; the spec's rule
    "with K = 1 it is the teacher's x" is applied literally (and exactly, without rounding).
    """
    K = inner_u.shape[1] + 1
    span = t_t - t_s  # (B,)
    inner = torch.sort(inner_u.float(), dim=-1).values
    times = torch.cat([t_s[:, None], t_s[:, None] + inner * span[:, None], t_t[:, None]], dim=1)
    cond3 = cond[..., None]
    z, x_prev, x_hat = z_s, sc_half, z_s
    for k in range(K):
        t_k, t_next = times[:, k], times[:, k + 1]
        x_in = torch.cat([z, x_prev], dim=-1)  # (B, L, 2E)
        x_hat = teacher(x_in, t_k, w, 0.0)[0].float()
        if project is not None and project_from < 1.0:
            x_hat = project(x_hat, t_k >= project_from, w)
        # As in sampling: the condition is known, so x_hat is x there and z never moves there.
        x_hat = torch.where(cond3, x, x_hat)
        z = euler_step(z, velocity(x_hat, z, t_k, t_eps), t_k, t_next)
        z = torch.where(cond3, x, z)
        x_prev = x_hat  # the chained self-conditioning input
    scale = ((1.0 - t_s) / span.clamp_min(MIN_SPAN))[:, None, None]
    x_target = z_s + scale * (z - z_s)
    if K == 1:
        x_target = x_hat
    x_target = torch.where((span < MIN_SPAN)[:, None, None], x_hat, x_target)
    return x_target, z, x_hat


@dataclass
class RowSetup:
    """A batch as the distillation objectives read it: branches, condition, SC-CFG scale and
    the decoder rows' input (ELF_SPEC §3 steps 3-4, §8)."""

    x: Tensor
    """(B, L, E) clean latents, zeroed at the condition of label-dropped rows."""
    cond: Tensor
    """(B, L) bool condition mask."""
    w: Tensor
    """(B,) SC-CFG scale."""
    dec: Tensor
    """(B,) bool: decoder rows."""
    sc: Tensor
    """(B,) bool: student-step rows whose self-conditioning half is the teacher's x-prediction."""
    plan: RowPlan
    den_np: np.ndarray
    """Indices of the student-step (non-decoder) rows, on the host."""
    dec_rows: Tensor
    den_rows: Tensor
    x_cond_only: Tensor
    """(B, L, E) Z0: zeros with x at the condition positions."""
    z_dec: Tensor
    """(B, L, E) the decoder rows' corrupted input."""


def prepare_rows(
    batch: Batch, draws: DistillDraws, ocfg: ObjectiveConfig, check_inputs: bool = True
) -> RowSetup:
    """The :class:`RowSetup` of ``batch`` under ``draws`` (shared by the distillation methods)."""
    if check_inputs:
        check_finite(batch.x, "the batch's latents")
    x, cond = batch_latents(batch)  # a dropped condition zeroes x (hence z, z_dec, SC, target)
    B = x.shape[0]
    cond3 = cond[..., None]  # (B, L, 1)
    dec = draws.decoder_active.bool()
    plan = draws.plan if draws.plan is not None else RowPlan.of(draws)  # type: ignore[arg-type]
    den_np = np.setdiff1d(np.arange(B), plan.decoder)
    lam = draws.decoder_lambda
    return RowSetup(
        x=x,
        cond=cond,
        w=draws.w.float(),
        dec=dec,
        sc=draws.use_self_cond.bool() & ~dec,
        plan=plan,
        den_np=den_np,
        dec_rows=host_index(plan.decoder, x.device),
        den_rows=host_index(den_np, x.device),
        x_cond_only=torch.where(cond3, x, 0.0),
        z_dec=lam * x + (1.0 - lam) * ocfg.decoder_noise_scale * draws.decoder_noise,
    )


def self_cond_half(
    teacher: Forward,
    rows: RowSetup,
    z_s: Tensor,
    t_s: Tensor,
    project: Project | None = None,
    project_from: float = 1.0,
) -> Tensor:
    """The student's self-conditioning half (ELF_SPEC §8): the teacher's unconditional x_hat at
    (z_s, t_s, w) on the self-conditioning rows, Z0 elsewhere; condition positions reset."""
    x_hat_u = nograd_prediction(
        teacher, z_s, rows.x_cond_only, t_s, rows.w, host_index(rows.plan.self_cond, z_s.device)
    )
    # It stands for the previous step's x_hat, projected in sampling when that step's time was
    # >= project_from; here, for want of that time, when t_s is.
    if project is not None:
        with torch.no_grad():
            x_hat_u = project(x_hat_u, rows.sc & (t_s >= project_from), rows.w)
    keep = rows.sc[:, None, None] & ~rows.cond[..., None]
    return torch.where(keep, x_hat_u, rows.x_cond_only)  # (B, L, E)


def student_loss(
    student: Forward,
    batch: Batch,
    rows: RowSetup,
    z_s: Tensor,
    sc_half: Tensor,
    t_s: Tensor,
    x_target: Tensor,
    ocfg: ObjectiveConfig,
) -> DistillLossOutput:
    """The trained pass and the per-row losses (ELF_SPEC §8): student-step rows [z_s, SC half]
    at t_s against ``x_target`` (x-space MSE), decoder rows [z_dec, Z0] at t = 1 (cross-entropy);
    each row's masked token mean, then the plain mean over rows."""
    x_target = x_target.detach()
    B = x_target.shape[0]
    dec, dec_rows, den_rows, cond = rows.dec, rows.dec_rows, rows.den_rows, rows.cond
    den_in = torch.cat([z_s, sc_half], dim=-1)
    dec_in = torch.cat([rows.z_dec, rows.x_cond_only], dim=-1)
    x_in = torch.where(dec[:, None, None], dec_in, den_in)  # (B, L, 2E)
    t_in = torch.where(dec, torch.ones_like(t_s), t_s)
    x_pred, logits = student(x_in, t_in, rows.w, dec.float(), dec_rows)

    valid = torch.ones_like(cond) if ocfg.pad_with_eos else batch.attention_mask.bool()
    mask = (valid & ~cond).float()  # (B, L)
    l2_tok = (x_pred.float() - x_target).pow(2).mean(-1)  # (B, L)
    tok = torch.where(mask > 0, l2_tok, 0.0)  # decoder rows' x_pred is unused: keep it finite
    # NOTE: also with no decoder rows (then an empty slice), so that the decoder head is in the
    # graph and gets (zero) gradients on every rank: DDP reduces the same buckets everywhere.
    ce_dec = token_cross_entropy(logits, batch.input_ids.long().index_select(0, dec_rows))
    ce_tok = torch.zeros_like(tok).index_copy_(0, dec_rows, ce_dec)  # (B_dec, L) into (B, L)
    tok = torch.where(dec[:, None], ce_tok, tok)
    row_loss = (tok * mask).sum(-1) / mask.sum(-1).clamp_min(1.0)  # (B,)
    row_sum = row_loss.sum()
    # NOTE: a row with no loss tokens (all condition) counts as a zero row: the spec's mean over B.
    n_den, n_dec = len(rows.den_np), len(rows.plan.decoder)
    rl = row_loss.detach()
    return DistillLossOutput(
        loss=row_sum / max(B, 1),
        row_sum=row_sum,
        num_rows=B,
        row_loss=rl,
        l2_loss=rl.index_select(0, den_rows).sum() / max(n_den, 1),
        ce_loss=rl.index_select(0, dec_rows).sum() / max(n_dec, 1),
        x_target=x_target,
    )


def distill_loss(
    student: Forward,
    teacher: Forward,
    batch: Batch,
    draws: DistillDraws,
    cfg: DistillConfig,
    project: Project | None = None,
    check_inputs: bool = True,
) -> DistillLossOutput:
    """The distillation loss of one batch for the given draws (ELF_SPEC §8).

    In the spec's order: the self-conditioning half, the teacher's sub-steps and target, the
    trained pass, the per-row losses (:func:`student_loss`).

    Args:
        student: the student's forward function (:class:`elflow.train.forward.TrainForward`,
            possibly wrapped in DDP or FSDP2).
        teacher: the frozen teacher's forward function (in eval mode, never wrapped); every
            teacher pass runs under no_grad and only on the rows that need it.
        project: the teacher's projector (:func:`elflow.sampling.denoiser.projector`), which
            ``cfg.project_from`` < 1 needs.
        check_inputs: refuse non-finite latents at once (a device read; the trainer checks
            them with its other metrics instead).
    """
    ocfg = cfg.objective
    B = batch.x.shape[0]
    K = cfg.teacher_substeps
    if draws.inner_u.shape != (B, K - 1):
        raise ELFError(
            f"draws.inner_u must be (B, K - 1) = {(B, K - 1)}, got {tuple(draws.inner_u.shape)}; "
            "draw with the round's teacher_substeps"
        )
    if cfg.project_from < 1.0 and (project is None or batch.cond_mask is not None):
        raise ELFError(
            "distill.project_from < 1 needs an unconditional teacher and its projector "
            "(distill_loss(..., project=elflow.sampling.denoiser.projector(teacher, projection))); "
            "project_from 1 turns it off"
        )
    if cfg.project_from >= 1.0:
        project = None
    rows = prepare_rows(batch, draws, ocfg, check_inputs)
    x, cond3 = rows.x, rows.cond[..., None]

    t_s = draws.u.float() * max(1.0 - cfg.delta, MIN_TS_SCALE)  # (B,)
    t_t = t_s + cfg.delta
    z_s = torch.where(cond3, x, interpolate(x, draws.noise, t_s, ocfg.noise_scale))

    # 1) Self-conditioning half: the teacher's unconditional x_hat at (z_s, t_s, w) on sc rows.
    sc_half = self_cond_half(teacher, rows, z_s, t_s, project, cfg.project_from)

    # 2) Teacher sub-steps and the x-target, on the student-step rows only.
    x_target = torch.zeros_like(x)
    if len(rows.den_np):

        def sel(v: Tensor) -> Tensor:
            return v.index_select(0, rows.den_rows)

        targets = distill_targets(
            teacher,
            sel(z_s),
            sel(sc_half),
            sel(x),
            sel(rows.cond),
            sel(t_s),
            sel(t_t),
            sel(draws.inner_u),
            sel(rows.w),
            ocfg.t_eps,
            project,
            cfg.project_from,
        )[0]
        x_target.index_copy_(0, rows.den_rows, targets)

    # 3-4) Trained pass and per-row losses.
    return student_loss(student, batch, rows, z_s, sc_half, t_s, x_target, ocfg)
