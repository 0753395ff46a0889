"""The latent cache returns what the encoder would, label-dropped conditional rows included; a
saved cache is shared by later runs on the same rows and encoder, and concurrent builders of one
key encode once."""

import threading
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

from elflow.data import DataConfig, LatentCache, build_dataset
from elflow.data.latent_cache import CACHE_FILE, cache_key, cache_path, run_latent_cache
from elflow.errors import ELFError
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
    from elflow.data import latent_cache

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


# ---- the saved cache: where it lives, reuse, damage, concurrent builders -----------------------


@pytest.fixture
def user_cache(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("ELFLOW_CACHE", str(tmp_path / "user-cache"))
    return tmp_path / "user-cache" / "latents"


@pytest.fixture
def encoder_calls(tiny_encoder, monkeypatch) -> list[str]:
    """The name of the thread of every call of the tiny encoder."""
    calls: list[str] = []
    real = tiny_encoder.forward

    def counted(*args, **kwargs):
        calls.append(threading.current_thread().name)
        return real(*args, **kwargs)

    monkeypatch.setattr(tiny_encoder, "forward", counted)
    return calls


def bible_rows(tokenizer, tmp_path, n: int = 12, **changes):
    path = write_jsonl(tmp_path / "b.jsonl", shared_rows("web_bible", 12))
    cfg = DataConfig(path=str(path), latent_cache_dtype="float32", **changes)
    return cfg, build_dataset(replace(cfg, max_rows=n), tokenizer, 16)


def test_a_later_run_loads_the_shared_cache(
    tokenizer, tiny_encoder, encoder_calls, user_cache, tmp_path, capsys
):
    cfg, ds = bible_rows(tokenizer, tmp_path)
    first = run_latent_cache(cfg, ds, tiny_encoder, tmp_path / "run1", True)
    built = len(encoder_calls)
    assert built > 0
    file = user_cache / f"{cache_key(ds, tiny_encoder, 'float32')[:32]}.safetensors"
    assert [p.name for p in user_cache.glob("*.safetensors")] == [file.name]
    assert not (tmp_path / "run1").exists()  # no copy in the run folder
    second = run_latent_cache(cfg, ds, tiny_encoder, tmp_path / "run2", True)
    assert len(encoder_calls) == built  # loaded, not encoded
    assert torch.equal(second.latents, first.latents)
    assert (
        capsys.readouterr().out.splitlines()[-1] == f"elflow train: latent cache loaded from {file}"
    )
    # Other rows, or another encoder normalisation, are another file.
    _, fewer = bible_rows(tokenizer, tmp_path, n=8)
    run_latent_cache(cfg, fewer, tiny_encoder, tmp_path / "run3", True)
    std = tiny_encoder.latent_std
    try:
        tiny_encoder.latent_std = 2 * std
        run_latent_cache(cfg, ds, tiny_encoder, tmp_path / "run4", True)
    finally:
        tiny_encoder.latent_std = std
    assert len(list(user_cache.glob("*.safetensors"))) == 3
    assert len(encoder_calls) == 3 * built  # each build is one batch of <= 64 rows


def test_the_run_folder_or_a_named_folder_keeps_its_own_copy(
    tokenizer, tiny_encoder, encoder_calls, user_cache, tmp_path
):
    cfg, ds = bible_rows(tokenizer, tmp_path, latent_cache_dir="run")
    run_latent_cache(cfg, ds, tiny_encoder, tmp_path / "run", True)
    key = cache_key(ds, tiny_encoder, "float32")
    assert LatentCache.load(tmp_path / "run" / CACHE_FILE, key) is not None
    built = len(encoder_calls)
    # The run folder's copy also serves the default setting (a run folder moved elsewhere).
    run_latent_cache(replace(cfg, latent_cache_dir=""), ds, tiny_encoder, tmp_path / "run", True)
    assert len(encoder_calls) == built
    mine = tmp_path / "mine"
    run_latent_cache(replace(cfg, latent_cache_dir=str(mine)), ds, tiny_encoder, tmp_path, True)
    assert LatentCache.load(mine / f"{key[:32]}.safetensors", key) is not None
    assert not user_cache.exists()
    with pytest.raises(ELFError, match=r"latent_cache_dir .* is a file; give a folder"):
        cache_path(replace(cfg, latent_cache_dir=str(tmp_path / "b.jsonl")), tmp_path, key)
    with pytest.raises(ELFError, match="latent_cache_save=false"):
        replace(cfg, latent_cache_save=False)


def test_a_damaged_file_is_rebuilt(tokenizer, tiny_encoder, encoder_calls, user_cache, tmp_path):
    cfg, ds = bible_rows(tokenizer, tmp_path)
    good = run_latent_cache(cfg, ds, tiny_encoder, tmp_path, True)
    built = len(encoder_calls)
    (file,) = user_cache.glob("*.safetensors")
    file.write_bytes(file.read_bytes()[: file.stat().st_size // 2])  # a write cut short
    (user_cache / f".{file.name}.tmp-99999").write_bytes(b"half")  # a killed writer's
    again = run_latent_cache(cfg, ds, tiny_encoder, tmp_path, True)
    assert len(encoder_calls) == 2 * built and torch.equal(again.latents, good.latents)
    assert LatentCache.load(file, cache_key(ds, tiny_encoder, "float32")) is not None
    assert [p.name for p in user_cache.iterdir() if not p.name.endswith(".lock")] == [file.name]


def test_a_builder_waiting_for_the_lock_loads_what_the_first_saved(
    tokenizer, tiny_encoder, encoder_calls, user_cache, tmp_path, monkeypatch, capsys
):
    """Two builders of one key: the first holds the lock while it encodes, the second waits on
    it (seen through the lock, not a sleep) and then loads the saved file."""
    from elflow.data import latent_cache

    cfg, ds = bible_rows(tokenizer, tmp_path)
    encoding, waiting, go = threading.Event(), threading.Event(), threading.Event()
    forward = tiny_encoder.forward  # the counting one

    def first_waits(*args, **kwargs):
        if threading.current_thread().name == "first" and not go.is_set():
            encoding.set()
            assert go.wait(60)
        return forward(*args, **kwargs)

    class Watched(latent_cache.FileLock):
        def acquire(self, timeout=None, *args, **kwargs):
            if threading.current_thread().name == "second" and timeout is None:
                waiting.set()  # about to block: the first builder holds the lock
            return super().acquire(timeout, *args, **kwargs)

    monkeypatch.setattr(tiny_encoder, "forward", first_waits)
    monkeypatch.setattr(latent_cache, "FileLock", Watched)
    results = {}

    def builder():
        name = threading.current_thread().name
        results[name] = run_latent_cache(cfg, ds, tiny_encoder, tmp_path / name, True)

    first = threading.Thread(target=builder, name="first")
    first.start()
    assert encoding.wait(60)
    second = threading.Thread(target=builder, name="second")
    second.start()
    assert waiting.wait(60)
    assert not list(user_cache.glob("*.safetensors"))  # nothing saved yet
    go.set()
    first.join(60)
    second.join(60)
    assert set(results) == {"first", "second"}
    assert "second" not in encoder_calls and "first" in encoder_calls
    assert torch.equal(results["first"].latents, results["second"].latents)
    (file,) = user_cache.glob("*.safetensors")
    assert LatentCache.load(file, cache_key(ds, tiny_encoder, "float32")) is not None
    out = capsys.readouterr().out
    assert out.count("latent cache of 12 rows built") == 1
    assert f"waiting for another run to save {file}" in out
    assert f"latent cache loaded from {file}" in out


def test_cache_root_follows_elflow_cache_then_xdg(tmp_path, monkeypatch):
    from elflow.evaluation.judge import cache_root as judge_root
    from elflow.io.paths import cache_root

    monkeypatch.setenv("ELFLOW_CACHE", str(tmp_path / "mine"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_root() == tmp_path / "mine" and judge_root() == tmp_path / "mine" / "judges"
    monkeypatch.delenv("ELFLOW_CACHE")
    assert cache_root() == tmp_path / "xdg" / "elflow"
    monkeypatch.setenv("XDG_CACHE_HOME", "relative/xdg")  # invalid under the XDG spec
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert cache_root() == tmp_path / "home" / ".cache" / "elflow"
