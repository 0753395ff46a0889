"""The sampler's wiring: the network adapted to what the sampling maths takes (ELF_SPEC §5, §10).

The samplers (:mod:`elflow.sampling.sample_loop`, :mod:`elflow.sampling.samplers`) and projection
never see :class:`ELF` (``model.py``, the network): they take a ``denoise(z, x_prev, t) ->
(x_hat, v_hat)`` function and a ``decode(z)`` function. This module builds them from a network:
:func:`make_denoiser` (self-conditioning CFG's scale, classifier-free guidance in one batched
call, the condition reset), :func:`make_decoder`, and :func:`sample_model`, which wires the
sampler (and projected sampling when asked for) for a model. The objectives' forward function is
:class:`elflow.train.forward.TrainForward`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from functools import partial

import torch
from torch import Tensor

from elflow.config.sampler_config import SamplerConfig
from elflow.errors import ELFError
from elflow.flow import velocity
from elflow.model import ELF
from elflow.runtime import bf16_fast_path as fastpath
from elflow.runtime.hardware import keep_freed_memory
from elflow.sampling.projection import Project, Projection, project_denoiser, project_rows
from elflow.sampling.sample_loop import SampleOutput, StepCallback, sample
from elflow.sampling.step_context import Condition, Decoder, Denoiser


def sampling_w(model: ELF, w: float | Tensor) -> float | Tensor | None:
    """The SC-CFG scale the network takes: None for a network without scale tokens."""
    return w if model.cfg.num_scale_tokens > 0 else None


def make_denoiser(
    model: ELF,
    w: float | Tensor | None,
    t_eps: float,
    cond: Condition | None = None,
    cfg: float = 1.0,
    key_mask: Tensor | None = None,
) -> Denoiser:
    """``denoise(z, x_prev, t) -> (x_hat, v_hat)`` with condition reset and guidance.

    With a condition and ``cfg != 1`` the conditional and the unconditional evaluation (z and x_prev
    zeroed at the guided condition positions, zero condition latents there) go through ONE
    batched forward, and v = v_u + cfg (v_c - v_u), likewise for x_hat. The condition is read at
    each call (an infilling refresh may rewrite its latents). Under bf16 autocast the network
    runs on :mod:`elflow.runtime.bf16_fast_path` (``ELFLOW_FAST_BF16=0``: per-op autocast).
    """
    net = partial(fastpath.forward, model)

    def denoise(z: Tensor, x_prev: Tensor, t: Tensor) -> tuple[Tensor, Tensor]:
        B = z.shape[0]
        if cond is None:
            x_hat = net(torch.cat([z, x_prev], -1), t, w, 0.0, key_mask)[0].float()
            return x_hat, velocity(x_hat, z, t, t_eps)
        c3 = cond.mask.bool()[..., None]
        if cfg == 1.0:
            x_hat = net(torch.cat([z, x_prev], -1), t, w, 0.0, key_mask)[0].float()
        else:
            g3 = c3 if cond.guided is None else cond.guided.bool()[..., None]
            z_u, x_prev_u = z.masked_fill(g3, 0.0), x_prev.masked_fill(g3, 0.0)
            x_in = torch.cat([torch.cat([z, x_prev], -1), torch.cat([z_u, x_prev_u], -1)])
            t = t.expand(B) if t.dim() == 0 else t  # per row, so that it can be repeated
            km = None if key_mask is None else key_mask.repeat(2, 1)
            w2 = w.repeat(2) if isinstance(w, Tensor) and w.dim() > 0 else w
            x_both = net(x_in, t.repeat(2), w2, 0.0, km)[0].float()
            x_c = torch.where(c3, cond.latents, x_both[:B])
            x_u = torch.where(c3, cond.latents, x_both[B:]).masked_fill(g3, 0.0)
            x_hat = x_u + cfg * (x_c - x_u)
        x_hat = torch.where(c3, cond.latents, x_hat)
        return x_hat, velocity(x_hat, z, t, t_eps).masked_fill(c3, 0.0)

    return denoise


@torch.no_grad()
def decode_logits(
    model: ELF, z: Tensor, w: float | Tensor | None, t: float | Tensor = 1.0
) -> Tensor:
    """Decode mode (at t = 1 in sampling) on [z, 0] -> logits (B, L, V)."""
    _, hidden = fastpath.forward(model, torch.cat([z, torch.zeros_like(z)], -1), t, w, 1.0)
    return model.decode_logits(hidden)


DECODE_CHUNK_BYTES = 256 << 20
"""The most memory the decoder head's logits take at once when decoding to tokens: rows are
decoded in chunks of at most this many bytes of (rows, L, V) fp32 logits."""


def decode_rows(length: int, vocab: int, budget: int | None = None) -> int:
    """Rows whose fp32 logits fit in ``budget`` bytes (default :data:`DECODE_CHUNK_BYTES`; at
    least one row)."""
    budget = DECODE_CHUNK_BYTES if budget is None else budget
    return max(1, budget // (length * vocab * 4))


@torch.no_grad()
def decode_tokens(
    model: ELF, z: Tensor, w: float | Tensor | None, t: float | Tensor = 1.0
) -> Tensor:
    """Decode mode (at t = 1 in sampling) on [z, 0] -> argmax tokens (B, L).

    Rows go through in chunks whose logits fit :data:`DECODE_CHUNK_BYTES` (rows are
    independent), so memory does not grow with B x L x V: a batch of 256 at L 128 with T5's
    32,100 tokens would otherwise hold 4.2 GB of logits at once."""
    step = decode_rows(z.shape[1], model.cfg.vocab_size)
    out = []
    for start in range(0, z.shape[0], step):
        rows = slice(start, start + step)
        t_rows, w_rows = _rows_of(t, rows), _rows_of(w, rows)
        out.append(decode_logits(model, z[rows], w_rows, t_rows).argmax(-1))
    return torch.cat(out) if out else z.new_zeros(z.shape[:2], dtype=torch.long)


def _rows_of(value, rows: slice):
    """``value[rows]`` for a per-row tensor; a scalar (or None) as it is."""
    return value[rows] if isinstance(value, Tensor) and value.dim() > 0 else value


def make_decoder(model: ELF, w: float | Tensor | None) -> Decoder:
    """``decode(z) -> tokens`` at t = 1 with the sampling scale ``w``."""
    return partial(decode_tokens, model, w=w)


def projector(model: ELF, projection: Projection) -> Project:
    """Projects the given rows of an x_hat through ``model``'s decode mode and the encoder
    (projected sampling's replacement, used by the distillation teacher)."""
    return partial(project_rows, partial(decode_tokens, model), projection=projection)


@torch.no_grad()
def sample_model(
    model: ELF,
    generators: Sequence[torch.Generator],
    length: int,
    sampler: SamplerConfig,
    noise_scale: float = 2.0,
    t_eps: float = 0.05,
    cond: Condition | None = None,
    trajectory: bool = False,
    projection: Projection | None = None,
    callback_on_step_end: StepCallback | None = None,
    cuda_graphs: bool | None = None,
) -> SampleOutput:
    """:func:`elflow.sampling.sample_loop.sample` with ``model``'s denoiser and decoder
    (ELF_SPEC §5).

    ``sampler.project_from < 1`` wraps the denoiser in projected sampling
    (:func:`elflow.sampling.projection.project_denoiser`), which needs ``projection`` (unconditional
    models; checked by :func:`elflow.generation.pipeline.ELFPipeline.projection`). On a CPU it
    first calls :func:`elflow.runtime.hardware.keep_freed_memory` (process-wide; ``ELFLOW_MALLOC=0``
    opts out). ``cuda_graphs`` (None: on CUDA; True elsewhere is an error): each step replays a
    captured CUDA graph (:mod:`elflow.generation.cuda_graphs`; projected sampling runs eagerly).
    """
    from elflow.generation import cuda_graphs as graphs

    device = next(model.parameters()).device
    mode = graphs.graph_mode(cuda_graphs, device)
    if device.type == "cpu":
        keep_freed_memory()
    w = sampling_w(model, sampler.w)
    shape = (length, model.cfg.encoder_dim)
    if sampler.project_from < 1.0:  # projected sampling calls the encoder: always eager
        if projection is None or cond is not None:
            raise ELFError(
                "projected sampling (sampler.project_from < 1) needs an unconditional model and "
                "its encoder (sample(..., projection=pipe.projection())); project_from 1 turns "
                "it off"
            )
        mode = None
    if mode is None:
        steps = contextlib.nullcontext(None)
    else:
        make = partial(make_denoiser, model, w, t_eps, cfg=sampler.cfg)
        steps = graphs.sampling_steps(
            model, make, len(generators), shape, sampler, noise_scale, t_eps, cond, mode
        )
    with steps as runner:
        denoise = make_denoiser(model, w, t_eps, cond, sampler.cfg)
        if sampler.project_from < 1.0:
            decode_w = partial(decode_tokens, model)
            denoise = project_denoiser(
                denoise, decode_w, w, t_eps, projection, sampler.project_from
            )
        return sample(
            denoise,
            make_decoder(model, w),
            generators,
            shape,
            sampler,
            noise_scale,
            cond,
            trajectory,
            t_eps,
            callback_on_step_end,
            runner,
        )
