"""One code path for 1 and N processes, decided once from the torchrun environment.

:func:`setup` reads ``RANK``/``WORLD_SIZE``/``LOCAL_RANK`` (set by ``torchrun``), initialises the
process group (NCCL on GPU, gloo on CPU) when there is more than one process, and picks the device.
:func:`parallelize` wraps the trainable module in DDP (default) or shards it with FSDP2
(``fully_shard`` per block, then the root). The frozen encoder is never wrapped.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import time
import warnings
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


DEFAULT_TIMEOUT_MINUTES = 30.0
"""How long a collective may wait for the other processes (``train.dist_timeout``)."""


def setup(
    device: str = "auto", option: str = "train.device", timeout: float = DEFAULT_TIMEOUT_MINUTES
) -> DistInfo:
    """Initialise (once) from the torchrun environment; a single process needs no launcher.

    ``device`` is 'auto', 'cpu' or 'cuda'; ``option`` names where it came from in errors;
    ``timeout``: minutes a collective may wait for the others before it fails.
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
        wait = datetime.timedelta(minutes=timeout)
        # device_id binds the process to its GPU and creates NCCL's communicator at once.
        dist.init_process_group(
            backend="nccl" if use_cuda else "gloo",
            timeout=wait,
            device_id=dev if use_cuda else None,
        )
        if use_cuda:  # collective on every rank, once
            _CONTROL["control"] = dist.new_group(backend="gloo", timeout=wait)
    return DistInfo(rank, world, local, dev)


ALIVE_WAIT_S = 5.0
"""How long a process that saw a collective fail waits for the others to say they are alive."""


def is_collective_failure(error: BaseException) -> bool:
    """Whether ``error`` says a collective failed because another process is gone."""
    if isinstance(error, dist.DistError):
        return True
    text = str(error)
    return isinstance(error, RuntimeError) and any(
        mark in text for mark in ("Connection closed by peer", "gloo/transport", "NCCL")
    )


def unresponsive_ranks(wait_s: float | None = None) -> list[int] | None:
    """The ranks that do not say they are alive within ``wait_s`` (default :data:`ALIVE_WAIT_S`;
    each process that calls this says so first, through the rendezvous store); None when the store
    itself is gone (it lives with torchrun's agent, or with rank 0's process)."""
    if not dist.is_initialized():
        return []
    wait_s = ALIVE_WAIT_S if wait_s is None else wait_s
    world, me = dist.get_world_size(), dist.get_rank()

    def answered(rank: int, since: float) -> bool:
        key = f"elflow/alive/{rank}"
        # Said within this wait (a process that answered an earlier one may have exited since).
        return store.check([key]) and float(store.get(key)) >= since

    try:
        store = dist.distributed_c10d._get_default_store()
        since = time.time() - wait_s  # clocks of other nodes may differ by about as much
        store.set(f"elflow/alive/{me}", repr(time.time()))
        deadline = time.monotonic() + wait_s
        missing = list(range(world))
        while missing and time.monotonic() < deadline:
            missing = [r for r in missing if not answered(r, since)]
            if missing:
                time.sleep(0.1)
        return missing
    except Exception:  # the store's host is gone too
        return None


def failure_line(rank: int, what: str, last_ckpt) -> str:
    """The one line a process ends with when another one failed (ranks named when known)."""
    missing = unresponsive_ranks()
    if missing is None:
        who = "the process holding the rendezvous store (rank 0 or torchrun's agent) is gone"
    elif missing:
        who = f"process(es) {', '.join(map(str, missing))} stopped answering"
    else:
        who = "every process still answers (a network or timeout fault?)"
    return (
        f"process {rank}: {what}: {who}; the run cannot go on (last good checkpoint: "
        f"{last_ckpt or 'none'}); re-run the same command on every node to resume from it"
    )


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
    return gloo_group("control")  # made by setup(), or now for a group made before it


def gloo_group(name: str):
    """A gloo group of every process for a side task (stop agreement, background checkpoint
    writes), made once per name: collective on first use, so every process must ask together."""
    if name not in _CONTROL:
        _CONTROL[name] = dist.new_group(backend="gloo")
    return _CONTROL[name]


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

        # The network's x-prediction is a reshaped (view) matmul output that nothing modifies
        # in place, which is what FSDP2's warning about returned views guards against.
        warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view tensor")
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
    """The process's device for a ``device`` value: auto, cpu, cuda, or cuda:K (one process)."""
    if name not in ("auto", "cpu", "cuda") and not (name[:5] == "cuda:" and name[5:].isdigit()):
        raise ELFError(f"device= is {name!r}; use auto, cpu, cuda or cuda:K")
    info = setup("cuda" if name.startswith("cuda") else name, "device=")
    if name.startswith("cuda:") and not info.distributed:
        info = replace(info, device=torch.device(name))
    return info
