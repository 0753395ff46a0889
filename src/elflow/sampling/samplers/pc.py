"""The predictor-corrector sampler, an elflow addition: an Euler predictor, then one Langevin
corrector move with the score of the x-prediction (ELF_SPEC §5). ``pc_snr`` is its own
setting."""

from __future__ import annotations

from typing import TYPE_CHECKING

from elflow.sampling.registry import SamplerSpec

if TYPE_CHECKING:
    from torch import Tensor

    from elflow.sampling.step_context import Condition, Denoiser, StepContext

RANK = 3
"""After Heun."""


def pc_step(
    denoise: Denoiser,
    z: Tensor,
    x_prev: Tensor,
    t: Tensor,
    t_next: Tensor,
    noise: Tensor,
    snr: float,
    noise_scale: float,
    t_eps: float,
    cond: Condition | None = None,
) -> tuple[Tensor, Tensor]:
    """Predictor-corrector: an Euler predictor to t_next, then one Langevin corrector move at
    t_next with the score of the x-prediction there (self-conditioned on the predictor's x_hat),
    its step size set by ``snr``. Two network evaluations."""
    from elflow.flow import euler_step, langevin_step, score_from_x

    x_hat, v = denoise(z, x_prev, t)
    z_pred = euler_step(z, v, t, t_next)
    x_hat2, _ = denoise(z_pred, x_hat, t_next)
    score = score_from_x(z_pred, x_hat2, t_next, noise_scale, t_eps)
    z_next = langevin_step(z_pred, score, noise, snr)
    if cond is not None:
        z_next = cond.hold(z_next)
    return z_next, x_hat2


def _step(denoise, z, x_prev, t, t_next, ctx: StepContext):
    noise, snr = ctx.noise(), ctx.sampler.pc_snr
    return pc_step(denoise, z, x_prev, t, t_next, noise, snr, ctx.noise_scale, ctx.t_eps, ctx.cond)


SPEC = SamplerSpec(
    "pc",
    "predictor-corrector",
    "an Euler step, then one Langevin correction move",
    settings=("pc_snr",),
    evals_per_step=2,
    step=_step,
    noise_draws=1,
)
