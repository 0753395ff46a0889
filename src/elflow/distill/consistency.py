"""Consistency distillation (``elflow distill --method cd``): one student for every step count.

Consistency models (Song, Dhariwal, Chen, Sutskever 2023, "Consistency Models", §4 and Alg. 2)
learn f(z_t, t), the endpoint at t = 1 of the teacher's ODE through z_t, from the identity
f(z_t, t) = f(Φ(z_t; t → t'), t') with f(z, 1) = z. ELF's network already predicts a clean x, and
one Euler step from t to 1 lands on that prediction, so f is the x-prediction itself: the student
keeps the teacher's architecture, heads and checkpoints. Per example (decoder rows as in ELF_SPEC
§3): a time t (a point k/N of a uniform N-step grid), a span Δ from a set, t' = min(t + Δ, 1);
the teacher takes K Euler sub-steps t → t' (:func:`elflow.distill.progressive.distill_targets`,
LCM's skipping-step solver: Luo et al. 2023, "Latent Consistency Models", §4.3); the x-target is
z_{t'} when t' = 1 (no bootstrapping: the teacher's K-step endpoint, Luhman & Luhman 2021) and
otherwise the student's own no-grad x-prediction at (z_{t'}, t') (stop-gradient target weights,
as in "Improved Techniques for Training Consistency Models", Song & Dhariwal 2023, §3.2).
A student samples with the re-noising sampler (:mod:`elflow.sampling.samplers.renoise`), the
multistep consistency sampler (Alg. 1).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import Tensor

from elflow.config.objective_config import ObjectiveConfig
from elflow.distill.progressive import (
    DistillDraws,
    DistillLossOutput,
    distill_targets,
    prepare_rows,
    sample_distill_draws,
    sample_distill_draws_keyed,
    self_cond_half,
    student_loss,
)
from elflow.errors import ELFError, require
from elflow.flow import interpolate
from elflow.objective import Batch, Forward, nograd_prediction
from elflow.runtime.keyed_random import host_uniform


@dataclass(frozen=True)
class ConsistencySettings:
    """Consistency distillation's settings (``elflow distill --method cd --method-set K=V``)."""

    steps: int = 4
    """The student's default sampling steps, written into its config (it samples at any)."""
    spans: str = "1"
    """Teacher spans Δ, one drawn per example (e.g. 0.25,1): t' = min(t + Δ, 1); at t' = 1 the
    target is the teacher's endpoint, below it the student's prediction at t' (bootstrapping)."""
    teacher_substeps: int = 16
    """K: the teacher's Euler sub-steps over each span."""
    grid_steps: str = "1,2,4,8"
    """Training times: the points k/N (k < N) of uniform N-step grids, N drawn from these, the
    times the student's sampler visits; empty: the objective's logit-normal times."""

    def __post_init__(self) -> None:
        ConsistencyConfig.of(self, ObjectiveConfig())  # the errors, before anything loads


@dataclass(frozen=True)
class ConsistencyConfig:
    """One consistency-distillation stage, parsed."""

    spans: tuple[float, ...] = (1.0,)
    """Δ values, drawn uniformly per example."""
    teacher_substeps: int = 16
    """K: teacher Euler sub-steps per span."""
    grid_steps: tuple[int, ...] = (1, 2, 4, 8)
    """N values of the training times k/N; () for logit-normal times."""
    objective: ObjectiveConfig = field(default_factory=ObjectiveConfig)
    """The §3 settings (decoder branch, self-conditioning, w range, noise)."""

    def __post_init__(self) -> None:
        require(
            len(self.spans) > 0 and all(0.0 < s <= 1.0 for s in self.spans),
            f"spans= must be numbers in (0, 1], got {self.spans}",
        )
        require(
            isinstance(self.teacher_substeps, int) and self.teacher_substeps >= 1,
            f"teacher_substeps= must be a positive integer, got {self.teacher_substeps!r}",
        )
        require(
            all(isinstance(n, int) and n >= 1 for n in self.grid_steps),
            f"grid_steps= must be positive integers, got {self.grid_steps}",
        )

    @classmethod
    def of(cls, settings: ConsistencySettings, objective: ObjectiveConfig) -> ConsistencyConfig:
        return cls(
            spans=_numbers(settings.spans, float, "spans"),
            teacher_substeps=settings.teacher_substeps,
            grid_steps=_numbers(settings.grid_steps, int, "grid_steps")
            if settings.grid_steps
            else (),
            objective=objective,
        )


def _numbers(text: str, kind: type, name: str) -> tuple:
    try:
        return tuple(kind(v) for v in str(text).split(","))
    except ValueError:
        raise ELFError(f"{name}= must be numbers separated by commas, got {text!r}") from None


@dataclass
class ConsistencyDraws:
    """Every random draw of one consistency-distillation evaluation."""

    base: DistillDraws
    """§3's draws and the K - 1 interior sub-step times (its ``u`` is unused)."""
    t: Tensor
    """(B,) the student's time."""
    span: Tensor
    """(B,) the teacher span Δ."""


def _times_and_spans(
    u_steps: Tensor, u_k: Tensor, u_span: Tensor, logit_t: Tensor, cfg: ConsistencyConfig
) -> tuple[Tensor, Tensor]:
    """(t, span) from uniform draws in (0, 1): N from ``grid_steps`` and k < N (t = k / N), or the
    logit-normal ``logit_t`` without a grid; Δ from ``spans``."""
    spans = torch.tensor(cfg.spans, dtype=torch.float32, device=u_span.device)
    span = spans[(u_span * len(cfg.spans)).long().clamp_max(len(cfg.spans) - 1)]
    if not cfg.grid_steps:
        return logit_t.float(), span
    grid = torch.tensor(cfg.grid_steps, dtype=torch.float32, device=u_steps.device)
    n = grid[(u_steps * len(cfg.grid_steps)).long().clamp_max(len(cfg.grid_steps) - 1)]
    k = torch.minimum(torch.floor(u_k * n), n - 1)
    return k / n, span


def sample_consistency_draws(
    batch: int,
    length: int,
    dim: int,
    cfg: ConsistencyConfig,
    generator: torch.Generator | None = None,
    device: torch.device | str | None = None,
) -> ConsistencyDraws:
    """The draws from ``generator``: :func:`sample_distill_draws`' first, then (N, k, Δ)."""
    base = sample_distill_draws(
        batch, length, dim, cfg.objective, cfg.teacher_substeps, generator, device
    )
    u = torch.rand(3, batch, generator=generator, device=device)
    t, span = _times_and_spans(u[0], u[1], u[2], base.u, cfg)
    return ConsistencyDraws(base, t, span)


def sample_consistency_draws_keyed(
    positions: Sequence[int] | np.ndarray,
    length: int,
    dim: int,
    cfg: ConsistencyConfig,
    seed: int,
    device: torch.device | str = "cpu",
) -> ConsistencyDraws:
    """Draws for the examples at stream ``positions``, each row's a function of (seed, its
    position) alone (ELF_SPEC §10)."""
    pos = np.asarray(positions, dtype=np.int64).reshape(-1)
    base = sample_distill_draws_keyed(
        pos, length, dim, cfg.objective, cfg.teacher_substeps, seed, device
    )
    u = [
        torch.from_numpy(host_uniform(pos, seed, f"cd/{s}")).float().to(device)
        for s in ("steps", "k", "span")
    ]
    t, span = _times_and_spans(u[0], u[1], u[2], base.u, cfg)
    return ConsistencyDraws(base, t, span)


@torch.no_grad()
def consistency_targets(
    teacher: Forward,
    student: Forward,
    z_t: Tensor,
    sc_half: Tensor,
    x: Tensor,
    cond: Tensor,
    t: Tensor,
    t_next: Tensor,
    inner_u: Tensor,
    w: Tensor,
    use_sc: Tensor,
    t_eps: float,
) -> Tensor:
    """The student's x-target at (z_t, t): f(Φ_K(z_t; t → t'), t') with f(z, 1) = z.

    Args:
        teacher, student: forward functions (denoise mode); the student runs without gradients.
        z_t, sc_half, x: (B, L, E) the state, the student's self-conditioning half and the clean
            latents (condition positions equal x in z_t and sc_half).
        cond: (B, L) bool condition mask.
        t, t_next, w: (B,) per row; t_next <= 1.
        inner_u: (B, K - 1) the teacher's interior sub-step times as fractions of the span.
        use_sc: (B,) bool: the student at t' is self-conditioned on the teacher's last x_hat
            (the estimate a sampler would hand it), else on zeros with x at the condition.

    Returns:
        (B, L, E): z_{t'} on rows with t' = 1, the student's x_hat at (z_{t'}, t') elsewhere.
    """
    _, z_next, x_last = distill_targets(
        teacher, z_t, sc_half, x, cond, t, t_next, inner_u, w, t_eps
    )
    cond3 = cond[..., None]
    half = torch.where(use_sc[:, None, None] & ~cond3, x_last, torch.where(cond3, x, 0.0))
    inside = (t_next < 1.0).nonzero().squeeze(1)  # the rows that bootstrap (a device read)
    # NOTE: called with no row too: a sharded student's forward is a collective on every rank.
    f_next = nograd_prediction(student, z_next, half, t_next, w, inside)
    target = torch.where((t_next < 1.0)[:, None, None], f_next, z_next)
    return torch.where(cond3, x, target)


def consistency_loss(
    student: Forward,
    teacher: Forward,
    batch: Batch,
    draws: ConsistencyDraws,
    cfg: ConsistencyConfig,
    check_inputs: bool = True,
) -> DistillLossOutput:
    """The consistency-distillation loss of one batch for the given draws.

    As :func:`elflow.distill.progressive.distill_loss` (the same self-conditioning half, decoder
    rows and per-row normalisation), with the x-target of :func:`consistency_targets` at t.
    """
    ocfg = cfg.objective
    B = batch.x.shape[0]
    K = cfg.teacher_substeps
    if draws.base.inner_u.shape != (B, K - 1):
        raise ELFError(
            f"draws.base.inner_u must be (B, K - 1) = {(B, K - 1)}, got "
            f"{tuple(draws.base.inner_u.shape)}; draw with the stage's teacher_substeps"
        )
    rows = prepare_rows(batch, draws.base, ocfg, check_inputs)
    x, cond3 = rows.x, rows.cond[..., None]
    t = draws.t.float()
    t_next = torch.clamp(t + draws.span.float(), max=1.0)
    z_t = torch.where(cond3, x, interpolate(x, draws.base.noise, t, ocfg.noise_scale))
    sc_half = self_cond_half(teacher, rows, z_t, t)

    x_target = torch.zeros_like(x)
    if len(rows.den_np):

        def sel(v: Tensor) -> Tensor:
            return v.index_select(0, rows.den_rows)

        targets = consistency_targets(
            teacher,
            student,
            sel(z_t),
            sel(sc_half),
            sel(x),
            sel(rows.cond),
            sel(t),
            sel(t_next),
            sel(draws.base.inner_u),
            sel(rows.w),
            sel(rows.sc),
            ocfg.t_eps,
        )
        x_target.index_copy_(0, rows.den_rows, targets)
    return student_loss(student, batch, rows, z_t, sc_half, t, x_target, ocfg)
