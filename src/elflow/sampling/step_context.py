"""What a sampler's step works with (ELF_SPEC §5): the denoiser and decoder callables, the clean
condition, and the :class:`StepContext` the loop hands each step."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from torch import Tensor

from elflow.config.sampler_config import SamplerConfig

Denoiser = Callable[[Tensor, Tensor, Tensor], tuple[Tensor, Tensor]]
"""``denoise(z, x_prev, t) -> (x_hat, v_hat)``, each (B, L, E); t (B,) or a scalar."""
Decoder = Callable[[Tensor], Tensor]
"""``decode(z) -> tokens``: (B, L, E) latents at t = 1 to (B, L) argmax token ids."""


@dataclass
class Condition:
    """Clean condition latents: a conditional model's source, or an infilling template's kept
    positions (held clean at every step; the sampler resets z there after each step, so an
    infilling refresh that rewrites ``latents`` moves z with it)."""

    latents: Tensor
    """(B, L, E) clean latents, meaningful at condition positions."""
    mask: Tensor
    """(B, L) 1 at condition positions."""
    guided: Tensor | None = None
    """(B, L) the positions classifier-free guidance drops in its unconditional evaluation
    (a source); None: all of ``mask``."""

    def hold(self, z: Tensor) -> Tensor:
        """``z`` with the condition's latents at its positions."""
        return self.latents.where(self.mask.bool()[..., None], z)


@dataclass(frozen=True)
class StepContext:
    """What a sampler's step may use besides the state: its settings, the path's noise scale,
    the pc corrector's clamp, the condition, and ``noise()``, a fresh standard-normal (B, L, E)
    draw from the samples' generators."""

    sampler: SamplerConfig
    noise_scale: float
    t_eps: float
    cond: Condition | None
    noise: Callable[[], Tensor]
