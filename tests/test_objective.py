"""The ELF training objective (elflow.objective): the efficient procedure against the reference one,
row counting, draws, loss masking, label drop and an overfit sanity check."""

import copy

import pytest
import torch
from torch.testing import assert_close

from elflow.config import ObjectiveConfig, elf_tiny
from elflow.model import ELF, build_model
from elflow.objective import Batch, elf_loss
from elflow.train.forward import TrainForward
from elflow.train.objective_draws import Draws, sample_draws

E, V, L, B = 8, 20, 10, 6


def _model(seed: int = 0, **overrides) -> ELF:
    torch.manual_seed(seed)
    model = build_model(elf_tiny(encoder_dim=E, vocab_size=V, max_length=12, **overrides))
    # Non-zero flow head, so that every parameter gets a non-trivial gradient.
    g = torch.Generator().manual_seed(seed + 100)
    with torch.no_grad():
        lin = model.final_layer.linear
        lin.weight.copy_(0.2 * torch.randn(lin.weight.shape, generator=g))
        lin.bias.copy_(0.1 * torch.randn(lin.bias.shape, generator=g))
    return model


def _batch(seed: int = 0, conditional: bool = False, label_drop=None, b: int = B) -> Batch:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(L // 2, L + 1, (b,), generator=g)
    lengths[0] = L  # at least one full row
    attention_mask = (torch.arange(L)[None] < lengths[:, None]).float()
    cond_mask = None
    if conditional:
        src = torch.randint(1, L // 2, (b,), generator=g)
        cond_mask = (torch.arange(L)[None] < src[:, None]).float()
    return Batch(
        x=torch.randn(b, L, E, generator=g),
        input_ids=torch.randint(0, V, (b, L), generator=g),
        attention_mask=attention_mask,
        cond_mask=cond_mask,
        label_drop=None if label_drop is None else torch.as_tensor(label_drop, dtype=torch.float),
    )


def _draws(seed: int = 0, cfg: ObjectiveConfig | None = None, b: int = B, **fields) -> Draws:
    """Random draws with some fields replaced by hand (extreme cases)."""
    d = sample_draws(b, L, E, cfg or ObjectiveConfig(), torch.Generator().manual_seed(seed))
    for name, value in fields.items():
        setattr(d, name, torch.as_tensor(value, dtype=torch.float))
    return d


def _mixed(*pattern: float) -> list[float]:
    return list(pattern)


def _grads(model: ELF) -> dict[str, torch.Tensor]:
    return {
        n: (p.grad.clone() if p.grad is not None else torch.zeros_like(p))
        for n, p in model.named_parameters()
    }


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    scale = b.abs().max().item()
    diff = (a - b).abs().max().item()
    if scale == 0.0:
        return diff  # all-zero reference gradient: the other must be (almost) zero too
    return diff / scale


def _run(model: ELF, batch: Batch, draws: Draws, cfg: ObjectiveConfig, procedure: str):
    model.zero_grad(set_to_none=True)
    out = elf_loss(TrainForward(model), batch, draws, cfg, procedure)
    out.loss.backward()
    return out, _grads(model)


# --- efficient == reference ----------------------------------------------------------------------

ONES, ZEROS = [1.0] * B, [0.0] * B
CASES = {
    "all_decoder": (dict(decoder_active=ONES), {}, dict()),
    "no_decoder": (dict(decoder_active=ZEROS, use_self_cond=_mixed(1, 0, 1, 1, 0, 1)), {}, {}),
    "no_self_cond": (dict(use_self_cond=ZEROS, decoder_active=_mixed(0, 1, 0, 0, 1, 0)), {}, {}),
    "late_t": (
        dict(
            t=[0.96, 0.97, 0.99, 0.999, 0.965, 0.98],
            use_self_cond=ONES,
            decoder_active=_mixed(0, 0, 0, 1, 0, 0),
        ),
        {},
        {},
    ),
    "all_conditions_dropped": (
        dict(decoder_active=_mixed(0, 1, 0, 0, 0, 1), use_self_cond=_mixed(1, 1, 0, 1, 1, 0)),
        dict(conditional=True, label_drop=ONES),
        dict(label_drop_prob=0.1),
    ),
    "conditional_eos_padding": (
        dict(decoder_active=_mixed(1, 0, 0, 1, 0, 0), use_self_cond=_mixed(1, 1, 0, 0, 1, 1)),
        dict(conditional=True, label_drop=_mixed(0, 1, 0, 0, 1, 0)),
        dict(label_drop_prob=0.1, pad_with_eos=True, decoder_noise_scale=1.0),
    ),
    "random_draw": ({}, {}, {}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_efficient_matches_reference(case):
    draw_fields, batch_kw, cfg_kw = CASES[case]
    cfg = ObjectiveConfig(**cfg_kw)
    batch = _batch(seed=1, **batch_kw)
    draws = _draws(seed=3, cfg=cfg, **draw_fields)  # seed 3: mixed decoder and SC rows
    model_a = _model()
    model_b = copy.deepcopy(model_a)
    out_a, grads_a = _run(model_a, batch, draws, cfg, "efficient")
    out_b, grads_b = _run(model_b, batch, draws, cfg, "reference")
    for name in ("loss", "l2_loss", "ce_loss", "l2_sum", "ce_sum", "denom"):
        a, b = getattr(out_a, name), getattr(out_b, name)
        assert_close(a, b, rtol=1e-5, atol=1e-6, msg=name)
    assert out_a.loss.item() > 0
    n_sc = int(((draws.use_self_cond > 0) & (draws.decoder_active == 0)).sum())
    assert out_a.num_nograd_rows == n_sc
    assert out_b.num_nograd_rows == 2 * B
    if case == "random_draw":
        assert 0 < n_sc and 0 < draws.decoder_active.sum() < B
    nonzero = 0
    for name in grads_b:
        assert torch.isfinite(grads_a[name]).all(), name
        err = _rel_err(grads_a[name], grads_b[name])
        assert err <= 1e-5, f"{name}: relative gradient error {err:.2e}"
        nonzero += int(grads_b[name].abs().max() > 0)
    assert nonzero > len(grads_b) // 2  # the comparison is not vacuous


def test_unknown_procedure():
    model, batch = _model(), _batch()
    with pytest.raises(ValueError):
        elf_loss(TrainForward(model), batch, _draws(), ObjectiveConfig(), "fast")


# --- row counting --------------------------------------------------------------------------------


class _RowCounter:
    """Counts the rows of every network call made with and without grad."""

    def __init__(self, model: ELF) -> None:
        self.nograd = 0
        self.grad = 0
        self.decoder_rows = 0
        self.decoder_rows_grad = 0
        model.register_forward_pre_hook(self._net)
        model.decoder.register_forward_pre_hook(self._dec)

    def _net(self, module, args):
        if torch.is_grad_enabled():
            self.grad += args[0].shape[0]
        else:
            self.nograd += args[0].shape[0]

    def _dec(self, module, args):
        self.decoder_rows += args[0].shape[0]
        if torch.is_grad_enabled():
            self.decoder_rows_grad += args[0].shape[0]


DEC = [1.0, 0.0, 0.0, 1.0, 0.0, 0.0]
SC = [1.0, 1.0, 0.0, 1.0, 1.0, 0.0]  # denoiser & sc: rows 1 and 4


@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_row_counts(dropout):
    cfg = ObjectiveConfig()
    batch = _batch(seed=3)
    draws = _draws(seed=4, decoder_active=DEC, use_self_cond=SC)
    n_sc = 2
    n_dec = 2
    model = _model(dropout=dropout).train()
    counter = _RowCounter(model)
    out = elf_loss(TrainForward(model), batch, draws, cfg, "efficient")
    expected = n_sc if dropout == 0.0 else 2 * n_sc
    assert out.num_nograd_rows == expected
    assert counter.nograd == expected
    assert counter.grad == B
    assert counter.decoder_rows == n_dec

    ref = _model(dropout=dropout).train()
    counter = _RowCounter(ref)
    out = elf_loss(TrainForward(ref), batch, draws, cfg, "reference")
    assert out.num_nograd_rows == 2 * B
    assert counter.nograd == 2 * B
    assert counter.grad == B
    # The reference computes the V-way head on every row of the trained pass (it may also run it,
    # discarded, in its no-grad passes, as the authors' forward does).
    assert counter.decoder_rows_grad == B
    assert counter.decoder_rows in (B, 3 * B)


def test_no_nograd_pass_without_self_conditioning():
    model = _model()
    counter = _RowCounter(model)
    draws = _draws(seed=5, use_self_cond=ONES, decoder_active=ONES)
    out = elf_loss(TrainForward(model), _batch(), draws, ObjectiveConfig(), "efficient")
    assert out.num_nograd_rows == 0 and counter.nograd == 0
    assert counter.decoder_rows == B
    draws = _draws(seed=5, use_self_cond=ZEROS, decoder_active=ZEROS)
    out = elf_loss(TrainForward(model), _batch(), draws, ObjectiveConfig(), "efficient")
    assert out.num_nograd_rows == 0 and counter.nograd == 0
    assert counter.decoder_rows == B  # unchanged: no decoder rows this time


# --- draws ---------------------------------------------------------------------------------------


def test_sample_draws_reproducible_and_shaped():
    cfg = ObjectiveConfig()
    a = sample_draws(5, 7, 3, cfg, torch.Generator().manual_seed(0))
    b = sample_draws(5, 7, 3, cfg, torch.Generator().manual_seed(0))
    c = sample_draws(5, 7, 3, cfg, torch.Generator().manual_seed(1))
    shapes = {
        "t": (5,),
        "noise": (5, 7, 3),
        "decoder_active": (5,),
        "decoder_lambda": (5, 7, 1),
        "decoder_noise": (5, 7, 3),
        "use_self_cond": (5,),
        "w": (5,),
    }
    for name, shape in shapes.items():
        assert getattr(a, name).shape == shape, name
        assert torch.equal(getattr(a, name), getattr(b, name)), name
    assert not torch.equal(a.noise, c.noise)
    assert not torch.equal(a.t, c.t)


def test_sample_draws_distributions():
    cfg = ObjectiveConfig(decoder_prob=0.2, self_cond_prob=0.5, w_min=0.5, w_max=5.0)
    n = 20000
    d = sample_draws(n, 1, 1, cfg, torch.Generator().manual_seed(0))
    assert ((d.t > 0) & (d.t < 1)).all()
    # t = sigmoid(N(-1.5, 0.8)): the logit has mean -1.5 and std 0.8.
    logit = torch.logit(d.t.double())
    assert abs(logit.mean().item() + 1.5) < 0.03
    assert abs(logit.std().item() - 0.8) < 0.03
    assert ((d.w >= 0.5 - 1e-5) & (d.w <= 5.0 + 1e-5)).all()
    assert d.w.min() < 0.6 and d.w.max() > 4.8
    assert set(d.decoder_active.unique().tolist()) <= {0.0, 1.0}
    assert abs(d.decoder_active.mean().item() - 0.2) < 0.015
    assert abs(d.use_self_cond.mean().item() - 0.5) < 0.015
    assert ((d.decoder_lambda > 0) & (d.decoder_lambda < 1)).all()
    assert abs(torch.logit(d.decoder_lambda.double()).mean().item() - 0.8) < 0.03
    d0 = sample_draws(100, 1, 1, ObjectiveConfig(decoder_prob=0.0, self_cond_prob=1.0))
    assert (d0.decoder_active == 0).all() and (d0.use_self_cond == 1).all()


# --- loss masking --------------------------------------------------------------------------------


class _OutputGrads:
    """Captures d loss / d x_pred and d loss / d (the decoder head's input): the fused head
    never holds logits; a token's input gradient is 0 exactly where its CE weighs 0."""

    def __init__(self, model: ELF) -> None:
        self.x_pred = None
        self.logits = None
        model.final_layer.register_forward_hook(self._keep("x_pred"))
        model.decoder.register_forward_hook(
            lambda m, args, out: self._keep("logits")(m, (), args[0])
        )

    def _keep(self, name):
        def hook(module, args, out):
            if out.requires_grad:
                out.retain_grad()
                setattr(self, name, out)

        return hook


@pytest.mark.parametrize("procedure", ["efficient", "reference"])
@pytest.mark.parametrize("pad_with_eos", [False, True])
def test_loss_mask(procedure, pad_with_eos):
    cfg = ObjectiveConfig(pad_with_eos=pad_with_eos)
    batch = _batch(seed=6, conditional=True)
    assert (batch.attention_mask == 0).any() and (batch.cond_mask == 1).any()
    draws = _draws(seed=7, decoder_active=DEC, use_self_cond=SC)
    model = _model()
    grads = _OutputGrads(model)
    out = elf_loss(TrainForward(model), batch, draws, cfg, procedure)
    out.loss.backward()
    cond = batch.cond_mask.bool()
    pad = ~batch.attention_mask.bool()
    valid = torch.ones_like(pad) if pad_with_eos else ~pad
    assert out.denom.item() == (valid & ~cond).sum().item()
    dec = torch.tensor(DEC).bool()
    g_x = grads.x_pred.grad.abs().sum(-1)  # (B, L)
    g_l = grads.logits.grad.abs().sum(-1)  # (B or B_dec, L)
    if procedure == "efficient":
        full = torch.zeros(B, L)
        full[dec] = g_l
        g_l = full
    # Condition positions never contribute; padding contributes only with EOS padding.
    assert (g_x[cond] == 0).all() and (g_l[cond] == 0).all()
    trained = valid & ~cond
    assert (g_x[dec[:, None] & trained] == 0).all()  # decoder rows have no L2 term
    assert (g_l[~dec[:, None] & trained] == 0).all()  # denoiser rows have no CE term
    assert (g_x[~dec[:, None] & trained] > 0).all()
    assert (g_l[dec[:, None] & trained] > 0).all()
    if pad_with_eos:
        assert (g_x[~dec[:, None] & pad & ~cond] > 0).all()
        assert (g_l[dec[:, None] & pad & ~cond] > 0).all()
    else:
        assert (g_x[pad] == 0).all() and (g_l[pad] == 0).all()


@pytest.mark.parametrize("pad_with_eos", [False, True])
def test_ids_at_padding(pad_with_eos):
    cfg = ObjectiveConfig(pad_with_eos=pad_with_eos)
    batch = _batch(seed=8, conditional=True)
    draws = _draws(seed=9, decoder_active=ONES)
    model = _model()
    loss = elf_loss(TrainForward(model), batch, draws, cfg).loss
    changed = copy.copy(batch)
    ids = batch.input_ids.clone()
    pad = batch.attention_mask == 0
    ids[pad] = (ids[pad] + 7) % V
    ids[batch.cond_mask.bool()] = (ids[batch.cond_mask.bool()] + 3) % V
    changed.input_ids = ids
    loss2 = elf_loss(TrainForward(model), changed, draws, cfg).loss
    if pad_with_eos:
        assert not torch.allclose(loss, loss2)
    else:
        assert_close(loss2, loss, rtol=0, atol=0)


def test_latents_at_padding_reach_valid_positions_through_attention():
    # ELF_SPEC §2.6: training passes no attention mask, so padding latents are attended to and
    # can change the loss even though padded positions carry no loss themselves.
    cfg = ObjectiveConfig()
    batch = _batch(seed=10)
    draws = _draws(seed=11)
    model = _model()
    loss = elf_loss(TrainForward(model), batch, draws, cfg).loss
    changed = copy.copy(batch)
    x = batch.x.clone()
    x[batch.attention_mask == 0] += 3.0
    changed.x = x
    assert not torch.allclose(elf_loss(TrainForward(model), changed, draws, cfg).loss, loss)


# --- label drop ----------------------------------------------------------------------------------


@pytest.mark.parametrize("procedure", ["efficient", "reference"])
def test_dropped_condition_is_invisible(procedure):
    cfg = ObjectiveConfig(label_drop_prob=0.1)
    drop = [1.0, 0.0, 1.0, 0.0, 1.0, 0.0]
    batch = _batch(seed=12, conditional=True, label_drop=drop)
    draws = _draws(seed=13, decoder_active=DEC, use_self_cond=SC)
    model = _model()
    loss = elf_loss(TrainForward(model), batch, draws, cfg, procedure).loss
    cond = batch.cond_mask.bool()
    dropped = torch.tensor(drop).bool()[:, None] & cond
    kept = ~torch.tensor(drop).bool()[:, None] & cond
    changed = copy.copy(batch)
    x = batch.x.clone()
    x[dropped] = torch.randn(int(dropped.sum()), E, generator=torch.Generator().manual_seed(0))
    changed.x = x
    assert_close(
        elf_loss(TrainForward(model), changed, draws, cfg, procedure).loss, loss, rtol=0, atol=0
    )
    # The same change on rows that keep their condition does change the loss.
    x = batch.x.clone()
    x[kept] += 1.0
    changed.x = x
    assert not torch.allclose(
        elf_loss(TrainForward(model), changed, draws, cfg, procedure).loss, loss
    )


# --- overfit sanity ------------------------------------------------------------------------------


def test_overfits_one_batch():
    torch.manual_seed(0)
    model = build_model(elf_tiny(encoder_dim=E, vocab_size=V, max_length=12))
    cfg = ObjectiveConfig(decoder_noise_scale=1.0)
    # One example repeated: the x-prediction is then a function of position only, learnable in
    # a few steps (distinct rows would have to be told apart from noisy states).
    one = _batch(seed=14, b=1)
    batch = Batch(
        x=one.x.expand(8, -1, -1).contiguous(),
        input_ids=one.input_ids.expand(8, -1).contiguous(),
        attention_mask=torch.ones(8, L),
    )
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    g = torch.Generator().manual_seed(15)
    losses = []
    for _ in range(150):
        draws = sample_draws(8, L, E, cfg, g)
        out = elf_loss(TrainForward(model), batch, draws, cfg)
        opt.zero_grad(set_to_none=True)
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(out.loss.item())
    first = sum(losses[:15]) / 15
    last = sum(losses[-15:]) / 15
    assert last < 0.5 * first, (first, last)


@pytest.mark.parametrize("procedure", ["efficient", "reference"])
def test_no_scale_tokens_trains_towards_v_star(procedure):
    """A network without scale tokens cannot see w, so the drawn w must not enter its target."""
    model, batch, cfg = _model(num_scale_tokens=0), _batch(), ObjectiveConfig()
    sc = dict(use_self_cond=ONES, decoder_active=ZEROS)
    losses = [
        elf_loss(
            TrainForward(model), batch, _draws(cfg=cfg, w=[w] * B, **sc), cfg, procedure
        ).loss.item()
        for w in (0.5, 1.0, 5.0)
    ]
    assert losses[0] == losses[1] == losses[2]
    with_tokens = _model()  # the same draws do move an SC-CFG model's loss
    moved = [
        elf_loss(
            TrainForward(with_tokens), batch, _draws(cfg=cfg, w=[w] * B, **sc), cfg
        ).loss.item()
        for w in (0.5, 5.0)
    ]
    assert moved[0] != moved[1]
