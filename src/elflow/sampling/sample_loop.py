"""The sampling loop from noise to tokens (paper §3.3; ELF_SPEC §5); the samplers' steps are
theirs (:mod:`elflow.sampling.samplers`, found through :mod:`elflow.sampling.registry`).

Pure tensor functions over two callables: ``denoise(z, x_prev, t) -> (x_hat, v_hat)`` (the
guided network call, with the condition reset; :func:`elflow.sampling.denoiser.make_denoiser`
builds it from a model) and ``decode(z) -> tokens`` (decode mode at t = 1). Randomness comes
from explicit per-sample generators, so a sample depends on (seed, index) only, never on the
batch it is in.
With ``trajectory=True`` :func:`sample` also returns each step's decoded x_hat (§10).
Projected sampling wraps the denoiser (:mod:`elflow.sampling.projection`); nothing here knows
of it. A :data:`StepRunner` may run each step instead of the loop (CUDA graph replay,
:mod:`elflow.generation.cuda_graphs`): the step's noise is then drawn here, in the same order.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from elflow.config.sampler_config import SamplerConfig
from elflow.errors import ELFError, check_finite
from elflow.flow import logit_normal_grid, uniform_grid
from elflow.sampling.registry import noise_draws, sampler_step
from elflow.sampling.samplers.ode import ode_step
from elflow.sampling.step_context import Condition, Decoder, Denoiser, StepContext


def sample_seed(seed: int, index: int) -> int:
    """A 63-bit seed for sample ``index`` of a run seeded with ``seed`` (stable across runs)."""
    digest = hashlib.sha256(f"elflow:{seed}:{index}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


Seeds = int | Sequence[int]
"""One seed for every sample, or one per sample (sample k of a batch: ``seeds[k]``)."""


def seed_of(seeds: Seeds, k: int) -> int:
    """The seed of the ``k``-th sample of a batch."""
    return seeds if isinstance(seeds, int) else int(seeds[k])


def seeds_of(seeds: Seeds, start: int, stop: int) -> Seeds:
    """The seeds of samples ``start..stop-1`` (a batch of a longer run)."""
    return seeds if isinstance(seeds, int) else list(seeds[start:stop])


def sample_generators(
    seed: Seeds, indices: Sequence[int], device: torch.device | str = "cpu"
) -> list[torch.Generator]:
    """One generator per sample, seeded by (its seed, its index): ``seed`` one for all, or one
    per sample."""
    if not isinstance(seed, int) and len(seed) != len(indices):
        raise ELFError(f"{len(seed)} seeds for {len(indices)} samples; give one per sample")
    return [
        torch.Generator(device=device).manual_seed(sample_seed(seed_of(seed, k), i))
        for k, i in enumerate(indices)
    ]


def _randn(gens: Sequence[torch.Generator], shape: tuple[int, ...], device) -> Tensor:
    return torch.stack([torch.randn(shape, generator=g, device=device) for g in gens])


@dataclass
class SampleOutput:
    tokens: Tensor
    """(B, L) argmax tokens of the final decode."""
    z: Tensor
    """(B, L, E) final state."""
    trajectory: Tensor | None = None
    """(N, B, L) decode-mode argmax of each step's x_hat, when asked for."""


def advance(
    denoise: Denoiser,
    z: Tensor,
    x_prev: Tensor,
    t: Tensor,
    t_next: Tensor,
    ctx: StepContext,
    last: bool = False,
) -> tuple[Tensor, Tensor]:
    """One step of :func:`sample`'s loop: the sampler's step (Euler when ``last``), then the
    condition reset; returns (z_next, x_hat)."""
    if last:
        z, x_hat = ode_step(denoise, z, x_prev, t, t_next)
    else:
        z, x_hat = sampler_step(ctx.sampler.sampler)(denoise, z, x_prev, t, t_next, ctx)
    if ctx.cond is not None:  # a no-op unless the condition's latents were refreshed
        z = ctx.cond.hold(z)
    return z, x_hat


def step_function(
    denoise: Denoiser,
    sampler: SamplerConfig,
    noise_scale: float,
    t_eps: float,
    cond: Condition | None,
    last: bool,
) -> Callable[..., tuple[Tensor, Tensor]]:
    """:func:`advance` as a function of tensors alone, ``f(z, x_prev, t, t_next, *noises)``:
    the step's :func:`noise_draws` noises are arguments, drawn beforehand (what a CUDA graph
    captures)."""

    def f(z: Tensor, x_prev: Tensor, t: Tensor, t_next: Tensor, *noises: Tensor):
        draws = iter(noises)
        ctx = StepContext(sampler, noise_scale, t_eps, cond, lambda: next(draws))
        return advance(denoise, z, x_prev, t, t_next, ctx, last)

    return f


StepRunner = Callable[[bool, Sequence[Tensor]], tuple[Tensor, Tensor]]
"""``run(last, (z, x_prev, t, t_next, *noises)) -> (z_next, x_hat)``: a :func:`step_function`
run another way (a replayed CUDA graph). Its outputs may be overwritten by its next call."""


@dataclass(frozen=True)
class StepState:
    """What a sampling step hands to ``callback_on_step_end``."""

    step: int
    """The step just taken, from 0."""
    steps: int
    """The number of steps."""
    t: Tensor
    """(B,) the time reached (1 = data)."""
    z: Tensor
    """(B, L, E) the state at ``t``."""
    x_hat: Tensor
    """(B, L, E) the step's clean-latent estimate (what the trajectory decodes)."""
    tokens: Tensor | None = None
    """(B, L) the decode of ``x_hat`` (decode-mode argmax), when the trajectory is asked for."""


StepCallback = Callable[[StepState], None]


@torch.no_grad()
def sample(
    denoise: Denoiser,
    decode: Decoder,
    generators: Sequence[torch.Generator],
    shape: tuple[int, int],
    sampler: SamplerConfig,
    noise_scale: float = 2.0,
    cond: Condition | None = None,
    trajectory: bool = False,
    t_eps: float = 0.05,
    callback_on_step_end: StepCallback | None = None,
    runner: StepRunner | None = None,
) -> SampleOutput:
    """Integrate from noise to t = 1 and decode (ELF_SPEC §5). One generator per sample.

    Args:
        denoise, decode: the network's calls (:func:`elflow.sampling.denoiser.sample_model`
            wires them).
        shape: (L, E), one sample's latents.
        sampler: steps, method, gamma (and its schedule) and time grid; its guidance scales
            (w, cfg) and ``project_from`` are the denoiser's business.
        t_eps: the clamp of 1 - t in the pc corrector's score (the model's).
        callback_on_step_end: called after each step with a :class:`StepState` (the diffusers
            convention; it must not change the tensors it is given).
        runner: runs each step (:func:`step_function` of ``denoise`` over the same condition)
            instead of calling ``denoise`` here; each step's noise is drawn before it, in the
            order the eager loop draws it, so the samples are the same. Only for samplers whose
            spec gives their noise draws (:func:`noise_draws`).
    """
    B, N = len(generators), sampler.steps
    device = generators[0].device
    L, E = shape
    if sampler.time_grid == "uniform":
        grid = uniform_grid(N, B, device)
    else:
        grid = logit_normal_grid(
            _randn(generators, (N - 1,), device), sampler.time_mean, sampler.time_std
        )  # (B, N + 1)
    z = noise_scale * _randn(generators, (L, E), device)
    x_prev = torch.zeros_like(z)
    if cond is not None:
        check_finite(cond.latents, "the condition latents")
        c3 = cond.mask.bool()[..., None]
        z, x_prev = torch.where(c3, cond.latents, z), torch.where(c3, cond.latents, x_prev)
    frames = []

    def draw() -> Tensor:
        return _randn(generators, (L, E), device)

    ctx = StepContext(sampler, noise_scale, t_eps, cond, draw)
    draws = None if runner is None else noise_draws(sampler.sampler)
    if runner is not None and draws is None:
        raise ELFError(
            f"sampler {sampler.sampler!r} declares no noise_draws: sample it without a runner"
        )
    for k in range(N):
        t, t_next, last = grid[:, k], grid[:, k + 1], k == N - 1
        if runner is None:
            z, x_prev = advance(denoise, z, x_prev, t, t_next, ctx, last)
        else:  # the step's draws now, in the eager order; its outputs live until the next call
            noises = [draw() for _ in range(0 if last else draws)]
            z, x_prev = runner(last, (z, x_prev, t, t_next, *noises))
        tokens = decode(x_prev) if trajectory else None
        if tokens is not None:
            frames.append(tokens)
        if callback_on_step_end is not None:
            z_k, x_k = (z, x_prev) if runner is None else (z.clone(), x_prev.clone())
            callback_on_step_end(StepState(k, N, t_next, z_k, x_k, tokens))
    tokens = decode(z)
    z = z if runner is None else z.clone()
    return SampleOutput(tokens, z, torch.stack(frames) if trajectory else None)
