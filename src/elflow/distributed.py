"""One code path for 1 and N processes, decided once from the torchrun environment.

:func:`setup` reads ``RANK``/``WORLD_SIZE``/``LOCAL_RANK`` (set by ``torchrun``), initialises the
process group (NCCL on GPU, gloo on CPU) when there is more than one process, and picks the device.
:func:`parallelize` wraps the trainable module in DDP (default) or shards it with FSDP2
(``fully_shard`` per block, then the root). The frozen encoder is never wrapped.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist
from torch import Tensor, nn

from elflow.errors import ELFError


@dataclass(frozen=True)
class DistInfo:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1


def setup(device: str = "auto", option: str = "train.device") -> DistInfo:
    """Initialise (once) from the torchrun environment; a single process needs no launcher.

    ``device`` is 'auto', 'cpu' or 'cuda'; ``option`` names where it came from in errors.
    """
    if device not in ("auto", "cpu", "cuda"):
        raise ELFError(f"{option} is {device!r}; use auto, cpu or cuda")
    rank = int(os.environ.get("RANK", "0"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    local = int(os.environ.get("LOCAL_RANK", "0"))
    use_cuda = device == "cuda" or (device == "auto" and torch.cuda.is_available())
    if use_cuda and not torch.cuda.is_available():
        raise ELFError(f"{option} is 'cuda' but no CUDA device is available; use cpu or auto")
    dev = torch.device(f"cuda:{local}") if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(dev)
    # Under torchrun the group is made for one process too: the same wrappers and collectives
    # run as for N (a launch without torchrun skips them).
    if (world > 1 or launched_by_torchrun()) and not dist.is_initialized():
        dist.init_process_group(backend="nccl" if use_cuda else "gloo")
        if use_cuda:  # collective on every rank, once
            _CONTROL["group"] = dist.new_group(backend="gloo")
    return DistInfo(rank, world, local, dev)


def launched_by_torchrun() -> bool:
    """Whether this process was started by torchrun (its elastic agent sets the run id)."""
    return "TORCHELASTIC_RUN_ID" in os.environ and "MASTER_ADDR" in os.environ


def group_up() -> bool:
    """Whether a process group is initialised (N processes, or one under torchrun)."""
    return dist.is_available() and dist.is_initialized()


def teardown() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
    _CONTROL.clear()


def all_reduce_sum(t: Tensor) -> Tensor:
    """Sum over processes, in place (identity for one process)."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t


def all_reduce_min(t: Tensor) -> Tensor:
    """Elementwise minimum over processes, in place (identity for one process)."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return t


_CONTROL: dict[str, object] = {}


def control_group():
    """A gloo process group for host-side agreement (stop signals): its collectives run on the
    CPU, so agreeing never waits for the GPU's queue. The default group when that is gloo
    already; None for one process."""
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return None
    if dist.get_backend() == "gloo":
        return dist.group.WORLD
    if "group" not in _CONTROL:  # a group initialised before setup(): make it now (collective)
        _CONTROL["group"] = dist.new_group(backend="gloo")
    return _CONTROL["group"]


@contextlib.contextmanager
def gradient_sync(module: nn.Module, enabled: bool) -> Iterator[None]:
    """Reduce gradients over processes in the backward passes inside only when ``enabled`` (the
    last micro-batch of a step): DDP's ``no_sync``, FSDP2's ``set_requires_gradient_sync``;
    a module that is neither is left alone."""
    if enabled:
        yield
    elif hasattr(module, "no_sync"):  # DDP
        with module.no_sync():
            yield
    elif hasattr(module, "set_requires_gradient_sync"):  # FSDP2
        module.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            module.set_requires_gradient_sync(True)
    else:
        yield


def barrier() -> None:
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


def broadcast_object(obj, src: int = 0):
    """Rank ``src``'s Python object on every rank."""
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]


def parallelize(
    module: nn.Module,
    blocks: nn.ModuleList,
    info: DistInfo,
    mode: str,
    bf16: bool = False,
    compile: bool = False,
) -> nn.Module:
    """Compile and wrap ``module`` (whose parameters include ``blocks``) for ``info.world_size``
    processes; one function for every layout (torchtitan's ``parallelize_llama``).

    ``compile``: each block is compiled on its own first. ``ddp``: DistributedDataParallel (when
    a process group is up: N processes, or one under torchrun). ``fsdp2``: ``fully_shard`` on
    each block, with bf16 compute and fp32 gradient reduction when ``bf16`` (a
    :class:`MixedPrecisionPolicy`; the residual stream
    between blocks stays fp32), then on ``module``, whose own parameters (input projections,
    embedders, heads) stay fp32 as the spec keeps them. Parameters become DTensors (build the
    optimizer after).
    """
    if compile:
        for block in blocks:
            block.compile()
    if mode == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        mesh = init_device_mesh(info.device.type, (info.world_size,))
        policy = MixedPrecisionPolicy()
        if bf16:
            policy = MixedPrecisionPolicy(
                param_dtype=torch.bfloat16, reduce_dtype=torch.float32, cast_forward_inputs=False
            )
        for block in blocks:
            fully_shard(block, mesh=mesh, mp_policy=policy)
        fully_shard(module, mesh=mesh)
        return module
    if not group_up():
        return module
    from torch.nn.parallel import DistributedDataParallel

    ids = [info.device.index] if info.device.type == "cuda" else None
    return DistributedDataParallel(module, device_ids=ids)  # no buffers to broadcast


def resolve_device(name: str) -> DistInfo:
    """The process's device for a ``--device`` value: auto, cpu, cuda, or cuda:K (one process)."""
    if name not in ("auto", "cpu", "cuda") and not (name[:5] == "cuda:" and name[5:].isdigit()):
        raise ELFError(f"--device is {name!r}; use auto, cpu, cuda or cuda:K")
    info = setup("cuda" if name.startswith("cuda") else name, "--device")
    if name.startswith("cuda:") and not info.distributed:
        info = replace(info, device=torch.device(name))
    return info
