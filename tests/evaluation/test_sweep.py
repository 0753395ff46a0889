"""``elflow sweep`` on a tiny model with a tiny random GPT-2 judge built in the test (offline)."""

from __future__ import annotations

import argparse
import csv
import json

import pytest
import torch
from matplotlib.container import ErrorbarContainer

from elflow.__main__ import main as elflow_main
from elflow.cli import score_cmd as score_cli
from elflow.cli.sweep_cmd import parse_grid
from elflow.errors import ELFError
from elflow.evaluation import report_tables as tables
from elflow.evaluation import sweep_plan as sweep
from tests.builders import MINILM, read

VOCAB = 30522


@pytest.fixture(scope="module")
def model_dir(uncond_model):
    return uncond_model


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
    cells = parse_grid("ode,sde", {"steps": "2,4", "w": "1,2", "gamma": "0.5,1.5"})
    assert len(cells) == 2 * 2 + 2 * 2 * 2
    assert {c.get("gamma") for c in cells if c.sampler == "ode"} == {None}
    assert sweep.Cell.of("sde", steps=4, w=2.0, gamma=1.5).name == "sde-n4-w2-g1.5"
    assert sweep.Cell.of("ode", steps=8, gamma=1.5).name == "ode-n8-wdefault"  # gamma: SDE only
    with pytest.raises(ELFError, match="unknown sampler"):
        parse_grid("euler", {"steps": "2"})
    with pytest.raises(ELFError, match="names no sampler"):
        parse_grid(",", {"steps": "2"})
    with pytest.raises(ELFError, match="comma-separated"):
        parse_grid("ode", {"steps": "two"})
    assert sweep.Cell.of("ode").name == "ode-ndefault-wdefault"
    assert sweep.Cell.of("sde", w=1.0).settings == {
        "sampler": "sde",
        "steps": None,
        "w": 1.0,
        "gamma": None,
        "gamma_schedule": None,
    }
    assert sweep.Cell.of("sde", w=1.0).name == "sde-ndefault-w1-gdefault"  # as before the axis


def test_grid_cells_have_distinct_names():
    # A value given twice is one cell; values that print alike would share files: refused.
    cells = parse_grid("ode", {"steps": "4,4", "w": "1,1.0,2"})
    assert [c.name for c in cells] == ["ode-n4-w1", "ode-n4-w2"]
    with pytest.raises(ELFError, match="share the name 'ode-n4-w1'"):
        parse_grid("ode", {"steps": "4", "w": "1,1.0000001"})


@pytest.mark.e2e
def test_sweep_writes_grid_tables_plot_and_equals_sample_plus_score(model_dir, judge_dir, tmp_path):
    ref = tmp_path / "ref.jsonl"
    real = ["The Cat sat", "a dog ran", "In the beginning God created the heavens and the earth."]
    ref.write_text("".join(json.dumps({"text": t}) + "\n" for t in real))
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
    assert all(0 <= float(r["mauve"]) <= 1 for r in rows[:4]) and rows[4]["mauve"] == ""
    assert all(r["distinct_2"] != "nan" and r["num_seeds"] == "1" for r in rows)
    md = (out / "table.md").read_text()
    assert "| sde | 3 | 3 | 1.5 | 2.0 | 2" in md and "| MAUVE |" in md
    assert "prepared like the model's training rows" in md and "cut to 12 tokens" in md
    assert "pairs of cells differ in gen PPL beyond their 95% intervals" in md
    assert (out / "frontier.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # The real text as the model's rows hold it: its tokenizer (uncased), cut to the sample
    # length (12 tokens with [CLS] and [SEP]), decoded back.
    prepared = [r["text"] for r in read(out / "reference.jsonl")]
    assert prepared[:2] == ["the cat sat", "a dog ran"]
    assert prepared[2] == "in the beginning god created the heavens and the earth"  # no "."
    reference_metrics = json.loads((out / "metrics" / "reference.json").read_text())
    assert reference_metrics["num_samples"] == 3 and "mauve" not in reference_metrics

    # one cell == a separate `elflow sample` + `elflow score` with the same seed
    single = tmp_path / "single.jsonl"
    cell = ["--sampler", "sde", "--steps", "3", "--w", "2", "--gamma", "1.5"]
    assert elflow_main(["sample", *common, "--out", str(single), *cell]) == 0
    assert read(single) == read(out / "samples" / "sde-n3-w2-g1.5.jsonl")
    parser = argparse.ArgumentParser()
    score_cli.add_arguments(parser)
    metrics_path = tmp_path / "single_metrics.json"
    score_args = ["--samples", str(single), "--out", str(metrics_path), "--judge", str(judge_dir)]
    score_args += ["--reference", str(out / "reference.jsonl")]  # MAUVE against the same text
    assert score_cli.run(parser.parse_args([*score_args, "--bootstrap", "20"])) == 0
    swept = json.loads((out / "metrics" / "sde-n3-w2-g1.5.json").read_text())
    assert swept.pop("sweep")["cell"] == "sde-n3-w2-g1.5"
    assert swept == json.loads(metrics_path.read_text())


def _row(name, sampler, ppl, ci, entropy, entropy_ci=None, **more):
    metrics = {"gen_ppl": ppl, "gen_ppl_ci": ci, "entropy": entropy, **more}
    if entropy_ci is not None:
        metrics["entropy_ci"] = entropy_ci
    settings = {"sampler": sampler, "steps": 4, "nfe": 4, "w": 1.0}
    return tables.table_row(name, settings, metrics, 1.0)


def test_frontier_draws_each_interval_as_error_bars(tmp_path):
    rows = [
        _row("a", "ode", 50.0, [45.0, 58.0], 4.0, [3.9, 4.2]),
        _row("b", "ode", 80.0, [70.0, 81.0], 4.5, [4.4, 4.6]),
        _row("c", "sde", float("nan"), [float("nan")] * 2, 4.2),  # not drawn
    ]
    reference = {"gen_ppl": 30.0, "gen_ppl_ci": [28.0, 33.0], "entropy": 4.8}
    ax = tables.frontier_figure(rows, reference, "caption").axes[0]
    bars = [c for c in ax.containers if isinstance(c, ErrorbarContainer)]
    assert len(bars) == 2  # the ode curve and the real-text star; sde has no finite point
    _, _, (xbars, ybars) = bars[0].lines
    # Sorted by entropy; each bar spans exactly the point's interval.
    assert [tuple(seg[:, 1]) for seg in ybars.get_segments()] == [(45.0, 58.0), (70.0, 81.0)]
    assert [tuple(seg[:, 0]) for seg in xbars.get_segments()] == [(3.9, 4.2), (4.4, 4.6)]
    _, _, (ref_x, ref_y) = bars[1].lines
    assert tuple(ref_y.get_segments()[0][:, 1]) == (28.0, 33.0)
    assert tuple(ref_x.get_segments()[0][:, 0]) == (4.8, 4.8)  # no entropy interval: none drawn
    assert "caption" in ax.get_title()
    path = tables.plot_frontier(tmp_path / "f.png", rows, reference)
    assert path.read_bytes()[:4] == b"\x89PNG"


def test_tables_show_seed_spread_and_whether_cells_separate(tmp_path):
    spread = {"num_samples": 6, "seeds": [0, 1, 2]}
    spread |= {"gen_ppl_seed_mean": 51.0, "gen_ppl_seed_sd": 2.5}
    spread |= {"entropy_seed_mean": 4.01, "entropy_seed_sd": 0.02}
    spread |= {"mauve": 0.5, "mauve_seed_mean": 0.7, "mauve_seed_sd": 0.1}
    rows = [
        _row("a", "sde", 50.0, [45.0, 58.0], 4.0, **spread),
        _row("b", "sde", 60.0, [55.0, 66.0], 4.1, **spread),
    ]
    sweep.write_tables(tmp_path, rows, "p", ["Seeds 0,1,2: a note."])
    md = (tmp_path / "table.md").read_text()
    assert "gen PPL mean ± sd [pooled 95% CI]" in md and "| 51.00 ± 2.50 [45.00, 58.00] |" in md
    assert "| 4.010 ± 0.020 |" in md and "Seeds 0,1,2: a note." in md
    # MAUVE of all samples, then the seeds' (fewer samples each: a different number).
    assert "MAUVE (per seed: mean ± sd)" in md and "| 0.500 (0.700 ± 0.100) |" in md
    assert "depend on how many texts they see" in md
    assert "0 of 1 pairs of cells differ" in md and "too few samples" in md
    with (tmp_path / "table.csv").open() as f:
        got = next(csv.DictReader(f))
    assert got["num_seeds"] == "3" and float(got["gen_ppl_seed_sd"]) == 2.5
    rows[1] = _row("b", "sde", 90.0, [80.0, 99.0], 4.1)  # intervals apart now
    sweep.write_tables(tmp_path, rows, "p")
    md = (tmp_path / "table.md").read_text()
    assert "1 of 1 pairs of cells differ" in md and "too few" not in md


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
    assert md[1] == "|" + "---|" * 14
    assert md[2].startswith("| sde | 32 | 32 | 1.0 | 3.0 | 0.3 | 319.20 [295.30, 348.90] | 2.760")
    assert md[3].startswith("| sde | 32 | 32 | 1.0 | 3.0 |  | 319.20")
    sweep.write_tables(tmp_path, rows[1:], "p")  # no projected cell: no column
    assert "project from" not in (tmp_path / "table.md").read_text()


def test_conditional_sweep_scores_bleu_against_refs(tmp_path):
    from tests.builders import make_cond

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


@pytest.mark.e2e
def test_sweep_over_seeds_equals_sample_seeds_and_resumes_per_seed(
    model_dir, judge_dir, tmp_path, capsys
):
    out, clean = tmp_path / "sweep", tmp_path / "clean"
    argv = ["sweep", "--model", str(model_dir), "-n", "3", "--seeds", "0,1", "--device", "cpu"]
    argv += ["--sampler", "ode", "--steps", "2", "--judge", str(judge_dir), "--bootstrap", "20"]
    assert elflow_main([*argv, "--out", str(clean)]) == 0
    cell = clean / "samples" / "ode-n2-wdefault.jsonl"
    records = read(cell)
    assert [(r["seed"], r["id"]) for r in records] == [(s, i) for s in (0, 1) for i in range(3)]
    single = tmp_path / "single.jsonl"
    sample = ["sample", "--model", str(model_dir), "-n", "3", "--device", "cpu", "--sampler"]
    sample += ["ode", "--steps", "2", "--out", str(single)]
    assert elflow_main([*sample, "--seeds", "0,1"]) == 0
    assert read(single) == records  # a cell is `elflow sample --seeds` by construction
    assert elflow_main([*sample, "--seed", "1", "--overwrite"]) == 0
    assert read(single) == records[3:]  # and each seed is that seed's own run
    metrics = json.loads((clean / "metrics" / "ode-n2-wdefault.json").read_text())
    assert metrics["seeds"] == [0, 1] and set(metrics["per_seed"]) == {"0", "1"}
    assert metrics["num_samples"] == 6 and metrics["per_seed"]["1"]["num_samples"] == 3
    assert json.loads((clean / "sweep.json").read_text())["seeds"] == [0, 1]
    with (clean / "table.csv").open() as f:
        row = next(csv.DictReader(f))
    assert row["num_seeds"] == "2" and float(row["gen_ppl_seed_sd"]) >= 0
    assert "mean ± sd" in (clean / "table.md").read_text()

    # Interrupted after seed 0 of the cell was sampled: a resume samples seed 1 only.
    assert elflow_main([*argv, "--out", str(out)]) == 0
    (out / "metrics" / "ode-n2-wdefault.json").unlink()
    (out / "samples" / "ode-n2-wdefault.jsonl").write_text(
        "".join(json.dumps(r) + "\n" for r in records[:3])
    )
    capsys.readouterr()
    more = [a if a != "0,1" else "0,1,2" for a in argv]
    assert elflow_main([*more, "--out", str(out), "--resume"]) == 2
    assert "was run with --seeds 0,1, now 0,1,2" in capsys.readouterr().err
    assert elflow_main([*argv, "--out", str(out), "--resume"]) == 0
    assert "sampled earlier" in capsys.readouterr().err  # no single time for a mixed cell
    assert read(out / "samples" / "ode-n2-wdefault.jsonl") == records
    resumed = json.loads((out / "metrics" / "ode-n2-wdefault.json").read_text())
    assert resumed["gen_ppl"] == metrics["gen_ppl"] and resumed["per_seed"] == metrics["per_seed"]


def test_the_sampler_zoo_sweeps_and_groups_by_nfe(model_dir, tmp_path):
    out = tmp_path / "zoo"
    argv = ["sweep", "--model", str(model_dir), "--out", str(out), "-n", "2", "--judge", "none"]
    argv += ["--sampler", "sde,heun,pc", "--steps", "2,3", "--gamma-schedule", "constant,cosine"]
    argv += ["--bootstrap", "0", "--device", "cpu"]
    assert elflow_main(argv) == 0
    names = sorted(p.stem for p in (out / "samples").iterdir())
    assert "sde-n2-wdefault-gdefault-scosine" in names and "pc-n3-wdefault" in names
    assert len(names) == 2 * 2 + 2 + 2  # the schedule applies to the SDE only
    with (out / "table.csv").open() as f:
        rows = list(csv.DictReader(f))
    cosine = [r for r in rows if r["gamma_schedule"] == "cosine"]
    assert len(cosine) == 2 and all(r["sampler"] == "sde" for r in cosine)
    assert {r["nfe"] for r in rows if r["sampler"] == "pc"} == {"3", "5"}
    table = (out / "table.md").read_text()
    body = [line for line in table.splitlines() if line.startswith("| ") and "sampler" not in line]
    nfes = [int(line.split("|")[3]) for line in body]
    assert nfes == sorted(nfes)  # grouped by cost
    assert "γ schedule" in table


@pytest.fixture
def toy_sampler():
    """A sampler registered by the test alone: Euler steps that note the times they start at."""
    from elflow.config import SamplerSpec, register_sampler, unregister_sampler
    from elflow.sampling import ode_step

    starts: list[float] = []

    def step(denoise, z, x_prev, t, t_next, ctx):
        starts.append(float(t[0]))
        return ode_step(denoise, z, x_prev, t, t_next)

    register_sampler(SamplerSpec("toy", "Toy", "Euler steps that count themselves", step=step))
    yield starts
    unregister_sampler("toy")


def test_a_sampler_registered_in_a_test_runs_through_every_path(
    toy_sampler, model_dir, judge_dir, tmp_path
):
    """Registering a SamplerSpec is all a new sampler needs: the command line takes it, records
    and the trajectory page describe it, and a sweep crosses it with the others."""
    out, page = tmp_path / "toy.jsonl", tmp_path / "toy.html"
    argv = ["--model", str(model_dir), "--device", "cpu", "--steps", "3"]
    assert elflow_main(["sample", *argv, "-n", "2", "--sampler", "toy", "--out", str(out)]) == 0
    records = read(out)
    assert {r["sampler"] for r in records} == {"toy"} and records[0]["nfe"] == 3
    assert records[0]["gamma"] is None and records[0]["pc_snr"] is None  # others' settings
    assert len(toy_sampler) == 2  # one batch, 2 steps of its own (the last step is Euler)
    assert elflow_main(["sample", *argv, "--sampler", "toy", "--trajectory", str(page)]) == 0
    text = page.read_text()
    assert "Toy" in text and "Euler steps that count themselves" in text
    sweep_out = tmp_path / "sweep"
    argv = ["--model", str(model_dir), "--num-samples", "2", "--device", "cpu", "--steps", "3"]
    argv += ["--out", str(sweep_out), "--sampler", "toy,ode", "--judge", str(judge_dir)]
    assert elflow_main(["sweep", *argv, "--bootstrap", "5"]) == 0
    toy, ode = (read(sweep_out / "samples" / f"{s}-n3-wdefault.jsonl") for s in ("toy", "ode"))
    assert [r["text"] for r in toy] == [r["text"] for r in ode]  # its steps are Euler steps
    assert json.loads((sweep_out / "metrics" / "toy-n3-wdefault.json").read_text())["gen_ppl"] > 0


def test_the_python_sweep_is_what_the_command_runs(model_dir, judge_dir, tmp_path):
    """``elflow.evaluation.sweep_run.sweep`` from Python writes the samples, metrics and tables
    the command writes for the same grid, seed and options."""
    from elflow import ELFPipeline
    from elflow.evaluation import load_judge
    from elflow.evaluation.sweep_grid import grid
    from elflow.evaluation.sweep_run import SweepOptions, sweep

    cli_out, py_out = tmp_path / "cli", tmp_path / "py"
    argv = ["sweep", "--model", str(model_dir), "--num-samples", "2", "--device", "cpu"]
    argv += ["--sampler", "ode,sde", "--steps", "2", "--judge", str(judge_dir), "--seed", "4"]
    assert elflow_main([*argv, "--bootstrap", "5", "--out", str(cli_out)]) == 0
    pipe = ELFPipeline.from_pretrained(model_dir)
    cells = grid(["ode", "sde"], {"steps": [2]})
    rows = sweep(
        pipe,
        cells,
        py_out,
        num_samples=2,
        seeds=[4],
        judge=load_judge(str(judge_dir)),
        model=str(model_dir),
        options=SweepOptions(bootstrap=5),
    )
    assert [r["cell"] for r in rows] == ["ode-n2-wdefault", "sde-n2-wdefault-gdefault"]
    for cell in cells:
        texts = [
            [r["text"] for r in read(o / "samples" / f"{cell.name}.jsonl")]
            for o in (cli_out, py_out)
        ]
        assert texts[0] == texts[1]
        metrics = [
            json.loads((o / "metrics" / f"{cell.name}.json").read_text()) for o in (cli_out, py_out)
        ]
        assert metrics[0]["gen_ppl"] == metrics[1]["gen_ppl"]
    assert (py_out / "table.md").is_file() and (py_out / "frontier.png").is_file()
