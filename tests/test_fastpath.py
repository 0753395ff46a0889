"""The bf16 inference fast path (elflow.runtime.bf16_fast_path): ELF's blocks on cached bf16
weights under autocast in eval mode without gradients, close to fp32 and to per-op autocast; one
switch (``ELFLOW_FAST_BF16=0``) gives the plain path; ``ELF.forward`` itself keeps no state."""

import copy
import gc
import io
import threading

import pytest
import torch
from torch.testing import assert_close

from elflow.model import ELF
from elflow.runtime import bf16_fast_path as fastpath
from tests.builders import varied_network

E, V, MAX_LEN = 8, 20, 12


def _tiny(seed: int = 0) -> ELF:
    return varied_network(seed, 0.1, E, V, MAX_LEN)


def _inputs(B: int, L: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(B, L, 2 * E, generator=g), torch.rand(B, generator=g), 3.0


def _bf16():
    return torch.autocast("cpu", dtype=torch.bfloat16)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def _cached(model: ELF) -> bool:
    return model in fastpath._CACHE


@pytest.mark.parametrize("masked", [False, True])
def test_fast_path_matches_per_op_autocast(masked, monkeypatch):
    """As close to fp32 as per-op autocast (the training path, and the switch off) is."""
    model = _tiny()
    x_in, t, w = _inputs(3, 6, seed=12)
    mask = torch.tensor([[1, 1, 1, 1, 0, 0]] * 3) if masked else None
    with torch.no_grad():
        ref = model(x_in, t, w, 0.0, mask)[0]
        with _bf16():
            x_pred, hidden = fastpath.forward(model, x_in, t, w, 0.0, mask)
            assert _cached(model)
            monkeypatch.setenv(fastpath.ENV, "0")
            per_op = fastpath.forward(model, x_in, t, w, 0.0, mask)[0]
            assert torch.equal(per_op, model(x_in, t, w, 0.0, mask)[0])  # off: the plain path
    assert x_pred.dtype == hidden.dtype == torch.float32
    assert _rel(x_pred, ref) < max(2 * _rel(per_op, ref), 0.01)
    assert _rel(x_pred, per_op) < 0.02


def test_switch_and_conditions(monkeypatch):
    model, cpu = _tiny(), torch.device("cpu")
    with torch.no_grad():
        assert fastpath.lowp_dtype(model, cpu) is None  # fp32: never
        with _bf16():
            assert fastpath.lowp_dtype(model, cpu) == torch.bfloat16
            model.train()
            assert fastpath.lowp_dtype(model, cpu) is None  # training mode: per-op autocast
            model.eval()
            for off in ("0", " 0 "):
                monkeypatch.setenv(fastpath.ENV, off)
                assert not fastpath.enabled() and fastpath.lowp_dtype(model, cpu) is None
            monkeypatch.setenv(fastpath.ENV, "1")
            assert fastpath.enabled()
    with _bf16():
        assert fastpath.lowp_dtype(model, cpu) is None  # gradients wanted: per-op autocast
    x_in, t, w = _inputs(2, 6, seed=14)
    fastpath.forward(model, x_in, t, w)[0].sum().backward()  # the plain path, differentiable
    assert model.blocks[0].attn.qkv.weight.grad is not None and not _cached(model)


def _snapshot(model: ELF) -> dict:
    """Every attribute of every module (by identity, containers by their items) and every
    parameter's and buffer's storage and version: what a forward could change."""

    def contents(value):
        if isinstance(value, dict):
            return tuple((k, id(v)) for k, v in value.items())
        if isinstance(value, (list, tuple, set)):
            return tuple(id(v) for v in value)
        return None

    attrs = {
        (name, key): (id(value), contents(value))
        for name, module in model.named_modules()
        for key, value in vars(module).items()
    }
    tensors = {
        name: (p.data_ptr(), p._version)
        for name, p in [*model.named_parameters(), *model.named_buffers()]
    }
    return {"attrs": attrs, "tensors": tensors}


def test_forward_changes_no_state_of_the_model():
    """ELF.forward (and the fast path around it) leave the model exactly as they found it: no
    cache on the model, so threads may share one."""
    model = _tiny()
    x_in, t, w = _inputs(2, 7, seed=15)
    before = _snapshot(model)
    with torch.no_grad():
        model(x_in, t, w)
        with _bf16():
            model(x_in, t, w)
            fastpath.forward(model, x_in, t, w, 1.0)
    with torch.inference_mode(), _bf16():
        model(x_in, t, w)
    assert _cached(
        model
    )  # the fast path's copy lives in elflow.runtime.bf16_fast_path, not on the model
    assert _snapshot(model) == before


def test_lowp_block_is_block_in_exact_arithmetic():
    """lowp_block with fp32 weights computes Block's function (norm weights folded into qkv and
    w12, w12 split into gate and value, q and k normalised and rotated together)."""
    model = _tiny()
    block, cfg = model.blocks[0], model.cfg
    x = torch.randn(2, cfg.num_prefix_tokens + 6, cfg.hidden_size)
    rotations = model.rotations(6, torch.device("cpu"))
    with torch.no_grad():
        ref = block(x, rotations, None)
        p = fastpath.LowpBlock.of(block, torch.float32)
        out = fastpath.lowp_block(x, p, rotations[:, None, None], None, cfg.num_heads)
    assert not p.qkv.packed
    assert_close(out, ref, rtol=1e-5, atol=1e-5)


def test_fast_path_takes_an_empty_batch():
    """The held-out loss's no-grad pass may hold no rows (nograd_prediction's selection)."""
    model = _tiny()
    x_in, t, w = _inputs(0, 6, seed=13)
    with _bf16(), torch.no_grad():
        x_pred, hidden = fastpath.forward(model, x_in, t, w)
    assert x_pred.shape == (0, 6, E) and hidden.shape[0] == 0


def _fast(model: ELF, x_in, t, w) -> torch.Tensor:
    with torch.no_grad(), _bf16():
        return fastpath.forward(model, x_in, t, w)[0]


def test_the_cache_follows_the_weights_and_dies_with_the_model():
    model, fresh = _tiny(), _tiny()
    x_in, t, w = _inputs(2, 6, seed=13)
    before = _fast(model, x_in, t, w)
    cached = fastpath._CACHE[model]
    assert torch.equal(_fast(model, x_in, t, w), before) and fastpath._CACHE[model] is cached
    with torch.no_grad():
        model.blocks[0].mlp.w3.weight.add_(1.0)  # an in-place update (an optimizer step)
    assert not torch.equal(_fast(model, x_in, t, w), before)
    model.load_state_dict(fresh.state_dict())  # copied back in place
    assert torch.equal(_fast(model, x_in, t, w), _fast(fresh, x_in, t, w))
    n = len(fastpath._CACHE)
    del model
    gc.collect()
    assert len(fastpath._CACHE) == n - 1  # freed with its model


def test_copies_and_pickles_work_after_the_fast_path():
    model = _tiny()
    x_in, t, w = _inputs(2, 6, seed=15)
    out = _fast(model, x_in, t, w)
    clone = copy.deepcopy(model)
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    assert not _cached(clone) and not _cached(loaded)
    assert torch.equal(_fast(clone, x_in, t, w), out)
    assert torch.equal(_fast(loaded, x_in, t, w), out)


def test_threads_sharing_a_model_build_the_cache_once(monkeypatch):
    model = _tiny()
    x_in, t, w = _inputs(2, 6, seed=17)
    builds = []
    build = fastpath.LowpBlock.of

    def counted(block, dtype):
        builds.append(block)
        return build(block, dtype)

    monkeypatch.setattr(fastpath.LowpBlock, "of", counted)
    start = threading.Barrier(4)
    outs: list[torch.Tensor] = []

    def run():
        start.wait()
        outs.append(_fast(model, x_in, t, w))

    threads = [threading.Thread(target=run) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(builds) == model.cfg.depth  # one copy of each block, whichever thread built it
    assert len(outs) == 4 and all(torch.equal(o, outs[0]) for o in outs)
