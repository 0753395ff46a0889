"""Run configs: paper presets carry the released settings; overrides are typed and strict."""

from __future__ import annotations

import json

import pytest

from elflow.config.run_presets import PRESETS, preset
from elflow.config.train_config import (
    apply_overrides,
    override_keys,
    run_config_from_dict,
    run_config_to_dict,
)
from elflow.errors import ELFError
from elflow.train.optim import peak_lr


def test_paper_presets_have_the_released_settings():
    b = preset("owt-b")
    assert (b.model.depth, b.model.hidden_size, b.model.num_heads) == (12, 768, 12)
    assert b.model.max_length == 1024 and b.task == "unconditional"
    assert b.encoder.name == "google-t5/t5-small" and b.encoder.latent_std == 0.2
    assert b.train.global_batch == 512 and peak_lr(b.optim, 512) == pytest.approx(2e-3)
    assert b.train.warmup_epochs == 0.5 and b.train.ema_decay == 0.9999
    o = b.objective
    assert (o.time_mean, o.time_std, o.noise_scale, o.t_eps) == (-1.5, 0.8, 2.0, 0.05)
    assert (o.decoder_prob, o.decoder_noise_scale, o.self_cond_prob) == (0.2, 5.0, 0.5)
    assert (o.w_min, o.w_max) == (0.5, 5.0) and not o.pad_with_eos
    assert (b.sampler.steps, b.sampler.sampler, b.sampler.gamma, b.sampler.w) == (32, "sde", 1.5, 3)
    assert preset("owt-m").model.hidden_size == 1056 and preset("owt-m").sampler.steps == 64
    assert preset("owt-l").model.depth == 32 and preset("owt-l").sampler.gamma == 1.0
    de = preset("de-en-b")
    assert (de.model.max_length, de.max_input_length, de.task) == (128, 64, "conditional")
    assert de.objective.pad_with_eos and de.objective.decoder_noise_scale == 1.0
    assert de.objective.label_drop_prob == 0.1 and de.optim.warmup_steps == 5000
    assert (de.sampler.sampler, de.sampler.steps, de.sampler.cfg, de.sampler.w) == (
        "ode",
        64,
        2.0,
        1.0,
    )
    xs = preset("xsum-b")
    assert (xs.model.max_length, xs.max_input_length) == (1088, 1024)


def _recipe_table() -> list[dict[str, str]]:
    """The rows of docs/training.md's table "The paper's recipe, field by field"."""
    from pathlib import Path

    text = (Path(__file__).resolve().parents[2] / "docs" / "training.md").read_text()
    section = text.split("### The paper's recipe, field by field", 1)[1]
    table = next(block for block in section.split("\n\n") if block.startswith("|"))
    lines = table.splitlines()

    def cells(line: str) -> list[str]:
        return [c.strip() for c in line.strip("|").split("|")]

    return [dict(zip(cells(lines[0]), cells(line), strict=True)) for line in lines[2:]]


def test_paper_presets_equal_the_recipe_table_in_the_docs():
    from elflow.config import MODEL_PRESETS

    rows = _recipe_table()
    assert [r["preset"] for r in rows] == ["`owt-b`", "`owt-m`", "`owt-l`", "`de-en-b`", "`xsum-b`"]
    for row in rows:
        cfg = preset(row["preset"].strip("`"))
        dims = ("depth", "hidden_size", "num_heads", "mlp_ratio", "bottleneck_dim")
        paper = MODEL_PRESETS[row["model"]]()
        assert all(getattr(cfg.model, d) == getattr(paper, d) for d in dims), row["preset"]
        for key in (
            "model.max_length",
            "max_input_length",
            "train.global_batch",
            "optim.blr",
            "train.epochs",
            "train.ema_decay",
            "objective.decoder_noise_scale",
            "objective.label_drop_prob",
            "objective.pad_with_eos",
            "data.packing",
        ):
            node = cfg
            for part in key.split("."):
                node = getattr(node, part)
            want = json.loads(row[key])
            assert node == want and type(node) is type(want), (row["preset"], key, node, want)
        amount, unit = row["warm-up"].split()
        if unit == "epochs":
            assert (cfg.train.warmup_epochs, cfg.optim.warmup_steps) == (float(amount), 0)
        else:
            assert (cfg.train.warmup_epochs, cfg.optim.warmup_steps) == (0.0, int(amount))
        kind, steps, _, gamma, _, w, _, guidance = row["sampler"].split()
        sampler = cfg.sampler
        assert (sampler.sampler, sampler.steps) == (kind, int(steps)), row["preset"]
        assert (sampler.gamma, sampler.w, sampler.cfg) == (float(gamma), float(w), float(guidance))
        assert cfg.encoder.name == "google-t5/t5-small" and cfg.encoder.latent_std == 0.2
        assert cfg.train.max_steps == 0  # trained by epochs


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_presets_round_trip_through_dicts(name):
    cfg = preset(name)
    assert run_config_from_dict(json.loads(json.dumps(run_config_to_dict(cfg)))) == cfg


def test_cpu_presets_use_offline_encoder_and_short_run_ema():
    cfg = preset("bible-tiny")
    assert cfg.encoder.name == "minilm" and cfg.encoder.latent_std == 0.0  # measured
    assert cfg.train.ema_warmup and cfg.train.ema_decay < 0.9999
    assert cfg.data.latent_cache and cfg.data.path.endswith("train.jsonl.gz")
    assert cfg.objective.pad_with_eos  # learns where a verse ends
    assert preset("de-en-tiny").task == "conditional"
    assert preset("summ-tiny").max_input_length == 96


def test_encoder_layer_needs_its_own_latent_std():
    assert apply_overrides(preset("bible-tiny"), None, ["encoder.layer=4"]).encoder.layer == 4
    with pytest.raises(ELFError, match=r"set encoder\.latent_std=0 to measure it"):
        apply_overrides(preset("owt-b"), None, ["encoder.layer=3"])
    cfg = apply_overrides(preset("owt-b"), None, ["encoder.layer=3", "encoder.latent_std=0"])
    assert cfg.encoder.layer == 3
    with pytest.raises(ELFError, match=r"encoder\.layer must be >= 0"):
        apply_overrides(preset("bible-tiny"), None, ["encoder.layer=-1"])


def test_overrides_from_set_and_yaml(tmp_path):
    yaml_file = tmp_path / "cfg.yaml"
    # YAML 1.1 reads 3e-4 (no dot) as a string; a float key takes it as the number.
    yaml_file.write_text("train:\n  global_batch: 32\nmodel:\n  depth: 3\noptim:\n  blr: 3e-4\n")
    cfg = apply_overrides(
        preset("bible-tiny"), yaml_file, ["train.max_steps=7", "optim.lr=1e-3", "data.path=x.txt"]
    )
    assert cfg.train.global_batch == 32 and cfg.model.depth == 3
    assert cfg.train.max_steps == 7 and cfg.optim.lr == 1e-3 and cfg.data.path == "x.txt"
    assert cfg.optim.blr == 3e-4


@pytest.mark.parametrize(
    ("sets", "message"),
    [
        (["train.max_stepz=1"], "unknown config key 'train.max_stepz'"),
        (["trian.max_steps=1"], "unknown config key 'trian'"),
        (["train.max_steps=1.5"], "must be an integer"),
        (["train.ema_warmup=yes"], "true or false"),
        (["optim.blr=-1"], "optim"),
        (["objective.self_cond_prob=2"], "self_cond_prob must be in [0, 1]"),
        (["task=conditional"], "max_input_length"),
        (
            ["sampler.cfg=2"],
            "sampler.cfg 2.0 (classifier-free guidance on the source) applies to conditional tasks",
        ),
        (["train.seed=-1"], "train.seed must be >= 0"),
        (['objective={"time_mean": -3}'], "names a whole section"),
        (["train.warmup_epochs=0.5", "optim.warmup_steps=10"], "both set the warm-up"),
        (["train.epochs=2"], "train.epochs=2.0 applies when train.max_steps=0 (it is 7000)"),
        (["max_input_length=abc"], "max_input_length must be an integer, got 'abc'"),
        (["train.epochs=Infinity"], "train.epochs must be a finite number, got inf"),
        (["encoder.latent_std=NaN"], "encoder.latent_std must be a finite number, got nan"),
        (
            ["optim.schedule=constant", "optim.decay_steps=500"],
            "optim.decay_steps=500 applies to optim.schedule=wsd",
        ),
        (
            ["optim.schedule=constant", "optim.min_lr_ratio=0.1"],
            "optim.min_lr_ratio=0.1 applies to the cosine and wsd schedules only",
        ),
    ],
)
def test_bad_overrides(sets, message):
    with pytest.raises(ELFError) as e:
        apply_overrides(preset("bible-tiny"), None, sets)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_another_schedule_over_a_presets_decay_is_fine():
    cfg = apply_overrides(preset("bible-tiny"), None, ["optim.schedule=constant"])
    assert cfg.optim.schedule == "constant" and cfg.optim.decay_steps == 2000  # unused, not set


def test_conditional_only_settings_are_checked_on_what_users_ask_for():
    # A run saved before the check (its value was ignored) still loads, so it can resume.
    data = run_config_to_dict(preset("bible-tiny"))
    data["sampler"]["cfg"], data["max_input_length"] = 2.0, 16
    saved = run_config_from_dict(data)
    assert saved.sampler.cfg == 2.0 and saved.max_input_length == 16
    with pytest.raises(ELFError, match="max_input_length 16 applies to conditional tasks only"):
        apply_overrides(preset("bible-tiny"), None, ["max_input_length=16"])


def test_unknown_key_in_config_file(tmp_path):
    f = tmp_path / "c.json"
    f.write_text(json.dumps({"train": {"globl_batch": 3}}))
    with pytest.raises(ELFError, match=r"train\.globl_batch"):
        apply_overrides(preset("bible-tiny"), f)
    with pytest.raises(ELFError, match="does not exist"):
        apply_overrides(preset("bible-tiny"), tmp_path / "missing.yaml")
    f.write_text("[1, 2]")  # JSON, like YAML, must hold a mapping
    with pytest.raises(ELFError, match="must hold a mapping"):
        apply_overrides(preset("bible-tiny"), f)


def test_override_keys(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("objective:\n  time_mean: -2\ntrain:\n  max_steps: 3\n")
    keys = override_keys(f, ["optim.lr=1e-3", " objective.time_std =1"])
    assert keys == {"objective.time_mean", "train.max_steps", "optim.lr", "objective.time_std"}


def test_a_resume_must_keep_the_optimizer_task_and_source_length(tmp_path):
    from dataclasses import replace

    from elflow.train.resume import check_resumable

    saved = preset("de-en-tiny")
    check_resumable(saved, saved, tmp_path)  # the same run
    changes = {
        "optim.optimizer=muon, now adamw": replace(
            saved, optim=replace(saved.optim, optimizer="adamw")
        ),
        "max_input_length=": replace(saved, max_input_length=saved.max_input_length // 2),
    }
    for message, cfg in changes.items():
        with pytest.raises(ELFError, match=message):
            check_resumable(cfg, saved, tmp_path)
    # Unconditional runs once saved an unused max_input_length: they still resume.
    old = replace(preset("bible-tiny"), max_input_length=16)
    check_resumable(preset("bible-tiny"), old, tmp_path)


def test_own_data_with_the_presets_validation_split_is_noted(capsys, monkeypatch):
    from elflow import errors

    monkeypatch.setattr(errors, "_NOTED", set())
    apply_overrides(preset("bible-tiny"), None, ["data.path=my.jsonl"])
    assert "data.valid_path is still the preset's" in capsys.readouterr().err
    for sets in (["data.path=my.jsonl", "data.valid_path=v.jsonl"], ["data.valid_path=v.jsonl"]):
        apply_overrides(preset("bible-tiny"), None, sets)
    apply_overrides(preset("bible-tiny"), None, ["data.path=my.jsonl", "data.valid_path="])
    assert capsys.readouterr().err == ""
