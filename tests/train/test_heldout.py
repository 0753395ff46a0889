"""Held-out loss during training (`train.eval_every`): fixed rows, fixed draws, EMA weights."""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

from elflow.config.train_config import run_config_from_dict
from elflow.train.forward import TrainForward
from elflow.train.heldout import HeldOutSplit, RowSubset, heldout_loss, spread_rows
from elflow.train.step import ELFObjective
from tests.train_helpers import (
    WORDS,
    assert_same,
    distill_cli,
    heldout_lines,
    run_config,
    train_cli,
    weights,
)


@pytest.fixture(scope="module")
def valid_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("valid") / "valid.jsonl"
    g = np.random.default_rng(1)
    lines = [" ".join(g.choice(WORDS, size=int(g.integers(3, 10)))) for _ in range(12)]
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in lines))
    return path


def strip_timing(line: dict) -> dict:
    return {k: v for k, v in line.items() if k != "eval_seconds"}


def test_spread_rows_are_evenly_spaced_with_shared_keys_dealt_over_processes():
    rows, keys = spread_rows(10, 4)
    assert rows.tolist() == [0, 3, 6, 9] and keys.tolist() == [0, 1, 2, 3]
    rows, keys = spread_rows(3, 256)
    assert rows.tolist() == [0, 1, 2] and keys.tolist() == [0, 1, 2]
    assert len(set(spread_rows(1000, 999)[0].tolist())) == 999  # no row twice
    shares = [spread_rows(7, 5, r, 2) for r in range(2)]
    assert [r.tolist() for r, _ in shares] == [[0, 3, 6], [2, 4]]
    assert [k.tolist() for _, k in shares] == [[0, 2, 4], [1, 3]]


@pytest.mark.e2e
def test_heldout_loss_is_logged_and_leaves_training_unchanged(
    tmp_path,
    assets,
    valid_file,
    capsys,
):
    # Dropout uses the global RNG: the evaluation must not draw from it.
    plain = run_config(assets, model={"dropout": 0.2})
    evaluated = run_config(
        assets,
        model={"dropout": 0.2},
        data={"valid_path": str(valid_file)},
        train={"eval_every": 3, "eval_rows": 10},
    )
    assert train_cli(tmp_path, tmp_path / "plain", plain) == 0
    assert train_cli(tmp_path, tmp_path / "eval", evaluated) == 0
    assert "held-out loss (EMA weights) valid" in capsys.readouterr().out
    # The evaluation draws from its own keyed generators: the run's weights are bitwise the same.
    for name in ("model.safetensors", "ema.safetensors"):
        assert_same(
            weights(tmp_path / "plain" / "checkpoint-6", name),
            weights(tmp_path / "eval" / "checkpoint-6", name),
        )
    lines = heldout_lines(tmp_path / "eval")
    assert [x["step"] for x in lines] == [3, 6]
    for x in lines:
        for split in ("valid", "train_rows"):
            assert all(math.isfinite(x[f"{split}_{k}"]) for k in ("loss", "l2", "ce"))
    assert lines[1]["valid_loss"] != lines[0]["valid_loss"]
    # The logged value is the objective on the first 10 rows with the EMA weights, recomputed here.
    from elflow import load_model
    from elflow.data.rows import build_dataset
    from elflow.text.encoder import FrozenEncoder
    from elflow.text.tokenizer import load_tokenizer
    from elflow.text.tokens import token_spec
    from elflow.train.batches import make_batch

    ckpt = tmp_path / "eval" / "checkpoint-6"
    cfg = run_config_from_dict(json.loads((ckpt / "config.json").read_text())["run"])
    net, _ = load_model(ckpt)
    tok = load_tokenizer(cfg.encoder.tokenizer_name)
    data = build_dataset(cfg.data, tok, 12, 0, token_spec(tok).eos_id, "valid")
    encoder = FrozenEncoder.from_pretrained(cfg.encoder.name, latent_std=cfg.encoder.latent_std)
    rows, keys = spread_rows(len(data), 10)
    subset = RowSubset(data, rows)
    split = HeldOutSplit(
        "valid",
        lambda i, k: make_batch(cfg, subset, None, encoder, torch.device("cpu"), i, k),
        keys,
        chunk=4,  # chunking does not change the loss (it is normalised over all rows at once)
    )
    again = heldout_loss(ELFObjective(cfg), TrainForward(net.eval()), split, "cpu")
    for k in ("valid_loss", "valid_l2", "valid_ce"):
        assert again[k] == pytest.approx(lines[1][k], rel=1e-5)


@pytest.mark.e2e
def test_heldout_loss_resumes_and_works_without_a_validation_split(
    tmp_path,
    assets,
    capsys,
):
    cfg = run_config(assets, train={"eval_every": 2, "eval_rows": 6})
    half = run_config(assets, train={"eval_every": 2, "eval_rows": 6, "max_steps": 3})
    assert train_cli(tmp_path, tmp_path / "full", cfg) == 0
    assert "covers training rows only" in capsys.readouterr().out
    assert train_cli(tmp_path, tmp_path / "part", half) == 0
    assert train_cli(tmp_path, tmp_path / "part", cfg) == 0
    full, part = heldout_lines(tmp_path / "full"), heldout_lines(tmp_path / "part")
    assert [x["step"] for x in full] == [2, 4, 6]
    assert [x["step"] for x in part] == [2, 3, 4, 6]  # step 3 ended the first invocation
    assert all("valid_loss" not in x for x in full)
    assert all(x["eval_seconds"] > 0 for x in full)
    by_step = {x["step"]: strip_timing(x) for x in part}
    assert [by_step[x["step"]] for x in full] == [strip_timing(x) for x in full]


@pytest.mark.e2e
def test_distillation_rounds_log_their_own_heldout_loss(
    tmp_path,
    assets,
    teacher,
):
    assert distill_cli(tmp_path, tmp_path / "pd", assets, teacher, "2/2", eval_every=2) == 0
    (line,) = heldout_lines(tmp_path / "pd" / "round-1-2x2")
    assert line["step"] == 2 and line["train_rows_loss"] > 0


@pytest.mark.parametrize(
    ("setting", "message"),
    [("train.eval_every=-1", "train.eval_every must be >= 0"), ("train.eval_rows=0", "eval_rows")],
)
def test_bad_heldout_settings_are_one_line_errors(tmp_path, setting, message, capsys):
    from elflow.__main__ import main

    argv = ["train", "--preset", "bible-tiny", "--out", str(tmp_path / "o"), "--print-config"]
    assert main([*argv, "--set", setting]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1


@pytest.mark.e2e
def test_conditional_run_trains_evaluates_and_translates(tmp_path, assets):
    """The de-en/summ path end to end: source/target pairs, label drop, held-out loss, CFG."""
    g = np.random.default_rng(2)
    for name, n in (("pairs.jsonl", 40), ("pairs-valid.jsonl", 8)):
        with (tmp_path / name).open("w") as f:
            for _ in range(n):
                src = " ".join(g.choice(WORDS, size=int(g.integers(2, 5))))
                f.write(json.dumps({"de": src, "en": " ".join(reversed(src.split()))}) + "\n")
    data = {
        "path": str(tmp_path / "pairs.jsonl"),
        "valid_path": str(tmp_path / "pairs-valid.jsonl"),
        "format": "pairs",
        "source_field": "de",
        "target_field": "en",
    }
    # Seed 2: the 8 held-out rows' draws include decoder rows (seed 0's first 8 have none).
    train = {"eval_every": 3, "eval_rows": 8, "sample_every": 6, "num_samples": 2, "seed": 2}
    cfg = run_config(assets, data=data, train=train)
    cfg |= {"task": "conditional", "max_input_length": 6}
    cfg["objective"] = {"pad_with_eos": True, "decoder_noise_scale": 1.0, "label_drop_prob": 0.5}
    cfg["sampler"] = {"steps": 3, "sampler": "ode", "gamma": 0.0, "w": 1.0, "cfg": 2.0}
    assert train_cli(tmp_path, tmp_path / "run", cfg) == 0
    lines = heldout_lines(tmp_path / "run")
    assert [x["step"] for x in lines] == [3, 6]
    assert all(math.isfinite(x["valid_loss"]) and x["valid_ce"] > 0 for x in lines)
    # The periodic samples record the sources they translate: the first rows' (unshuffled).
    samples = [json.loads(x) for x in (tmp_path / "run" / "samples" / "step-6.jsonl").open()]
    firsts = [json.loads(x)["de"] for x in (tmp_path / "pairs.jsonl").open()][:2]
    assert [r["source"] for r in samples] == firsts and all("text" in r for r in samples)
    from elflow import ELFPipeline

    pipe = ELFPipeline.from_pretrained(tmp_path / "run")
    assert pipe.config.task == "conditional"
    out = pipe.generate(sources=["god said", "the earth"], sampler=replace(pipe.sampler, steps=3))
    assert len(out) == 2 and all(isinstance(t, str) for t in out)
