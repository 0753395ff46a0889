"""`elflow distill --method`: the method registry, consistency distillation through the trainer,
and its students as ordinary models (sampled, loaded, saved with their sampler)."""

from __future__ import annotations

import json
from dataclasses import dataclass, replace

import pytest

from elflow import load_model
from elflow.__main__ import main
from elflow.distill.methods import (
    DISTILL_METHODS,
    PD,
    DistillMethod,
    Stage,
    distill_method,
    method_settings,
    register_distill_method,
)
from elflow.errors import ELFError
from tests.train_helpers import error_lines, run_config, weights

pytestmark = pytest.mark.e2e  # whole distillation runs through the command line


def _cd(tmp_path, out, assets, teacher, *extra: str, max_steps: int = 2) -> int:
    cfg = run_config(assets, train={"max_steps": max_steps, "ema_decay": 0.1})
    path = tmp_path / f"cd-{out.name}.json"
    path.write_text(json.dumps(cfg))
    argv = ["distill", "--model", str(teacher), "--out", str(out), "--config", str(path)]
    return main([*argv, "--method", "cd", *extra])


def test_consistency_students_are_ordinary_models(tmp_path, assets, teacher, capsys):
    out = tmp_path / "cd"
    sets = ["--method-set", "teacher_substeps=2", "--method-set", "spans=0.5,1"]
    assert _cd(tmp_path, out, assets, teacher, *sets, "--method-set", "steps=2") == 0
    folder = out / "round-1-cd"
    record = json.loads((folder / "round.json").read_text())
    assert record["method"] == "cd" and record["spans"] == [0.5, 1.0]
    start = json.loads((folder / "start.json").read_text())
    assert start["settings"]["teacher_substeps"] == 2
    lines = [json.loads(x) for x in (folder / "metrics.jsonl").read_text().splitlines()]
    assert all(x["loss"] > 0 for x in lines if "loss" in x)
    # The student carries its sampler: re-noising steps on a uniform grid, the teacher's w.
    model, config = load_model(folder)
    _, tconfig = load_model(teacher)
    s = config.sampler
    assert (s.sampler, s.steps, s.time_grid, s.w) == ("renoise", 2, "uniform", tconfig.sampler.w)
    # `elflow sample` takes it as any model, and save_pretrained keeps the sampler.
    samples = tmp_path / "s.jsonl"
    assert main(["sample", "--model", str(folder), "-n", "2", "--out", str(samples)]) == 0
    assert len(samples.read_text().splitlines()) == 2
    model.save_pretrained(tmp_path / "saved", config)
    assert load_model(tmp_path / "saved")[1].sampler.sampler == "renoise"
    # Continued only with the settings it was trained with.
    capsys.readouterr()
    assert _cd(tmp_path, out, assets, teacher, "--method-set", "steps=2", max_steps=3) == 2
    (line,) = error_lines(capsys.readouterr().err)
    assert "was distilled with --method cd" in line and "teacher_substeps" in line
    assert not (folder / "checkpoint-3").exists()
    assert _cd(tmp_path, out, assets, teacher, *sets, "--method-set", "steps=2", max_steps=3) == 0
    assert (folder / "checkpoint-3").is_dir()


def test_method_errors_are_one_line(tmp_path, assets, teacher, capsys):
    never = tmp_path / "never-loaded"
    assert _cd(tmp_path, tmp_path / "a", assets, never, "--rounds", "2/2") == 2
    assert _cd(tmp_path, tmp_path / "b", assets, never, "--method-set", "span=1") == 2
    assert _cd(tmp_path, tmp_path / "c", assets, never, "--method-set", "spans=2") == 2
    assert _cd(tmp_path, tmp_path / "d", assets, never, "--teacher-project-from", "0.3") == 2
    assert _cd(tmp_path, tmp_path / "e", assets, never, "--method", "nope") == 2
    assert _cd(tmp_path, tmp_path / "f", assets, never, "--method-set", "steps") == 2
    errs = error_lines(capsys.readouterr().err)
    assert len(errs) == 6
    assert "--rounds and --teacher-steps are progressive distillation's" in errs[0]
    assert "unknown setting(s) span for method cd" in errs[1] and "spans (" in errs[1]
    assert "spans= must be numbers in (0, 1]" in errs[2]
    assert "--method cd does not distil a projected teacher" in errs[3]
    assert "unknown distillation --method 'nope'; choose one of cd, pd" in errs[4]
    assert "--method-set takes KEY=VALUE" in errs[5]
    assert not any((tmp_path / n).exists() for n in "abcdef")


def test_pd_through_the_registry_and_a_third_method_is_one_registration(tmp_path, assets, teacher):
    assert distill_method("pd") is PD and method_settings(PD, {"rounds": "2/2"}).rounds == "2/2"
    with pytest.raises(ELFError, match="already registered"):
        register_distill_method(PD)

    @dataclass(frozen=True)
    class Once:
        steps: int = 2
        """The student's steps."""

    def stages(settings, objective, project_from):
        (pd,) = PD.stages(replace(PD.settings(), rounds="2/2", teacher_steps=4), objective, 1.0)
        return [Stage("once", settings.steps, pd.spec, {"student_steps": settings.steps})]

    register_distill_method(DistillMethod("once", "PD's round", Once, stages, PD.loss, PD.sampler))
    try:
        out = tmp_path / "once"
        assert _cd(tmp_path, out, assets, teacher, "--method", "once") == 0
        _, config = load_model(out / "round-1-once")
        assert config.sampler.steps == 2 and config.sampler.sampler == "sde"
        assert weights(out / "round-1-once" / "checkpoint-2")  # trained as a PD round
    finally:
        DISTILL_METHODS.pop("once")
