"""Run ``elflow`` on N processes, forked or under ``torchrun`` (the few multi-process tests,
marked ``dist``); gloo functions on N processes: :func:`tests.dist.fork_ranks.fork_gloo`."""

from __future__ import annotations

import os
import socket
import subprocess
import sys


def free_port() -> int:
    """A TCP port nothing listens on now, for a rendezvous on this machine."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_elflow(
    argv: list[str], nproc: int = 2, timeout: int = 300, torchrun: bool = False
) -> subprocess.CompletedProcess:
    """``elflow ARGV`` on ``nproc`` processes (one thread each, offline), forked from one
    interpreter that imported elflow once (:mod:`tests.dist.fork_ranks`), or with ``torchrun``
    as ``python -m torch.distributed.run ... -m elflow ARGV``; it must succeed (the failure
    shows the end of its stderr)."""
    if torchrun:
        env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}"]
        cmd += [f"--master_port={free_port()}", "-m", "elflow", *argv]
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    else:
        from tests.dist.fork_ranks import fork_elflow

        proc = fork_elflow(argv, nproc, timeout)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc
