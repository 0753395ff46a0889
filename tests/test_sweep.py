"""``elflow sweep`` on a tiny model with a tiny random GPT-2 judge built in the test (offline)."""

from __future__ import annotations

import argparse
import csv
import json

import pytest
import torch

from elflow.__main__ import main as elflow_main
from elflow.cli import score as score_cli
from elflow.cli.sweep import parse_grid
from elflow.errors import ELFError
from elflow.evaluation import sweep
from tests.test_sample_cli import MINILM, make_uncond, read

VOCAB = 30522


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_uncond(tmp_path_factory.mktemp("uncond") / "model")


@pytest.fixture(scope="module")
def judge_dir(tmp_path_factory):
    from transformers import AutoTokenizer, GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    folder = tmp_path_factory.mktemp("judge")
    cfg = GPT2Config(vocab_size=VOCAB, n_embd=16, n_layer=1, n_head=2, n_positions=64)
    GPT2LMHeadModel(cfg).save_pretrained(folder)
    tok = AutoTokenizer.from_pretrained(MINILM)
    tok.eos_token = tok.sep_token  # the judge's end-of-text slot
    tok.save_pretrained(folder)
    return folder


def test_grid_gamma_only_for_sde():
    cells = parse_grid("ode,sde", "2,4", "1,2", "0.5,1.5")
    assert len(cells) == 2 * 2 + 2 * 2 * 2
    assert {c.gamma for c in cells if c.sampler == "ode"} == {None}
    assert sweep.Cell("sde", 4, 2.0, 1.5).name == "sde-n4-w2-g1.5"
    assert sweep.Cell("ode", 8, None, None).name == "ode-n8-wdefault"
    with pytest.raises(ELFError, match="unknown sampler"):
        parse_grid("euler", "2", None, None)
    with pytest.raises(ELFError, match="names no sampler"):
        parse_grid(",", "2", None, None)
    with pytest.raises(ELFError, match="comma-separated"):
        parse_grid("ode", "two", None, None)
    assert sweep.Cell("ode", None, None, None).name == "ode-ndefault-wdefault"


def test_grid_cells_have_distinct_names():
    # A value given twice is one cell; values that print alike would share files: refused.
    assert [c.name for c in parse_grid("ode", "4,4", "1,1.0,2", None)] == ["ode-n4-w1", "ode-n4-w2"]
    with pytest.raises(ELFError, match="share the name 'ode-n4-w1'"):
        parse_grid("ode", "4", "1,1.0000001", None)


def test_sweep_writes_grid_tables_plot_and_equals_sample_plus_score(model_dir, judge_dir, tmp_path):
    ref = tmp_path / "ref.jsonl"
    ref.write_text("".join(json.dumps({"text": t}) + "\n" for t in ["the cat sat", "a dog ran"]))
    out = tmp_path / "sweep"
    common = ["--model", str(model_dir), "--num-samples", "3", "--seed", "5"]
    common += ["--device", "cpu", "--batch-size", "2"]
    argv = [*common, "--out", str(out), "--sampler", "ode,sde", "--steps", "2,3", "--w", "2"]
    argv += ["--gamma", "1.5", "--judge", str(judge_dir), "--bootstrap", "20"]
    assert elflow_main(["sweep", *argv, "--reference", str(ref)]) == 0
    names = ["ode-n2-w2", "ode-n3-w2", "sde-n2-w2-g1.5", "sde-n3-w2-g1.5"]
    for name in names:
        assert len(read(out / "samples" / f"{name}.jsonl")) == 3
        assert json.loads((out / "metrics" / f"{name}.json").read_text())["gen_ppl"] > 0
    with (out / "table.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert [r["cell"] for r in rows] == [*names, "reference"]
    assert tuple(rows[0]) == sweep.COLUMNS and rows[0]["gamma"] == "" and rows[2]["gamma"] == "1.5"
    assert rows[2]["nfe"] == "2" and float(rows[2]["seconds"]) >= 0
    assert all(r["project_from"] == "" for r in rows)  # projected sampling is off
    assert "| sde | 3 | 3 | 1.5 | 2.0 | 2" in (out / "table.md").read_text()
    assert (out / "frontier.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    # one cell == a separate `elflow sample` + `elflow score` with the same seed
    single = tmp_path / "single.jsonl"
    cell = ["--sampler", "sde", "--steps", "3", "--w", "2", "--gamma", "1.5"]
    assert elflow_main(["sample", *common, "--out", str(single), *cell]) == 0
    assert read(single) == read(out / "samples" / "sde-n3-w2-g1.5.jsonl")
    parser = argparse.ArgumentParser()
    score_cli.add_arguments(parser)
    metrics_path = tmp_path / "single_metrics.json"
    score_args = ["--samples", str(single), "--out", str(metrics_path), "--judge", str(judge_dir)]
    assert score_cli.run(parser.parse_args([*score_args, "--bootstrap", "20"])) == 0
    swept = json.loads((out / "metrics" / "sde-n3-w2-g1.5.json").read_text())
    assert swept.pop("sweep")["cell"] == "sde-n3-w2-g1.5"
    assert swept == json.loads(metrics_path.read_text())


def test_frontier_without_reference(tmp_path):
    rows = [
        sweep.table_row(
            f"c{i}", {"sampler": s, "steps": 4, "nfe": 4, "w": 1.0}, {"gen_ppl": p, "entropy": e}, 1
        )
        for i, (s, p, e) in enumerate(
            [("ode", 50.0, 4.0), ("ode", 80.0, 4.5), ("sde", float("nan"), 4.2)]
        )
    ]
    path = sweep.plot_frontier(tmp_path / "f.png", rows)
    assert path.read_bytes()[:4] == b"\x89PNG"


def test_tables_show_projected_sampling(tmp_path):
    settings = {"sampler": "sde", "steps": 32, "nfe": 32, "gamma": 1.0, "w": 3.0}
    metrics = {"gen_ppl": 319.2, "gen_ppl_ci": [295.3, 348.9], "entropy": 2.76}
    rows = [
        sweep.table_row("a", {**settings, "project_from": 0.3}, metrics, 4.0),
        sweep.table_row("b", {**settings, "project_from": None}, metrics, 4.0),
    ]
    sweep.write_tables(tmp_path, rows, "p")
    with (tmp_path / "table.csv").open() as f:
        assert [r["project_from"] for r in csv.DictReader(f)] == ["0.3", ""]
    md = (tmp_path / "table.md").read_text().splitlines()
    assert md[0].startswith("| sampler | steps | nfe | gamma | w | project from | gen PPL")
    assert md[1] == "|" + "---|" * 10
    assert md[2].startswith("| sde | 32 | 32 | 1.0 | 3.0 | 0.3 | 319.20 [295.30, 348.90] | 2.760")
    assert md[3].startswith("| sde | 32 | 32 | 1.0 | 3.0 |  | 319.20")
    sweep.write_tables(tmp_path, rows[1:], "p")  # no projected cell: no column
    assert "project from" not in (tmp_path / "table.md").read_text()


def test_conditional_sweep_scores_bleu_against_refs(tmp_path):
    from tests.test_sample_cli import make_cond

    model = make_cond(tmp_path / "cond")
    sources = tmp_path / "src.jsonl"
    pairs = [{"de": "ein werkzeug", "en": "a tool"}, {"de": "eine bibliothek", "en": "a library"}]
    sources.write_text("".join(json.dumps(p) + "\n" for p in pairs))
    out = tmp_path / "sweep"
    argv = ["sweep", "--model", str(model), "--sources", str(sources), "--source-field", "de"]
    argv += ["--out", str(out), "--sampler", "ode", "--steps", "2", "--judge", "none"]
    argv += ["--bootstrap", "0", "--refs", str(sources), "--ref-field", "en"]
    assert elflow_main(argv) == 0
    with (out / "table.csv").open() as f:
        row = next(csv.DictReader(f))
    metrics = json.loads((out / "metrics" / "ode-n2-wdefault.json").read_text())
    assert float(row["bleu"]) == pytest.approx(metrics["bleu"]) and "rougeL" in metrics
    assert "| BLEU | ROUGE-L |" in (out / "table.md").read_text()
    # References that cannot align are refused before the earlier sweep is touched.
    short = tmp_path / "short.jsonl"
    short.write_text(json.dumps(pairs[0]) + "\n")
    refs_at = argv.index("--refs")
    bad = [*argv[: refs_at + 1], str(short), *argv[refs_at + 2 :]]
    assert elflow_main([*bad, "--overwrite"]) == 2
    assert (out / "table.csv").is_file() and (out / "samples" / "ode-n2-wdefault.jsonl").is_file()
    # So is projected sampling, which a conditional model cannot take.
    assert elflow_main([*argv, "--overwrite", "--project-from", "0.3"]) == 2
    assert (out / "table.csv").is_file() and (out / "samples" / "ode-n2-wdefault.jsonl").is_file()
    # A sweep.json written before --refs and project_from were recorded still resumes.
    saved = json.loads((out / "sweep.json").read_text())
    saved.pop("refs"), saved.pop("ref_field"), saved.pop("project_from")
    (out / "sweep.json").write_text(json.dumps(saved))
    # Its cell sampled but not scored, by a version whose records had no project_from.
    sample_file = out / "samples" / "ode-n2-wdefault.jsonl"
    old = [{k: v for k, v in r.items() if k != "project_from"} for r in read(sample_file)]
    sample_file.write_text("".join(json.dumps(r) + "\n" for r in old))
    (out / "metrics" / "ode-n2-wdefault.json").unlink()
    assert elflow_main([*argv[:refs_at], "--resume"]) == 0
    assert json.loads((out / "metrics" / "ode-n2-wdefault.json").read_text())["sweep"]["cell"]
    # The same cell scored by `elflow score` against the same references.
    parser = argparse.ArgumentParser()
    score_cli.add_arguments(parser)
    scored = tmp_path / "m.json"
    score = ["--samples", str(out / "samples" / "ode-n2-wdefault.jsonl"), "--out", str(scored)]
    score += ["--judge", "none", "--bootstrap", "0", "--refs", str(sources), "--ref-field", "en"]
    assert score_cli.run(parser.parse_args(score)) == 0
    assert json.loads(scored.read_text())["bleu"] == metrics["bleu"]
