"""Run ``elflow`` under ``torchrun`` (the few multi-process tests, marked ``slow``)."""

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
