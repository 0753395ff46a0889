"""Run ``elflow`` under ``torchrun``, or a function in N gloo processes (the few multi-process
tests, marked ``slow``)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from collections.abc import Callable


def free_port() -> int:
    """A TCP port nothing listens on now, for a rendezvous on this machine."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun_elflow(
    argv: list[str], nproc: int = 2, timeout: int = 300
) -> subprocess.CompletedProcess:
    """``python -m elflow ARGV`` on ``nproc`` processes (one thread each, offline); it must
    succeed (the failure shows the end of its stderr)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}"]
    cmd += [f"--master_port={free_port()}", "-m", "elflow", *argv]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def spawn_gloo(work: Callable[[int], object], world: int, out: str) -> None:
    """``work(rank)`` in ``world`` processes of a gloo group on this machine; rank 0 saves what
    it returns to ``out`` (``work`` must be a module-level function: it is pickled)."""
    import torch

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    args = (world, free_port(), work, out)
    torch.multiprocessing.spawn(_gloo_worker, args=args, nprocs=world, join=True)


def _gloo_worker(rank: int, world: int, port: int, work, out: str) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    url = f"tcp://127.0.0.1:{port}"
    dist.init_process_group("gloo", init_method=url, rank=rank, world_size=world)
    try:
        results = work(rank)
        if rank == 0:
            torch.save(results, out)
        dist.barrier()
    finally:
        dist.destroy_process_group()
