"""Data under several processes: the latent cache is built once (by process 0) and loaded by the
others (test_train.py's two-process DDP test), or refused in one line when it cannot be shared;
raw training data too large for every process to tokenise is refused with the `elflow prepare`
command to run."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import torch

from elflow.errors import ELFError
from elflow.runtime.distributed import DistInfo
from tests.train_helpers import run_config, train_argv


def _two_processes(tmp: Path, out: Path, cfg: dict) -> subprocess.CompletedProcess:
    """``elflow train`` on 2 forked processes (:mod:`tests.dist.fork_ranks`), failing or not."""
    from tests.dist.fork_ranks import fork_elflow

    return fork_elflow(train_argv(tmp, out, cfg), 2)


@pytest.mark.dist
def test_two_processes_refuse_a_latent_cache_nobody_saves(tmp_path, assets):
    """(A cache built once by process 0 and loaded by the others, the same run as one process:
    test_train.py's two-process DDP test.)"""
    # A cache nobody saves would be encoded by every process: refused, on both, in one line.
    unsaved = run_config(
        assets,
        data={"latent_cache": True, "latent_cache_dtype": "float32", "latent_cache_save": False},
    )
    proc = _two_processes(tmp_path, tmp_path / "unsaved", unsaved)
    assert proc.returncode != 0
    text = (proc.stdout + proc.stderr).replace("\r", "\n")
    lines = [x for x in text.splitlines() if "elflow: error:" in x]
    assert len(lines) == 2 and all(
        "data.latent_cache_save=false would make each of the 2 processes encode every row" in x
        for x in lines
    ), text[-3000:]


def test_large_raw_data_under_several_processes_is_refused(tmp_path, assets, monkeypatch):
    from elflow.config.run_presets import preset
    from elflow.config.train_config import apply_overrides
    from elflow.train import setup

    cfg_path = tmp_path / "cfg.json"
    cfg_path.write_text(json.dumps(run_config(assets)))
    cfg = apply_overrides(preset("bible-tiny"), cfg_path)
    two = DistInfo(rank=0, world_size=2, local_rank=0, device=torch.device("cpu"))
    one = DistInfo(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))
    size = (assets / "train.jsonl").stat().st_size
    setup.check_raw_data(cfg, two)  # small: every process may read it
    monkeypatch.setattr(setup, "RAW_DATA_LIMIT", size - 1)
    setup.check_raw_data(cfg, one)  # one process: its own business
    with pytest.raises(ELFError) as e:
        setup.check_raw_data(cfg, two)
    data = assets / "train.jsonl"
    assert str(e.value) == (
        f"data.path {data} is 0 MB of raw data, which each of the 2 processes would read and "
        f"tokenise at start; prepare it once (elflow prepare --data {data} --out {data}-prepared "
        f"--tokenizer minilm --max-length 12) and set data.path to the prepared folder"
    )
    # The command it gives works, and its output is accepted.
    from elflow.__main__ import main

    out = tmp_path / "prepared"  # (the command's own --out is beside the shared test data)
    argv = ["prepare", "--data", str(data), "--out", str(out), "--tokenizer", "minilm"]
    assert main([*argv, "--max-length", "12"]) == 0
    setup.check_raw_data(apply_overrides(cfg, None, [f"data.path={out}"]), two)
