"""benchmarks/gpu_sbs.py's CPU dry run: both sides' code paths at tiny shapes, so that the GPU's
minutes are never spent on a bug (one subprocess, the command its docstring gives)."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _reference() -> Path | None:
    for path in (ROOT / ".sbs" / "elf_pytorch", ROOT.parent / "shared/reference/elf_pytorch"):
        if (path / "src" / "train_step.py").is_file():
            return path
    return None


@pytest.mark.slow
def test_the_dry_run_trains_samples_and_serves_both_sides(tmp_path):
    cmd = [sys.executable, "benchmarks/gpu_sbs.py", "--cpu-dry-run", "--peak-tflops", "1"]
    cmd += ["--out", str(tmp_path), "--json", "sbs.json"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "2"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / "src"), env.get("PYTHONPATH")]))
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads((tmp_path / "sbs.json").read_text())
    assert "== targets' ratios" in proc.stdout and "device: CPU; torch" in proc.stdout
    train = {r["name"]: r for r in report["train"]}
    steps = report["steps"]
    assert steps > report["warmup"] > 0
    assert {"elflow blocks", "elflow step"} <= set(train)
    for r in train.values():
        assert len(r["losses"]) == steps and all(math.isfinite(x) for x in r["losses"])
        assert r["tokens_per_s"] > 0 and 0 < r["model_flops"] <= r["executed_flops"]
    # The same batches, draws and initial weights: compiling the step changes nothing.
    blocks, step = train["elflow blocks"]["losses"], train["elflow step"]["losses"]
    assert step == pytest.approx(blocks, rel=1e-4)
    assert all(r["batch"] and r["elflow eager"] > 0 for r in report["sample"])
    assert [r["clients"] for r in report["serve"]] == [1, 4]
    assert all(r["samples"] > 0 and r["failed"] == 0 for r in report["serve"])
    assert report["ratios"]["serve samples/s, 4 clients / 1 client"] > 0
    if _reference() is None or importlib.util.find_spec("einops") is None:
        assert any(n.startswith("authors' side: skipped") for n in report["notes"])
        return
    authors = train["authors"]
    # The authors' step, counted op by op, is what reference_step_flops says it runs.
    assert authors["counted_flops"] == pytest.approx(authors["executed_flops"], rel=1e-9)
    assert authors["model_flops"] == train["elflow blocks"]["model_flops"]  # the same network
    assert authors["executed_flops"] > 1.5 * authors["model_flops"]
    assert len(authors["losses"]) == steps and all(math.isfinite(x) for x in authors["losses"])
    assert all(r["authors"] > 0 for r in report["sample"])
    assert report["ratios"]["training tokens/s, best elflow / authors"] > 0
