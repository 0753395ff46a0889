"""The Hugging Face-shaped pipeline API: ``pipe(...)`` returning a Generation, a step callback,
``to``, ``save_pretrained`` with a model card, ``from_pretrained`` of a Hub id from the local
Hugging Face cache offline, and ``push_to_hub`` failing in one line offline."""

from __future__ import annotations

import shutil

import pytest
import torch

from elflow import ELFError, ELFPipeline, Generation


@pytest.fixture(scope="module")
def model(uncond_model):
    return uncond_model


@pytest.fixture(scope="module")
def pipe(model):
    return ELFPipeline.from_pretrained(model)


def test_calling_the_pipeline_returns_a_generation_and_reports_each_step(pipe):
    seen = []
    out = pipe(3, seed=5, batch_size=2, callback_on_step_end=seen.append)
    assert isinstance(out, Generation) and len(out.texts) == 3 and out.tokens.shape[0] == 3
    assert out.texts == pipe.generate(3, seed=5, batch_size=2)
    steps = pipe.sampler.steps
    assert [(s.step, s.steps) for s in seen] == [(k, steps) for k in range(steps)] * 2
    assert [s.z.shape[0] for s in seen] == [2] * steps + [1] * steps  # one report per batch
    assert all(torch.equal(s.t, torch.ones_like(s.t)) for s in seen[steps - 1 :: steps])
    assert pipe.to("cpu") is pipe


def test_save_pretrained_writes_a_card_and_loads_back_the_same_samples(pipe, tmp_path):
    folder = pipe.save_pretrained(tmp_path / "saved", metrics={"gen_ppl": 123.4, "entropy": 2.5})
    card = (folder / "README.md").read_text()
    front = card.split("---")[1]
    assert "library_name: elflow" in front and "pipeline_tag: text-generation" in front
    assert "- elflow" in front and "gen_ppl: 123.4" in front
    assert (folder / "tokenizer" / "tokenizer.json").is_file()
    again = ELFPipeline.from_pretrained(folder)
    assert again(2, seed=1).texts == pipe(2, seed=1).texts


def test_a_hub_id_loads_from_the_local_cache_offline(pipe, tmp_path, monkeypatch):
    import huggingface_hub.constants as hub

    assert hub.HF_HUB_OFFLINE  # tests never reach the network
    cache = tmp_path / "hub"
    snapshot = cache / "models--someone--elf-tiny" / "snapshots" / ("a1" * 20)
    pipe.save_pretrained(snapshot)
    (cache / "models--someone--elf-tiny" / "refs").mkdir()
    (cache / "models--someone--elf-tiny" / "refs" / "main").write_text("a1" * 20)
    monkeypatch.setattr(hub, "HF_HUB_CACHE", str(cache))
    loaded = ELFPipeline.from_pretrained("someone/elf-tiny")
    assert loaded(2, seed=3).texts == pipe(2, seed=3).texts
    shutil.rmtree(cache / "models--someone--elf-tiny" / "snapshots")
    with pytest.raises(ELFError, match="HF_HUB_OFFLINE"):
        ELFPipeline.from_pretrained("someone/elf-tiny")


def test_push_to_hub_offline_is_one_line(pipe):
    with pytest.raises(ELFError) as e:
        pipe.push_to_hub("someone/elf-tiny")
    assert "\n" not in str(e.value) and "HF_HUB_OFFLINE" in str(e.value)


def test_two_threads_sharing_a_pipeline_get_what_they_would_alone(pipe):
    """Reentrant: concurrent calls on one pipeline give the texts of the same calls made one
    after the other (fp32; different seeds and sizes, so the batches differ)."""
    from concurrent.futures import ThreadPoolExecutor

    calls = [(3, 11), (2, 12), (4, 13), (1, 14)]
    alone = [pipe(n, seed=s).tokens for n, s in calls]
    with ThreadPoolExecutor(2) as pool:
        together = list(pool.map(lambda c: pipe(c[0], seed=c[1]).tokens, calls * 2))
    for got, want in zip(together, alone * 2, strict=True):
        assert torch.equal(got, want)


def test_per_sample_seeds_batch_together_and_equal_each_alone(pipe):
    """seed=[...] gives each sample its own seed inside one batch; a sample depends on (its
    seed, its index) only, so it equals the sample of a run with that one seed."""
    seeds = [5, 7, 9, 7]
    together = pipe(4, seed=seeds, batch_size=4).tokens
    for i, s in enumerate(seeds):
        assert torch.equal(together[i], pipe(4, seed=s, batch_size=3).tokens[i])
    assert pipe.generate(2, seed=[3, 3]) == pipe.generate(2, seed=3)
    with pytest.raises(ELFError, match="3 seeds for 2 samples"):
        pipe(2, seed=[1, 2, 3])
    with pytest.raises(ELFError, match="an int or a list of ints"):
        pipe(1, seed=["a"])


def test_a_sampler_is_checked_once_per_pipeline_not_per_batch(model, monkeypatch):
    from dataclasses import replace

    from elflow.io.artifact import ArtifactConfig

    checked = []
    real = ArtifactConfig.check_sampler
    monkeypatch.setattr(
        ArtifactConfig, "check_sampler", lambda self, s: (checked.append(s), real(self, s))
    )
    pipe = ELFPipeline.from_pretrained(model)
    pipe(3, batch_size=1)
    pipe(2, seed=4)
    assert checked == [pipe.sampler]
    other = replace(pipe.sampler, steps=2)
    pipe(1, sampler=other)
    with pytest.raises(ELFError, match="cfg"):  # a refused sampler is refused every time
        pipe(1, sampler=replace(pipe.sampler, cfg=2.0))
    with pytest.raises(ELFError, match="cfg"):
        pipe(1, sampler=replace(pipe.sampler, cfg=2.0))
    assert checked[:2] == [pipe.sampler, other] and len(checked) == 4


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda p: p("4"), r"n= is the number of samples, an int; got str '4'; .*pipe\.infill"),
        (lambda p: p.generate("4"), "n= is the number of samples"),
        (lambda p: p(2.0), "got float 2.0"),
        (lambda p: p(True), "got bool True"),
        (lambda p: p.infill("In the [___] beginning"), "wrap a single template in a list"),
    ],
)
def test_a_request_of_the_wrong_type_is_one_line(pipe, call, message):
    with pytest.raises(ELFError, match=message) as e:
        call(pipe)
    assert "\n" not in str(e.value)


def test_a_numpy_count_is_a_count(pipe):
    import numpy as np

    assert pipe(np.int64(2), seed=1).texts == pipe(2, seed=1).texts


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
@pytest.mark.parametrize("device", ["cuda", "cuda:1"])
def test_moving_to_a_missing_device_is_one_line_and_leaves_the_pipeline_usable(model, pipe, device):
    with pytest.raises(ELFError, match="no CUDA device is available here; use 'cpu'"):
        pipe.to(device)
    with pytest.raises(ELFError, match="no CUDA device"):
        ELFPipeline.from_pretrained(model, device=device)
    with pytest.raises(ELFError, match="'tpu' is not a device"):
        pipe.to("tpu")
    assert pipe.device.type == "cpu" and len(pipe(1).texts) == 1
