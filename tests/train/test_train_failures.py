"""When one process of a multi-process run fails, the others end with one line naming it and
the last good checkpoint: a crashed process (its collective fails at once) and a hung one (the
others, sent SIGTERM, give up after train.stop_timeout)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.dist.launch import free_port
from tests.train_helpers import run_config, train_argv

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.e2e  # whole training runs through the command line


def torchrun_failing(tmp: Path, out: Path, cfg: dict, rank: int, step: int, mode: str):
    """``elflow train`` on 2 gloo processes where ``rank`` fails at ``step`` (tests/dist)."""
    argv = train_argv(tmp, out, cfg)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2"]
    cmd += [f"--master_port={free_port()}", str(ROOT / "tests" / "dist" / "failing_rank.py")]
    cmd += [str(rank), str(step), mode, *argv]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)}
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)


def _lines(proc) -> list[str]:
    text = (proc.stdout + proc.stderr).replace("\r", "\n")
    return [x for x in text.splitlines() if "elflow: error: process" in x]


@pytest.mark.dist
def test_a_crashed_process_ends_the_others_with_one_line(tmp_path, assets):
    cfg = run_config(assets, train={"max_steps": 8, "save_every": 3})
    proc = torchrun_failing(tmp_path, tmp_path / "run", cfg, rank=1, step=4, mode="die")
    assert proc.returncode != 0
    lines = _lines(proc)
    assert len(lines) == 1, (proc.stdout + proc.stderr)[-3000:]
    line = lines[0]
    assert "process 0: a collective failed: process(es) 1 stopped answering" in line
    assert f"last good checkpoint: {tmp_path / 'run' / 'checkpoint-3'}" in line
    assert sorted(p.name for p in (tmp_path / "run").glob("checkpoint-*")) == ["checkpoint-3"]


@pytest.mark.dist
def test_a_hung_process_ends_the_others_after_the_stop_timeout(tmp_path, assets):
    train = {"max_steps": 8, "save_every": 3, "stop_timeout": 2.0}
    proc = torchrun_failing(
        tmp_path, tmp_path / "run", run_config(assets, train=train), 1, 4, "hang"
    )
    assert proc.returncode != 0
    # (torchrun then sends the hung process SIGTERM too: it says so in a line of its own.)
    lines = [x for x in _lines(proc) if "process 0:" in x]
    assert len(lines) == 1, (proc.stdout + proc.stderr)[-3000:]
    line = lines[0]
    assert "process 0: stopped by SIGTERM, but its step did not finish within 2 s" in line
    assert "process(es) 1 stopped answering" in line and "checkpoint-3" in line


@pytest.mark.dist
def test_a_run_folder_some_process_cannot_see_is_refused_at_start(tmp_path, assets):
    cfg = run_config(assets, train={"max_steps": 4})
    proc = torchrun_failing(tmp_path, tmp_path / "run", cfg, rank=1, step=99, mode="blind")
    assert proc.returncode != 0
    text = (proc.stdout + proc.stderr).replace("\r", "\n")
    lines = [x for x in text.splitlines() if "elflow: error:" in x]
    assert len(lines) == 2, text[-3000:]  # one from each process, the same
    assert all("process(es) 1 (on " in x and "cannot see --out" in x for x in lines)
    assert "a file system every node shares" in lines[0]
    assert not list((tmp_path / "run").glob("checkpoint-*"))
    assert not list((tmp_path / "run").glob(".elflow-shared-*"))


@pytest.mark.slow  # 4 training subprocesses, 2 killed
def test_kills_during_saves_lose_nothing(monkeypatch, capsys):
    """A couple of SIGKILLs while checkpoints are written (benchmarks/kill_saves.py does 20)."""
    import importlib.util

    bench = ROOT / "benchmarks"
    monkeypatch.syspath_prepend(str(bench))
    spec = importlib.util.spec_from_file_location("kill_saves", bench / "kill_saves.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    # 24 steps, not the benchmark's 100: two kills come within the first 10 (saves every 2).
    monkeypatch.setattr(module, "STEPS", 24)
    assert module.main(["--trials", "2", "--seed", "3"]) == 0
    out = capsys.readouterr().out
    assert "2 kills, 2 during a save: every checkpoint intact and kept: True" in out
    assert "uninterrupted run: 0" in out


def test_a_second_run_on_a_run_folder_in_use_is_refused(tmp_path, assets, capsys):
    from elflow.io.run_lock import HOLDER, RunLock
    from tests.train_helpers import error_lines, train_cli

    out = tmp_path / "run"
    cfg = run_config(assets, train={"max_steps": 2, "save_every": 2})
    holder = RunLock(out)  # another run (a lock taken through another file descriptor)
    holder.acquire()
    try:
        assert train_cli(tmp_path, out, cfg) == 2
        lines = error_lines(capsys.readouterr().err)
        assert len(lines) == 1
        assert f"--out {out} is in use by another run (process {os.getpid()} on " in lines[0]
        assert "wait for it to end or give another --out" in lines[0]
        assert not list(out.glob("checkpoint-*")) and not (out / "metrics.jsonl").exists()
    finally:
        holder.release()
    # A holder that died leaves its name behind but not its lock: the next run goes ahead.
    (out / HOLDER).write_text('{"pid": 1, "host": "gone", "since": "", "command": ""}\n')
    assert train_cli(tmp_path, out, cfg) == 0
    assert (out / "checkpoint-2").is_dir() and not (out / HOLDER).exists()
    # and the lock is free again once a run ends: a resume runs.
    assert train_cli(tmp_path, out, {**cfg, "train": {**cfg["train"], "max_steps": 3}}) == 0


def test_a_rerun_after_a_crash_before_the_first_checkpoint_logs_each_step_once(
    tmp_path,
    assets,
):
    from tests.train_helpers import train_cli

    out = tmp_path / "run"
    out.mkdir()
    # What a run killed at step 3, before its first save, leaves (a line cut short at the end).
    (out / "metrics.jsonl").write_text(
        "".join(json.dumps({"step": k, "loss": 9.0}) + "\n" for k in (1, 2)) + '{"step": 3, "l'
    )
    cfg = run_config(assets, train={"max_steps": 3, "save_every": 3})
    assert train_cli(tmp_path, out, cfg) == 0
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines] == [1, 2, 3] and all(x["loss"] != 9.0 for x in lines)
