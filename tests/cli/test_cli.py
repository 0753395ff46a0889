"""The command line's shape: fast help, one model flag, sampler flags from the config's
docstrings, help on every flag, and the old spellings still working with one note."""

from __future__ import annotations

import argparse
import dataclasses
import json
import subprocess
import sys

import pytest

from elflow.__main__ import COMMANDS, build_parser, main
from elflow.cli.common import NUM_SAMPLES
from elflow.config import SAMPLERS, SamplerConfig, field_docs


@pytest.fixture(scope="module")
def model(uncond_model):
    return uncond_model


def _subparsers() -> dict[str, argparse.ArgumentParser]:
    parser = build_parser()
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(action.choices)


def test_help_imports_neither_torch_nor_transformers():
    code = (
        "import sys; from elflow.__main__ import build_parser; build_parser(); "
        "print(sorted(m for m in ('torch', 'transformers', 'numpy') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_every_command_and_flag_has_help():
    commands = _subparsers()
    assert set(commands) == set(COMMANDS)
    for name, sub in commands.items():
        assert sub.description, name
        for action in sub._actions:
            if isinstance(action, argparse._HelpAction):
                continue
            assert action.help, f"elflow {name} {action.option_strings or action.dest}: no help"


def test_sampler_flags_are_the_config_fields_with_their_docstrings():
    docs = field_docs(SamplerConfig)
    assert set(docs) == {f.name for f in dataclasses.fields(SamplerConfig)}
    assert docs["gamma"] == "SDE noise re-injection rate (0 gives the ODE)."
    for command in ("sample", "sweep", "demo"):
        flags = {a.dest: a for a in _subparsers()[command]._actions}
        for name, doc in docs.items():
            assert doc in flags[name].help, (command, name)
    sample = {a.dest: a for a in _subparsers()["sample"]._actions}
    assert sample["sampler"].choices is SAMPLERS  # the live registry: a new sampler is a choice
    assert tuple(SAMPLERS) == ("ode", "sde", "heun", "pc", "renoise")
    assert sample["steps"].type is int and sample["gamma"].type is float


def test_every_model_command_takes_model():
    for name in ("sample", "sweep", "demo", "distill", "train", "info", "import", "generate"):
        dests = {a.dest for a in _subparsers()[name]._actions}
        assert "model" in dests, name


def test_sample_prints_n_texts_by_default_and_writes_with_out(model, tmp_path, capsys):
    assert main(["sample", "--model", str(model), "--steps", "2", "--device", "cpu"]) == 0
    printed = capsys.readouterr().out.splitlines()
    assert len(printed) == NUM_SAMPLES
    out = tmp_path / "s.jsonl"
    argv = ["sample", "--model", str(model), "--steps", "2", "--out", str(out), "-n", "3"]
    assert main(argv) == 0
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["text"] for r in records][:NUM_SAMPLES] == printed[:3]  # same seed, same texts


def _notes(err: str) -> list[str]:
    return [line for line in err.splitlines() if line.startswith("elflow: note:")]


def test_old_spellings_run_and_say_so_once(model, tmp_path, capsys):
    capsys.readouterr()
    assert main(["generate", str(model), "-n", "2", "--steps", "2"]) == 0
    captured = capsys.readouterr()
    assert len(captured.out.splitlines()) == 2
    assert _notes(captured.err) == [
        "elflow: note: 'elflow generate MODEL' is now 'elflow sample --model MODEL' (it prints "
        "the texts when --out is not given); the old spelling goes in a later version"
    ]
    out = tmp_path / "old.jsonl"
    argv = ["sample", "--checkpoint", str(model), "-n", "1", "--steps", "2", "--out", str(out)]
    assert main(argv) == 0
    assert [
        "elflow: note: --checkpoint MODEL is now --model MODEL; the old spelling goes in a "
        "later version"
    ] == _notes(capsys.readouterr().err)
    assert main(["info", str(model)]) == 0
    assert json.loads(capsys.readouterr().out)["format"] == "elflow-model"
    # Two spellings naming two models: refused in one line.
    code = main(["sample", "--model", str(model), "--checkpoint", str(tmp_path), "-n", "1"])
    assert code == 2 and "name two models" in capsys.readouterr().err


def test_train_and_distill_take_the_model_flag(model, capsys):
    from elflow.cli.common import model_from_args
    from elflow.cli.train_cmd import init_from_args

    commands = _subparsers()
    args = commands["distill"].parse_args(["--teacher", str(model), "--out", "x"])
    args.command = "distill"
    assert model_from_args(args) == str(model)
    assert "--teacher MODEL is now --model MODEL" in capsys.readouterr().err
    args = commands["train"].parse_args(["--preset", "bible-tiny", "--out", "x", "--init", "m"])
    assert init_from_args(args) == "m"
    assert "--init MODEL is now --model MODEL" in capsys.readouterr().err
    args = commands["train"].parse_args(["--preset", "bible-tiny", "--out", "x", "--model", "m"])
    assert init_from_args(args) == "m"


def test_the_demo_model_is_a_model_source(capsys):
    assert main(["info", "--model", "demo"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["sampler"]["project_from"] == 0.3 and info["parameters"] > 1e6


def test_an_sde_left_at_a_conditional_models_gamma_0_is_refused(capsys, tmp_path):
    from tests.builders import make_cond

    cond = make_cond(tmp_path / "cond")
    argv = ["sample", "--model", str(cond), "--source", "x", "--steps", "2", "--sampler", "sde"]
    assert main(argv) == 2
    assert "default gamma 0 is the ODE; give --gamma" in capsys.readouterr().err
    assert main([*argv, "--gamma", "0"]) == 0  # asked for: the ODE, as given
    assert main([*argv, "--gamma", "1.5"]) == 0


def test_sampler_errors_name_flags(model, capsys):
    argv = ["sample", "--model", str(model), "-n", "1", "--w", "-2"]
    assert main(argv) == 2
    assert "elflow: error: --w must be > -1, got -2.0" in capsys.readouterr().err


def test_a_sweep_checks_each_cell_as_sample_does(model, tmp_path, capsys):
    argv = ["sweep", "--model", str(model), "--out", str(tmp_path / "s"), "--judge", "none"]
    assert main([*argv, "--steps", "2,0"]) == 2
    assert "elflow: error: --steps must be >= 1, got 0" in capsys.readouterr().err
    assert not (tmp_path / "s" / "samples").exists()
