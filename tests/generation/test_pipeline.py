"""ELFPipeline and the CLI on tiny models with the offline MiniLM tokenizer."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from elflow import ArtifactConfig, ELFError, ELFPipeline, SamplerConfig, build_model, save_model
from elflow.__main__ import main
from elflow.config import elf_tiny
from elflow.io.official import elflow_to_official
from tests.builders import (
    MINILM,
    VOCAB,
    make_infill_model,
    perturb,
)


def test_generate_unconditional_deterministic(uncond_model):
    pipe = ELFPipeline.from_pretrained(uncond_model)
    a = pipe.generate(3, seed=1)
    b = pipe.generate(3, seed=1, batch_size=1)
    assert len(a) == 3 and all(isinstance(t, str) for t in a)
    assert a == b  # batch size does not change a sample
    full = pipe.generate_full(3, seed=1)
    assert full.tokens.shape == (3, 12)
    assert (
        pipe.generate(3, seed=2) != a or pipe.generate_full(3, seed=2).tokens.ne(full.tokens).any()
    )


def test_generate_overrides_and_trajectory(uncond_model):
    pipe = ELFPipeline.from_pretrained(uncond_model)
    heun = replace(pipe.sampler, steps=5, sampler="heun", length=6)
    out = pipe.generate_full(2, seed=0, sampler=heun, trajectory=True)
    assert out.tokens.shape == (2, 6)
    assert len(out.trajectory) == 5 and all(len(frame) == 2 for frame in out.trajectory)
    with pytest.raises(ELFError, match="max_length"):
        pipe.generate(1, sampler=replace(pipe.sampler, length=13))
    half = ELFPipeline.from_pretrained(uncond_model)
    half.model.to(torch.bfloat16)
    with pytest.raises(ELFError, match=r"weights are torch.bfloat16; sampling takes fp32"):
        half.generate(1)
    with pytest.raises(ELFError, match=r"sampler\.sampler must be one of ode, sde, heun"):
        pipe.generate(1, sampler=replace(pipe.sampler, sampler="euler"))
    with pytest.raises(ELFError, match=r"sampler must be a SamplerConfig, got str"):
        pipe.generate(1, sampler="sde")
    with pytest.raises(ELFError, match="unconditional"):
        pipe.encode_sources(["x"])


def test_generate_conditional(cond_model):
    pipe = ELFPipeline.from_pretrained(cond_model)
    sources = ["the package provides a library", "a tool for text"]
    out = pipe.generate_full(sources=sources, seed=0)
    assert len(out.texts) == 2 and out.tokens.shape == (2, 16 - 8)
    one = pipe.generate_full(sources=sources[:1], seed=0)
    torch.testing.assert_close(one.tokens[0], out.tokens[0])
    with pytest.raises(ELFError, match="conditional"):
        pipe.generate(2)
    # The conditional model's default gamma is 0: its SDE at gamma 0 is its ODE (the command
    # line refuses --sampler sde without --gamma there, tests/cli/test_cli.py).
    ode = pipe.generate(sources=sources, seed=0)
    assert (
        pipe.generate(sources=sources, seed=0, sampler=replace(pipe.sampler, sampler="sde")) == ode
    )
    sde = pipe.generate(
        sources=sources, sampler=replace(pipe.sampler, sampler="sde", gamma=1.5), seed=0
    )
    assert sde != pipe.generate(sources=sources, seed=0)


def test_a_given_encoder_must_fit_the_model(cond_model):
    from elflow.generation.pipeline import model_encoder
    from elflow.text.encoder import FrozenEncoder

    config = ELFPipeline.from_pretrained(cond_model).config
    other = FrozenEncoder.from_pretrained(config.encoder)  # the paper's 0.2, not the model's 0.5
    with pytest.raises(ELFError, match=r"latent_std \(8, 0, 0.0, 0.2\), but the model"):
        ELFPipeline.from_pretrained(cond_model, encoder=other)
    own = ELFPipeline.from_pretrained(cond_model, encoder=model_encoder(config))
    assert own.generate(sources=["a tool"], seed=0) == ELFPipeline.from_pretrained(
        cond_model
    ).generate(sources=["a tool"], seed=0)


def test_generate_refuses_misused_arguments(uncond_model, cond_model):
    cond = ELFPipeline.from_pretrained(cond_model)
    with pytest.raises(ELFError, match="wrap a single source in a list"):
        cond.generate(sources="hello")  # not one sample per character
    with pytest.raises(ELFError, match="source 1 is a NoneType, not a string"):
        cond.generate(sources=["hello", None])
    with pytest.raises(ELFError, match="length applies to unconditional models"):
        cond.generate(sources=["hello"], sampler=replace(cond.sampler, length=3))
    with pytest.raises(ELFError, match="one sample per source; drop n"):
        cond.generate(5, sources=["hello"])
    with pytest.raises(ELFError, match=r"give source texts \(sources=\)"):
        cond.generate(2)
    uncond = ELFPipeline.from_pretrained(uncond_model)
    with pytest.raises(ELFError, match="conditional tasks only"):
        uncond.generate(2, sampler=replace(uncond.sampler, cfg=2.0))


def test_tokenizer_mismatch_is_one_line(tmp_path):
    cfg = elf_tiny(encoder_dim=8, vocab_size=100, max_length=8)
    save_model(
        tmp_path / "m",
        build_model(cfg),
        ArtifactConfig(model=cfg, encoder=MINILM, tokenizer=MINILM),
    )
    with pytest.raises(ELFError, match="decoder head has 100") as e:
        ELFPipeline.from_pretrained(tmp_path / "m")
    assert "\n" not in str(e.value)


def test_tokenizer_hash_mismatch(tmp_path):
    cfg = elf_tiny(encoder_dim=8, vocab_size=VOCAB, max_length=8)
    config = ArtifactConfig(model=cfg, tokenizer=MINILM, tokenizer_hash="0" * 64)
    save_model(tmp_path / "m", build_model(cfg), config)
    with pytest.raises(ELFError, match="hash mismatch"):
        ELFPipeline.from_pretrained(tmp_path / "m")


def test_cli_generate_info_import(uncond_model, tmp_path, capsys):
    assert main(["generate", str(uncond_model), "-n", "2", "--steps", "2"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 2
    assert main(["generate", str(uncond_model), "--steps", "2"]) == 0
    assert len(capsys.readouterr().out.splitlines()) == 4  # the default count
    assert main(["generate", str(uncond_model), "--steps", "0"]) == 2
    assert "elflow: error: --steps must be >= 1, got 0" in capsys.readouterr().err  # the option
    assert main(["info", str(uncond_model)]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["model"]["vocab_size"] == VOCAB and info["parameters"] > 0
    # import: an authors' pickle -> an elflow folder
    cfg = elf_tiny(encoder_dim=8, vocab_size=VOCAB, max_length=12)
    model = perturb(build_model(cfg))
    torch.save({"params": elflow_to_official(model.state_dict())}, tmp_path / "checkpoint_3")
    assert main(["import", str(tmp_path / "checkpoint_3"), "--out", str(tmp_path / "m")]) == 0
    assert (tmp_path / "m" / "model.safetensors").is_file()
    # An authors' checkpoint records no task: info (like sample and generate) takes --task.
    capsys.readouterr()
    assert main(["info", str(tmp_path / "checkpoint_3"), "--task", "de-en"]) == 0
    assert json.loads(capsys.readouterr().out)["task"] == "conditional"
    assert main(["info", str(uncond_model), "--task", "de-en"]) == 2
    assert "applies to authors' checkpoints" in capsys.readouterr().err


def test_tokenizer_by_name_and_home_relative_folder(uncond_model, tmp_path, monkeypatch):
    from elflow.text.tokenizer import load_tokenizer

    load_tokenizer(MINILM).save_pretrained(tmp_path / "tok")
    monkeypatch.setenv("HOME", str(tmp_path))
    assert len(load_tokenizer("~/tok")) == VOCAB  # "~" is a folder here, not a Hub id
    pipe = ELFPipeline.from_pretrained(uncond_model, tokenizer="~/tok")  # a name, not an object
    assert len(pipe.tokenizer) == VOCAB


def test_cli_errors_are_one_line(tmp_path, capsys):
    assert main(["info", "--model", str(tmp_path / "missing")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("elflow: error:") and err.count("\n") == 1


@pytest.fixture(scope="module")
def projected_dir(tmp_path_factory):
    """An unconditional model whose sampler projects (a tiny BERT encoder of the model's width)."""
    sampler = SamplerConfig(steps=4, sampler="sde", gamma=1.0, w=2.0, project_from=0.2)
    root = tmp_path_factory.mktemp("projected")
    return Path(make_infill_model(root, length=12, sampler=sampler))


def test_projected_sampling_loads_the_encoder_and_is_deterministic(projected_dir, monkeypatch):
    from elflow.sampling import projection as sampling

    pipe = ELFPipeline.from_pretrained(projected_dir)
    assert pipe.encoder is None  # an unconditional model loads it only to project
    plain = pipe.generate_full(3, seed=1, sampler=replace(pipe.sampler, project_from=1.0))
    assert pipe.encoder is None
    rows = []
    text_rows = sampling.text_rows
    monkeypatch.setattr(
        sampling, "text_rows", lambda *a: rows.append(a) or text_rows(*a)
    )  # records each projection's decoded tokens and ids
    a = pipe.generate_full(3, seed=1)
    assert pipe.encoder is not None and rows
    assert all(eos == pipe.tokens.eos_id and pad == pipe.tokens.eos_id for _, eos, pad in rows)
    b = pipe.generate_full(3, seed=1, batch_size=1)
    assert a.texts == b.texts and torch.equal(a.tokens, b.tokens)
    assert a.tokens.shape == plain.tokens.shape == (3, 12)


def test_projection_rows_are_the_training_rows(projected_dir, uncond_model):
    from elflow.sampling.projection import text_rows

    texts = ["in the beginning", "", "a much longer verse that will not fit in twelve tokens"]
    for folder, pad_with_eos in ((projected_dir, True), (uncond_model, False)):
        pipe = ELFPipeline.from_pretrained(folder)
        assert pipe.config.pad_with_eos is pad_with_eos
        pad = pipe.tokens.eos_id if pad_with_eos else pipe.tokens.pad_id
        assert pipe.row_pad_id == pad
        ids, mask = pipe.training_rows(texts)
        junk = ids.masked_fill(mask == 0, 7)  # what a decode may put after the end
        again = text_rows(junk, pipe.tokens.eos_id, pad)
        assert torch.equal(again[0], ids) and torch.equal(again[1], mask)


def test_projected_sampling_is_refused_where_it_cannot_run(cond_model, projected_dir, tmp_path):
    cond = ELFPipeline.from_pretrained(cond_model)
    with pytest.raises(ELFError, match="one unconditional text per row, but this model is cond"):
        cond.generate(sources=["a tool"], sampler=replace(cond.sampler, project_from=0.3))
    packed = ELFPipeline.from_pretrained(projected_dir)
    packed.config = replace(packed.config, packed=True)  # as a model trained on packed rows
    with pytest.raises(
        ELFError, match=r"was trained on packed rows; turn it off \(sampler\.project_from 1\)"
    ):
        packed.generate(n=2, sampler=replace(packed.sampler, steps=2))
    unprojected = replace(packed.sampler, steps=2, project_from=1.0)
    assert len(packed.generate(n=2, sampler=unprojected)) == 2
    from elflow.config.run_presets import preset
    from elflow.config.train_config import RunConfig, apply_overrides, check_projection

    config = ELFPipeline.from_pretrained(projected_dir).config
    conditional = RunConfig(
        task="conditional", max_input_length=4, model=config.model, sampler=config.sampler
    )
    with pytest.raises(ELFError, match=r"does not apply with a conditional task; set sampler\."):
        check_projection(conditional)
    # The bible-tiny preset projects; its own setting turns off (with a note) where it cannot
    # apply, a user's is refused.
    tiny = preset("bible-tiny")
    assert tiny.sampler.project_from == 0.3
    packed = apply_overrides(tiny, sets=["data.packing=true"])
    assert packed.sampler.project_from == 1.0
    cond = apply_overrides(tiny, sets=["task=conditional", "max_input_length=8"])
    assert cond.sampler.project_from == 1.0
    with pytest.raises(ELFError, match=r"does not apply with data\.packing"):
        apply_overrides(tiny, sets=["data.packing=true", "sampler.project_from=0.5"])
    assert apply_overrides(tiny, sets=["sampler.project_from=0.5"]).sampler.project_from == 0.5


def test_cli_project_from(projected_dir, tmp_path, capsys):
    out = tmp_path / "s.jsonl"
    argv = ["sample", "--checkpoint", str(projected_dir), "--out", str(out), "--num-samples", "2"]
    assert main([*argv, "--project-from", "0.5"]) == 0
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["project_from"] for r in records] == [0.5, 0.5]
    assert main([*argv, "--project-from", "1", "--overwrite"]) == 0
    assert json.loads(out.read_text().splitlines()[0])["project_from"] is None
    capsys.readouterr()
    assert main([*argv, "--project-from", "2", "--overwrite"]) == 2
    err = capsys.readouterr().err
    assert "--project-from must be in [0, 1] (1 = off), got 2.0" in err and err.count("\n") == 1
    assert main(["generate", str(projected_dir), "-n", "1", "--project-from", "0.1"]) == 0
