"""The re-noising sampler: multistep consistency sampling (Song et al. 2023, Alg. 1), for
consistency-distilled students (ELF_SPEC §11): each step takes the clean estimate as the sample
and noises it afresh to the next time."""

from __future__ import annotations

from typing import TYPE_CHECKING

from elflow.sampling.registry import SamplerSpec

if TYPE_CHECKING:
    from torch import Tensor

    from elflow.sampling.step_context import Denoiser, StepContext

RANK = 4
"""Last of the built-ins: for distilled students only."""


def renoise_step(
    denoise: Denoiser, z: Tensor, x_prev: Tensor, t: Tensor, t_next: Tensor, ctx: StepContext
) -> tuple[Tensor, Tensor]:
    """Take the x-prediction at (z, t) as the sample, then put fresh noise back to t_next:
    z' = t' x_hat + (1 - t') s ε (the condition reset). The sampler's last step is Euler, which
    lands on x_hat."""
    from elflow.flow import interpolate

    x_hat, _ = denoise(z, x_prev, t)
    z_next = interpolate(x_hat, ctx.noise(), t_next, ctx.noise_scale)
    if ctx.cond is not None:
        z_next = ctx.cond.hold(z_next)
    return z_next, x_hat


SPEC = SamplerSpec(
    "renoise",
    "re-noising",
    "takes the clean estimate as the sample and noises it afresh to the next time "
    "(multistep consistency sampling, for consistency-distilled students)",
    step=renoise_step,
    noise_draws=1,
)
