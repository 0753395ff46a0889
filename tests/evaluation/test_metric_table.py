"""A metric is one entry of ``METRICS``: score, the sweep tables and ``elflow score`` follow it;
a sweep row's settings follow the sampler registry."""

from __future__ import annotations

import argparse
import ast
import csv
from pathlib import Path

import pytest

from elflow.cli import score_cmd as score_cli
from elflow.config import SamplerConfig, SamplerSpec, register_sampler, unregister_sampler
from elflow.errors import ELFError
from elflow.evaluation import report_tables as tables
from elflow.evaluation import score_samples
from elflow.evaluation.comparison import compare, load_result
from elflow.evaluation.metric_table import METRICS, Metric
from elflow.evaluation.sweep_grid import row_settings

SRC = Path(__file__).resolve().parents[2] / "src" / "elflow"
SAMPLES = [
    {"id": 0, "seed": 0, "text": "the cat sat"},
    {"id": 1, "seed": 0, "text": "a dog ran far"},
    {"id": 0, "seed": 1, "text": "the cat sat on a mat"},
    {"id": 1, "seed": 1, "text": ""},
]
HAND_LAID = {
    "evaluation/report_tables.py": {
        # table.md's digest and the frontier plot lay these out by hand (gen PPL vs entropy)
        "gen_ppl",
        "entropy",
        "mauve",
        "distinct_2",
        "rep_4",
        "self_bleu",
        "duplicate_share",
        "bleu",
        "rougeL",
    },
    "evaluation/comparison.py": {"gen_ppl", "entropy"},  # matched-entropy gen PPL comparison
    "evaluation/sweep_run.py": {"gen_ppl", "entropy"},  # a cell's progress line
    "cli/demo_cmd.py": {"gen_ppl", "entropy"},  # the demo's one-line verdict
    "evaluation/diversity.py": {"self_bleu", "empty_share", "duplicate_share"},  # diversity()
    "evaluation/scoring.py": {"mauve"},  # the protocol card's MAUVE settings
    "evaluation/__init__.py": {"gen_ppl", "bleu", "bleu_cased"},  # functions of those names
    "evaluation/text_metrics.py": {"rouge1", "rouge2", "rougeL", "rougeLsum"},  # rouge-score's
}
"""Where a metric's name may appear outside the table: output built on particular metrics, and
names that are not the metric (a function, rouge-score's own keys). No list of metrics."""


def _literals(path: Path) -> set[str]:
    """The string constants of ``path`` that are not docstrings."""
    tree = ast.parse(path.read_text())
    docstrings = {
        id(node.body[0].value)
        for node in ast.walk(tree)
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef))
        and node.body
        and isinstance(node.body[0], ast.Expr)
        and isinstance(node.body[0].value, ast.Constant)
    }
    return {
        node.value
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant) and isinstance(node.value, str)
        if id(node) not in docstrings
    }


def test_no_module_but_the_table_lists_the_metrics():
    for path in sorted(SRC.rglob("*.py")):
        rel = path.relative_to(SRC).as_posix()
        if rel == "evaluation/metric_table.py":
            continue
        named = _literals(path) & set(METRICS)
        assert named <= HAND_LAID.get(rel, set()), (rel, named - HAND_LAID.get(rel, set()))


def _words(s, idx, seed):
    return float(sum(len(t.split()) for t in s.texts_of(idx)))


WORDS = Metric("words", "words in all samples", "", _words, table_seeds=True)


def test_a_metric_added_to_the_table_is_scored_tabled_and_offered(monkeypatch, tmp_path, capsys):
    monkeypatch.setitem(METRICS, WORDS.name, WORDS)
    m = score_samples(SAMPLES, judge=None, bootstrap=0)
    assert m["words"] == 13.0 and m["per_seed"]["1"]["words"] == 6.0
    assert m["words_seed_mean"] == pytest.approx(6.5)  # seeds: 7 and 6 words
    assert list(m).index("words") == list(m).index("duplicate_share") + 1  # in table order

    columns = tables.table_columns()
    assert {"words", "words_seed_mean", "words_seed_sd"} <= set(columns)
    tables.write_tables(tmp_path, [tables.table_row("a", {"sampler": "ode"}, m, 1.0)], "paper")
    with (tmp_path / "table.csv").open() as f:
        assert float(next(csv.DictReader(f))["words"]) == 13.0

    parser = argparse.ArgumentParser()
    score_cli.add_arguments(parser)
    assert "words" in parser.format_help()  # --metrics lists it, the epilog explains it
    samples = tmp_path / "s.jsonl"
    samples.write_text('{"text": "one two"}\n{"text": "three"}\n')
    out = tmp_path / "m.json"
    argv = ["--samples", str(samples), "--out", str(out), "--judge", "none"]
    assert score_cli.run(parser.parse_args([*argv, "--metrics", "words,rep_4"])) == 0
    printed = capsys.readouterr().out
    with pytest.raises(ELFError, match="unknown metric 'word' in --metrics; use gen_ppl, "):
        score_cli.run(parser.parse_args([*argv, "--metrics", "word", "--overwrite"]))
    assert printed.startswith("rep_4") and "\nwords" in printed and "self_bleu" not in printed


def test_metrics_choose_what_is_computed(judge):
    m = score_samples(SAMPLES, judge=judge, bootstrap=10, metrics=["entropy"])
    assert "entropy" in m and "entropy_ci" in m and "gen_ppl" not in m and "rep_4" not in m
    no_judge = score_samples(SAMPLES, judge=judge, bootstrap=0, metrics=["empty_share"])
    assert "judge" not in no_judge["protocol"]  # nothing chosen needs the judge: not run
    with pytest.raises(ELFError, match="unknown metric 'ppl' in metrics=; use gen_ppl, "):
        score_samples(SAMPLES, judge=None, metrics=["ppl"])


def test_every_metric_says_what_it_needs_and_which_way_is_better():
    for m in METRICS.values():
        assert m.help and m.line.startswith(m.help)
        assert m.keys[0] == m.name and m.keys[-1] == f"{m.name}_seed_sd"
    with pytest.raises(ValueError, match="needs must be one of"):
        Metric("x", "x", "lower", _words, needs="judges")


def test_row_settings_follow_the_sampler_config_and_registry(monkeypatch, tmp_path):
    # Today's columns, in their order, plus pc_snr (the pc sampler's own setting).
    assert row_settings() == (
        "sampler",
        "steps",
        "nfe",
        "gamma",
        "gamma_schedule",
        "pc_snr",
        "w",
        "project_from",
    )
    fields = list(SamplerConfig.__dataclass_fields__)
    assert all(name in fields for name in row_settings() if name != "nfe")
    # A sampler that owns another field brings its column, and compare can require it.
    register_sampler(SamplerSpec("late", "Late", "x", settings=("time_std",), step=lambda *a: a))
    try:
        assert "time_std" in row_settings() and "time_std" in tables.table_columns()
        row = tables.table_row("a", {"sampler": "late", "time_std": 0.5}, {}, 1.0)
        assert row["time_std"] == 0.5
        tables.write_tables(tmp_path, [row], "paper")
        cells = load_result(tmp_path)
        assert cells[0].settings["time_std"] == "0.5"
        compare([cells], same=["time_std"])
    finally:
        unregister_sampler("late")
    assert "time_std" not in row_settings()
