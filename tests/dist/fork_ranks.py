"""N ``elflow`` processes forked from one interpreter that imported elflow once per test session.

torchrun starts a fresh interpreter for every process, which imports torch, transformers and
elflow anew: 3-4 s of CPU each on a small machine, most of a multi-process test's time. Here a
forkserver (Python's ``multiprocessing``) imports them once and forks each process from it, with
the variables torchrun gives a worker (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``,
``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``, ``TORCHELASTIC_RUN_ID``, ...) over the
caller's environment, one thread each; rank 0 hosts the rendezvous store (under torchrun the
agent does). What is torchrun's own (its agent ending the others when one fails, SIGTERM) stays
tested under torchrun: tests/train/test_train_failures.py and the first launch of
test_train.py's DDP test.

The forkserver preloads this module, so the imports below are paid there once.
"""

from __future__ import annotations

import functools
import multiprocessing
import multiprocessing.forkserver
import os
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import torch
import transformers  # noqa: F401  (the encoders' code, imported once in the forkserver)

import elflow.cli.distill_cmd
import elflow.cli.sample_cmd
import elflow.cli.train_cmd
import elflow.train.loop  # noqa: F401
from elflow.__main__ import main as elflow_main

@functools.cache
def _context() -> multiprocessing.context.BaseContext:
    """The forkserver context, its server started once with this module preloaded, one OpenMP
    thread (a thread pool must not exist before a fork) and offline Hub libraries."""
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload([__name__])
    saved = dict(os.environ)
    os.environ.update(OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    try:
        multiprocessing.forkserver.ensure_running()
    finally:
        os.environ.clear()
        os.environ.update(saved)
    return ctx


def _worker_env(rank: int, nproc: int, port: int, run_id: str) -> dict[str, str]:
    """The caller's environment with what torchrun sets for a worker on one node."""
    n = str(nproc)
    return {
        **os.environ,
        "RANK": str(rank),
        "LOCAL_RANK": str(rank),
        "GROUP_RANK": "0",
        "ROLE_RANK": str(rank),
        "WORLD_SIZE": n,
        "LOCAL_WORLD_SIZE": n,
        "ROLE_WORLD_SIZE": n,
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "TORCHELASTIC_RUN_ID": run_id,
        "OMP_NUM_THREADS": "1",
        "HF_HUB_OFFLINE": "1",
    }


def _redirect(log: str) -> None:
    """This process's stdout and stderr into ``log``.out and ``log``.err."""
    for fd, suffix in ((1, ".out"), (2, ".err")):
        target = os.open(log + suffix, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        os.dup2(target, fd)
        os.close(target)


def _run_elflow(argv: list[str], env: dict[str, str], log: str) -> None:
    _redirect(log)
    os.environ.clear()
    os.environ.update(env)
    torch.set_num_threads(1)
    try:
        code = elflow_main(argv)
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
    raise SystemExit(code or 0)


def _run_work(work: Callable[[int], object], env: dict[str, str], log: str, out: str) -> None:
    import torch.distributed as dist

    _redirect(log)
    os.environ.update(env)
    torch.set_num_threads(1)
    rank = int(env["RANK"])
    dist.init_process_group("gloo")
    try:
        results = work(rank)
        if rank == 0:
            torch.save(results, out)
        dist.barrier()
    finally:
        dist.destroy_process_group()
        sys.stdout.flush()
        sys.stderr.flush()


def _launch(target, args_of: Callable[[dict, str], tuple], nproc: int, timeout: float):
    """``target(*args_of(env, log))`` on ``nproc`` forked processes; the exit code (the first
    failing process's, else 0) and their stdout and stderr, each in rank order. When one fails
    the others get 10 s to end (their collectives fail) and are then killed, as torchrun's agent
    would."""
    from tests.dist.launch import free_port

    ctx = _context()
    port, run_id = free_port(), uuid.uuid4().hex
    with tempfile.TemporaryDirectory(prefix="elflow-ranks-") as tmp:
        logs = [str(Path(tmp) / str(r)) for r in range(nproc)]
        procs = []
        for r in range(nproc):
            env = _worker_env(r, nproc, port, run_id)
            procs.append(ctx.Process(target=target, args=args_of(env, logs[r])))
            procs[-1].start()
        deadline, code = time.monotonic() + timeout, 0
        while any(p.is_alive() for p in procs):
            failed = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
            if failed and not code:
                code, deadline = failed[0], min(deadline, time.monotonic() + 10)
            if time.monotonic() > deadline:
                for p in procs:
                    p.kill()
                code = code or -9
            time.sleep(0.05)
        for p in procs:
            p.join()
        code = code or next((p.exitcode for p in procs if p.exitcode), 0)
        out, err = ("".join(_read(log + end) for log in logs) for end in (".out", ".err"))
    return code, out, err


def _read(path: str) -> str:
    """A process's log ("" when it ended before opening it)."""
    return Path(path).read_text() if Path(path).is_file() else ""


def fork_elflow(
    argv: list[str], nproc: int = 2, timeout: float = 300
) -> subprocess.CompletedProcess:
    """``elflow ARGV`` on ``nproc`` forked processes, as torchrun would run them on one node."""
    code, out, err = _launch(_run_elflow, lambda env, log: (argv, env, log), nproc, timeout)
    return subprocess.CompletedProcess(["elflow", *argv], code, out, err)


def fork_gloo(work: Callable[[int], object], world: int, out: str, timeout: float = 300) -> None:
    """``work(rank)`` in ``world`` forked processes of a gloo group; rank 0 saves what it returns
    to ``out`` (``work``: a module-level function, pickled by name)."""
    code, _, err = _launch(_run_work, lambda env, log: (work, env, log, out), world, timeout)
    assert code == 0, err[-3000:]
