"""The latent cache returns what the encoder would, label-dropped conditional rows included."""

from dataclasses import replace

import numpy as np
import torch

from elflow.data import DataConfig, LatentCache, build_dataset
from elflow.data.latent_cache import cache_key
from tests.data.conftest import shared_rows, write_jsonl


def test_unconditional_packed_cache_equals_direct_encoding(tokenizer, tiny_encoder, tmp_path):
    path = write_jsonl(tmp_path / "b.jsonl", shared_rows("web_bible", 12))
    ds = build_dataset(DataConfig(path=str(path), packing=True), tokenizer, 16)
    cache = LatentCache.build(ds, tiny_encoder, batch_size=4, dtype="float32")
    idx = np.array([5, 0, 3, 3])
    batch = ds.get_batch(idx)
    direct = tiny_encoder(batch["input_ids"], batch["attention_mask"])
    torch.testing.assert_close(cache.get(idx), direct, rtol=0, atol=0)
    half = LatentCache.build(ds, tiny_encoder, batch_size=4)
    assert half.latents.dtype == torch.float16 and half.nbytes == cache.nbytes // 2
    torch.testing.assert_close(half.get(idx), direct, rtol=2e-3, atol=2e-3)


def test_conditional_cache_with_label_drop(tokenizer, tiny_encoder, tmp_path):
    path = write_jsonl(tmp_path / "p.jsonl", shared_rows("ddtp_de_en", 10))
    cfg = DataConfig(path=str(path), source_field="de", target_field="en")
    ds = build_dataset(cfg, tokenizer, max_length=32, max_input_length=16)
    cache = LatentCache.build(ds, tiny_encoder, batch_size=3, dtype="float32")
    idx = np.array([9, 2, 4, 7, 0])
    drop = np.array([True, False, True, False, False])
    b = ds.get_batch(idx)
    direct = tiny_encoder(
        b["input_ids"], b["attention_mask"], b["cond_mask"], torch.from_numpy(drop)
    )
    got = cache.get(idx, drop)
    torch.testing.assert_close(got, direct, rtol=0, atol=0)
    # The label drop changes target latents of dropped rows only (source latents never see the
    # target, so they agree).
    kept = cache.get(idx)
    tgt = (b["attention_mask"].bool() & ~b["cond_mask"].bool())[..., None]
    assert not torch.allclose(got[0][tgt[0, :, 0]], kept[0][tgt[0, :, 0]])
    torch.testing.assert_close(got[1], kept[1])
    src = b["cond_mask"].bool()
    torch.testing.assert_close(got[0][src[0]], kept[0][src[0]])


def test_saved_cache_loads_only_with_its_key(tokenizer, tiny_encoder, tmp_path):
    path = write_jsonl(tmp_path / "p.jsonl", shared_rows("ddtp_de_en", 6))
    cfg = DataConfig(path=str(path), source_field="de", target_field="en")
    ds = build_dataset(cfg, tokenizer, max_length=32, max_input_length=16)
    cache = LatentCache.build(ds, tiny_encoder, batch_size=4)
    key = cache_key(ds, tiny_encoder, "float16")
    file = tmp_path / "cache.safetensors"
    cache.save(file, key)
    assert [p.name for p in tmp_path.iterdir() if p.suffix == ".safetensors"] == [file.name]
    loaded = LatentCache.load(file, key)
    assert torch.equal(loaded.latents, cache.latents) and torch.equal(loaded.dropped, cache.dropped)
    assert LatentCache.load(file, "another key") is None
    assert LatentCache.load(tmp_path / "missing.safetensors", key) is None
    # The key follows the rows, the storage dtype and the encoder's normalisation.
    fewer = build_dataset(replace(cfg, max_rows=5), tokenizer, max_length=32, max_input_length=16)
    assert cache_key(fewer, tiny_encoder, "float16") != key
    assert cache_key(ds, tiny_encoder, "float32") != key
    std, layer = tiny_encoder.latent_std, tiny_encoder.layer
    try:
        tiny_encoder.latent_std = 2 * std
        assert cache_key(ds, tiny_encoder, "float16") != key
        tiny_encoder.latent_std, tiny_encoder.layer = std, layer + 1
        assert cache_key(ds, tiny_encoder, "float16") != key
    finally:
        tiny_encoder.latent_std, tiny_encoder.layer = std, layer
    with torch.no_grad():  # the encoder's weights
        weight = next(tiny_encoder.model.parameters())
        saved = weight.clone()
        weight.add_(1.0)
        try:
            assert cache_key(ds, tiny_encoder, "float16") != key
        finally:
            weight.copy_(saved)
    assert cache_key(ds, tiny_encoder, "float16") == key
    # The same encoder loaded from another folder (a moved venv) keeps the key.
    where = tiny_encoder.model.config._name_or_path
    try:
        tiny_encoder.model.config._name_or_path = "/somewhere/else"
        assert cache_key(ds, tiny_encoder, "float16") == key
    finally:
        tiny_encoder.model.config._name_or_path = where
    # A truncated file (a killed write of an older version) is a miss, not an error.
    file.write_bytes(file.read_bytes()[:200])
    assert LatentCache.load(file, key) is None


def test_a_cache_larger_than_memory_is_one_line(tokenizer, tiny_encoder, tmp_path, monkeypatch):
    import pytest

    from elflow.data import latent_cache
    from elflow.errors import ELFError

    path = write_jsonl(tmp_path / "b.jsonl", shared_rows("web_bible", 8))
    cfg = DataConfig(path=str(path), latent_cache_dtype="float32")
    ds = build_dataset(cfg, tokenizer, 16)
    need = latent_cache.cache_nbytes(ds, tiny_encoder, "float32")
    assert need == 8 * 16 * tiny_encoder.hidden_size * 4
    monkeypatch.setattr(latent_cache, "available_memory", lambda: need)  # 90% of it is usable
    message = r"needs 0\.0 GiB per process \(1 on .* data\.latent_cache=false"
    with pytest.raises(ELFError, match=message):
        latent_cache.run_latent_cache(cfg, ds, tiny_encoder, tmp_path, True)
    monkeypatch.setattr(latent_cache, "available_memory", lambda: 2 * need)
    assert len(latent_cache.run_latent_cache(cfg, ds, tiny_encoder, tmp_path, True)) == 8


def test_available_memory_takes_a_containers_limit(tmp_path):
    from elflow.data.latent_cache import available_memory

    (tmp_path / "proc").mkdir()
    (tmp_path / "proc" / "meminfo").write_text("MemTotal: 9 kB\nMemAvailable:    8000 kB\n")
    assert available_memory(tmp_path) == 8000 * 1024
    cgroup = tmp_path / "sys" / "fs" / "cgroup"
    cgroup.mkdir(parents=True)
    (cgroup / "memory.max").write_text("max\n")  # v2, no limit
    (cgroup / "memory.current").write_text("100\n")
    assert available_memory(tmp_path) == 8000 * 1024
    (cgroup / "memory.max").write_text("4096000\n")  # a container's 4 MB limit, 100 B in use
    assert available_memory(tmp_path) == 4096000 - 100
    assert available_memory(tmp_path / "nothing") is None
