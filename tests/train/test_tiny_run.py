"""The trainer through :func:`elflow.train.loop.train` on the session's tiny run
(``tiny_run``, tests/train/conftest.py): what a run writes, that a checkpoint is a model, and
that a resume continues the run bitwise. The same through the command line, with dropout,
accumulation, the latent cache and N processes: test_train.py (``e2e``, full tier)."""

from __future__ import annotations

import json
import math
import shutil
from dataclasses import replace

import pytest
import torch

from elflow import ELFPipeline, load_model
from elflow.train.loop import train
from tests.train_helpers import assert_same_checkpoint, weights


def test_train_returns_the_last_checkpoint_and_writes_every_step(tiny_run):
    run = tiny_run.out
    assert tiny_run.last == run / "checkpoint-6"
    assert sorted(p.name for p in run.glob("checkpoint-*")) == ["checkpoint-3", "checkpoint-6"]
    lines = tiny_run.metrics()
    steps = [x for x in lines if "loss" in x]
    assert [x["step"] for x in steps] == list(range(1, 7))
    for key in ("loss", "l2", "ce", "lr", "grad_norm", "tokens_per_s"):
        assert key in steps[-1]
    assert all(math.isfinite(x["loss"]) for x in steps)
    assert steps[0]["lr"] == 0 and steps[-1]["lr"] == pytest.approx(3e-3)  # 2 warm-up steps
    held = [x for x in lines if "train_rows_loss" in x]  # no valid_path: training rows
    assert [x["step"] for x in held] == [3, 6] and all(x["train_rows_loss"] > 0 for x in held)
    state = json.loads((tiny_run.last / "state.json").read_text())
    assert state["step"] == 6 and state["world_size"] == 1 and state["rows"] == 40
    config = json.loads((tiny_run.last / "config.json").read_text())
    assert config["run"]["train"]["max_steps"] == 6 and config["latent_std"] == 0.5
    for step in (3, 6):
        assert len((run / "samples" / f"step-{step}.jsonl").read_text().splitlines()) == 2


def test_a_checkpoint_is_a_model_and_its_samples_are_the_pipelines(tiny_run):
    model, _ = load_model(tiny_run.out)  # the run's latest checkpoint, EMA weights
    ema = weights(tiny_run.last, "ema.safetensors")
    assert ema.keys() <= model.state_dict().keys()
    for key, value in ema.items():
        torch.testing.assert_close(model.state_dict()[key], value, rtol=0, atol=0)
    pipe = ELFPipeline.from_pretrained(tiny_run.out)
    assert len(pipe.generate(2, sampler=replace(pipe.sampler, steps=3))) == 2
    # The periodic samples came through the pipeline's one path: the saved model, sampled with
    # the run's seed and sampler, writes the same texts.
    path = tiny_run.out / "samples" / "step-6.jsonl"
    written = [json.loads(x)["text"] for x in path.read_text().splitlines()]
    assert pipe.generate(2, seed=tiny_run.cfg.train.seed) == written


def test_a_resume_continues_the_run_bitwise(tiny_run, tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    shutil.copytree(tiny_run.checkpoint(3), run / "checkpoint-3")
    assert train(tiny_run.cfg, run) == run / "checkpoint-6"  # resume="auto": from checkpoint-3
    assert_same_checkpoint(tiny_run.last, run / "checkpoint-6")
    straight = [x for x in tiny_run.metrics() if x["step"] > 3]
    resumed = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in resumed] == [x["step"] for x in straight]
    for a, b in zip(resumed, straight, strict=True):  # the same losses, held-out losses included
        assert {k: v for k, v in a.items() if "loss" in k} == {
            k: v for k, v in b.items() if "loss" in k
        }
    samples = "samples/step-6.jsonl"
    assert (run / samples).read_text() == (tiny_run.out / samples).read_text()
