"""benchmarks/train_demo_gpu.py: the MiniLM pack round trip, and the whole GPU recipe as its CPU
dry run (the same code at a tiny size: prepare, train under a time budget, export in shards)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.builders import tiny_bert
from tests.test_benchmarks import load

ROOT = Path(__file__).resolve().parents[1]


def test_pack_round_trip_keeps_rows_and_rounds_matrices_only(tmp_path, monkeypatch):
    gpu = load("train_demo_gpu")
    torch.manual_seed(0)
    src = tmp_path / "bert"
    tiny_bert(num_hidden_layers=2).save_pretrained(src)
    rows = [0, 7, 100, 101, 102, 2023]
    info = gpu.pack_encoder(tmp_path / "pack", src=src, rows=rows)
    assert info["rows"] == len(rows) and info["total_mib"] < 1
    before = load_file(str(src / "model.safetensors"))
    monkeypatch.setitem(sys.modules, gpu.MINILM_MODULE, None)  # restored after the test
    folder = gpu.use_pack(tmp_path / "pack", tmp_path / "unpacked")
    after = load_file(str(folder / "model.safetensors"))
    assert set(after) == {k for k in before if not k.startswith("pooler.")} - {
        "embeddings.position_ids"
    }
    for name, value in after.items():
        want = before[name]
        if name == "embeddings.word_embeddings.weight":
            assert torch.equal(value[rows], want[rows].bfloat16().float())
            kept = torch.zeros(len(value), dtype=torch.bool)
            kept[rows] = True
            assert not value[~kept].any()  # the rows no verse uses are zero
        elif want.ndim == 2:
            assert torch.equal(value, want.bfloat16().float()), name
        else:
            assert torch.equal(value, want), name  # biases and norm scales exact
    assert (folder / "vocab.txt").is_file() and (folder / "config.json").is_file()

    index = json.loads((tmp_path / "pack" / gpu.PACK_INDEX).read_text())
    index["sha256"] = "0" * 64  # as if the payload had changed
    (tmp_path / "pack" / gpu.PACK_INDEX).write_text(json.dumps(index))
    with pytest.raises(SystemExit, match="is damaged"):
        gpu.unpack_encoder(tmp_path / "pack", tmp_path / "again")


def test_use_pack_points_the_minilm_alias_at_the_unpacked_folder(tmp_path, monkeypatch):
    from elflow.text.encoder import resolve_pretrained

    gpu = load("train_demo_gpu")
    src = tmp_path / "bert"
    tiny_bert().save_pretrained(src)
    gpu.pack_encoder(tmp_path / "pack", src=src, rows=[0, 101, 102])
    monkeypatch.setitem(sys.modules, gpu.MINILM_MODULE, None)  # restored after the test
    folder = gpu.use_pack(tmp_path / "pack", tmp_path / "unpacked")
    assert Path(resolve_pretrained("minilm")) == folder


@pytest.mark.slow
def test_cpu_dry_run_trains_under_its_budget_and_exports_shards(tmp_path):
    out = tmp_path / "out"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT / "src")}
    proc = subprocess.run(
        [
            sys.executable,
            "train_demo_gpu.py",
            "--cpu-dry-run",
            "--budget-s",
            "20",
            "--out",
            str(out),
        ],
        cwd=ROOT / "benchmarks",
        env=env,
        capture_output=True,
        text=True,
        timeout=1200,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "tokens/s" in proc.stdout and "held-out (EMA)" in proc.stdout
    names = sorted(p.name for p in out.iterdir())
    shards = [n for n in names if n.startswith("model-")]
    assert names == sorted(
        ["config.json", "model.safetensors.index.json", "train_demo.json", *shards]
    )
    assert len(shards) >= 2 and len(names) <= 7  # with the tee'd train.log: 8 files at most
    assert all((out / n).stat().st_size < 16 * 2**20 for n in names)

    from elflow.io.artifact import load_model

    model, config = load_model(out)
    assert model.cfg == config.model and config.model.hidden_size == 64
    assert config.encoder == "minilm"
    assert config.sampler.project_from == 0.3 and config.pad_with_eos
    summary = json.loads((out / "train_demo.json").read_text())
    assert summary["steps"] >= 1 and summary["curve"]
    assert summary["heldout"] and "valid_loss" in summary["heldout"][-1]
    assert summary["run_config"]["preset"] == "bible-demo"
    assert len(summary["samples"]) == 4
    if not summary["overran"]:  # a CPU shared with other work may be too slow for the plan
        assert summary["plans"] and summary["plans"][-1]["total_steps"] == summary["steps"]
        assert summary["wall_s"] < summary["budget_s"] * 1.5
