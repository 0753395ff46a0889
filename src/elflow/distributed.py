"""One code path for 1 and N processes, decided once from the torchrun environment.

:func:`setup` reads ``RANK``/``WORLD_SIZE``/``LOCAL_RANK`` (set by ``torchrun``), initialises the
process group (NCCL on GPU, gloo on CPU) when there is more than one process, and picks the device.
:func:`parallelize` wraps the trainable module in DDP (default) or shards it with FSDP2
(``fully_shard`` per block, then the root). The frozen encoder is never wrapped.
"""

from __future__ import annotations

import os
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
    if world > 1 and not dist.is_initialized():
        dist.init_process_group(backend="nccl" if use_cuda else "gloo")
    return DistInfo(rank, world, local, dev)


def teardown() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def all_reduce_sum(t: Tensor) -> Tensor:
    """Sum over processes (identity for one process)."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t


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


def parallelize(module: nn.Module, blocks: nn.ModuleList, info: DistInfo, mode: str) -> nn.Module:
    """Wrap ``module`` (whose parameters include ``blocks``) for ``info.world_size`` processes.

    ``ddp``: DistributedDataParallel (a no-op for one process). ``fsdp2``: ``fully_shard`` on each
    block, then on ``module``; parameters become DTensors (the optimizer must be built after).
    """
    if mode == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh(info.device.type, (info.world_size,))
        for block in blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(module, mesh=mesh)
        return module
    if not info.distributed:
        return module
    from torch.nn.parallel import DistributedDataParallel

    ids = [info.device.index] if info.device.type == "cuda" else None
    return DistributedDataParallel(module, device_ids=ids, broadcast_buffers=False)


def resolve_device(name: str) -> DistInfo:
    """The process's device for a ``--device`` value: auto, cpu, cuda, or cuda:K (one process)."""
    if name not in ("auto", "cpu", "cuda") and not (name[:5] == "cuda:" and name[5:].isdigit()):
        raise ELFError(f"--device is {name!r}; use auto, cpu, cuda or cuda:K")
    info = setup("cuda" if name.startswith("cuda") else name, "--device")
    if name.startswith("cuda:") and not info.distributed:
        info = replace(info, device=torch.device(name))
    return info
