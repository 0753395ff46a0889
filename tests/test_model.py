"""The ELF network (elflow.model) and its configuration (elflow.config.model_config)."""

import math

import pytest
import torch
from torch import nn
from torch.testing import assert_close

from elflow import load_model
from elflow.config import ModelConfig, elf_tiny, from_dict, model_preset
from elflow.errors import ELFError
from elflow.model import ELF, RMSNorm, apply_rope, build_model, count_parameters, rope_tables

E, V, MAX_LEN = 8, 20, 12


def _tiny(**overrides) -> ELF:
    cfg = elf_tiny(encoder_dim=E, vocab_size=V, max_length=MAX_LEN, **overrides)
    torch.manual_seed(0)
    model = build_model(cfg).eval()
    # A fresh flow head is zero; perturb it so x_pred carries information.
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        lin = model.final_layer.linear
        lin.weight.copy_(0.1 * torch.randn(lin.weight.shape, generator=g))
        lin.bias.copy_(0.1 * torch.randn(lin.bias.shape, generator=g))
    return model


def _inputs(B: int, L: int, width: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x_in = torch.randn(B, L, width, generator=g)
    t = torch.rand(B, generator=g)
    w = 0.5 + 4.5 * torch.rand(B, generator=g)
    return x_in, t, w


# --- parameter counts (ELF_SPEC §2) --------------------------------------------------------------


@pytest.mark.parametrize(
    ("preset", "expected"),
    [("elf-b", 104_579_940), ("elf-m", 342_540_036), ("elf-l", 652_103_332)],
)
@pytest.mark.parametrize("vocab", [32100, 32128])
def test_parameter_counts(preset, expected, vocab):
    with torch.device("meta"):
        model = ELF(model_preset(preset, encoder_dim=512, vocab_size=vocab))
    assert count_parameters(model) == expected + (14_364 if vocab == 32128 else 0)


# --- construction and initialisation -------------------------------------------------------------


def test_meta_then_to_empty_then_init_matches_build_model():
    cfg = elf_tiny(encoder_dim=E, vocab_size=V, max_length=MAX_LEN)
    with torch.device("meta"):
        model = ELF(cfg)
    assert all(p.is_meta for p in model.parameters())
    model.to_empty(device="cpu")
    torch.manual_seed(123)
    model.init_weights()
    torch.manual_seed(123)
    built = build_model(cfg)
    for (name, a), (_, b) in zip(
        model.state_dict().items(), built.state_dict().items(), strict=True
    ):
        assert torch.isfinite(a).all(), name
        assert_close(a, b, rtol=0, atol=0, msg=name)


def test_init_values():
    torch.manual_seed(0)
    model = build_model(elf_tiny(encoder_dim=E, vocab_size=V, max_length=MAX_LEN))
    assert (model.final_layer.linear.weight == 0).all()
    assert (model.final_layer.linear.bias == 0).all()
    norms = [m for m in model.modules() if isinstance(m, RMSNorm)]
    assert len(norms) == 2 * 2 + 2 * 2 + 1  # per block: norm1, norm2, q_norm, k_norm; final
    for m in norms:
        assert (m.weight == 1).all()
    for name, p in model.named_parameters():
        if name.endswith("bias"):
            assert (p == 0).all(), name
    embedder_weights = {
        f"{emb}.mlp.{i}.weight" for emb in ("t_embedder", "self_cond_cfg_embedder") for i in (0, 2)
    }
    for name in ("t_emb_tokens", "self_cond_cfg_tokens", "mode_tokens", *embedder_weights):
        p = model.get_parameter(name)
        assert abs(p.mean().item()) < 0.01, name
        assert 0.015 < p.std().item() < 0.025, name
    # Every other Linear weight is xavier-uniform: within the bound, and not degenerate.
    for name, m in model.named_modules():
        if isinstance(m, nn.Linear) and f"{name}.weight" not in embedder_weights:
            if name == "final_layer.linear":
                continue
            fan_out, fan_in = m.weight.shape
            bound = math.sqrt(6.0 / (fan_in + fan_out))
            assert m.weight.abs().max() <= bound + 1e-7, name
            assert m.weight.abs().max() > 0.5 * bound, name


def test_fresh_model_predicts_zero():
    torch.manual_seed(0)
    model = build_model(elf_tiny(encoder_dim=E, vocab_size=V, max_length=MAX_LEN))
    x_in, t, w = _inputs(3, 7, 2 * E)
    x_pred, hidden = model(x_in, t, w, 0.0)
    assert x_pred.shape == (3, 7, E) and hidden.shape == (3, 7, 64)
    assert (x_pred == 0).all()
    assert hidden.abs().sum() > 0


# --- sequence length and input validation --------------------------------------------------------


@pytest.mark.parametrize("L", [1, 5, MAX_LEN])
def test_any_length_up_to_max_length(L):
    model = _tiny()
    x_in, t, w = _inputs(2, L, 2 * E)
    x_pred, hidden = model(x_in, t, w, 0.0)
    assert x_pred.shape == (2, L, E)
    assert hidden.shape == (2, L, 64)
    assert torch.isfinite(x_pred).all()


def test_too_long_raises():
    model = _tiny()
    x_in, t, w = _inputs(2, MAX_LEN + 1, 2 * E)
    with pytest.raises(ELFError, match="max_length"):
        model(x_in, t, w, 0.0)


@pytest.mark.parametrize("shape", [(2, 5, E + 1), (2, 5, 3 * E), (5, 2 * E), (1, 2, 5, 2 * E)])
def test_wrong_input_shape_raises(shape):
    model = _tiny()
    with pytest.raises(ELFError):
        model(torch.zeros(shape), 0.5, 1.0, 0.0)


def test_wrong_per_row_shape_raises():
    model = _tiny()
    x_in, _, _ = _inputs(2, 5, 2 * E)
    with pytest.raises(ELFError):
        model(x_in, torch.rand(3), 1.0, 0.0)
    with pytest.raises(ELFError):
        model(x_in, 0.5, 1.0, 0.0, key_mask=torch.ones(2, 4))


# --- configurable prefix token counts -------------------------------------------------------------


@pytest.mark.parametrize(("n_t", "n_s", "n_m"), [(1, 0, 2), (4, 4, 4), (2, 3, 1)])
def test_token_counts(n_t, n_s, n_m):
    model = _tiny(num_time_tokens=n_t, num_scale_tokens=n_s, num_mode_tokens=n_m)
    assert model.cfg.num_prefix_tokens == n_t + n_s + n_m
    assert model.t_emb_tokens.shape == (1, n_t, 64)
    assert model.mode_tokens.shape == (1, n_m, 64)
    assert hasattr(model, "self_cond_cfg_tokens") == (n_s > 0)
    assert hasattr(model, "self_cond_cfg_embedder") == (n_s > 0)
    x_in, t, w = _inputs(2, 6, 2 * E)
    if n_s == 0:
        x_pred, _ = model(x_in, t, None, 0.0)
    else:
        x_pred, _ = model(x_in, t, w, 0.0)
        with pytest.raises(ELFError):
            model(x_in, t, None, 0.0)
        # w reaches the network.
        x_pred_w, _ = model(x_in, t, w + 1.0, 0.0)
        assert not torch.allclose(x_pred, x_pred_w)
    assert x_pred.shape == (2, 6, E)
    assert torch.isfinite(x_pred).all()
    # t reaches the network, and so does the gate.
    assert not torch.allclose(x_pred, model(x_in, t * 0.5, w, 0.0)[0])
    assert not torch.allclose(x_pred, model(x_in, t, w, 1.0)[0])


def test_zero_time_or_mode_tokens_rejected():
    with pytest.raises(ELFError):
        elf_tiny(num_time_tokens=0)
    with pytest.raises(ELFError):
        elf_tiny(num_mode_tokens=0)
    with pytest.raises(ELFError):
        elf_tiny(num_scale_tokens=-1)


# --- decode gate ----------------------------------------------------------------------------------


def test_decode_gate_per_row():
    model = _tiny()
    x_in, t, w = _inputs(2, 6, 2 * E, seed=3)
    x_pred, hidden = model(x_in, t, w, torch.tensor([1.0, 0.0]))
    x1, h1 = model(x_in, t, w, 1.0)
    x0, h0 = model(x_in, t, w, 0.0)
    assert_close(x_pred[0], x1[0], rtol=0, atol=1e-5)
    assert_close(hidden[0], h1[0], rtol=0, atol=1e-5)
    assert_close(x_pred[1], x0[1], rtol=0, atol=1e-5)
    assert_close(hidden[1], h0[1], rtol=0, atol=1e-5)
    assert not torch.allclose(h1, h0, atol=1e-3)
    logits = model.decode_logits(hidden)
    assert logits.shape == (2, 6, V)
    assert_close(logits[0], model.decode_logits(h1)[0], rtol=0, atol=1e-5)


def test_decode_mode_below_t1_allowed_and_differs():
    model = _tiny()
    x_in, _, w = _inputs(2, 6, 2 * E, seed=4)
    _, h_one = model(x_in, 1.0, w, 1.0)
    _, h_half = model(x_in, torch.tensor([0.5, 0.9]), w, 1.0)
    assert torch.isfinite(h_half).all()
    assert not torch.allclose(h_one, h_half, atol=1e-4)
    assert not torch.equal(model.decode_logits(h_one), model.decode_logits(h_half))


def test_decoder_head_skips_final_norm():
    model = _tiny()
    h = torch.randn(2, 3, 64, generator=torch.Generator().manual_seed(0))
    d = model.decoder
    expected = d.unembed(torch.nn.functional.gelu(d.proj(h), approximate="tanh"))
    assert_close(model.decode_logits(h), expected)
    # Scaling the hidden state changes the logits (no normalisation inside the head).
    assert not torch.allclose(model.decode_logits(2 * h), model.decode_logits(h))


# --- key mask -------------------------------------------------------------------------------------


def test_key_mask_hides_masked_keys():
    model = _tiny()
    x_in, t, w = _inputs(2, 8, 2 * E, seed=5)
    key_mask = torch.ones(2, 8)
    key_mask[0, 5:] = 0
    key_mask[1, 2:4] = 0
    out, _ = model(x_in, t, w, 0.0, key_mask)
    changed = x_in.clone()
    changed[key_mask == 0] = 100.0 * torch.randn(int((key_mask == 0).sum()), 2 * E)
    out2, _ = model(changed, t, w, 0.0, key_mask)
    valid = key_mask.bool()
    assert_close(out2[valid], out[valid], rtol=0, atol=1e-5)
    # Without the mask the change does reach the valid positions.
    out3, _ = model(changed, t, w, 0.0)
    assert not torch.allclose(out3[valid], model(x_in, t, w, 0.0)[0][valid], atol=1e-4)


def test_key_mask_never_masks_prefix():
    model = _tiny()
    x_in, t, w = _inputs(2, 5, 2 * E, seed=6)
    key_mask = torch.zeros(2, 5)  # every sequence key masked: only the prefix remains
    out, _ = model(x_in, t, w, 0.0, key_mask)
    assert torch.isfinite(out).all()
    # Queries still see the prefix: the time and the gate still reach them.
    out_t, _ = model(x_in, t * 0.5, w, 0.0, key_mask)
    out_g, _ = model(x_in, t, w, 1.0, key_mask)
    assert not torch.allclose(out, out_t, atol=1e-4)
    assert not torch.allclose(out, out_g, atol=1e-4)


def test_all_ones_key_mask_equals_no_mask():
    model = _tiny()
    x_in, t, w = _inputs(2, 5, 2 * E, seed=7)
    assert_close(model(x_in, t, w, 0.0, torch.ones(2, 5))[0], model(x_in, t, w, 0.0)[0])


# --- batch independence ---------------------------------------------------------------------------


def test_batch_independence():
    model = _tiny()
    x_in, t, w = _inputs(4, 6, 2 * E, seed=8)
    gate = torch.tensor([0.0, 1.0, 0.0, 1.0])
    x_pred, hidden = model(x_in, t, w, gate)
    for i in range(4):
        xi, hi = model(x_in[i : i + 1], t[i : i + 1], w[i : i + 1], gate[i : i + 1])
        assert_close(x_pred[i : i + 1], xi, rtol=0, atol=1e-5)
        assert_close(hidden[i : i + 1], hi, rtol=0, atol=1e-5)


def test_bf16_autocast_runs_only_the_blocks_in_bf16():
    """Spec §3: input projections, prefix embedders and heads stay fp32 under bf16 autocast."""
    model = _tiny()
    x_in, t, w = _inputs(2, 6, 2 * E, seed=3)
    seen = {}
    names = ("self_cond_proj", "text_proj", "t_embedder", "self_cond_cfg_embedder")
    names += ("final_layer", "decoder", "blocks.0.attn.qkv")
    for name in names:
        module = model.get_submodule(name)
        module.register_forward_hook(lambda m, i, o, name=name: seen.__setitem__(name, o.dtype))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        x_pred, hidden = model(x_in, t, w, 0.0)
        logits = model.decode_logits(hidden)
    assert seen.pop("blocks.0.attn.qkv") == torch.bfloat16
    assert set(seen.values()) == {torch.float32} and len(seen) == len(names) - 1, seen
    assert x_pred.dtype == hidden.dtype == logits.dtype == torch.float32
    ref, _ = model(x_in, t, w, 0.0)
    assert (x_pred - ref).abs().max() < 0.05  # the blocks' bf16 rounding only


# --- self-conditioning width ----------------------------------------------------------------------


def test_e_wide_input_skips_self_cond_proj():
    model = _tiny()
    calls = []
    model.self_cond_proj.register_forward_hook(lambda m, i, o: calls.append(1))
    x_in, t, w = _inputs(2, 6, E, seed=9)
    x_pred, _ = model(x_in, t, w, 0.0)
    assert x_pred.shape == (2, 6, E)
    assert calls == []
    model(torch.cat([x_in, x_in], -1), t, w, 0.0)
    assert calls == [1]
    # Same weights without self-conditioning: identical output on the E-wide input.
    plain = ELF(elf_tiny(encoder_dim=E, vocab_size=V, max_length=MAX_LEN, self_condition=False))
    state = {k: v for k, v in model.state_dict().items() if not k.startswith("self_cond_proj.")}
    plain.load_state_dict(state, strict=True)
    assert_close(plain.eval()(x_in, t, w, 0.0)[0], x_pred, rtol=0, atol=0)


def test_no_self_condition_model():
    model = _tiny(self_condition=False)
    assert not hasattr(model, "self_cond_proj")
    assert not any(n.startswith("self_cond_proj") for n, _ in model.named_parameters())
    x_in, t, w = _inputs(2, 6, E)
    assert model(x_in, t, w, 0.0)[0].shape == (2, 6, E)
    with pytest.raises(ELFError):
        model(torch.cat([x_in, x_in], -1), t, w, 0.0)


# --- RoPE -----------------------------------------------------------------------------------------


def _rope(x: torch.Tensor, num_prefix: int, theta: float = 10000.0) -> torch.Tensor:
    """Rotate x (B, H, P + L, hd) with the model's tables, whatever their representation."""
    tables = rope_tables(num_prefix, x.shape[-2] - num_prefix, x.shape[-1], theta, x.device)
    return apply_rope(x, *tables) if isinstance(tables, tuple) else apply_rope(x, tables)


def _explicit_rope(x: torch.Tensor, num_prefix: int, theta: float = 10000.0) -> torch.Tensor:
    """ELF_SPEC §2: pair (2i, 2i+1) of sequence token j rotated by j * theta^(-2i/hd)."""
    hd, n = x.shape[-1], x.shape[-2]
    freqs = theta ** (-torch.arange(0, hd, 2, dtype=torch.float64) / hd)
    pos = (torch.arange(n, dtype=torch.float64) - num_prefix).clamp_min(0)  # prefix: position 0
    angle = pos[:, None] * freqs[None]  # (P + L, hd / 2)
    c, s = torch.cos(angle), torch.sin(angle)
    a, b = x.double()[..., 0::2], x.double()[..., 1::2]
    return torch.stack([a * c - b * s, b * c + a * s], dim=-1).flatten(-2).to(x.dtype)


def test_rope_prefix_identity_and_positions():
    P, L, hd = 7, 5, 16
    x = torch.randn(2, 3, P + L, hd, generator=torch.Generator().manual_seed(0))
    y = _rope(x, P)
    assert y.shape == x.shape
    assert_close(y[:, :, :P], x[:, :, :P], rtol=0, atol=1e-6)  # prefix: identity rotation
    assert_close(y[:, :, P], x[:, :, P], rtol=0, atol=1e-6)  # sequence token 0: angle 0
    assert not torch.allclose(y[:, :, P + 1 :], x[:, :, P + 1 :])
    assert_close(y, _explicit_rope(x, P), rtol=1e-5, atol=1e-5)
    if isinstance(rope_tables(P, L, hd, 10000.0, torch.device("cpu")), tuple):
        cos, sin = rope_tables(P, L, hd, 10000.0, torch.device("cpu"))
        assert (cos[:P] == 1).all() and (sin[:P] == 0).all()


def test_apply_rope_preserves_norms():
    P, L, hd = 3, 6, 8
    x = torch.randn(2, 4, P + L, hd, generator=torch.Generator().manual_seed(1))
    assert_close(_rope(x, P).norm(dim=-1), x.norm(dim=-1), rtol=1e-5, atol=1e-5)


def test_rope_scores_depend_on_relative_position():
    L, hd = 10, 8
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(hd, generator=g), torch.randn(hd, generator=g)
    rq = _rope(q.expand(1, 1, L, hd).contiguous(), 0)[0, 0]
    rk = _rope(k.expand(1, 1, L, hd).contiguous(), 0)[0, 0]
    assert_close(rq[5] @ rk[2], rq[7] @ rk[4], rtol=1e-5, atol=1e-5)
    assert not torch.allclose(rq[5] @ rk[2], rq[5] @ rk[4])


# --- config validation ----------------------------------------------------------------------------


def test_config_validation():
    with pytest.raises(ELFError, match="divisible"):
        ModelConfig(hidden_size=65, num_heads=4)
    with pytest.raises(ELFError, match="dropout"):
        ModelConfig(dropout=-0.1)
    with pytest.raises(ELFError):
        ModelConfig(dropout=1.0)
    with pytest.raises(ELFError, match="even"):
        ModelConfig(hidden_size=20, num_heads=4)  # head_dim 5 cannot be rotated in pairs
    ModelConfig(hidden_size=24, num_heads=4)  # head_dim 6 is fine
    with pytest.raises(ELFError):
        model_preset("elf-xxl")


def test_from_dict():
    cfg = from_dict(ModelConfig, {"hidden_size": 64, "num_heads": 4, "dropout": 0})
    assert cfg.hidden_size == 64 and cfg.dropout == 0.0 and isinstance(cfg.dropout, float)
    with pytest.raises(ELFError, match="hidden_sise"):
        from_dict(ModelConfig, {"hidden_sise": 64})
    with pytest.raises(ELFError, match="depth"):
        from_dict(ModelConfig, {"depth": "12"})
    with pytest.raises(ELFError):
        from_dict(ModelConfig, {"depth": 12.0})
    with pytest.raises(ELFError):
        from_dict(ModelConfig, {"self_condition": 1})
    with pytest.raises(ELFError):
        from_dict(ModelConfig, {"depth": True})
    with pytest.raises(ELFError):
        from_dict(ModelConfig, [("depth", 12)])


# --- activation checkpointing (train.activation_checkpointing) -----------------------------------


def _saved_bytes_and_grads(model: ELF, recompute: bool, seed: int = 0):
    """Bytes autograd keeps for the backward pass, and the gradients, of one forward/backward."""
    model.activation_checkpointing = recompute
    model.zero_grad(set_to_none=True)
    x_in, t, w = _inputs(4, MAX_LEN, 2 * E)
    saved = []

    def pack(tensor):
        saved.append(tensor.numel() * tensor.element_size())
        return tensor

    torch.manual_seed(seed)  # dropout's masks
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        x_pred, hidden = model(x_in, t, w, 0.0)
    (x_pred.square().sum() + model.decode_logits(hidden).logsumexp(-1).sum()).backward()
    return sum(saved), {n: p.grad.clone() for n, p in model.named_parameters()}


def test_activation_checkpointing_keeps_less_and_gives_the_same_gradients(checkpoint_calls):
    calls = checkpoint_calls
    model = _tiny(depth=4, dropout=0.3).train()
    kept, grads = _saved_bytes_and_grads(model, recompute=False)
    assert not calls
    kept_ac, grads_ac = _saved_bytes_and_grads(model, recompute=True)
    assert len(calls) == 4  # one per block
    assert kept_ac < 0.5 * kept  # only each block's input is kept (and the head's activations)
    for name, g in grads.items():  # dropout masks are replayed in the recomputation
        assert torch.equal(g, grads_ac[name]), name
    calls.clear()
    x_in, t, w = _inputs(2, MAX_LEN, 2 * E)
    with torch.no_grad():  # no-grad passes (sampling, the objective's own) never recompute
        model(x_in, t, w)
    model.eval()  # nor does eval mode
    model(x_in, t, w)
    assert not calls


# --- inference: one forward, no state (the bf16 fast path: tests/test_fastpath.py) --------------


def _varied(model: ELF) -> ELF:
    """Non-unit RMSNorm weights, so that folding them into the next Linear is exercised."""
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, RMSNorm):
                module.weight.copy_(1 + 0.3 * torch.randn(module.weight.shape, generator=g))
    return model


def test_rotations_are_cached_and_equal_recomputed_tables():
    model = _tiny()
    cfg, cpu = model.cfg, torch.device("cpu")
    table = model.rotations(7, cpu)
    assert torch.equal(table, rope_tables(cfg.num_prefix_tokens, 7, cfg.head_dim, 10000.0, cpu))
    assert model.rotations(7, cpu) is table  # computed once
    assert _tiny().rotations(7, cpu) is table  # shared: kept outside the model
    assert model.rotations(5, cpu).shape[0] == cfg.num_prefix_tokens + 5


def test_fp32_inference_takes_the_module_path_bitwise():
    """Without autocast nothing changes: no_grad and grad forwards agree bit for bit."""
    model = _varied(_tiny())
    x_in, t, w = _inputs(2, 6, 2 * E, seed=11)
    with torch.no_grad():
        x_pred, hidden = model(x_in, t, w, 0.0)
    ref, ref_hidden = model(x_in, t, w, 0.0)
    assert torch.equal(x_pred, ref) and torch.equal(hidden, ref_hidden)


def test_tables_cached_under_inference_mode_serve_a_later_training_step():
    from elflow.model import _shared_rope_tables

    _shared_rope_tables.cache_clear()  # so that the inference-mode call computes the tables
    model = _tiny()
    x_in, t, w = _inputs(2, 6, 2 * E, seed=16)
    with torch.inference_mode():
        model(x_in, t, w, 0.0)
    model.train()
    model(x_in, t, w, 0.0)[0].sum().backward()  # no "inference tensor saved for backward"
    assert model.blocks[0].attn.qkv.weight.grad is not None


# --- ELF.from_pretrained / save_pretrained (elflow.io.artifact) ----------------------------------


def test_save_pretrained_and_from_pretrained_round_trip(tmp_path):
    from tests.builders import make_uncond

    folder = make_uncond(tmp_path / "made")
    model, config = load_model(folder)
    out = model.save_pretrained(tmp_path / "again", config)
    assert out == tmp_path / "again" and (out / "config.json").is_file()
    again = ELF.from_pretrained(out)
    assert isinstance(again, ELF) and not again.training and again.cfg == model.cfg
    state, loaded = model.state_dict(), again.state_dict()
    assert state.keys() == loaded.keys()
    assert all(torch.equal(state[k], loaded[k]) for k in state)


def test_from_pretrained_is_load_models_network(tmp_path):
    from tests.builders import make_uncond

    folder = make_uncond(tmp_path / "made")
    ref = load_model(folder, use_ema=False)[0].state_dict()
    got = ELF.from_pretrained(str(folder), use_ema=False, device="cpu").state_dict()
    assert ref.keys() == got.keys() and all(torch.equal(ref[k], got[k]) for k in ref)


def test_save_pretrained_checks_the_config(tmp_path):
    from tests.builders import make_uncond

    _, config = load_model(make_uncond(tmp_path / "made"))
    with pytest.raises(ELFError, match="does not match"):
        _tiny().save_pretrained(tmp_path / "other", config)  # another architecture
