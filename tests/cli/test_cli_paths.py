"""The CLI's checks on what it reads and writes: one line, before any work, nothing lost."""

from __future__ import annotations

import csv
import json
import shutil

import pytest

from elflow.__main__ import main
from elflow.errors import ELFError
from tests.builders import make_uncond


@pytest.fixture
def model(tmp_path):
    return make_uncond(tmp_path / "model")


def run_cli(capsys, *argv: str) -> tuple[int, str]:
    """Exit code and the one ``elflow: error:`` line (empty when the command succeeded)."""
    capsys.readouterr()
    code = main([str(a) for a in argv])
    errs = [x for x in capsys.readouterr().err.splitlines() if x.startswith("elflow: error:")]
    assert len(errs) <= 1, errs
    return code, errs[0] if errs else ""


def test_sample_keeps_an_existing_out_unless_overwrite(tmp_path, model, capsys):
    out = tmp_path / "s.jsonl"
    out.write_text("earlier results\n")
    argv = ("sample", "--model", model, "--num-samples", "2", "--steps", "2", "--out", out)
    code, err = run_cli(capsys, *argv)
    assert code == 2 and "already exists; pass --overwrite" in err
    assert out.read_text() == "earlier results\n"
    assert run_cli(capsys, *argv, "--overwrite")[0] == 0
    assert len(out.read_text().splitlines()) == 2
    # The trajectory page follows the same rule, and never takes --out's own file.
    page = tmp_path / "earlier.html"
    page.write_text("kept")
    code, err = run_cli(capsys, *argv, "--overwrite", "--trajectory", out)
    assert code == 2 and "--trajectory and --out name the same file" in err
    code, err = run_cli(
        capsys, *[a for a in argv if a != out], tmp_path / "n.jsonl", "--trajectory", page
    )
    assert code == 2 and "--trajectory" in err and "already exists" in err
    assert page.read_text() == "kept" and len(out.read_text().splitlines()) == 2


@pytest.mark.parametrize("flag", ["--out", "--trajectory"])
def test_sample_refuses_a_folder_as_output_before_sampling(tmp_path, model, capsys, flag):
    folder = tmp_path / "adir"
    folder.mkdir()
    paths = {"--out": tmp_path / "s.jsonl", "--trajectory": tmp_path / "t.html", flag: folder}
    argv = ["sample", "--model", model, "--num-samples", "2", "--steps", "2"]
    code, err = run_cli(capsys, *argv, *[x for kv in paths.items() for x in kv])
    assert code == 2 and err.endswith(f"{flag} {folder} is a folder; give a file name")
    assert not (tmp_path / "s.jsonl").exists() and list(folder.iterdir()) == []


def test_sample_refuses_an_unwritable_place(tmp_path, model, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    code, err = run_cli(capsys, "sample", "--model", model, "--out", blocker / "sub" / "s.jsonl")
    assert code == 2 and f"{blocker} is a file, not a folder" in err


@pytest.mark.parametrize(
    ("args", "match"),
    [
        (["--time-mean", "nan"], "--time-mean must be a finite number"),
        (["--w", "inf"], "--w must be a finite number"),
        (["--gamma", "inf"], "--gamma must be a finite number"),
        (["--time-std", "0"], "--time-std must be positive"),
        (["--length", "-1"], "--length must be >= 0 (0 = the model's), got -1"),
        (["--device", "foo"], "--device is 'foo'; use auto, cpu, cuda or cuda:K"),
        (["--device", "cudaa"], "--device is 'cudaa'; use auto"),
        (["--out", "-"], "--out - : leave --out out to print the texts"),
        (["--device", "cuda:x"], "--device is 'cuda:x'"),
    ],
)
def test_sample_refuses_bad_values(tmp_path, model, capsys, args, match):
    out = tmp_path / "s.jsonl"
    code, err = run_cli(capsys, "sample", "--model", model, "--out", out, *args)
    assert code == 2 and match in err
    assert not out.exists()


def test_sources_that_are_not_utf8_or_a_folder(tmp_path, model, capsys):
    bad = tmp_path / "src.jsonl"
    bad.write_bytes(b'{"text": "caf\xe9"}\n')
    argv = ("sample", "--model", model, "--out", tmp_path / "s.jsonl", "--sources")
    assert "src.jsonl:1: invalid UTF-8 (byte 0xe9 at column 14)" in run_cli(capsys, *argv, bad)[1]
    assert "is a folder; give a file" in run_cli(capsys, *argv, tmp_path)[1]


def test_config_file_that_is_not_utf8_or_a_folder(tmp_path, capsys):
    bad = tmp_path / "c.yaml"
    bad.write_bytes(b"optim:\n  lr: \xff\n")
    argv = ("train", "--preset", "bible-tiny", "--out", tmp_path / "run", "--config")
    assert "is not UTF-8 text" in run_cli(capsys, *argv, bad)[1]
    assert "is a folder; give a YAML or JSON file" in run_cli(capsys, *argv, tmp_path)[1]
    assert not (tmp_path / "run").exists()


def _samples(path):
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in ["a b c", "d e"]))
    return path


def test_score_checks_before_scoring(tmp_path, capsys):
    samples = _samples(tmp_path / "s.jsonl")
    out = tmp_path / "m.json"
    out.write_text("{}\n")
    base = ("score", "--samples", samples, "--judge", "none", "--out")
    code, err = run_cli(capsys, *base, out)
    assert code == 2 and "already exists; pass --overwrite" in err and out.read_text() == "{}\n"
    assert run_cli(capsys, *base, out, "--overwrite")[0] == 0
    assert json.loads(out.read_text())["num_samples"] == 2
    assert (
        "--bootstrap must be >= 0"
        in run_cli(capsys, *base, tmp_path / "b.json", "--bootstrap", "-1")[1]
    )
    assert (
        "--batch-size must be >= 1"
        in run_cli(capsys, *base, tmp_path / "b.json", "--batch-size", "0")[1]
    )
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    code, err = run_cli(
        capsys, "score", "--samples", empty, "--judge", "none", "--out", tmp_path / "e.json"
    )
    assert code == 2 and "holds no samples" in err
    code, err = run_cli(
        capsys, "score", "--samples", tmp_path, "--judge", "none", "--out", tmp_path / "d.json"
    )
    assert code == 2 and "is a folder; give a JSONL file" in err


@pytest.mark.e2e
def test_sweep_keeps_an_earlier_sweep_unless_overwrite(tmp_path, model, capsys):
    out = tmp_path / "sweep"
    argv = ["sweep", "--model", model, "--out", out, "--num-samples", "2", "--judge", "none"]
    assert run_cli(capsys, *argv, "--sampler", "ode", "--steps", "2,3")[0] == 0
    first = sorted(p.name for p in (out / "samples").iterdir())
    assert len(first) == 2
    code, err = run_cli(capsys, *argv, "--sampler", "ode", "--steps", "2")
    assert code == 2 and "already holds a sweep" in err
    assert sorted(p.name for p in (out / "samples").iterdir()) == first
    # A bad cell is refused before any cell is sampled, and the earlier sweep is kept.
    code, err = run_cli(capsys, *argv, "--overwrite", "--sampler", "ode", "--w", "1,inf")
    assert code == 2 and "--w must be a finite number" in err
    assert sorted(p.name for p in (out / "samples").iterdir()) == first
    # A judge that cannot load stops the new sweep before the earlier one is removed.
    bad_judge = [a if a != "none" else str(tmp_path / "no-judge") for a in argv]
    assert run_cli(capsys, *bad_judge, "--overwrite", "--sampler", "ode", "--steps", "2")[0] == 2
    assert sorted(p.name for p in (out / "samples").iterdir()) == first
    assert (out / "table.md").is_file()
    assert run_cli(capsys, *argv, "--overwrite", "--sampler", "ode", "--steps", "2")[0] == 0
    assert len(list((out / "samples").iterdir())) == 1  # the old cells are gone with the tables
    assert (
        "--score-batch-size must be >= 1"
        in run_cli(capsys, *argv, "--overwrite", "--score-batch-size", "0")[1]
    )
    # The per-sample checks also run before the earlier sweep is removed.
    kept = sorted(p.name for p in (out / "samples").iterdir())
    for flag, value, message in (
        ("--batch-size", "0", "--batch-size must be >= 1"),
        ("--length", "-1", "--length must be >= 0"),
        ("--length", "1000", "--length 1000 exceeds the model's max_length"),
        ("--num-samples", "0", "--num-samples must be >= 1"),
    ):
        code, err = run_cli(capsys, *argv, "--overwrite", "--steps", "2", flag, value)
        assert code == 2 and message in err
        assert sorted(p.name for p in (out / "samples").iterdir()) == kept
        assert (out / "table.md").is_file()


@pytest.mark.e2e
def test_an_interrupted_sweep_resumes(tmp_path, model, capsys, monkeypatch):
    import elflow.evaluation as evaluation

    out, clean = tmp_path / "sweep", tmp_path / "clean"
    argv = ["sweep", "--model", model, "--num-samples", "2", "--judge", "none"]
    argv += ["--sampler", "ode", "--steps", "2,3", "--bootstrap", "0"]
    assert run_cli(capsys, *argv, "--out", clean)[0] == 0
    real, calls = evaluation.score_samples, {"n": 0}

    def judge_dies_on_the_second_cell(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 2:
            raise MemoryError
        return real(*args, **kwargs)

    monkeypatch.setattr(evaluation, "score_samples", judge_dies_on_the_second_cell)
    code, err = run_cli(capsys, *argv, "--out", out)
    assert code == 2 and "out of memory" in err and "--resume keeps its scored cells" in err
    assert sorted(p.name for p in (out / "metrics").iterdir()) == ["ode-n2-wdefault.json"]
    assert len(list((out / "samples").iterdir())) == 2  # the second cell was sampled
    monkeypatch.setattr(evaluation, "score_samples", real)
    code, err = run_cli(capsys, *argv, "--out", out)
    assert code == 2 and "pass --resume to finish it" in err
    code, err = run_cli(capsys, *argv, "--out", out, "--resume", "--seed", "1")
    assert code == 2 and "was run with --seed 0, now 1" in err
    code, err = run_cli(capsys, *argv, "--out", out, "--resume", "--project-from", "0.5")
    assert code == 2 and "was run with --project-from 1.0, now 0.5" in err
    code, err = run_cli(capsys, *argv, "--out", out, "--resume", "--overwrite")
    assert code == 2 and "give one" in err
    capsys.readouterr()
    assert main([str(a) for a in [*argv, "--out", out, "--resume"]]) == 0
    err = capsys.readouterr().err
    assert "ode-n2-wdefault: done earlier" in err and "(sampled earlier)" in err

    def table(folder):  # all but the seconds column
        with (folder / "table.csv").open() as f:
            return [{k: v for k, v in row.items() if k != "seconds"} for row in csv.DictReader(f)]

    assert table(out) == table(clean) and len(table(out)) == 2
    # A damaged metrics file is scored again from its samples; a grid that drops cells is refused.
    (out / "metrics" / "ode-n3-wdefault.json").write_text("")
    capsys.readouterr()
    assert main([str(a) for a in [*argv, "--out", out, "--resume"]]) == 0
    assert "ode-n3-wdefault: gen_ppl" in capsys.readouterr().err
    fewer = [a if a != "2,3" else "2" for a in argv]
    code, err = run_cli(capsys, *fewer, "--out", out, "--resume")
    assert code == 2 and "also has cells ode-n3-wdefault" in err


def test_a_sweep_records_the_checkpoint_a_run_folder_resolves_to(tmp_path, model):
    import shutil

    from elflow.evaluation import sweep_plan as sweep

    run = tmp_path / "run"
    shutil.copytree(model, run / "checkpoint-1")
    (run / "checkpoint-1" / "state.json").write_text("{}")
    shared = {k: None for k in sweep.RESUME_KEYS} | {"checkpoint": str(run)}
    before = sweep.sweep_settings(shared, [])["checkpoint"]
    shutil.copytree(run / "checkpoint-1", run / "checkpoint-2")  # training went on
    assert before.endswith("checkpoint-1")
    assert sweep.sweep_settings(shared, [])["checkpoint"].endswith("checkpoint-2")


def test_sweep_refuses_a_training_run_folder(tmp_path, model, capsys):
    run = tmp_path / "run"
    (run / "samples").mkdir(parents=True)
    (run / "samples" / "step-2.jsonl").write_text("{}\n")
    (run / "metrics.jsonl").write_text("{}\n")
    argv = ("sweep", "--model", model, "--out", run, "--judge", "none", "--overwrite")
    code, err = run_cli(capsys, *argv)
    assert code == 2 and "is a training run's folder" in err
    assert (run / "samples" / "step-2.jsonl").is_file()


def test_generate_checks_its_options(model, capsys):
    base = ("generate", model, "-n", "2", "--steps", "2")
    assert "--batch-size must be >= 1" in run_cli(capsys, *base, "--batch-size", "0")[1]
    assert "applies to conditional tasks only" in run_cli(capsys, *base, "--cfg", "2")[1]
    assert "--device is 'foo'" in run_cli(capsys, *base, "--device", "foo")[1]
    code, err = run_cli(capsys, "generate", model, "--source", "x")
    assert code == 2 and "unconditional: it takes no sources" in err


def test_demo_checks_html_and_counts_first(tmp_path, model, capsys):
    folder = tmp_path / "adir"
    folder.mkdir()
    base = ("demo", "--model", model, "--no-animate", "--steps", "2", "-n", "1")
    assert "--html" in run_cli(capsys, *base, "--html", folder)[1]
    assert "--num-samples must be >= 1" in run_cli(capsys, "demo", "--model", model, "-n", "0")[1]
    page = tmp_path / "new" / "d.html"
    assert run_cli(capsys, *base, "--html", page)[0] == 0 and page.is_file()


def test_import_never_writes_into_a_used_folder(tmp_path, model, capsys):
    victim = tmp_path / "victim"
    shutil.copytree(model, victim)
    before = {p.name: p.read_bytes() for p in victim.iterdir()}
    code, err = run_cli(capsys, "import", tmp_path / "checkpoint_1", "--out", victim)
    assert code == 2 and "is not an empty folder" in err
    assert {p.name: p.read_bytes() for p in victim.iterdir()} == before


def test_truncated_weights_are_one_line(tmp_path, model, capsys):
    broken = tmp_path / "broken"
    shutil.copytree(model, broken)
    weights = broken / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])
    code, err = run_cli(capsys, "info", broken)
    assert code == 2 and "truncated or corrupt" in err and str(weights) in err


def test_training_checkpoint_without_ema_is_not_sampled_as_ema(tmp_path, model, capsys):
    ckpt = tmp_path / "run" / "checkpoint-2"
    shutil.copytree(model, ckpt)
    (ckpt / "state.json").write_text('{"step": 2}\n')  # a training checkpoint, its EMA lost
    out = tmp_path / "s.jsonl"
    code, err = run_cli(capsys, "sample", "--model", ckpt, "--out", out, "--steps", "2")
    assert code == 2 and "without its ema.safetensors" in err and "--no-ema" in err
    argv = ("sample", "--model", ckpt, "--out", out, "--steps", "2", "--num-samples", "1")
    assert run_cli(capsys, *argv, "--no-ema")[0] == 0
    assert json.loads(out.read_text())["ema"] is False


def test_official_checkpoint_that_is_not_a_torch_file(tmp_path, capsys):
    script = tmp_path / "checkpoint_3"
    script.write_text("#!/bin/sh\necho hi\n")
    code, err = run_cli(capsys, "import", script, "--out", tmp_path / "m")
    assert code == 2 and "weights-only torch checkpoint" in err and "weights_only=False" not in err
    script.write_bytes(b"")
    empty = run_cli(capsys, "import", script, "--out", tmp_path / "m")[1]
    assert "not a torch file, or a truncated one (EOFError: empty?)" in empty
    assert not (tmp_path / "m").exists()


def test_check_fixture_with_bad_metadata(tmp_path, capsys):
    import torch
    from safetensors.torch import save_file

    fixture = tmp_path / "fx.safetensors"
    save_file({"a": torch.zeros(1)}, str(fixture))
    for text, match in [("{bad", "cannot read fixture metadata"), ("{}", "no 'model' section")]:
        fixture.with_suffix(".json").write_text(text)
        code, err = run_cli(capsys, "check-fixture", fixture)
        assert code == 2 and match in err
    fixture.write_bytes(fixture.read_bytes()[:10])
    assert "truncated or corrupt" in run_cli(capsys, "check-fixture", fixture)[1]


def test_unforeseen_os_errors_are_one_line(tmp_path, capsys, monkeypatch):
    from elflow.cli import model_cmd as model_cli

    def boom(args):
        raise IsADirectoryError(21, "Is a directory", str(tmp_path))

    monkeypatch.setattr(model_cli, "run_info", boom)
    code, err = run_cli(capsys, "info", "--model", "x")
    assert code == 2 and err == f"elflow: error: {tmp_path}: Is a directory"


def test_version_is_the_installed_package_version(capsys):
    from importlib.metadata import version

    with pytest.raises(SystemExit) as stop:
        main(["--version"])
    assert stop.value.code == 0
    assert capsys.readouterr().out.strip() == f"elflow {version('elflow')}"


def test_sweep_refuses_an_empty_reference(tmp_path, model, capsys):
    empty = tmp_path / "real.jsonl"
    empty.write_text("\n")
    argv = ["sweep", "--model", model, "--out", tmp_path / "sweep", "--judge", "none"]
    code, err = run_cli(capsys, *argv, "--steps", "2", "--reference", empty)
    assert code == 2 and f"--reference {empty} holds no texts" in err
    assert not (tmp_path / "sweep" / "samples").exists()


def test_score_refuses_empty_references(tmp_path, capsys):
    samples = tmp_path / "s.jsonl"
    samples.write_text('{"id": 0, "text": "a b"}\n')
    refs = tmp_path / "refs.jsonl"
    refs.write_text("\n\n")
    argv = ["score", "--samples", samples, "--out", tmp_path / "m.json", "--judge", "none"]
    code, err = run_cli(capsys, *argv, "--refs", refs)
    assert code == 2 and f"--refs {refs} holds no references" in err
    assert not (tmp_path / "m.json").exists()


# Every output flag alike: checked before any model loads, its missing parent folders made then,
# a path through a file refused in one line (sample --out once failed only after sampling, on its
# internal partial file; likelihood --out after the whole computation).
OUTPUT_FLAGS = {
    "sample --out": ("sample", "--num-samples", "1", "--steps", "2", "--out"),
    "sample --trajectory": ("sample", "--num-samples", "1", "--steps", "2", "--trajectory"),
    "likelihood --out": ("likelihood", "--texts", "TEXTS", "--steps", "2", "--out"),
    "demo --html": ("demo", "--num-samples", "1", "--steps", "2", "--no-animate", "--html"),
}


def _no_loading(monkeypatch, seen: list):
    """load_pipeline records which folders existed when it was called, then stops the command."""
    from elflow.cli import common
    from elflow.cli import demo_cmd as demo
    from elflow.cli import sample_cmd as sample

    def stop(*args, **kwargs):
        seen.append(True)
        raise ELFError("stopped at loading")

    for module in (common, demo, sample):
        monkeypatch.setattr(module, "load_pipeline", stop)


def _argv(name, tmp_path, target):
    texts = _samples(tmp_path / "texts.jsonl")
    return [str(texts) if a == "TEXTS" else a for a in OUTPUT_FLAGS[name]] + [target]


@pytest.mark.parametrize("name", list(OUTPUT_FLAGS))
def test_outputs_make_missing_folders_before_loading(tmp_path, capsys, monkeypatch, name):
    seen = []
    _no_loading(monkeypatch, seen)
    target = tmp_path / "a" / "b" / "out.file"
    code, err = run_cli(capsys, *_argv(name, tmp_path, target), "--model", tmp_path / "m")
    assert code == 2 and err.endswith("stopped at loading") and seen
    assert target.parent.is_dir() and not target.exists()


@pytest.mark.parametrize("name", [*OUTPUT_FLAGS, "score --out", "compare --out"])
def test_an_output_through_a_file_is_one_line_before_loading(tmp_path, capsys, monkeypatch, name):
    seen = []
    _no_loading(monkeypatch, seen)
    blocker = tmp_path / "file"
    blocker.write_text("kept\n")
    target = blocker / "sub" / "out.file"
    if name == "score --out":
        argv = ["score", "--samples", _samples(tmp_path / "s.jsonl"), "--judge", "none", "--out"]
        argv.append(target)
    elif name == "compare --out":
        argv = ["compare", tmp_path / "absent.json", "--out", target]
    else:
        argv = [*_argv(name, tmp_path, target), "--model", tmp_path / "m"]
    code, err = run_cli(capsys, *argv)
    flag = name.split()[1]
    assert code == 2 and err == f"elflow: error: {flag} {target}: {blocker} is a file, not a folder"
    assert not seen and blocker.read_text() == "kept\n"


def test_sample_out_in_a_missing_folder(tmp_path, uncond_model, capsys):
    out = tmp_path / "nodir" / "deeper" / "s.jsonl"
    argv = ("sample", "--model", uncond_model, "-n", "2", "--steps", "2", "--out", out)
    assert run_cli(capsys, *argv) == (0, "")
    assert len(out.read_text().splitlines()) == 2
    assert [p.name for p in out.parent.iterdir()] == ["s.jsonl"]  # no partial files left


def test_likelihood_out_in_a_missing_folder_and_kept_unless_overwrite(
    tmp_path, infill_model, capsys, monkeypatch
):
    texts = _samples(tmp_path / "t.jsonl")
    out = tmp_path / "nodir3" / "l.json"
    argv = ("likelihood", "--model", infill_model, "--texts", texts, "--steps", "2", "--out", out)
    assert run_cli(capsys, *argv) == (0, "")
    assert len(json.loads(out.read_text())["per_text"]) == 2
    out.write_text("earlier\n")
    seen = []
    _no_loading(monkeypatch, seen)
    code, err = run_cli(capsys, *argv)
    assert code == 2 and err.endswith(
        f"--out {out} already exists; pass --overwrite to replace it, or a new name"
    )
    assert not seen and out.read_text() == "earlier\n"
    assert run_cli(capsys, *argv, "--overwrite")[1].endswith("stopped at loading")


def test_demo_replaces_its_own_page_but_no_other_file(tmp_path, uncond_model, capsys):
    mine = tmp_path / "mine.html"
    mine.write_text("<p>my own page</p>\n")
    base = ("demo", "--model", uncond_model, "-n", "1", "--steps", "2", "--no-animate", "--html")
    code, err = run_cli(capsys, *base, mine)
    assert code == 2 and err == (
        f"elflow: error: --html {mine} already exists and is not an elflow trajectory page; pass "
        "--overwrite to replace it, or a new name"
    )
    assert mine.read_text() == "<p>my own page</p>\n"
    page = tmp_path / "elflow-demo.html"
    assert run_cli(capsys, *base, page) == (0, "")
    first = page.read_text()
    assert first.startswith("<!DOCTYPE html>")
    page.write_text(first.replace("sample 0", "an earlier run"))
    assert run_cli(capsys, *base, page) == (0, "")  # run again: its own earlier page is rewritten
    assert page.read_text() == first
    assert run_cli(capsys, *base, mine, "--overwrite") == (0, "")
    assert mine.read_text() == first
