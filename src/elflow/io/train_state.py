"""The trainer's state in a checkpoint, sharded: optimizer buffers and EMA shadows written with
``torch.distributed.checkpoint`` (DCP, the format torchtitan uses) (ELF_SPEC §7, §10).

Each process writes only the shards it holds (FSDP2's DTensors) and a tensor every process holds
alike (DDP's replicated buffers) is written once. A resume on another number of processes reads
the shards it now owns, so DDP and FSDP2 runs continue on any number of processes. Only tensors
are written, and the reader refuses anything else (DCP would unpickle it). Each process's RNG
state is a small file of its own, ``rng-<rank>.pt``, read weights-only.
"""

from __future__ import annotations

import contextlib
import io
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import Tensor, nn
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

from elflow.errors import ELFError, first_line
from elflow.runtime.distributed import gloo_group

FOLDER = "train-state"
"""The DCP folder inside a checkpoint folder."""


def rng_file(rank: int) -> str:
    return f"rng-{rank}.pt"


def _optimizers(optimizer) -> dict[str, torch.optim.Optimizer]:
    subs = getattr(optimizer, "optimizers", None)
    return subs if isinstance(subs, dict) else {"optimizer": optimizer}


def state_tensors(optimizer, model: nn.Module, ema) -> dict[str, Tensor]:
    """Every tensor of the optimizers' state (by parameter name) and the EMA's shadows: the live
    tensors, so that a load fills them in place."""
    names = {id(p): n for n, p in model.named_parameters()}
    out: dict[str, Tensor] = {}
    for sub, opt in _optimizers(optimizer).items():
        for p, st in opt.state.items():
            for key, value in st.items():
                if isinstance(value, Tensor):
                    out[f"optim/{sub}/{names[id(p)]}/{key}"] = value
    for name, shadow in ema.shadow.items():
        out[f"ema/{name}"] = shadow
    return out


def make_optimizer_state(optimizer) -> None:
    """Create every buffer the optimizers keep: one step at lr 0 on zero gradients (the
    parameters do not change: each update is 0 x a finite value; Adam's step count and the
    buffers are then overwritten by a load)."""
    groups = [g for opt in _optimizers(optimizer).values() for g in opt.param_groups]
    lrs = [g["lr"] for g in groups]
    params = [p for g in groups for p in g["params"]]
    for p in params:
        p.grad = torch.zeros_like(p)
    for g in groups:
        g["lr"] = 0.0
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    for g, lr in zip(groups, lrs, strict=True):
        g["lr"] = lr


class TensorsOnly(DefaultLoadPlanner):
    """DCP's planner, refusing the pickled objects it would otherwise unpickle."""

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        raise ELFError(
            f"the checkpoint's training state holds a pickled object at "
            f"{read_item.dest_index.fqn!r}, where elflow writes only tensors; it is not loaded"
        )


def _single() -> bool:
    return not (dist.is_available() and dist.is_initialized())


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """DCP warns on every single-process call that it assumes a single process: it is one."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable")
        yield


def save(folder: Path, optimizer, model: nn.Module, ema, asynchronous: bool = False):
    """Write the state into ``folder`` (every process calls it); with ``asynchronous`` the
    tensors are copied to host memory now and written by a background thread: returns the
    future to wait on before the folder is complete (else None)."""
    state = state_tensors(optimizer, model, ema)
    with _quiet():
        if asynchronous:
            # Its writer thread runs collectives while training runs its own: a group of its own.
            group = None if _single() else gloo_group("checkpoint writes")
            return dcp.async_save(
                state, checkpoint_id=str(folder), process_group=group, no_dist=_single()
            )
        dcp.save(state, checkpoint_id=str(folder), no_dist=_single())
    return None


def load(folder: Path, optimizer, model: nn.Module, ema) -> None:
    """Fill the optimizer's buffers and the EMA's shadows from ``folder``, resharded to this
    run's processes; a missing or unreadable entry is a one-line error."""
    make_optimizer_state(optimizer)
    state = state_tensors(optimizer, model, ema)
    try:
        with _quiet():
            dcp.load(state, checkpoint_id=str(folder), planner=TensorsOnly(), no_dist=_single())
    except ELFError:
        raise
    except Exception as e:
        raise ELFError(
            f"cannot resume: the training state in {folder} does not fit this run "
            f"({first_line(e)}); "
            "it was saved with other optimizer settings or is damaged"
        ) from None
