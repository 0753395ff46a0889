"""The progressive-distillation objective (elflow.distill.progressive, ELF_SPEC §8): the x-target
against a hand computation (plain and with a projected teacher), its limits (K = 1, tiny spans,
constant teachers), condition handling, the per-row normalisation, the frozen teacher, keyed draws
and round parsing."""

import copy

import pytest
import torch
from torch.testing import assert_close

from elflow.config import ObjectiveConfig, elf_tiny
from elflow.distill.distill_config import DistillConfig, parse_rounds
from elflow.distill.progressive import (
    DistillDraws,
    distill_loss,
    distill_targets,
    sample_distill_draws,
    sample_distill_draws_keyed,
)
from elflow.errors import ELFError
from elflow.flow import euler_step, velocity
from elflow.model import ELF, build_model
from elflow.objective import Batch
from elflow.sampling.denoiser import projector
from elflow.sampling.projection import Projection
from elflow.train.forward import TrainForward

E, V, L, B = 8, 20, 8, 4
T_EPS = 0.05


def _distill(student, teacher, batch, draws, cfg, projection=None):
    """distill_loss with both networks adapted (and the teacher's projector when given)."""
    project = None if projection is None else projector(teacher, projection)
    return distill_loss(TrainForward(student), TrainForward(teacher), batch, draws, cfg, project)


def _model(seed: int = 0) -> ELF:
    torch.manual_seed(seed)
    model = build_model(elf_tiny(encoder_dim=E, vocab_size=V, max_length=L))
    # Non-zero flow head, so that the teacher's predictions (and the student's gradients) are real.
    g = torch.Generator().manual_seed(seed + 100)
    with torch.no_grad():
        lin = model.final_layer.linear
        lin.weight.copy_(0.2 * torch.randn(lin.weight.shape, generator=g))
        lin.bias.copy_(0.1 * torch.randn(lin.bias.shape, generator=g))
    return model.eval()


def _batch(seed: int = 0, conditional: bool = False, label_drop=None) -> Batch:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.tensor([L, L - 3, L - 1, L - 2])
    cond_mask = None
    if conditional:
        cond_mask = (torch.arange(L)[None] < torch.tensor([2, 1, 3, 2])[:, None]).float()
    return Batch(
        x=torch.randn(B, L, E, generator=g),
        input_ids=torch.randint(0, V, (B, L), generator=g),
        attention_mask=(torch.arange(L)[None] < lengths[:, None]).float(),
        cond_mask=cond_mask,
        label_drop=None if label_drop is None else torch.tensor(label_drop, dtype=torch.float),
    )


def _draws(cfg: DistillConfig, seed: int = 0, **fields) -> DistillDraws:
    g = torch.Generator().manual_seed(seed)
    d = sample_distill_draws(B, L, E, cfg.objective, cfg.teacher_substeps, g)
    for name, value in fields.items():
        setattr(d, name, torch.as_tensor(value, dtype=torch.float))
    return d


def _half(model: ELF, z: torch.Tensor, sc: torch.Tensor, t, w, gate=0.0) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.cat([z, sc], -1), t, w, gate)[0]


def test_copied_student_with_one_substep_has_zero_loss():
    teacher = _model(0)
    cfg = DistillConfig(student_steps=64, teacher_substeps=1)
    batch = _batch(conditional=True, label_drop=[1, 0, 0, 1])
    draws = _draws(cfg, decoder_active=[0, 0, 0, 0], use_self_cond=[1, 0, 1, 0])
    out = _distill(copy.deepcopy(teacher), teacher, batch, draws, cfg)
    assert torch.equal(out.row_loss, torch.zeros(B))
    assert out.loss.item() == 0.0 and out.num_rows == B
    # Not vacuous: another student is penalised.
    assert _distill(_model(1), teacher, batch, draws, cfg).loss.item() > 1e-3


@pytest.mark.parametrize("conditional", [False, True])
def test_two_substeps_match_a_hand_computation_and_the_student_step_lands_on_the_teacher(
    conditional: bool,
):
    teacher, student = _model(0), _model(1)
    cfg = DistillConfig(student_steps=16, teacher_substeps=2, teacher_steps=None)
    batch = _batch(3, conditional, label_drop=[0, 1, 0, 0] if conditional else None)
    draws = _draws(cfg, 3, decoder_active=[0, 0, 0, 0], use_self_cond=[1, 0, 0, 1])
    out = _distill(student, teacher, batch, draws, cfg)

    cond = batch.cond_mask.bool() if conditional else torch.zeros(B, L, dtype=torch.bool)
    c3 = cond[..., None]
    x = batch.x
    if conditional:
        x = x.masked_fill(c3 & batch.label_drop.bool()[:, None, None], 0.0)

    def reset(a: torch.Tensor) -> torch.Tensor:
        return torch.where(c3, x, a)

    delta, w = 1 / 16, draws.w
    t_s = draws.u * (1 - delta)
    t_t = t_s + delta
    z_s = reset(t_s[:, None, None] * x + (1 - t_s[:, None, None]) * 2.0 * draws.noise)
    z0 = reset(torch.zeros_like(x))
    use_sc = draws.use_self_cond.bool()[:, None, None]
    sc = reset(torch.where(use_sc, _half(teacher, z_s, z0, t_s, w), 0))
    t_mid = t_s + draws.inner_u[:, 0] * delta
    x0 = reset(_half(teacher, z_s, sc, t_s, w))
    z1 = reset(z_s + ((t_mid - t_s) / (1 - t_s).clamp_min(T_EPS))[:, None, None] * (x0 - z_s))
    x1 = reset(_half(teacher, z1, x0, t_mid, w))
    z2 = reset(z1 + ((t_t - t_mid) / (1 - t_mid).clamp_min(T_EPS))[:, None, None] * (x1 - z1))
    x_target = z_s + ((1 - t_s) / delta)[:, None, None] * (z2 - z_s)
    assert_close(out.x_target, x_target, atol=1e-5, rtol=1e-5)
    assert (out.x_target - x1).abs().max() > 1e-3  # the span formula, not the last x_hat

    # One student Euler step with x_hat = x_target lands on the teacher's endpoint.
    landed = euler_step(z_s, velocity(out.x_target, z_s, t_s, T_EPS), t_s, t_t)
    assert_close(landed, z2, atol=1e-5, rtol=1e-5)
    # And the loss is the x-space MSE against that target, off the condition.
    x_pred = _half(student, z_s, sc, t_s, w)
    row = (x_pred - x_target).pow(2).mean(-1)
    m = batch.attention_mask * ~cond
    assert_close(out.row_loss, (row * m).sum(-1) / m.sum(-1), atol=1e-5, rtol=1e-5)


def _decoded(teacher: ELF, x_hat: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        _, hidden = teacher(torch.cat([x_hat, torch.zeros_like(x_hat)], -1), 1.0, w, 1.0)
        return teacher.decode_logits(hidden).argmax(-1)


def test_projected_teacher_matches_a_hand_computation():
    """project_from T: every teacher x_hat at t >= T (sub-steps and the self-conditioning half) is
    the encoder's latents of its decoded text, cut after the first EOS and padded."""
    teacher, student = _model(0), _model(1)
    T = 0.45
    cfg = DistillConfig(student_steps=16, teacher_substeps=2, teacher_steps=None, project_from=T)
    batch = _batch(11)
    # Row 0 is a decoder row; t_s = u * 15/16 = 0.441 (its interior time 0.472 >= T), 0.469
    # (with the self-conditioning half) and 0.094 (t < T throughout).
    draws = _draws(
        cfg,
        11,
        u=[0.5, 0.47, 0.5, 0.1],
        inner_u=[[0.5]] * B,
        decoder_active=[1, 0, 0, 0],
        use_self_cond=[0, 1, 1, 0],
    )
    table = torch.randn(V, E, generator=torch.Generator().manual_seed(4))
    pad = 0
    eos = int(_decoded(teacher, batch.x, draws.w)[0, 1])  # a token the decoder does produce

    def encode(ids, mask):
        return table[ids] * mask[..., None]

    projection = Projection(encode, eos, pad)
    out = _distill(student, teacher, batch, draws, cfg, projection)

    cut = []

    def project(a: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        ids = _decoded(teacher, a, draws.w)
        is_eos = ids == eos
        last = torch.tensor([int(r.nonzero()[0]) if r.any() else L - 1 for r in is_eos])
        keep = torch.arange(L)[None] <= last[:, None]
        cut.append(~keep.all(1))
        latents = table[ids.masked_fill(~keep, pad)] * keep[..., None]
        return torch.where(rows[:, None, None], latents, a)

    w, delta = draws.w, 1 / 16
    t_s = draws.u * (1 - delta)
    t_t, t_mid = t_s + delta, t_s + 0.5 * delta
    z_s = t_s[:, None, None] * batch.x + (1 - t_s[:, None, None]) * 2.0 * draws.noise
    zero = torch.zeros_like(z_s)
    use_sc = draws.use_self_cond.bool()
    sc = project(_half(teacher, z_s, zero, t_s, w), use_sc & (t_s >= T))
    sc = torch.where(use_sc[:, None, None], sc, 0.0)
    x0 = project(_half(teacher, z_s, sc, t_s, w), t_s >= T)
    z1 = z_s + ((t_mid - t_s) / (1 - t_s))[:, None, None] * (x0 - z_s)
    x1 = project(_half(teacher, z1, x0, t_mid, w), t_mid >= T)
    z2 = z1 + ((t_t - t_mid) / (1 - t_mid))[:, None, None] * (x1 - z1)
    x_target = z_s + ((1 - t_s) / delta)[:, None, None] * (z2 - z_s)
    assert_close(out.x_target[1:], x_target[1:], atol=1e-5, rtol=1e-5)
    assert torch.equal(out.x_target[0], torch.zeros(L, E))  # the decoder row has no target
    assert torch.stack(cut).any()  # some decoded row did end early
    # Against the unprojected teacher: row 3 (t < T throughout) is unchanged, rows 1-2 moved;
    # project_from 1 is the plain objective, projection or not.
    plain = _distill(student, teacher, batch, draws, DistillConfig(16, 2, None)).x_target
    off = DistillConfig(16, 2, None, project_from=1.0)
    unprojected = _distill(student, teacher, batch, draws, off, projection).x_target
    assert torch.equal(unprojected, plain)
    assert torch.equal(out.x_target[3], plain[3])
    assert all((out.x_target[r] - plain[r]).abs().max() > 1e-3 for r in (1, 2))


def test_projected_teacher_needs_an_encoder_and_an_unconditional_batch():
    teacher = _model(0)
    cfg = DistillConfig(16, 2, None, project_from=0.3)
    draws = _draws(cfg)
    projection = Projection(lambda ids, mask: torch.zeros(*ids.shape, E), V - 1, 0)
    with pytest.raises(ELFError, match="needs an unconditional teacher and its projector"):
        _distill(_model(1), teacher, _batch(), draws, cfg)
    with pytest.raises(ELFError, match="needs an unconditional"):
        _distill(_model(1), teacher, _batch(conditional=True), draws, cfg, projection)
    for bad in (-0.1, 1.5, True, "0.3"):
        with pytest.raises(ELFError, match=r"distill\.project_from"):
            DistillConfig(16, 2, None, project_from=bad)


def _targets(teacher, K: int, span: float, seed: int = 0, t_s: float = 0.3, flip: bool = False):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(B, L, E, generator=g)
    z_s = torch.randn(B, L, E, generator=g)
    sc = torch.randn(B, L, E, generator=g)
    cond = torch.zeros(B, L, dtype=torch.bool)
    ts = torch.full((B,), t_s)
    inner = torch.rand(B, K - 1, generator=g)
    inner = inner.flip(-1) if flip else inner
    w = torch.full((B,), 2.0)
    return distill_targets(
        TrainForward(teacher), z_s, sc, x, cond, ts, ts + span, inner, w, T_EPS
    ), (z_s, ts)


def test_tiny_span_targets_the_last_teacher_prediction():
    teacher = _model(0)
    (x_target, _, x_last), _ = _targets(teacher, K=3, span=5e-4)
    assert torch.equal(x_target, x_last)
    (x_target, _, x_last), _ = _targets(teacher, K=3, span=0.05)
    assert (x_target - x_last).abs().max() > 1e-4
    # Interior times are sorted: their order in the draws does not matter.
    (a, _, _), _ = _targets(teacher, K=4, span=0.1, seed=1)
    (b, _, _), _ = _targets(teacher, K=4, span=0.1, seed=1, flip=True)
    assert torch.equal(a, b)
    # Through the loss: N = 2000 gives a span of 5e-4.
    cfg = DistillConfig(student_steps=2000, teacher_substeps=2, teacher_steps=None)
    draws = _draws(cfg, decoder_active=[0, 0, 0, 0])
    out = _distill(_model(1), teacher, _batch(), draws, cfg)
    assert torch.isfinite(out.loss) and out.x_target.abs().max() < 10


def test_one_substep_span_formula_equals_the_teacher_prediction():
    teacher = _model(0)
    (x_target, z_t, x_hat), (z_s, t_s) = _targets(teacher, K=1, span=0.25, t_s=0.5)
    assert torch.equal(x_target, x_hat)  # the spec's literal rule
    formula = z_s + ((1 - t_s) / 0.25)[:, None, None] * (z_t - z_s)  # clamp inactive here
    assert_close(formula, x_hat, atol=1e-5, rtol=1e-5)


def test_constant_teacher_target_is_the_constant():
    """A teacher predicting a constant c moves on a straight line to c: every Euler chain, any K and
    any interior times, gives the x-target c exactly (up to rounding)."""
    teacher = _model(0)
    with torch.no_grad():
        teacher.final_layer.linear.weight.zero_()
    c = teacher.final_layer.linear.bias.detach()
    cfg = DistillConfig(student_steps=4, teacher_substeps=16)
    draws = _draws(cfg, 5, decoder_active=[0, 1, 0, 0])
    out = _distill(_model(1), teacher, _batch(5), draws, cfg)
    for row in (0, 2, 3):
        assert_close(out.x_target[row], c.expand(L, E), atol=1e-4, rtol=1e-4)
    assert torch.equal(out.x_target[1], torch.zeros(L, E))  # decoder row: no target


def test_row_mean_normalisation_and_condition_positions_excluded():
    teacher, student = _model(0), _model(1)
    cfg = DistillConfig(student_steps=8, teacher_substeps=8)
    batch = _batch(7, conditional=True)
    dec = torch.tensor([0.0, 1.0, 0.0, 1.0])
    draws = _draws(cfg, 7, decoder_active=dec, use_self_cond=[0, 0, 0, 0])
    out = _distill(student, teacher, batch, draws, cfg)

    x, c3 = batch.x, batch.cond_mask.bool()[..., None]
    z0 = torch.where(c3, x, 0.0)  # zeros with x at the condition: both branches' SC half
    t_s = draws.u * (1 - 1 / 8)
    z_s = torch.where(c3, x, t_s[:, None, None] * x + (1 - t_s[:, None, None]) * 2 * draws.noise)
    lam = draws.decoder_lambda
    z_dec = lam * x + (1 - lam) * 5.0 * draws.decoder_noise
    with torch.no_grad():
        x_pred = student(torch.cat([z_s, z0], -1), t_s, draws.w, 0.0)[0]
        _, hidden = student(torch.cat([z_dec, z0], -1), 1.0, draws.w, 1.0)
        logits = student.decode_logits(hidden)
    l2 = (x_pred - out.x_target).pow(2).mean(-1)
    ce = torch.nn.functional.cross_entropy(
        logits.transpose(1, 2), batch.input_ids, reduction="none"
    )
    tok = torch.where(dec.bool()[:, None], ce, l2)
    mask = batch.attention_mask * (1 - batch.cond_mask)
    rows = (tok * mask).sum(-1) / mask.sum(-1)
    assert_close(out.row_loss, rows, atol=1e-5, rtol=1e-5)
    assert_close(out.loss, rows.mean(), atol=1e-5, rtol=1e-5)
    assert_close(out.l2_loss, rows[[0, 2]].mean(), atol=1e-5, rtol=1e-5)
    assert_close(out.ce_loss, rows[[1, 3]].mean(), atol=1e-5, rtol=1e-5)
    token_weighted = (tok * mask).sum() / mask.sum()
    assert (out.loss - token_weighted).abs() > 1e-3  # the counts differ, so the two means do

    # Condition positions (excluded from the mask above) carry x itself in the target.
    c = batch.cond_mask.bool()
    for r in (0, 2):
        assert torch.equal(out.x_target[r][c[r]], x[r][c[r]])


def test_label_dropped_rows_are_blind_to_the_condition():
    teacher, student = _model(0), _model(1)
    cfg = DistillConfig(student_steps=16, teacher_substeps=4)
    batch = _batch(9, conditional=True, label_drop=[1, 0, 1, 0])
    draws = _draws(cfg, 9, decoder_active=[0, 0, 1, 0], use_self_cond=[1, 1, 0, 1])
    out = _distill(student, teacher, batch, draws, cfg)
    moved = copy.copy(batch)
    moved.x = torch.where(batch.cond_mask.bool()[..., None], batch.x + 3.0, batch.x)
    out2 = _distill(student, teacher, moved, draws, cfg)
    for row in (0, 2):  # dropped: identical
        assert torch.equal(out.row_loss[row], out2.row_loss[row])
        assert torch.equal(out.x_target[row], out2.x_target[row])
    for row in (1, 3):  # kept: the condition matters
        assert (out.x_target[row] - out2.x_target[row]).abs().max() > 1e-3


def test_teacher_gets_no_gradient_and_stays_unchanged():
    teacher, student = _model(0), _model(1)
    before = {n: p.detach().clone() for n, p in teacher.named_parameters()}
    cfg = DistillConfig(student_steps=16, teacher_substeps=4)
    draws = _draws(cfg, 2, decoder_active=[0, 1, 0, 0], use_self_cond=[1, 0, 1, 0])
    _distill(student, teacher, _batch(2, conditional=True), draws, cfg).loss.backward()
    assert all(p.grad is None for p in teacher.parameters())
    assert all(torch.equal(p, before[n]) for n, p in teacher.named_parameters())
    grads = {n: p.grad for n, p in student.named_parameters()}
    assert all(g is not None for g in grads.values())
    for name in ("final_layer.linear.weight", "decoder.unembed.weight", "blocks.0.attn.qkv.weight"):
        assert grads[name].abs().sum() > 0, name


def test_keyed_draws_do_not_depend_on_the_batch():
    ocfg = ObjectiveConfig()
    a = sample_distill_draws_keyed([3, 7, 11], L, E, ocfg, K=4, seed=5)
    b = sample_distill_draws_keyed([11, 42], L, E, ocfg, K=4, seed=5)
    assert a.inner_u.shape == (3, 3) and a.noise.shape == (3, L, E)
    for f in DistillDraws.__dataclass_fields__:
        if f != "plan":  # host indices of the batch's own rows
            assert torch.equal(getattr(a, f)[2], getattr(b, f)[0]), f
    assert not torch.equal(a.noise[0], a.noise[1])
    assert ((a.inner_u > 0) & (a.inner_u < 1)).all()
    one = sample_distill_draws_keyed([3], L, E, ocfg, K=1, seed=5)
    assert one.inner_u.shape == (1, 0)


def test_parse_rounds():
    assert parse_rounds() == [(16, 4), (8, 8), (4, 16), (2, 32), (1, 64)]
    assert parse_rounds(" 4/16, 2/32") == [(4, 16), (2, 32)]
    assert parse_rounds("16/5", teacher_steps=None) == [(16, 5)]
    for bad in ("16/5", "0/64", "a/b", "16", "16/4/2", "-4/16", "16/4,", "2.0/32"):
        with pytest.raises(ELFError):
            parse_rounds(bad)
    with pytest.raises(ELFError):
        DistillConfig(student_steps=16, teacher_substeps=5)
    with pytest.raises(ELFError):
        DistillConfig(student_steps=0, teacher_substeps=4, teacher_steps=None)
    assert DistillConfig(16, 5, teacher_steps=None).delta == 1 / 16
