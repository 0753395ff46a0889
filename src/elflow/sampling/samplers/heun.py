"""The Heun sampler: second-order ODE steps, an Euler predictor corrected by a second network
evaluation (ELF_SPEC §10)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from elflow.sampling.registry import SamplerSpec

if TYPE_CHECKING:
    from torch import Tensor

    from elflow.sampling.step_context import Denoiser, StepContext

RANK = 2
"""After the SDE."""


def heun_step(
    denoise: Denoiser, z: Tensor, x_prev: Tensor, t: Tensor, t_next: Tensor
) -> tuple[Tensor, Tensor]:
    """Heun (second order): Euler predictor, corrector at (z_pred, t_next) self-conditioned on the
    predictor's x_hat, velocities averaged (ELF_SPEC §10)."""
    from elflow.flow import euler_step

    x_hat, v = denoise(z, x_prev, t)
    z_pred = euler_step(z, v, t, t_next)
    x_hat2, v2 = denoise(z_pred, x_hat, t_next)
    return euler_step(z, 0.5 * (v + v2), t, t_next), x_hat2


def _step(denoise, z, x_prev, t, t_next, ctx: StepContext):
    return heun_step(denoise, z, x_prev, t, t_next)


SPEC = SamplerSpec(
    "heun",
    "Heun",
    "second-order steps: an Euler step corrected by a second network evaluation",
    evals_per_step=2,
    step=_step,
    noise_draws=0,
)
