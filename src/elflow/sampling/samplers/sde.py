"""The gamma-SDE sampler, the paper's stochastic sampler (paper §3.3; ELF_SPEC §5): each step
first re-injects noise back to an earlier time, then takes an Euler step. ``gamma`` and its
schedule are its own settings."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from elflow.sampling.registry import SamplerSpec

if TYPE_CHECKING:
    from torch import Tensor

    from elflow.sampling.step_context import Condition, Denoiser, StepContext

RANK = 1
"""After the ODE."""


def sde_step(
    denoise: Denoiser,
    z: Tensor,
    x_prev: Tensor,
    t: Tensor,
    t_next: Tensor,
    gamma: float | Tensor,
    noise: Tensor,
    noise_scale: float,
    cond: Condition | None = None,
) -> tuple[Tensor, Tensor]:
    """gamma-SDE step: re-inject noise back to t_back = alpha t, then Euler to t_next (``gamma``
    a number or per row)."""
    from elflow.flow import euler_step, sde_backtrack

    z_back, t_back = sde_backtrack(z, t, t_next, gamma, noise, noise_scale)
    if cond is not None:
        z_back = cond.hold(z_back)
    x_hat, v = denoise(z_back, x_prev, t_back)
    return euler_step(z_back, v, t_back, t_next), x_hat


def _step(denoise, z, x_prev, t, t_next, ctx: StepContext):
    from elflow.flow import gamma_at

    noise = ctx.noise()
    gamma = gamma_at(ctx.sampler.gamma_schedule, ctx.sampler.gamma, t)
    return sde_step(denoise, z, x_prev, t, t_next, gamma, noise, ctx.noise_scale, ctx.cond)


def _eval_time(t: Any, t_next: Any, settings: Mapping[str, Any]) -> Any:
    from elflow.flow import backtrack_alpha, gamma_at

    rate = gamma_at(settings.get("gamma_schedule") or "constant", float(settings["gamma"]), t)
    return t * backtrack_alpha(t, t_next, rate)


def _check_choice(base: Any, changes: Mapping[str, Any]) -> str | None:
    if "gamma" not in changes and base.gamma == 0.0:
        return (
            "the SDE with this model's default gamma 0 is the ODE; give sampler.gamma, e.g. 1.5, "
            "the paper's unconditional value"
        )
    return None


SPEC = SamplerSpec(
    "sde",
    "SDE",
    "Euler steps that first put some noise back (the paper's stochastic sampler)",
    settings=("gamma", "gamma_schedule"),
    step=_step,
    noise_draws=1,
    eval_time=_eval_time,
    check_choice=_check_choice,
)
