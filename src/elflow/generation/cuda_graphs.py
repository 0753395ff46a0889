"""Graph-captured sampling (an elflow addition): one denoising step replayed as a CUDA graph.

Sampling small batches is launch-bound on a GPU: a step is hundreds of small kernels whose
launches cost more than their arithmetic. :class:`GraphRunner` captures a function of tensors
once over static copies of its inputs (after a warm-up on a side stream) and replays it;
:class:`StepGraphs` holds one bucket's runners (the sampler's step, the last Euler step) over a
static copy of the condition, and :class:`GraphCache`, one per model, keeps a bounded number of
buckets, keyed by batch, length and everything the step closes over, all in one memory pool.
The noise is drawn outside the graph (:func:`elflow.sampling.sample_loop.sample`), so texts
equal the eager path's. :func:`sampling_steps` is what the wiring and the engine call.
"""

from __future__ import annotations

import contextlib
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import astuple, dataclass

import torch
from torch import Tensor, nn

from elflow.config import SamplerConfig
from elflow.errors import ELFError
from elflow.runtime import bf16_fast_path as fastpath
from elflow.sampling import Condition, Denoiser, StepRunner, noise_draws, step_function

MAX_BUCKETS = 8
"""Buckets a model's :class:`GraphCache` keeps (least recently used dropped first)."""

WARMUP = 2
"""Eager runs on a side stream before a capture (lazy library initialisation happens there)."""


def graph_mode(flag: bool | None, device: torch.device) -> str | None:
    """How sampling on ``device`` runs its steps: ``"capture"`` (replayed CUDA graphs) or None
    (eagerly). ``flag``: None = graphs on CUDA, eager elsewhere; True on a device without CUDA
    graphs is an error; False = eager. (Tests also use ``"buffers"``: the runners' static
    buffers without capture, on any device.)"""
    if flag is None:
        return "capture" if device.type == "cuda" else None
    if not isinstance(flag, bool):
        raise ELFError(f"cuda_graphs must be True, False or None (auto), got {flag!r}")
    if flag and device.type != "cuda":
        raise ELFError(
            f"cuda_graphs=True needs a CUDA device, but the model is on {device}; "
            "leave cuda_graphs unset (None) to use them where they exist"
        )
    return "capture" if flag else None


@contextlib.contextmanager
def _no_autocast_cache() -> Iterator[None]:
    """Autocast without its cast cache: a cast cached before a capture would be read by the
    graph from memory the cache later frees, so every cast must happen inside the graph."""
    if not torch.is_autocast_enabled("cuda"):
        yield
        return
    with torch.autocast("cuda", dtype=torch.get_autocast_dtype("cuda"), cache_enabled=False):
        yield


class GraphRunner:
    """``fn(*inputs) -> tuple of tensors`` captured once over static copies of ``inputs``.

    A call copies its arguments into the static inputs (an argument that *is* the static input
    is not copied) and replays; the outputs are the graph's static outputs, overwritten by the
    next replay of any graph in the same pool: read or copy them before that. ``capture=False``
    keeps the static buffers but calls ``fn`` on them instead of replaying (any device): the
    buffer logic without CUDA.
    """

    def __init__(
        self,
        fn: Callable[..., tuple[Tensor, ...]],
        inputs: Sequence[Tensor],
        *,
        capture: bool = True,
        pool: tuple[int, int] | None = None,
        warmup: int = WARMUP,
    ) -> None:
        self.fn = fn
        self.inputs = [x.detach().clone() for x in inputs]
        self.graph: torch.cuda.CUDAGraph | None = None
        self.outputs: tuple[Tensor, ...] = ()
        self.replays = 0
        if not capture:
            return
        device = self.inputs[0].device
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side), _no_autocast_cache():
            for _ in range(warmup):
                fn(*self.inputs)
        torch.cuda.current_stream(device).wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with (
            _no_autocast_cache(),
            torch.cuda.graph(self.graph, pool=pool, capture_error_mode="thread_local"),
        ):
            self.outputs = tuple(fn(*self.inputs))

    def __call__(self, *inputs: Tensor) -> tuple[Tensor, ...]:
        if len(inputs) != len(self.inputs):
            raise ELFError(f"{len(inputs)} inputs for a graph captured with {len(self.inputs)}")
        for static, x in zip(self.inputs, inputs, strict=True):
            if x.shape != static.shape or x.dtype != static.dtype:
                raise ELFError(
                    f"an input of {tuple(x.shape)} {x.dtype} for a graph captured with "
                    f"{tuple(static.shape)} {static.dtype}"
                )
            if x is not static:
                static.copy_(x)
        self.replays += 1
        if self.graph is None:
            self.outputs = tuple(self.fn(*self.inputs))
        else:
            self.graph.replay()
        return self.outputs


def _static_condition(cond: Condition | None) -> Condition | None:
    if cond is None:
        return None
    guided = None if cond.guided is None else cond.guided.clone()
    return Condition(cond.latents.clone(), cond.mask.clone(), guided)


class StepGraphs:
    """One bucket: the sampler's step and the last (Euler) step, each a :class:`GraphRunner`
    made on first use, over a static copy of the condition (:meth:`load` refreshes it). Called
    as an :data:`elflow.sampling.sample_loop.StepRunner`."""

    def __init__(
        self,
        make_denoise: Callable[[Condition | None], Denoiser],
        sampler: SamplerConfig,
        cond: Condition | None,
        *,
        noise_scale: float,
        t_eps: float,
        capture: bool,
        pool: tuple[int, int] | None = None,
        keep: tuple = (),
    ) -> None:
        self.cond = _static_condition(cond)
        denoise = make_denoise(self.cond)
        self.steps = {
            last: step_function(
                denoise, sampler, noise_scale=noise_scale, t_eps=t_eps, cond=self.cond, last=last
            )
            for last in (False, True)
        }
        self.capture, self.pool, self.keep = capture, pool, keep
        self.runners: dict[bool, GraphRunner] = {}

    def load(self, cond: Condition | None) -> None:
        """Copy this call's condition into the static one (same shapes)."""
        if cond is None or self.cond is None:
            return
        self.cond.latents.copy_(cond.latents)
        self.cond.mask.copy_(cond.mask)
        if cond.guided is not None and self.cond.guided is not None:
            self.cond.guided.copy_(cond.guided)

    @property
    def captures(self) -> int:
        """Graphs captured (or, without capture, runners made) in this bucket."""
        return len(self.runners)

    def __call__(self, last: bool, inputs: Sequence[Tensor]) -> tuple[Tensor, Tensor]:
        runner = self.runners.get(last)
        if runner is None:
            try:
                runner = GraphRunner(self.steps[last], inputs, capture=self.capture, pool=self.pool)
            except ELFError:
                raise
            except RuntimeError as e:
                first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
                raise ELFError(
                    f"capturing the sampling step in a CUDA graph failed ({first}); sample "
                    "without graphs (cuda_graphs=False)"
                ) from e
            self.runners[last] = runner
        z, x_hat = runner(*inputs)
        return z, x_hat


class GraphCache:
    """A model's captured buckets, least recently used dropped past ``size``; all graphs share
    one memory pool (they never run at once: :meth:`session` holds a lock), so the pool holds
    about one step's activations whatever the number of buckets. Dropped whole when the
    model's parameters change (moved, reloaded or updated in place)."""

    def __init__(self, size: int = MAX_BUCKETS) -> None:
        self.size = size
        self.buckets: OrderedDict[tuple, StepGraphs] = OrderedDict()
        self.lock = threading.RLock()
        self.weights: tuple = ()
        self.pool: tuple[int, int] | None = None
        self.built = 0
        """Buckets built over the cache's life (a replayed bucket is not built again)."""

    def get(self, key: tuple, build: Callable[[], StepGraphs]) -> StepGraphs:
        """The bucket ``key``, built on a miss (evicting the least recently used)."""
        with self.lock:
            if key in self.buckets:
                self.buckets.move_to_end(key)
                return self.buckets[key]
            while len(self.buckets) >= self.size:
                self.buckets.popitem(last=False)
            bucket = build()
            self.buckets[key] = bucket
            self.built += 1
            return bucket

    def check_weights(self, weights: tuple) -> None:
        """Forget every bucket when the weights' addresses or versions changed."""
        with self.lock:
            if weights != self.weights:
                self.buckets.clear()
                self.weights = weights

    def clear(self) -> None:
        with self.lock:
            self.buckets.clear()

    def __len__(self) -> int:
        return len(self.buckets)

    # A copied or pickled model starts with an empty cache (graphs cannot be copied).
    def __deepcopy__(self, memo) -> GraphCache:
        return GraphCache(self.size)

    def __reduce__(self):
        return GraphCache, (self.size,)


_ATTR = "_elflow_cuda_graphs"


def graph_cache(model: nn.Module) -> GraphCache:
    """``model``'s :class:`GraphCache` (kept on the model, so it goes with it)."""
    cache = model.__dict__.get(_ATTR)
    if cache is None:
        cache = GraphCache()
        model.__dict__[_ATTR] = cache
    return cache


def _weights(model: nn.Module) -> tuple:
    return tuple((p.data_ptr(), p._version) for p in model.parameters())


@dataclass(frozen=True)
class _Knobs:
    """What a step closes over besides its tensors (a change needs another graph)."""

    sampler: str
    gamma: float
    gamma_schedule: str
    pc_snr: float
    w: float
    cfg: float
    noise_scale: float
    t_eps: float


def eager_reason(model: nn.Module, sampler: SamplerConfig) -> str | None:
    """Why sampling with ``model`` and ``sampler`` cannot replay graphs (it runs eagerly), or
    None."""
    if noise_draws(sampler.sampler) is None:
        return f"sampler {sampler.sampler!r} is registered, not built in"
    if model.training:
        return "the model is in training mode"
    if any(type(p) is not nn.Parameter for p in model.parameters()):
        return "the parameters are not plain tensors (sharded)"
    return None


@contextlib.contextmanager
def sampling_steps(
    model: nn.Module,
    make_denoise: Callable[[Condition | None], Denoiser],
    batch: int,
    shape: tuple[int, int],
    sampler: SamplerConfig,
    noise_scale: float,
    t_eps: float,
    cond: Condition | None,
    mode: str | None,
    kind: str = "",
) -> Iterator[StepRunner | None]:
    """The :data:`~elflow.sampling.sample_loop.StepRunner` of this batch's bucket (None: sample
    eagerly), its condition loaded; the model's cache stays locked until the block ends.

    Args:
        make_denoise: builds the denoiser over a given condition (the bucket's static one).
        shape: (L, E), one sample's latents.
        mode: :func:`graph_mode`'s answer.
        kind: what else tells buckets apart (the caller's denoiser family).
    """
    if mode is None or eager_reason(model, sampler) is not None:
        yield None
        return
    cache = graph_cache(model)
    device = next(model.parameters()).device
    autocast = torch.is_autocast_enabled(device.type)
    dtype = fastpath.lowp_dtype(model, device) if autocast else None
    key = (
        kind,
        batch,
        *shape,
        _knobs(sampler, noise_scale=noise_scale, t_eps=t_eps),
        None if cond is None else (cond.guided is not None, cond.mask.dtype),
        autocast and torch.get_autocast_dtype(device.type),
        fastpath.enabled(),
        mode,
    )

    def build() -> StepGraphs:
        pool = None
        if mode == "capture":
            if cache.pool is None:
                cache.pool = torch.cuda.graph_pool_handle()
            pool = cache.pool
        # Tensors the network reads that live outside the model: held while the graph lives.
        keep = (model.rotations(shape[0], device),) if hasattr(model, "rotations") else ()
        if dtype is not None:
            keep = (*keep, fastpath.lowp_blocks(model, dtype))
        return StepGraphs(
            make_denoise,
            sampler,
            cond,
            noise_scale=noise_scale,
            t_eps=t_eps,
            capture=mode == "capture",
            pool=pool,
            keep=keep,
        )

    with cache.lock:
        cache.check_weights(_weights(model))
        bucket = cache.get(key, build)
        bucket.load(cond)
        yield bucket


def _knobs(sampler: SamplerConfig, *, noise_scale: float, t_eps: float) -> tuple:
    return astuple(
        _Knobs(
            sampler.sampler,
            sampler.gamma,
            sampler.gamma_schedule,
            sampler.pc_snr,
            sampler.w,
            sampler.cfg,
            noise_scale,
            t_eps,
        )
    )
