"""`elflow distill`: rounds through the trainer, initialisation chain, frozen teacher, resume."""

from __future__ import annotations

import json
import shutil
from dataclasses import replace
from pathlib import Path

import pytest

from elflow import load_model
from elflow.__main__ import main
from elflow.errors import ELFError
from tests.dist.launch import run_elflow
from tests.train_helpers import (
    assert_same,
    distill_cli,
    error_lines,
    run_config,
    weights,
)

pytestmark = pytest.mark.e2e  # whole distillation runs through the command line


def test_rounds_chain_and_teacher_is_frozen(tmp_path, assets, teacher):
    before = (teacher / "ema.safetensors").read_bytes()
    out = tmp_path / "pd"
    # One step per round at lr 0 (first warm-up step): each round's weights equal its init.
    lr0 = {"warmup_steps": 1000}
    assert distill_cli(tmp_path, out, assets, teacher, "2/2,1/4", max_steps=1, optim=lr0) == 0
    r1, r2 = out / "round-1-2x2" / "checkpoint-1", out / "round-2-1x4" / "checkpoint-1"
    assert_same(weights(r1), weights(teacher, "ema.safetensors"))  # round 1 starts at the teacher
    assert_same(weights(r2), weights(r1, "ema.safetensors"))  # round 2 at round 1's EMA
    assert (teacher / "ema.safetensors").read_bytes() == before
    record = json.loads((out / "round-2-1x4" / "round.json").read_text())
    assert record["student_steps"] == 1 and len(record["teacher_sha256"]) == 64
    _, config = load_model(out / "round-2-1x4")
    assert (config.sampler.steps, config.sampler.sampler, config.sampler.w) == (1, "sde", 2.5)
    assert config.sampler.project_from == 0.3  # the teacher's (the bible-tiny preset's)


def test_distillation_learns_and_resumes_mid_round_bitwise(tmp_path, assets, teacher):
    assert distill_cli(tmp_path, tmp_path / "full", assets, teacher, "2/2", max_steps=4) == 0
    assert distill_cli(tmp_path, tmp_path / "part", assets, teacher, "2/2", max_steps=2) == 0
    assert distill_cli(tmp_path, tmp_path / "part", assets, teacher, "2/2", max_steps=4) == 0
    for name in ("model.safetensors", "ema.safetensors"):
        assert_same(
            weights(tmp_path / "full" / "round-1-2x2" / "checkpoint-4", name),
            weights(tmp_path / "part" / "round-1-2x2" / "checkpoint-4", name),
        )
    lines = (tmp_path / "full" / "round-1-2x2" / "metrics.jsonl").read_text().splitlines()
    assert all(json.loads(x)["loss"] > 0 for x in lines)
    # Running a finished curriculum again does nothing.
    assert distill_cli(tmp_path, tmp_path / "full", assets, teacher, "2/2", max_steps=4) == 0


def test_a_round_built_on_other_weights_is_not_continued(tmp_path, assets, teacher, capsys):
    out = tmp_path / "pd"
    assert distill_cli(tmp_path, out, assets, teacher, "2/2,1/4") == 0  # 2 steps a round
    assert (out / "round-2-1x4" / "start.json").is_file()
    # Another first round would change what round 2 (already trained) started from: refused
    # before anything trains.
    capsys.readouterr()
    assert distill_cli(tmp_path, out, assets, teacher, "4/1,1/4") == 2
    (line,) = error_lines(capsys.readouterr().err)
    assert "round 1 still has to train" in line and "round-2-1x4" in line
    assert not (out / "round-1-4x1").exists()
    # So would a longer first round; the same rounds again are fine.
    assert distill_cli(tmp_path, out, assets, teacher, "2/2,1/4") == 0
    assert distill_cli(tmp_path, out, assets, teacher, "2/2,1/4", max_steps=3) == 2
    assert "round 1 still has to train" in capsys.readouterr().err
    assert not (out / "round-1-2x2" / "checkpoint-3").exists()  # round 1 kept as it was
    # A round whose record names other starting weights (trained by an earlier version after
    # its predecessor changed) is not continued either.
    record = json.loads((out / "round-2-1x4" / "start.json").read_text())
    (out / "round-2-1x4" / "start.json").write_text(json.dumps({**record, "init_sha256": "0"}))
    assert distill_cli(tmp_path, out, assets, teacher, "2/2,1/4") == 2
    (line,) = error_lines(capsys.readouterr().err)
    assert "round 2" in line and "was started from other weights" in line


def test_rounds_share_one_latent_cache(tmp_path, assets, teacher, capsys):
    cfg = run_config(
        assets,
        train={"max_steps": 1, "ema_decay": 0.1},
        # "run": the folder train() is given, which distillation shares between its rounds.
        data={"latent_cache": True, "latent_cache_dtype": "float32", "latent_cache_dir": "run"},
    )
    path = tmp_path / "c.json"
    path.write_text(json.dumps(cfg))
    out = tmp_path / "pd"
    argv = ["distill", "--teacher", str(teacher), "--out", str(out), "--config", str(path)]
    capsys.readouterr()
    assert main([*argv, "--rounds", "2/2,1/4", "--teacher-steps", "4"]) == 0
    printed = capsys.readouterr().out
    assert printed.count("latent cache of") == 1 and printed.count("latent cache loaded") == 1
    assert (out / "latent-cache.safetensors").is_file()
    assert not list(out.glob("round-*/latent-cache.safetensors"))


def test_student_settings_the_teacher_fixes_are_checked(
    tmp_path,
    assets,
    teacher,
    capsys,
    monkeypatch,
):
    capsys.readouterr()
    argv = ("--set", "model.depth=4")  # the teacher's depth is 2: it would be silently replaced
    assert distill_cli(tmp_path, tmp_path / "a", assets, teacher, "2/2", *argv) == 2
    (line,) = error_lines(capsys.readouterr().err)
    assert "model.depth=4 is set" in line and "model.depth=2" in line
    # The teacher's own settings, however spelt, are fine: a relative encoder folder, and
    # latent_std 0 ("measure it", the preset's value).
    monkeypatch.chdir(assets)
    same = ("--set", "encoder.name=encoder", "--set", "encoder.latent_std=0")
    assert distill_cli(tmp_path, tmp_path / "c", assets, teacher, "2/2", *same) == 0
    # A teacher whose recorded vocabulary is not the tokenizer found here.
    other = tmp_path / "teacher"
    shutil.copytree(teacher, other)
    config = json.loads((other / "config.json").read_text())
    config["tokenizer_hash"] = "0" * 64
    (other / "config.json").write_text(json.dumps(config))
    (other / "manifest.json").unlink()  # an edit on purpose, not damage
    assert distill_cli(tmp_path, tmp_path / "b", assets, other, "2/2") == 2
    assert "another vocabulary" in error_lines(capsys.readouterr().err)[0]


def test_bad_rounds_and_teacher(tmp_path, assets, teacher, capsys):
    assert distill_cli(tmp_path, tmp_path / "a", assets, teacher, "3/3") == 2
    assert distill_cli(tmp_path, tmp_path / "b", assets, tmp_path / "no-teacher", "2/2") == 2
    assert distill_cli(tmp_path, tmp_path / "c", assets, teacher, "2/2", ema_decay=0.9) == 2
    errs = error_lines(capsys.readouterr().err)
    assert len(errs) == 3 and "does not exist" in errs[1]
    assert "train.ema_decay=0.9 would keep 81%" in errs[2] and "ema_warmup=true" in errs[2]
    assert not (tmp_path / "c").exists()


def test_projected_teacher_rounds_are_recorded_and_kept(tmp_path, assets, teacher, capsys):
    out, flag = tmp_path / "pd", "--teacher-project-from"
    assert distill_cli(tmp_path, out, assets, teacher, "2/2", flag, "0") == 0
    assert distill_cli(tmp_path, tmp_path / "plain", assets, teacher, "2/2") == 0
    round_dir = out / "round-1-2x2"
    assert json.loads((round_dir / "round.json").read_text())["teacher_project_from"] == 0.0
    assert json.loads((round_dir / "start.json").read_text())["teacher_project_from"] == 0.0
    plain = tmp_path / "plain" / "round-1-2x2"
    assert json.loads((plain / "round.json").read_text())["teacher_project_from"] == 1.0
    # The projected targets (every teacher x_hat here) train another student.
    a, b = weights(round_dir / "checkpoint-2"), weights(plain / "checkpoint-2")
    assert any(not a[k].equal(b[k]) for k in a)
    # A round is continued only with the value it was distilled with.
    capsys.readouterr()
    assert distill_cli(tmp_path, out, assets, teacher, "2/2", max_steps=3) == 2
    (line,) = error_lines(capsys.readouterr().err)
    assert "distilled with --teacher-project-from 0.0, not 1.0" in line
    assert not (round_dir / "checkpoint-3").exists()
    assert distill_cli(tmp_path, out, assets, teacher, "2/2", flag, "0", max_steps=3) == 0
    _, config = load_model(round_dir)
    assert config.sampler.project_from == 0.0  # the students sample from T on at the latest
    # A round recorded before the setting existed counts as unprojected.
    record = json.loads((plain / "start.json").read_text())
    del record["teacher_project_from"]
    (plain / "start.json").write_text(json.dumps(record))
    assert distill_cli(tmp_path, tmp_path / "plain", assets, teacher, "2/2", max_steps=3) == 0
    # Bad values, and packed rows (several texts a row), are refused before anything trains.
    assert distill_cli(tmp_path, tmp_path / "x", assets, teacher, "2/2", flag, "1.5") == 2
    packed = ("--set", "data.packing=true")
    assert distill_cli(tmp_path, tmp_path / "y", assets, teacher, "2/2", flag, "0.5", *packed) == 2
    errs = error_lines(capsys.readouterr().err)
    assert "must be a number in [0, 1]" in errs[0] and "data.packing is on" in errs[1]
    assert not (tmp_path / "x").exists() and not (tmp_path / "y").exists()


def test_projected_teacher_has_one_text_a_row(tmp_path, assets, teacher, capsys, monkeypatch):
    import elflow.distill.curriculum as distill_train

    # A student trained on packed rows records it, and samples without projection.
    packed = ("--set", "data.packing=true")
    assert distill_cli(tmp_path, tmp_path / "packed", assets, teacher, "2/2", *packed) == 0
    _, config = load_model(tmp_path / "packed" / "round-1-2x2")
    assert config.packed and config.sampler.project_from == 1.0
    # A conditional or packed teacher cannot be projected.
    real = distill_train.load_model
    changes = {}

    def changed(source, device, task):
        model, config = real(source, device=device, task=task)
        return model, replace(config, **changes)

    monkeypatch.setattr(distill_train, "load_model", changed)
    flag = "--teacher-project-from"
    for change, why in (
        ({"task": "conditional", "max_input_length": 4}, "is conditional: drop the setting"),
        ({"packed": True}, "is trained on packed rows: drop the setting"),
    ):
        changes.clear()
        changes.update(change)
        assert distill_cli(tmp_path, tmp_path / "pd", assets, teacher, "2/2", flag, "0.3") == 2
        (line,) = error_lines(capsys.readouterr().err)
        assert "needs an unconditional teacher with one text per row" in line and why in line


def test_teacher_task(tmp_path, assets, teacher, capsys, monkeypatch):
    """--task names an authors' teacher's paper task; an elflow teacher's config gives its own."""
    import elflow.distill.curriculum as distill_train

    assert distill_cli(tmp_path, tmp_path / "a", assets, teacher, "2/2", "--task", "owt") == 2
    assert "applies to authors' checkpoints" in error_lines(capsys.readouterr().err)[0]
    asked = []

    def fake_load_model(source, device, task):
        asked.append(task)
        raise ELFError("stop here")

    monkeypatch.setattr(distill_train, "load_model", fake_load_model)
    assert distill_cli(tmp_path, tmp_path / "b", assets, teacher, "2/2", "--task", "de-en") == 2
    assert distill_cli(tmp_path, tmp_path / "c", assets, teacher, "2/2") == 2
    assert asked == ["de-en", None]


def test_another_teacher_is_refused(tmp_path, assets, teacher, capsys):
    from safetensors.torch import save_file

    other = tmp_path / "other-teacher"
    shutil.copytree(teacher, other)
    ema = weights(other, "ema.safetensors")
    save_file({k: v + 0.01 for k, v in ema.items()}, str(other / "ema.safetensors"))
    (other / "manifest.json").unlink()  # another model, not a damaged copy
    out = tmp_path / "pd"
    assert distill_cli(tmp_path, out, assets, teacher, "2/2", max_steps=1) == 0
    record = json.loads((out / "teacher.json").read_text())
    assert record["teacher"] == str(teacher.resolve()) and len(record["teacher_sha256"]) == 64
    assert record["checkpoint"] == str(teacher)
    saved = (out / "round-1-2x2" / "checkpoint-1" / "model.safetensors").read_bytes()
    capsys.readouterr()
    assert distill_cli(tmp_path, out, assets, other, "2/2", max_steps=1) == 2
    err = error_lines(capsys.readouterr().err)
    assert len(err) == 1 and f"distilled from teacher {teacher} (weights sha256" in err[0]
    assert f"not {other} (" in err[0]  # the checkpoints themselves, not the names typed
    assert "--model (teacher)" in err[0] and "new --out" in err[0]
    # A folder distilled before teacher.json existed: its rounds' round.json name the teacher.
    (out / "teacher.json").unlink()
    assert distill_cli(tmp_path, out, assets, other, "2/2", max_steps=2) == 2
    assert "distilled from teacher" in error_lines(capsys.readouterr().err)[0]
    assert (out / "round-1-2x2" / "checkpoint-1" / "model.safetensors").read_bytes() == saved
    assert not (out / "round-1-2x2" / "checkpoint-2").exists()
    # The same teacher continues: the finished round is skipped, a longer one resumes.
    assert distill_cli(tmp_path, out, assets, teacher, "2/2", max_steps=1) == 0
    assert distill_cli(tmp_path, out, assets, teacher, "2/2", max_steps=2) == 0
    assert (out / "round-1-2x2" / "checkpoint-2").is_dir()


def test_round_errors_name_the_flags(tmp_path, assets, capsys):
    teacher = tmp_path / "never-loaded"
    assert (
        distill_cli(tmp_path, tmp_path / "a", assets, teacher, "2/2", "--teacher-steps", "-4") == 2
    )
    assert distill_cli(tmp_path, tmp_path / "b", assets, teacher, "1/2") == 2
    assert distill_cli(tmp_path, tmp_path / "c", assets, teacher, "0/4") == 2
    errs = error_lines(capsys.readouterr().err)
    assert len(errs) == 3 and "--teacher-steps must be a positive integer" in errs[0]
    assert "--teacher-steps is 4" in errs[1] and "pass --teacher-steps 0" in errs[1]
    assert "None" not in errs[1] and "bad round '0/4' in --rounds" in errs[2]
    assert not any((tmp_path / name).exists() for name in "abc")


def test_student_keeps_the_teachers_encoder_layer(tmp_path, assets):
    cfg = tmp_path / "t.json"
    cfg.write_text(json.dumps(run_config(assets, train={"max_steps": 2}, encoder={"layer": 1})))
    run = tmp_path / "teacher"
    assert main(["train", "--preset", "bible-tiny", "--out", str(run), "--config", str(cfg)]) == 0
    assert load_model(run)[1].encoder_layer == 1
    assert distill_cli(tmp_path, tmp_path / "pd", assets, run, "2/2", max_steps=1) == 0
    student = tmp_path / "pd" / "round-1-2x2"
    _, config = load_model(student)
    assert config.encoder_layer == 1
    saved = json.loads((student / "checkpoint-1" / "config.json").read_text())
    assert saved["run"]["encoder"]["layer"] == 1


def test_objective_settings_override_the_teachers(tmp_path, assets, capsys):
    # A teacher fine-tuned at earlier times: its run config records time_mean -2.0.
    cfg = tmp_path / "t.json"
    cfg.write_text(
        json.dumps(run_config(assets, train={"max_steps": 2}, objective={"time_mean": -2.0}))
    )
    run = tmp_path / "teacher"
    assert main(["train", "--preset", "bible-tiny", "--out", str(run), "--config", str(cfg)]) == 0

    def round_objective(out: Path) -> dict:
        saved = (out / "round-1-2x2" / "checkpoint-1" / "config.json").read_text()
        return json.loads(saved)["run"]["objective"]

    capsys.readouterr()
    assert distill_cli(tmp_path, tmp_path / "a", assets, run, "2/2", max_steps=1) == 0
    assert round_objective(tmp_path / "a")["time_mean"] == -2.0  # the teacher's, by default
    assert "except" not in capsys.readouterr().out
    sets = ["--set", "objective.time_mean=-1.5", "--set", "objective.time_std=0.8"]
    assert distill_cli(tmp_path, tmp_path / "b", assets, run, "2/2", *sets, max_steps=1) == 0
    objective = round_objective(tmp_path / "b")
    assert (objective["time_mean"], objective["time_std"]) == (-1.5, 0.8)
    # Only the setting that differs from the teacher's is reported.
    out = capsys.readouterr().out
    assert "except time_mean -1.5 (teacher -2.0)" in out and "time_std" not in out
    # A round continues only with the objective it was trained with (here: finished, max_steps 1).
    assert distill_cli(tmp_path, tmp_path / "b", assets, run, "2/2", max_steps=1) == 2
    err = error_lines(capsys.readouterr().err)
    assert len(err) == 1 and "was trained with objective time_mean=-1.5" in err[0]
    # The teacher's input conventions cannot be overridden.
    bad = ["--set", "objective.noise_scale=1.0"]
    assert distill_cli(tmp_path, tmp_path / "c", assets, run, "2/2", *bad, max_steps=1) == 2
    err = error_lines(capsys.readouterr().err)
    assert len(err) == 1 and "objective.noise_scale=1.0 differs from the teacher's" in err[0]
    assert not (tmp_path / "c").exists()


@pytest.mark.dist
def test_two_processes_distil_as_one(tmp_path, assets, teacher):
    # Two examples per process: a process's share of a step often has no decoder row, and
    # DDP must still reduce the same gradients on both (it deadlocked or crashed before).
    assert distill_cli(tmp_path, tmp_path / "one", assets, teacher, "2/2", global_batch=4) == 0
    cfg = run_config(assets, train={"max_steps": 2, "ema_decay": 0.1, "global_batch": 4})
    path = tmp_path / "two.json"
    path.write_text(json.dumps(cfg))
    argv = ["distill", "--teacher", str(teacher), "--out", str(tmp_path / "two")]
    run_elflow([*argv, "--config", str(path), "--rounds", "2/2", "--teacher-steps", "4"])
    for name in ("model.safetensors", "ema.safetensors"):
        assert_same(
            weights(tmp_path / "one" / "round-1-2x2" / "checkpoint-2", name),
            weights(tmp_path / "two" / "round-1-2x2" / "checkpoint-2", name),
            atol=1e-5,
        )
