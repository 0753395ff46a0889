"""Consistency distillation (elflow.distill.consistency): the objective against a direct row-by-row
reference, and, on Gaussian data whose flow is known in closed form, the self-consistency
identity, the targets' convergence to it and the student's sampler against the teacher's ODE."""

from __future__ import annotations

import copy

import pytest
import torch
from torch.testing import assert_close

from elflow.config import ObjectiveConfig, SamplerConfig
from elflow.distill.consistency import (
    ConsistencyConfig,
    ConsistencySettings,
    consistency_loss,
    consistency_targets,
    sample_consistency_draws,
    sample_consistency_draws_keyed,
)
from elflow.errors import ELFError
from elflow.sampling import renoise_step, sample
from elflow.train.forward import TrainForward
from tests.test_distill_objective import T_EPS, B, E, L, _batch, _model

S = 2.0  # the path's noise scale


def _draws(cfg: ConsistencyConfig, seed: int = 0, **fields):
    d = sample_consistency_draws(B, L, E, cfg, torch.Generator().manual_seed(seed))
    for name, value in fields.items():
        target = d if name in ("t", "span") else d.base
        setattr(target, name, torch.as_tensor(value, dtype=torch.float))
    return d


def _cd(student, teacher, batch, draws, cfg):
    return consistency_loss(TrainForward(student), TrainForward(teacher), batch, draws, cfg)


def _x_hat(model, z, half, t, w, gate=0.0):
    """One row's x-prediction, (L, E), at a scalar t and w."""
    with torch.no_grad():
        x_in = torch.cat([z, half], -1)[None]
        return model(x_in, torch.tensor([t]), torch.tensor([w]), gate)[0][0].float()


def _reference_row(student, teacher, batch, d, cfg, b):
    """The x-target and loss of row b, step by step with Python scalars: the slow, obvious way."""
    x, eps = batch.x[b], d.base.noise[b]
    t, w = float(d.t[b]), float(d.base.w[b])
    t_next = min(t + float(d.span[b]), 1.0)
    z = t * x + (1 - t) * S * eps
    zeros = torch.zeros_like(x)
    half = _x_hat(teacher, z, zeros, t, w) if d.base.use_self_cond[b] > 0 else zeros
    inner = sorted(float(u) for u in d.base.inner_u[b])
    times = [t, *(t + u * (t_next - t) for u in inner), t_next]
    zk, prev = z, half
    for k in range(len(times) - 1):
        x_k = _x_hat(teacher, zk, prev, times[k], w)
        zk = zk + (times[k + 1] - times[k]) / max(1 - times[k], T_EPS) * (x_k - zk)
        prev = x_k
    if t_next >= 1.0:
        target = zk
    else:
        sc = prev if d.base.use_self_cond[b] > 0 else zeros
        target = _x_hat(student, zk, sc, t_next, w)
    pred = _x_hat(student, z, half, t, w)
    valid = batch.attention_mask[b] > 0
    loss = (pred - target).pow(2).mean(-1)[valid].mean()
    return target, loss


def test_objective_matches_a_direct_reference():
    teacher, student = _model(0), _model(1)
    cfg = ConsistencyConfig(spans=(0.25, 1.0), teacher_substeps=3, grid_steps=(1, 2, 4))
    batch = _batch(4)
    draws = _draws(
        cfg, 4, t=[0.0, 0.5, 0.25, 0.75], span=[1.0, 0.25, 0.25, 1.0],
        decoder_active=[0, 0, 0, 1], use_self_cond=[1, 0, 1, 0],
    )  # fmt: skip
    out = _cd(student, teacher, batch, draws, cfg)
    for b in range(3):  # rows 0 (t' = 1), 1 and 2 (bootstrapped, with and without SC)
        target, loss = _reference_row(student, teacher, batch, draws, cfg, b)
        assert_close(out.x_target[b], target, atol=1e-5, rtol=1e-5)
        assert_close(out.row_loss[b], loss, atol=1e-5, rtol=1e-5)
    # Row 3 is a decoder row: cross-entropy of the decode-mode logits, as in every objective.
    with torch.no_grad():
        lam = draws.base.decoder_lambda[3]
        z_dec = lam * batch.x[3] + (1 - lam) * 5.0 * draws.base.decoder_noise[3]
        x_in = torch.cat([z_dec, torch.zeros_like(z_dec)], -1)[None]
        _, h = student(x_in, torch.ones(1), draws.base.w[3:4], 1.0)
        logits = student.decode_logits(h)[0]
    valid = batch.attention_mask[3] > 0
    ce = torch.nn.functional.cross_entropy(logits[valid], batch.input_ids[3][valid])
    assert_close(out.row_loss[3], ce, atol=1e-5, rtol=1e-5)
    assert_close(out.loss, out.row_loss.mean())


def test_copied_student_with_direct_one_substep_targets_has_zero_loss():
    """Span to t = 1 in one teacher step: the target is the teacher's own x-prediction."""
    teacher = _model(0)
    cfg = ConsistencyConfig(spans=(1.0,), teacher_substeps=1)
    draws = _draws(cfg, 1, decoder_active=[0, 0, 0, 0], use_self_cond=[1, 0, 1, 0])
    assert float(draws.t.max()) <= 1 - 1 / 8  # 1 - t >= t_eps: the Euler step reaches x_hat
    out = _cd(copy.deepcopy(teacher), teacher, _batch(1), draws, cfg)
    assert out.loss.item() < 1e-10
    assert _cd(_model(1), teacher, _batch(1), draws, cfg).loss.item() > 1e-3


def test_training_times_are_the_grid_points_and_keyed_draws_are_per_example():
    cfg = ConsistencyConfig(spans=(0.25, 0.5), teacher_substeps=2, grid_steps=(2, 4))
    d = sample_consistency_draws_keyed(range(400), L, E, cfg, seed=3)
    assert set(torch.unique(d.t * 4).tolist()) == {0.0, 1.0, 2.0, 3.0}
    assert set(torch.unique(d.span).tolist()) == {0.25, 0.5}
    assert (d.t == 0).float().mean() > 0.3  # t = 0 is on every grid: the first step weighs most
    again = sample_consistency_draws_keyed([7, 399], L, E, cfg, seed=3)
    assert torch.equal(again.t, d.t[[7, 399]]) and torch.equal(again.span, d.span[[7, 399]])
    logit = ConsistencyConfig(grid_steps=())
    d = sample_consistency_draws_keyed(range(50), L, E, logit, seed=3)
    assert torch.equal(d.t, d.base.u) and len(torch.unique(d.t)) == 50


def test_bad_settings_are_one_line_errors():
    with pytest.raises(ELFError, match=r"spans= must be numbers in \(0, 1\]"):
        ConsistencySettings(spans="0,1")
    with pytest.raises(ELFError, match="spans= must be numbers separated by commas"):
        ConsistencySettings(spans="a")
    with pytest.raises(ELFError, match="teacher_substeps= must be a positive integer"):
        ConsistencySettings(teacher_substeps=0)
    with pytest.raises(ELFError, match="grid_steps= must be positive integers"):
        ConsistencySettings(grid_steps="0,2")


# Gaussian data x ~ N(0, SIGMA^2 I): z_t = t x + (1 - t) S eps has standard deviation
# sd(t) = sqrt(t^2 SIGMA^2 + (1 - t)^2 S^2), the ideal x-prediction is E[x | z_t] =
# t SIGMA^2 / sd(t)^2 z_t, the probability-flow ODE scales z by sd(t') / sd(t), and the exact
# consistency function (the ODE's endpoint) is f(z, t) = SIGMA z / sd(t).
SIGMA = 0.5
EXACT_EPS = 1e-9


def _sd(t: torch.Tensor) -> torch.Tensor:
    return (t.square() * SIGMA**2 + (1 - t).square() * S**2).sqrt()


def _bc(t, z):
    t = torch.as_tensor(t, dtype=z.dtype)
    return t.reshape(-1, *[1] * (z.dim() - 1)) if t.dim() else t


def _posterior_mean(x_in, t, w, gate, head_rows=None):
    """The analytic teacher as a forward function (it ignores the self-conditioning half)."""
    z = x_in[..., :E]
    t = _bc(t, z)
    return t * SIGMA**2 / _sd(t).square() * z, None


def _endpoint(x_in, t, w, gate, head_rows=None):
    """The exact consistency function as a student's forward function."""
    z = x_in[..., :E]
    return SIGMA * z / _sd(_bc(t, z)), None


def test_exact_consistency_function_satisfies_the_identity_and_targets_converge_to_it():
    g = torch.Generator().manual_seed(0)
    n = 6
    z_t = S * torch.randn(n, L, E, generator=g)
    t = torch.tensor([0.0, 0.1, 0.3, 0.5, 0.7, 0.2])
    t_next = torch.tensor([1.0, 0.6, 1.0, 0.75, 1.0, 0.45])
    z_t = z_t * _sd(t)[:, None, None] / S  # on the marginal at t
    cond = torch.zeros(n, L, dtype=torch.bool)
    w, use_sc = torch.zeros(n), torch.zeros(n, dtype=torch.bool)
    f_t = _endpoint(z_t, t, w, 0.0)[0]
    # The identity on the exact flow: f(Φ(z_t; t -> t'), t') = f(z_t, t).
    z_next = z_t * (_sd(t_next) / _sd(t))[:, None, None]
    assert_close(_endpoint(z_next, t_next, w, 0.0)[0], f_t, atol=1e-5, rtol=1e-5)
    # The targets (the analytic teacher's Euler sub-steps, then f at t') converge to f(z_t, t)
    # as the sub-steps shrink: Euler's error, first order (without the clamp of 1 - t, which
    # this teacher's bounded velocity does not need).
    errors = []
    for K in (4, 16, 64):
        inner = (torch.arange(1, K) / K).expand(n, -1)  # evenly spaced sub-steps
        target = consistency_targets(
            _posterior_mean, _endpoint, z_t, torch.zeros_like(z_t), z_t, cond, t, t_next,
            inner, w, use_sc, EXACT_EPS,
        )  # fmt: skip
        errors.append((target - f_t).abs().max().item())
    assert errors[0] > 3.3 * errors[1] and errors[1] > 3.3 * errors[2], errors
    assert errors[2] < 0.03 * f_t.abs().max().item(), errors


def _gaussian_samples(denoise, steps: int, sampler: str, n: int = 4000):
    gens = [torch.Generator().manual_seed(i) for i in range(n)]
    cfg = SamplerConfig(steps=steps, sampler=sampler, time_grid="uniform", w=1.0)
    out = sample(denoise, lambda z: z.argmax(-1), gens, (1, 1), cfg, S, t_eps=T_EPS)
    return out.z.flatten()


def _denoiser(forward):
    def denoise(z, x_prev, t):
        x_hat = forward(z, t, None, 0.0)[0]
        v = (x_hat - z) / _bc(torch.clamp(1 - t, min=EXACT_EPS), z)
        return x_hat, v

    return denoise


def test_the_students_sampler_agrees_with_the_teachers_ode_and_keeps_the_data_law():
    # One student step from the same noise lands where the teacher's ODE does with many steps.
    teacher_ode = _gaussian_samples(_denoiser(_posterior_mean), 400, "ode", 200)
    student_one = _gaussian_samples(_denoiser(_endpoint), 1, "renoise", 200)
    assert_close(student_one, teacher_ode, atol=1e-3, rtol=1e-2)  # Euler's O(1/400)
    # At 4 steps the re-noising sampler keeps the data's law; Euler steps on the consistency
    # function do not (they keep the first step's noise: the variance grows).
    renoise = _gaussian_samples(_denoiser(_endpoint), 4, "renoise")
    euler = _gaussian_samples(_denoiser(_endpoint), 4, "ode")
    assert abs(renoise.std().item() - SIGMA) < 0.03 and abs(renoise.mean().item()) < 0.03
    assert euler.std().item() > SIGMA + 0.2


def test_renoise_step_is_the_interpolation_of_the_prediction():
    from elflow.sampling import Condition, StepContext

    g = torch.Generator().manual_seed(1)
    z, noise = torch.randn(2, L, E, generator=g), torch.randn(2, L, E, generator=g)
    x_hat = torch.randn(2, L, E, generator=g)
    mask = torch.zeros(2, L)
    mask[:, 0] = 1
    cond = Condition(latents=torch.full((2, L, E), 7.0), mask=mask)
    ctx = StepContext(SamplerConfig(), S, T_EPS, cond, lambda: noise)
    t, t_next = torch.tensor([0.0, 0.2]), torch.tensor([0.5, 0.6])
    z_next, x_out = renoise_step(lambda *a: (x_hat, None), z, z, t, t_next, ctx)
    want = t_next[:, None, None] * x_hat + (1 - t_next[:, None, None]) * S * noise
    assert_close(z_next[:, 1:], want[:, 1:])
    assert torch.equal(z_next[:, 0], cond.latents[:, 0]) and x_out is x_hat


def test_objective_settings_fill_the_objective():
    cfg = ConsistencyConfig.of(ConsistencySettings(spans="0.5,1", grid_steps=""), ObjectiveConfig())
    assert cfg.spans == (0.5, 1.0) and cfg.grid_steps == () and cfg.teacher_substeps == 16
