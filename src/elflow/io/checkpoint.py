"""Training checkpoints: one folder per step, written atomically, resumable exactly.

``OUT/checkpoint-<step>/`` holds ``model.safetensors`` (training weights) and ``ema.safetensors``
(both gathered to and written by rank 0), ``config.json`` (the model artifact config plus the full
run config under ``"run"``), ``state.json`` (step, epoch, data position, world size, EMA
updates), ``train-state/`` (the optimizer buffers and EMA shadows, sharded,
:mod:`elflow.io.train_state`) and ``rng-<rank>.pt`` per process. Everything is first written to
a hidden temporary folder that is renamed into place, so an interrupted save leaves the previous
checkpoints loadable; the last ``keep_last`` are kept. Checkpoints of elflow < 0.3 hold
``rank<r>.pt`` per process instead (:func:`load_rank_state`). ``manifest.json`` lists every
file's size and SHA-256 (:mod:`elflow.io.manifest`): a damaged checkpoint is found before it is
used. Each file is flushed to the disk before the folder is renamed into place, and a pruned
checkpoint is renamed out of sight before it is deleted. Any checkpoint folder is also a model
folder for ``load_model``.
"""

from __future__ import annotations

import json
import os
import random
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file
from torch import Tensor

from elflow.errors import ELFError, first_line
from elflow.io.artifact_config import ArtifactConfig
from elflow.io.manifest import fsync_dir, write_manifest
from elflow.io.model_sources import (
    CONFIG,
    EMA_WEIGHTS,
    WEIGHTS,
    latest_run_checkpoint,
    run_checkpoints,
)
from elflow.io.paths import save_safetensors
from elflow.runtime.distributed import DistInfo, barrier, broadcast_object

STATE = "state.json"


def rank_file(rank: int) -> str:
    return f"rank{rank}.pt"


def full_state(state: dict[str, Tensor], info: DistInfo | None = None) -> dict[str, Tensor]:
    """Plain CPU tensors of a (possibly FSDP2-sharded) state dict on rank 0, an empty dict on the
    others (with ``info``; without, on every process). Collective under FSDP2: each shard goes to
    rank 0 only, so no other process holds a full copy."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    if info is not None and info.distributed and dist.is_initialized():
        if any(isinstance(v, DTensor) for v in state.values()):
            from torch.distributed._state_dict_utils import _gather_state_dict

            gathered = _gather_state_dict(state, cpu_offload=True, ranks_only=(0,))
            return {k: v.contiguous() for k, v in gathered.items()} if info.is_main else {}
        if not info.is_main:
            return {}
    out = {}
    for key, value in state.items():
        if isinstance(value, DTensor):
            value = value.full_tensor()
        out[key] = value.detach().to("cpu").contiguous()
    return out


def rng_state() -> dict[str, Any]:
    state = {
        "torch": torch.get_rng_state(),
        "python": random.getstate(),
        "numpy": _numpy_state_to_torch(np.random.get_state()),
    }
    if torch.cuda.is_available():  # this process's device only (others may differ on resume)
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _numpy_state_to_torch(state: tuple) -> dict[str, Any]:
    # NOTE: numpy arrays are not weights-only loadable; keep the key array as a tensor.
    kind, keys, pos, has_gauss, cached = state
    return {
        "kind": kind,
        "keys": torch.from_numpy(keys.astype(np.int64)),
        "pos": int(pos),
        "has_gauss": int(has_gauss),
        "cached": float(cached),
    }


def _numpy_state_from_torch(state: dict[str, Any]) -> tuple:
    keys = state["keys"].numpy().astype(np.uint32)
    return (state["kind"], keys, state["pos"], state["has_gauss"], state["cached"])


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    np.random.set_state(_numpy_state_from_torch(state["numpy"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


@dataclass
class PendingSave:
    """A checkpoint being written: complete once :func:`finish_checkpoint` renames it."""

    final: Path
    tmp: Path
    step: int
    keep_last: int
    future: Any = None
    """The asynchronous training-state write to wait for (``train.async_save``), or None."""
    error: str | None = None


def begin_checkpoint(
    out_dir: Path,
    step: int,
    *,
    model_state: dict[str, Tensor],
    ema_state: dict[str, Tensor],
    write_state: Any,
    artifact: ArtifactConfig,
    run_config: dict[str, Any],
    state: dict[str, Any],
    info: DistInfo,
    keep_last: int,
) -> PendingSave:
    """Start writing ``checkpoint-<step>`` into a temporary folder (every rank calls it).

    Rank 0 writes the full weights (``model_state``, ``ema_state``: rank 0's; empty elsewhere),
    the config and ``state.json``; every rank its RNG state; ``write_state(folder)`` writes the
    sharded training state (:mod:`elflow.io.train_state`), returning a future when it writes in
    the background.
    """
    from elflow.io import train_state

    final = out_dir / f"checkpoint-{step}"
    tmp = out_dir / f".tmp-checkpoint-{step}"
    error = None
    if info.is_main:
        try:
            out_dir.mkdir(parents=True, exist_ok=True)
            if tmp.exists():
                shutil.rmtree(tmp)
            tmp.mkdir()
        except Exception as e:
            error = first_line(e)
    error = broadcast_object(error)
    pending = PendingSave(final, tmp, step, keep_last, error=error)
    if error is not None:
        return pending
    try:
        rng_path = tmp / train_state.rng_file(info.rank)
        torch.save(rng_state(), rng_path)
        with open(rng_path, "rb") as f:  # each process flushes what it wrote (DCP does too)
            os.fsync(f.fileno())
        pending.future = write_state(tmp / train_state.FOLDER)
        if info.is_main:
            save_safetensors(model_state, tmp / WEIGHTS, {"format": "elflow-model"})
            save_safetensors(ema_state, tmp / EMA_WEIGHTS, {"format": "elflow-model"})
            config = {**artifact.to_json(), "run": run_config}
            (tmp / CONFIG).write_text(json.dumps(config, indent=2) + "\n")
            saved = {**state, "world_size": info.world_size, "format": "dcp"}
            (tmp / STATE).write_text(json.dumps(saved) + "\n")
    except Exception as e:  # OSError, or torch's RuntimeError on a full disk
        pending.error = first_line(e)
    return pending


def finish_checkpoint(pending: PendingSave, info: DistInfo) -> Path:
    """Wait for ``pending``'s writes on every rank, then move it into place and prune (rank 0).

    A failure (e.g. a full disk) removes the temporary folder, leaves earlier checkpoints as they
    were, and raises the same one-line :class:`ELFError` on every rank.
    """
    error = pending.error
    if pending.future is not None:
        try:
            pending.future.result()
        except Exception as e:
            error = error or first_line(e)
    barrier()
    errors = _gather_errors(error)
    if not errors and info.is_main:
        try:
            write_manifest(pending.tmp)  # and every file flushed to the disk
            if pending.final.exists():
                _remove(pending.final)
            pending.tmp.rename(pending.final)
            fsync_dir(pending.final.parent)
            _prune(pending.final.parent, pending.keep_last, pending.step)
        except Exception as e:
            errors = [first_line(e)]
    errors = broadcast_object(errors if info.is_main else None)
    if errors:
        if info.is_main:
            shutil.rmtree(pending.tmp, ignore_errors=True)
        barrier()
        raise ELFError(
            f"cannot write checkpoint {pending.final} ({errors[0]}); earlier checkpoints are "
            "untouched — free disk space or choose another out=, then resume"
        )
    barrier()
    return pending.final


def _gather_errors(error: str | None) -> list[str]:
    import torch.distributed as dist

    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return [error] if error else []
    box: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(box, error)
    return [e for e in box if e]


def _remove(path: Path) -> None:
    """Delete a checkpoint folder atomically: renamed out of sight first, so a kill midway leaves
    a hidden ``.trash-*`` folder (deleted by the next prune), never half a checkpoint."""
    trash = path.with_name(f".trash-{path.name}")
    if trash.exists():
        shutil.rmtree(trash, ignore_errors=True)
    path.rename(trash)
    shutil.rmtree(trash, ignore_errors=True)


def _prune(out_dir: Path, keep_last: int, current: int) -> None:
    """Keep the ``keep_last`` newest checkpoints up to ``current``; never touch later ones.

    Temporary folders of saves up to ``current`` that a killed process left behind go too, and
    what a killed prune left.
    """
    older = [path for step, path in run_checkpoints(out_dir) if step <= current]
    for path in older[:-keep_last]:
        _remove(path)
    for path in out_dir.glob(".trash-checkpoint-*"):
        shutil.rmtree(path, ignore_errors=True)
    for path in out_dir.glob(".tmp-checkpoint-*"):
        step = path.name.removeprefix(".tmp-checkpoint-")
        if step.isdigit() and int(step) <= current:
            shutil.rmtree(path, ignore_errors=True)


def set_aside_later(out_dir: Path, step: int) -> Path | None:
    """Move the ``checkpoint-<s>`` folders with s > ``step`` into ``out_dir/abandoned-<n>``.

    A run resumed from an earlier checkpoint of its folder starts another branch; the abandoned
    branch's later checkpoints would otherwise stay the folder's "latest" (what sampling the run
    and ``--resume auto`` pick). Nothing is deleted. Returns the folder they went to, if any.
    """
    later = [path for s, path in run_checkpoints(out_dir) if s > step]
    if not later:
        return None
    n = 1
    while (out_dir / f"abandoned-{n}").exists():
        n += 1
    target = out_dir / f"abandoned-{n}"
    target.mkdir()
    for path in later:
        path.rename(target / path.name)
    return target


def find_checkpoint(path: Path) -> Path | None:
    """A checkpoint folder itself, or the latest complete one in a run folder."""
    if (path / STATE).is_file():
        return path
    if not path.is_dir():
        return None
    return latest_run_checkpoint(path)


def read_state(ckpt: Path) -> dict[str, Any]:
    try:
        return json.loads((ckpt / STATE).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ELFError(f"cannot resume: {ckpt / STATE} is unreadable ({e})") from None


def read_run_config(ckpt: Path) -> dict[str, Any]:
    try:
        return json.loads((ckpt / CONFIG).read_text())["run"]
    except (OSError, json.JSONDecodeError, KeyError) as e:
        raise ELFError(f"cannot resume: {ckpt / CONFIG} has no readable run config ({e})") from None


def load_weights(ckpt: Path, name: str) -> dict[str, Tensor]:
    path = ckpt / name
    try:
        return load_file(str(path))
    except Exception as e:
        raise ELFError(f"cannot resume: {path} is missing or corrupt ({e})") from None


def load_rank_state(
    ckpt: Path, info: DistInfo, saved_world: int, sharded: bool = False
) -> dict[str, Any]:
    """This rank's optimizer, EMA and RNG state (weights-only load) from ``ckpt``, saved by
    ``saved_world`` processes (``state.json``) in the same parallel mode (checked before).

    A run saved by another number of processes resumes when neither run shards (DDP or one
    process): every DDP rank holds the same optimizer and EMA state, so each rank takes rank 0's
    (and ranks > 0 then draw a dropout stream of their own, see ``train.rank_seed``). The global
    batch and its examples are keyed by stream position, not by rank, so the steps that follow
    are the ones the original run would have taken (up to the order of the gradient all-reduce's
    sums; with dropout, up to the masks). FSDP2 state is sharded by rank: that resume is refused.
    """
    path = ckpt / rank_file(info.rank)
    if saved_world != info.world_size:
        if sharded:
            raise ELFError(
                f"cannot resume {ckpt}: it was saved by {saved_world} processes, this run has "
                f"{info.world_size}, and FSDP2 shards the optimizer state by rank; resume under "
                f"torchrun --nproc_per_node {saved_world}"
            )
        path = ckpt / rank_file(0)
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:
        raise ELFError(f"cannot resume: {path} is missing or corrupt ({e})") from None


def load_rng(path: Path) -> dict[str, Any]:
    """A process's saved RNG state (weights-only)."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:
        raise ELFError(f"cannot resume: {path} is missing or corrupt ({first_line(e)})") from None


def restore_optimizer(optimizer, state: dict[str, Any]) -> None:
    """Load a saved optimizer's buffers; its settings stay ``optimizer``'s (the current config).

    NOTE: ``Optimizer.load_state_dict`` also replaces every group's settings with the saved ones.
    They are put back afterwards, so a resume follows the config it runs with, and a run resumed
    on other hardware, where ``muon_ns_dtype="auto"`` picks the other Muon class (both keep one
    ``momentum_buffer`` per matrix), does not step with the saved class's settings. (lr is set
    before every step anyway.) ``load_state_dict`` also casts saved tensors to the parameter's
    device and dtype but cannot make them DTensors, so the momentum/Adam buffers of sharded
    parameters are re-wrapped with the parameter's mesh and placements here.
    """
    from torch.distributed.tensor import DTensor

    settings = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
    try:
        optimizer.load_state_dict(state)
    except (ValueError, KeyError) as e:  # torch's own messages: group or parameter counts
        raise ELFError(
            f"the checkpoint's optimizer state does not fit this optimizer ({e}); it was saved "
            "with other optimizer settings or an older elflow: start a new out= with train.init "
            "set to it to continue from its weights"
        ) from None
    for group, own in zip(optimizer.param_groups, settings, strict=True):
        for key in set(group) - set(own) - {"params"}:
            del group[key]  # a setting only the saved optimizer class has
        group.update(own)
    subs = getattr(optimizer, "optimizers", None)
    for opt in subs.values() if isinstance(subs, dict) else [optimizer]:
        for p, st in opt.state.items():
            if not isinstance(p, DTensor):
                continue
            local_shape = p.to_local().shape
            for k, v in st.items():
                if isinstance(v, Tensor) and not isinstance(v, DTensor) and v.shape == local_shape:
                    st[k] = DTensor.from_local(
                        v, p.device_mesh, p.placements, shape=p.shape, stride=p.stride()
                    )
