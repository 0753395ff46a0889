"""Sharded checkpoints (torch.distributed.checkpoint) resume on another number of processes,
FSDP2 here (DDP's, with async saves on two processes: test_train.py's two-process test),
continuing within 1e-5 of the uninterrupted run; checkpoints of elflow < 0.3 (one file of state
per process) still resume; async saves complete."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from tests.train_helpers import (
    assert_same_checkpoint,
    heldout_lines,
    run_config,
    train_cli,
    train_processes,
)

pytestmark = pytest.mark.e2e  # whole training runs through the command line

TRAIN = {"max_steps": 6, "save_every": 3, "global_batch": 4}


def _resume(tmp: Path, source: Path, name: str, cfg: dict, nproc: int, steps: int) -> Path:
    """``source`` (a checkpoint folder) resumed to step ``steps`` in a new run folder ``name``,
    on ``nproc`` processes; its last checkpoint."""
    run = tmp / name
    run.mkdir()
    shutil.copytree(source, run / source.name)
    train_processes(tmp, run, {**cfg, "train": {**cfg["train"], "max_steps": steps}}, nproc)
    return run / f"checkpoint-{steps}"


@pytest.mark.dist
def test_fsdp2_resumes_on_one_two_and_four_processes(tmp_path, assets):
    """One chain of resumes (a constant learning rate: a run's length changes nothing before its
    end): 2 processes to step 3, then 2 -> 1 to step 6, 1 -> 2 to step 9 (with activation
    checkpointing: the recomputed blocks re-gather their shards), and 2 -> 4 from step 3 to 6,
    each within 1e-5 of the one-process run, and so are the held-out losses (steps 2, 4 and 8:
    no save there; the sharded EMA gathered; 1 row leaves the other processes none)."""
    held = {"eval_every": 2, "eval_rows": 1}
    straight = tmp_path / "single"
    single = run_config(assets, train={**TRAIN, **held, "max_steps": 9})
    assert train_cli(tmp_path, straight, single) == 0
    fsdp = run_config(assets, train={**TRAIN, **held, "parallel": "fsdp2", "max_steps": 3})
    train_processes(tmp_path, tmp_path / "two", fsdp, 2)
    middle = tmp_path / "two" / "checkpoint-3"
    assert_same_checkpoint(straight / "checkpoint-3", middle, 1e-5)
    # Two processes to one (FSDP2 over a mesh of one), and that one process's checkpoint to two.
    one = _resume(tmp_path, middle, "two-to-one", fsdp, 1, 6)
    assert_same_checkpoint(straight / "checkpoint-6", one, atol=1e-5)
    recompute = {**fsdp, "train": {**fsdp["train"], "activation_checkpointing": True}}
    end = _resume(tmp_path, one, "one-to-two", recompute, 2, 9)
    assert_same_checkpoint(straight / "checkpoint-9", end, atol=1e-5)
    end = _resume(tmp_path, middle, "two-to-four", fsdp, 4, 6)
    assert_same_checkpoint(straight / "checkpoint-6", end, atol=1e-5)
    losses = {x["step"]: x["train_rows_loss"] for x in heldout_lines(straight)}
    runs = {"two": [2], "two-to-one": [4, 6], "one-to-two": [8, 9], "two-to-four": [4, 6]}
    for run, steps in runs.items():  # (and each run's last step, not always the straight run's)
        got = {x["step"]: x["train_rows_loss"] for x in heldout_lines(tmp_path / run)}
        assert set(steps) <= set(got), (run, got)
        assert [got[k] for k in steps] == pytest.approx([losses[k] for k in steps], rel=1e-4)


def test_a_checkpoint_of_the_older_layout_still_resumes_bitwise(tmp_path, assets):
    """elflow < 0.3 wrote rank<r>.pt (optimizer state_dict, EMA state, RNG) per process."""
    from elflow.config.run_presets import preset
    from elflow.config.train_config import apply_overrides
    from elflow.io.checkpoint import load_rng
    from elflow.train.setup import prepare_run

    cfg = run_config(assets, train=TRAIN)
    assert train_cli(tmp_path, tmp_path / "straight", cfg) == 0
    old = tmp_path / "old"
    old.mkdir()
    ckpt = old / "checkpoint-3"
    shutil.copytree(tmp_path / "straight" / "checkpoint-3", ckpt)
    # The older layout, made from the restored state of this checkpoint.
    (tmp_path / "cfg.json").write_text(json.dumps(cfg))
    run = prepare_run(apply_overrides(preset("bible-tiny"), tmp_path / "cfg.json"), old, "auto")
    payload = {
        "optimizer": run.optimizer.state_dict(),
        "ema": run.ema.state_dict(),
        "rng": load_rng(ckpt / "rng-0.pt"),
    }
    run.lock.release()
    torch.save(payload, ckpt / "rank0.pt")
    shutil.rmtree(ckpt / "train-state")
    (ckpt / "rng-0.pt").unlink()
    (ckpt / "manifest.json").unlink()  # (elflow < 0.3 wrote none)
    state = json.loads((ckpt / "state.json").read_text())
    del state["format"], state["ema_updates"]
    (ckpt / "state.json").write_text(json.dumps(state))
    assert train_cli(tmp_path, old, cfg) == 0
    assert_same_checkpoint(tmp_path / "straight" / "checkpoint-6", old / "checkpoint-6")


def test_async_saves_complete_and_resume_bitwise(tmp_path, assets):
    cfg = run_config(assets, train=TRAIN)
    assert train_cli(tmp_path, tmp_path / "sync", cfg) == 0
    asynchronous = run_config(assets, train={**TRAIN, "async_save": True, "max_steps": 3})
    assert train_cli(tmp_path, tmp_path / "async", asynchronous) == 0
    assert not list((tmp_path / "async").glob(".tmp-*"))
    assert_same_checkpoint(tmp_path / "sync" / "checkpoint-3", tmp_path / "async" / "checkpoint-3")
    more = run_config(assets, train={**TRAIN, "async_save": True})
    assert train_cli(tmp_path, tmp_path / "async", more) == 0
    assert_same_checkpoint(tmp_path / "sync" / "checkpoint-6", tmp_path / "async" / "checkpoint-6")
