"""The ODE sampler: deterministic Euler steps along the flow (paper §3.3; ELF_SPEC §5). Every
sampler's last step is one of these."""

from __future__ import annotations

from typing import TYPE_CHECKING

from elflow.sampling.registry import SamplerSpec

if TYPE_CHECKING:
    from torch import Tensor

    from elflow.sampling.step_context import Denoiser, StepContext

RANK = 0
"""First in listings."""


def ode_step(
    denoise: Denoiser, z: Tensor, x_prev: Tensor, t: Tensor, t_next: Tensor
) -> tuple[Tensor, Tensor]:
    """Euler step; returns (z_next, x_hat) where x_hat is the next self-conditioning input."""
    from elflow.flow import euler_step

    x_hat, v = denoise(z, x_prev, t)
    return euler_step(z, v, t, t_next), x_hat


def _step(denoise, z, x_prev, t, t_next, ctx: StepContext):
    return ode_step(denoise, z, x_prev, t, t_next)


SPEC = SamplerSpec(
    "ode", "ODE", "deterministic Euler steps along the flow", step=_step, noise_draws=0
)
