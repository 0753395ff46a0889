"""``train.compile=step``: the whole micro-batch as one compiled graph equals the eager step, with
no graph break and no recompile while the branch draws change; the chunked decoder head equals
the full head; attention without a mask equals attention with an all-ones mask."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch.testing import assert_close

from elflow.config import ObjectiveConfig, elf_tiny
from elflow.config.train_config import RunConfig, TrainConfig, apply_overrides, run_config_from_dict
from elflow.errors import ELFError
from elflow.model import Attention, DecoderHead, build_model, rope_tables
from elflow.objective import Batch
from elflow.runtime.fused_head_loss import linear_cross_entropy
from elflow.train.forward import TrainForward
from elflow.train.objective_draws import keyed_row_draws
from elflow.train.step import ELFObjective

E, V, L, B = 8, 20, 10, 6

# --- the chunked decoder head ------------------------------------------------------------------


@pytest.mark.parametrize("chunk", [1, 7, 64])
def test_the_chunked_head_equals_the_full_head(chunk):
    torch.manual_seed(0)
    head = DecoderHead(16, E, V)
    h = torch.randn(23, 16, requires_grad=True)
    ids = torch.randint(0, V, (23,))
    weights = torch.rand(23) * (torch.rand(23) > 0.3)  # some tokens weigh 0
    loss, ce = linear_cross_entropy(h, head.proj, head.unembed, ids, weights, chunk=chunk)
    full_ce = F.cross_entropy(head(h).float(), ids, reduction="none")
    full = (full_ce * weights).sum()
    assert_close(ce, full_ce, rtol=1e-6, atol=1e-6)
    assert_close(loss, full, rtol=1e-6, atol=1e-6)
    params = [h, *head.parameters()]
    for a, b in zip(
        torch.autograd.grad(2.5 * loss, params),
        torch.autograd.grad(2.5 * full, params),
        strict=True,
    ):
        assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert not ce.requires_grad


def test_the_head_on_no_tokens_gives_zero_gradients():
    """With no decoder rows the head still runs, so every rank's parameters get gradients."""
    head = DecoderHead(16, E, V)
    h = torch.zeros(0, 16, requires_grad=True)
    loss, _ = linear_cross_entropy(h, head.proj, head.unembed, torch.zeros(0).long(), h[:, 0])
    loss.backward()
    assert loss.item() == 0.0
    assert all(p.grad is not None and not p.grad.any() for p in head.parameters())


def test_no_head_gradients_are_made_without_grad():
    head = DecoderHead(16, E, V)
    h = torch.randn(5, 16, requires_grad=True)
    with torch.no_grad():
        loss, ce = linear_cross_entropy(h, head.proj, head.unembed, torch.ones(5).long(), h[:, 0])
    assert not loss.requires_grad and ce.shape == (5,)


# --- attention without a mask -----------------------------------------------------------------


def test_maskless_attention_equals_all_ones_masked_attention():
    torch.manual_seed(0)
    attn = Attention(32, 4)
    with torch.no_grad():  # RMSNorm weights are made empty (init_weights sets them)
        attn.q_norm.weight.fill_(1.0)
        attn.k_norm.weight.fill_(1.0)
    x = torch.randn(3, 7, 32)
    rot = rope_tables(2, 5, 8, 10000.0, torch.device("cpu"))
    ones = torch.ones(3, 1, 1, 7, dtype=torch.bool)
    assert_close(attn(x, rot, None), attn(x, rot, ones), rtol=1e-6, atol=1e-6)


def test_an_all_ones_host_mask_is_dropped_before_the_network():
    torch.manual_seed(0)
    model = build_model(elf_tiny(encoder_dim=E, vocab_size=V, max_length=12)).eval()
    x_in, t, w = torch.randn(2, L, 2 * E), torch.rand(2), torch.rand(2) + 1
    _, mask = model.embed(x_in, t, w, 0.0, torch.ones(2, L))
    assert mask is None  # so attention runs without one (flash / cuDNN on a GPU)
    padded = torch.ones(2, L)
    padded[1, -3:] = 0
    assert model.embed(x_in, t, w, 0.0, padded)[1] is not None
    assert_close(model(x_in, t, w, 0.0, torch.ones(2, L))[0], model(x_in, t, w, 0.0)[0])


# --- the setting ------------------------------------------------------------------------------


def test_train_compile_takes_three_values_and_old_booleans():
    base = RunConfig()
    for given, expected in [("true", "blocks"), ("false", "none"), ("step", "step")]:
        assert apply_overrides(base, None, [f"train.compile={given}"]).train.compile == expected
    assert run_config_from_dict({"train": {"compile": True}}).train.compile == "blocks"
    with pytest.raises(ELFError, match="'none', 'blocks' or 'step', got 'fast'"):
        TrainConfig(compile="fast")
    with pytest.raises(ELFError, match="fsdp2"):
        TrainConfig(compile="step", parallel="fsdp2")


# --- the compiled step ------------------------------------------------------------------------


def _model():
    torch.manual_seed(0)
    model = build_model(elf_tiny(encoder_dim=E, vocab_size=V, max_length=12)).train()
    with torch.no_grad():  # a fresh flow head is zero: perturb it so every pass matters
        model.final_layer.linear.weight.normal_(0, 0.1)
    return model


def _batches(seed: int = 0) -> list[tuple[Batch, np.ndarray]]:
    """Ten micro-batches whose draws give 0, 1, 2 or 3 decoder rows and 0 to all self-
    conditioned rows (the positions picked from the keyed draws)."""
    pool = np.arange(4000)
    scalars, _ = keyed_row_draws(pool, ObjectiveConfig(), seed)
    dec, sc = scalars[:, 1].numpy() > 0, scalars[:, 2].numpy() > 0
    kinds = {"dec": pool[dec], "sc": pool[~dec & sc], "plain": pool[~dec & ~sc]}
    used = {k: 0 for k in kinds}

    def take(kind: str, n: int) -> list[int]:
        out = kinds[kind][used[kind] : used[kind] + n]
        used[kind] += n
        return list(out)

    # (decoder rows, self-conditioned rows) of each step; the rest plain denoiser rows.
    counts = [(1, 2), (0, 3), (2, 0), (1, 1), (3, 2), (0, 6), (0, 0), (1, 5), (2, 4), (1, 0)]
    g = torch.Generator().manual_seed(seed)
    out = []
    for n_dec, n_sc in counts:
        positions = np.array(
            take("dec", n_dec) + take("sc", n_sc) + take("plain", B - n_dec - n_sc)
        )
        mask = torch.ones(B, L)
        mask[0, -2:] = 0  # some padding: the loss mask matters
        batch = Batch(
            torch.randn(B, L, E, generator=g), torch.randint(0, V, (B, L), generator=g), mask
        )
        out.append((batch, positions))
    return out


def _step(objective, forward, batch, positions):
    forward.zero_grad(set_to_none=True)
    out = objective(forward, batch, positions)
    out.numerator.backward()
    grads = {n: p.grad.clone() for n, p in forward.named_parameters()}
    return out.numerator.detach(), out.stats, grads


@pytest.fixture(scope="session")  # the tiers reorder tests: a module scope could rebuild it
def fp32_run():
    """Ten eager and ten compiled fp32 micro-batches, and dynamo's counters over the compiled."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    cfg = RunConfig(model=elf_tiny(encoder_dim=E, vocab_size=V, max_length=12))
    eager = ELFObjective(cfg)
    compiled = ELFObjective(replace(cfg, train=replace(cfg.train, compile="step")))
    forward = TrainForward(_model())
    batches = _batches()
    first = _step(compiled, forward, *batches[0])
    graphs = counters["stats"]["unique_graphs"]
    with torch._dynamo.config.patch(error_on_recompile=True):
        rest = [_step(compiled, forward, *b) for b in batches[1:]]
    return {
        "eager": [_step(eager, forward, *b) for b in batches],
        "compiled": [first, *rest],
        "graphs_after_first": graphs,
        "graphs": counters["stats"]["unique_graphs"],
        "graph_breaks": dict(counters["graph_break"]),
    }


def _assert_near(a: torch.Tensor, b: torch.Tensor, tol: float, name: str = "") -> None:
    """|a - b| <= tol x the largest |b| (at least 1): fused kernels sum in another order, so a
    tensor's error scales with its largest entries (a gradient of 800 moves by ~1e-3)."""
    error = (a.double() - b.double()).abs().max().item()
    assert error <= tol * max(1.0, b.abs().max().item()), (name, error)


@pytest.mark.slow
@pytest.mark.xdist_group("compiled-step-fp32")  # one worker compiles fp32_run once
def test_the_compiled_step_equals_the_eager_step_in_fp32(fp32_run):
    for (la, sa, ga), (lb, sb, gb) in zip(fp32_run["eager"], fp32_run["compiled"], strict=True):
        _assert_near(lb, la, 1e-5, "loss")
        _assert_near(sb, sa, 1e-5, "stats")
        for name in ga:
            _assert_near(gb[name], ga[name], 1e-5, name)


@pytest.mark.slow
@pytest.mark.xdist_group("compiled-step-fp32")  # one worker compiles fp32_run once
def test_the_compiled_step_has_no_graph_break_and_no_recompile(fp32_run):
    assert fp32_run["graph_breaks"] == {}
    assert fp32_run["graphs_after_first"] == 1
    assert fp32_run["graphs"] == 1  # ten steps, 0 to 3 decoder rows, one graph


@pytest.mark.slow
def test_the_compiled_step_equals_the_eager_step_under_bf16_autocast():
    cfg = RunConfig(model=elf_tiny(encoder_dim=E, vocab_size=V, max_length=12))
    eager = ELFObjective(cfg)
    compiled = ELFObjective(replace(cfg, train=replace(cfg.train, compile="step")))
    forward = TrainForward(_model())
    for batch, positions in _batches(seed=1)[:3]:
        with torch.autocast("cpu", torch.bfloat16):
            la, _, ga = _step(eager, forward, batch, positions)
        with torch.autocast("cpu", torch.bfloat16):
            lb, _, gb = _step(compiled, forward, batch, positions)
        _assert_near(lb, la, 2e-2, "loss")
        for name in ga:
            _assert_near(gb[name], ga[name], 5e-2, name)


# --- the bf16 residual stream (experimental) ----------------------------------------------------


def test_a_bf16_residual_stream_carries_bf16_between_blocks_and_fp32_out():
    model = _model()
    x_in, t, w = torch.randn(2, L, 2 * E), torch.rand(2), torch.rand(2) + 1
    seen = []
    model.blocks[1].register_forward_pre_hook(lambda m, args: seen.append(args[0].dtype))
    with torch.autocast("cpu", torch.bfloat16):
        fp32_stream, _ = model(x_in, t, w, 0.0)
        model.residual_dtype = torch.bfloat16
        bf16_stream, hidden = model(x_in, t, w, 0.0)
    assert seen == [torch.float32, torch.bfloat16]
    assert bf16_stream.dtype == hidden.dtype == torch.float32
    _assert_near(bf16_stream, fp32_stream, 5e-2)
    model(x_in, t, w, 0.0)  # without autocast the stream stays fp32
    assert seen[-1] == torch.float32
    assert apply_overrides(RunConfig(), None, ["train.residual_dtype=bf16"]).train.residual_dtype
    with pytest.raises(ELFError, match="'fp32' or 'bf16', got 'fp16'"):
        TrainConfig(residual_dtype="fp16")


# --- the compiled step through the trainer, under bf16 ------------------------------------------


@pytest.mark.slow
def test_the_compiled_step_trains_like_the_eager_step_under_bf16(assets, tmp_path):
    """Through :func:`train`, bf16: the same losses as eager. (Regression: inductor's 512-bit CPU
    kernels gave the timestep embedders NaN gradients from the first step, on AVX-512.)"""
    import json

    from elflow.train.loop import train
    from tests.train.conftest import resolved
    from tests.train_helpers import run_config

    losses = {}
    for mode in ("none", "step"):
        settings = {"max_steps": 3, "save_every": 100, "precision": "bf16", "compile": mode}
        cfg = resolved(run_config(assets, train=settings), tmp_path)
        train(cfg, tmp_path / mode)
        lines = (tmp_path / mode / "metrics.jsonl").read_text().splitlines()
        losses[mode] = [json.loads(x)["loss"] for x in lines]
    assert len(losses["step"]) == 3
    assert_close(torch.tensor(losses["step"]), torch.tensor(losses["none"]), rtol=1e-3, atol=0)
