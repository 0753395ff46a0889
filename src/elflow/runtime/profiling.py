"""Exact counts of what a piece of PyTorch work does, on any device (a CPU included).

:class:`OpCounter` is a ``TorchDispatchMode`` that sees every aten op below autograd and
autocast: it counts ops, the ops that force the host to wait for the device (a scalar read, a
data-dependent shape, a device-to-host copy), matrix FLOPs by the dtype they compute in, and the
payload bytes of every collective (``c10d`` ops, DDP's and FSDP2's included). With
``saved_activations=True`` it also sums the bytes autograd keeps for the backward pass (weights
and their autocast copies left out). These counts are the same on a CPU as on a GPU for the same
code path, which is how ``benchmarks/step_profile.py`` proves GPU behaviour without a GPU.
"""

from __future__ import annotations

import contextlib
import traceback
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

import torch
from torch import Tensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import flop_registry, sdpa_backward_flop_count, sdpa_flop_count

aten = torch.ops.aten

_SYNC_OPS = {
    aten._local_scalar_dense: "scalar read (.item(), float(), bool())",
    aten.nonzero: "nonzero (data-dependent shape)",
    aten.masked_select: "masked_select (data-dependent shape)",
    aten.is_nonzero: "truth value of a tensor",
    aten.equal: "torch.equal",
    aten._unique2: "unique (data-dependent shape)",
    aten.unique_dim: "unique (data-dependent shape)",
    aten.unique_consecutive: "unique (data-dependent shape)",
}
_INDEX_OPS = {aten.index, aten.index_put, aten.index_put_, aten._index_put_impl_}
_HOST_READS = ("tolist", "numpy")


def _cpu_sdpa(query, key, value, *args, out_shape=None, **kwargs) -> int:
    return sdpa_flop_count(query, key, value)


def _cpu_sdpa_backward(grad_out, query, key, value, *args, out_shape=None, **kwargs) -> int:
    return sdpa_backward_flop_count(grad_out, query, key, value)


def _shape(x):
    return x.shape if isinstance(x, Tensor) else x


def _flops(func, args, kwargs, out) -> int:
    """Matrix FLOPs of one op (torch's formulas; the CPU attention kernels added)."""
    packet = func._overloadpacket
    if packet in flop_registry:
        return int(flop_registry[packet](*args, **kwargs, out_val=out))
    if packet is aten._scaled_dot_product_flash_attention_for_cpu:
        return _cpu_sdpa(*map(_shape, args[:3]))
    if packet is aten._scaled_dot_product_flash_attention_for_cpu_backward:
        return _cpu_sdpa_backward(*map(_shape, args[:4]))
    return 0


def sync_reason(func, args, kwargs) -> str | None:
    """Why ``func`` on these arguments makes the host wait for the device, or None."""
    packet = func._overloadpacket
    if packet in _SYNC_OPS:
        return _SYNC_OPS[packet]
    if packet in _INDEX_OPS:
        indices = args[1] if len(args) > 1 else kwargs.get("indices", ())
        if any(
            isinstance(i, Tensor) and i.dtype in (torch.bool, torch.uint8) for i in indices or ()
        ):
            return "boolean-mask indexing (data-dependent shape)"
    if func is aten.repeat_interleave.Tensor and kwargs.get("output_size") is None:
        return "repeat_interleave without output_size"
    if packet in (aten._to_copy, aten.copy_):
        src = args[1] if packet is aten.copy_ else args[0]
        dst_device = args[0].device if packet is aten.copy_ else kwargs.get("device")
        if (
            isinstance(src, Tensor)
            and src.device.type not in ("cpu", "meta")
            and dst_device is not None
            and torch.device(dst_device).type == "cpu"
        ):
            return "device-to-host copy"
    return None


def _tensors(obj) -> Iterator[Tensor]:
    if isinstance(obj, Tensor):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for item in obj:
            yield from _tensors(item)


def _nbytes(obj) -> int:
    return sum(t.numel() * t.element_size() for t in _tensors(obj))


def collective_bytes(func, args) -> tuple[str, int] | None:
    """(kind, payload bytes this rank contributes) of a ``c10d`` collective, or None.

    Payload: the all-reduced tensors, the all-gathered output, the reduce-scattered input, the
    all-to-all input, the broadcast tensors. Wire traffic follows from it per algorithm
    (``benchmarks/scale_model.py``)."""
    name = func._overloadpacket.__name__
    if func.namespace == "_c10d_functional":  # DTensor's collectives (e.g. full_tensor())
        if name in ("all_gather_into_tensor", "all_gather_into_tensor_out"):
            return "all_gather", _nbytes(args[0]) * int(args[1])
        if name in ("reduce_scatter_tensor", "all_reduce", "all_to_all_single"):
            kind = {"reduce_scatter_tensor": "reduce_scatter", "all_to_all_single": "all_to_all"}
            return kind.get(name, "all_reduce"), _nbytes(args[0])
        return None
    if func.namespace != "c10d":
        return None
    if name in ("allreduce_", "allreduce_coalesced_"):
        return "all_reduce", _nbytes(args[0])
    if name in ("_allgather_base_", "allgather_", "allgather_into_tensor_coalesced_"):
        return "all_gather", _nbytes(args[0])
    if name in ("_reduce_scatter_base_", "reduce_scatter_", "reduce_scatter_tensor_coalesced_"):
        return "reduce_scatter", _nbytes(args[1])
    if name in ("alltoall_base_", "alltoall_"):
        return "all_to_all", _nbytes(args[1])
    if name == "broadcast_":
        return "broadcast", _nbytes(args[0])
    return None


@dataclass
class Counts:
    """What an :class:`OpCounter` saw."""

    ops: Counter = field(default_factory=Counter)
    """aten ops by name (views and metadata ops included)."""
    syncs: Counter = field(default_factory=Counter)
    """Ops that make the host wait for the device, by reason."""
    flops: Counter = field(default_factory=Counter)
    """Matrix FLOPs by compute dtype ('bf16', 'fp32', ...)."""
    comm_bytes: Counter = field(default_factory=Counter)
    """Collective payload bytes by kind (all_reduce, all_gather, reduce_scatter, all_to_all)."""
    comm_calls: Counter = field(default_factory=Counter)
    sync_sites: Counter = field(default_factory=Counter)
    """The innermost elflow (or torch.optim) source line of each sync: where to look."""
    saved_bytes: Counter = field(default_factory=Counter)
    """Bytes autograd saved for backward, by dtype (unique storages; weights left out)."""
    traffic: Counter = field(default_factory=Counter)
    """:attr:`traffic_bytes` by op name."""
    kernels: int = 0
    """Ops that compute (views, reshapes and other metadata ops left out): kernel launches."""
    traffic_bytes: int = 0
    """Bytes read and written by the computing ops other than matrix products and attention:
    the memory-bound work's traffic (eager, unfused), a GPU's elementwise time times its
    bandwidth."""
    weight_traffic_bytes: int = 0
    """The part of :attr:`traffic_bytes` on weights, their autocast copies and their gradients
    (tensors of a matrix weight's shape; vector weights' gradients are left with the
    activations): a cost per micro-batch, not per token (at a cluster's
    micro-batch of 65k tokens, small)."""
    activation_traffic: Counter = field(default_factory=Counter)
    """:attr:`traffic_bytes` less the weights' part, by op name: what grows with the tokens."""

    @property
    def num_ops(self) -> int:
        return sum(self.ops.values())

    @property
    def num_syncs(self) -> int:
        return sum(self.syncs.values())


_DTYPES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}


class OpCounter(TorchDispatchMode):
    """Counts ops, host syncs, FLOPs by dtype, collective bytes and saved activations.

    Args:
        weights: parameters whose storages (and autocast copies of them) are not activations.
        saved_activations: also sum what autograd saves (a ``saved_tensors_hooks`` context).
        host: tensors that live on the host in a GPU run too (e.g. the optimizers' step
            counters): reading them is no sync, though on a CPU every tensor looks alike.
    """

    def __init__(
        self,
        weights: Iterable[Tensor] = (),
        saved_activations: bool = False,
        host: Iterable[Tensor] = (),
    ) -> None:
        super().__init__()
        self.counts = Counts()
        weights = list(weights)
        self._weights = {_storage(p) for p in weights}
        self._weight_shapes = {tuple(p.shape) for p in weights if p.ndim >= 2}
        self._copies: list[Tensor] = []  # held: a freed copy's address must not name a weight
        self._host = {_storage(t) for t in host}
        self._saved: dict[int, tuple[int, str]] = {}
        self._hooks = (
            torch.autograd.graph.saved_tensors_hooks(self._pack, lambda x: x)
            if saved_activations
            else contextlib.nullcontext()
        )

    def __enter__(self) -> OpCounter:
        self._hooks.__enter__()
        # .tolist() and .numpy() read a CPU tensor's memory without dispatching an op; on a GPU
        # they are device-to-host copies: count them as such (patched for this context only).
        self._saved_methods = {name: getattr(Tensor, name) for name in _HOST_READS}
        for name, method in self._saved_methods.items():
            setattr(Tensor, name, self._reading(name, method))
        return super().__enter__()

    def __exit__(self, *exc) -> None:
        super().__exit__(*exc)
        for name, method in self._saved_methods.items():
            setattr(Tensor, name, method)
        self._hooks.__exit__(*exc)
        for nbytes, dtype in self._saved.values():
            self.counts.saved_bytes[dtype] += nbytes
        self._saved.clear()

    def _reading(self, name: str, method):
        counter = self

        def read(tensor: Tensor, *args, **kwargs):
            if _storage(tensor) not in counter._host and tensor.device.type != "meta":
                counter.counts.syncs[f"host read of a tensor (.{name}())"] += 1
                counter.counts.sync_sites[_caller()] += 1
            return method(tensor, *args, **kwargs)

        return read

    def share_weights(self, other: OpCounter) -> None:
        """Use ``other``'s record of the weights and their copies, so that a counter entered
        inside ``other`` (one region of its work) splits weights from activations as it does."""
        self._weights, self._weight_shapes, self._copies = (
            other._weights,
            other._weight_shapes,
            other._copies,
        )

    def _is_weight(self, t) -> bool:
        # A weight, a copy of one, or a tensor of a matrix weight's shape (its gradient, the
        # gradient's casts and accumulation): activations have a batch axis no matrix has.
        return isinstance(t, Tensor) and (
            _storage(t) in self._weights or tuple(t.shape) in self._weight_shapes
        )

    def _weight_bytes(self, obj) -> int:
        return sum(t.numel() * t.element_size() for t in _tensors(obj) if self._is_weight(t))

    def _pack(self, t: Tensor) -> Tensor:
        key = _storage(t)
        if key and key not in self._weights and key not in self._saved:
            self._saved[key] = (t.untyped_storage().nbytes(), _DTYPES.get(t.dtype, str(t.dtype)))
        return t

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        c = self.counts
        reason = sync_reason(func, args, kwargs)
        if reason and func._overloadpacket is aten._local_scalar_dense:
            reason = None if _storage(args[0]) in self._host else reason
        out = func(*args, **kwargs)
        c.ops[str(func.overloadpacket.__name__)] += 1
        if reason:
            c.syncs[reason] += 1
            c.sync_sites[_caller()] += 1
        flops = _flops(func, args, kwargs, out)
        if not _metadata_only(func):
            c.kernels += 1
            if not flops:
                moved = _nbytes(args) + _nbytes(kwargs.get("out")) + _nbytes(out)
                on_weights = self._weight_bytes(args) + self._weight_bytes(out)
                name = func.overloadpacket.__name__
                c.traffic_bytes += moved
                c.traffic[name] += moved
                c.weight_traffic_bytes += on_weights
                c.activation_traffic[name] += moved - on_weights
        if flops:
            first = next(_tensors(args), None)
            dtype = first.dtype if first is not None else torch.float32
            name = _DTYPES.get(dtype, str(dtype))
            if name == "fp32" and _tf32_on():
                name = "tf32"
            c.flops[name] += flops
        comm = collective_bytes(func, args)
        if comm:
            c.comm_bytes[comm[0]] += comm[1]
            c.comm_calls[comm[0]] += 1
        if func._overloadpacket is aten._to_copy and _storage(args[0]) in self._weights:
            self._weights.add(_storage(out))  # an autocast (or explicit) copy of a weight
            self._copies.append(out)
        return out


_METADATA = {
    aten.detach,
    aten.lift_fresh,
    aten.alias,
    aten._unsafe_view,
    aten.view_as_complex,
    aten.view_as_real,
    aten._conj,
    aten.split,
    aten.unbind,
    aten.chunk,
    aten.empty,
    aten.empty_like,
}


def _metadata_only(func) -> bool:
    """Views and other ops that launch no kernel (a GPU's view of 'ops': kernel launches)."""
    return (
        func.is_view
        or func._overloadpacket in _METADATA
        or func.namespace in ("c10d", "_c10d_functional")
    )


def _storage(t: Tensor) -> int:
    try:
        return t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):  # e.g. tensor subclasses without storage
        return 0


def _caller() -> str:
    """'file:line' of the innermost frame in elflow's or torch.optim's code."""
    for frame in reversed(traceback.extract_stack()[:-3]):
        path = frame.filename.replace("\\", "/")
        for root in ("/elflow/", "/torch/optim/", "/torch/nn/utils/"):
            if root in path and not path.endswith("/elflow/runtime/profiling.py"):
                return f"{root.strip('/')}/{path.split(root, 1)[1]}:{frame.lineno}"
    return "?"


def _tf32_on() -> bool:
    """Whether fp32 matrix products may use TF32 on CUDA (the process-wide switch)."""
    return torch.backends.cuda.matmul.allow_tf32


def optimizer_host_tensors(optimizer) -> list[Tensor]:
    """An optimizer's step counters that stay on the host in a GPU run too (torch.optim's when
    not capturable or fused): reading them is no device sync (:class:`OpCounter`'s ``host``)."""
    subs = getattr(optimizer, "optimizers", {"": optimizer}).values()
    return [
        s["step"]
        for opt in subs
        for s in opt.state.values()
        if isinstance(s.get("step"), Tensor) and s["step"].device.type == "cpu"
    ]
