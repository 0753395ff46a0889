"""Sampler steps, guidance and the full sampling loop (elflow.sampling.sample_loop)."""

import itertools
from dataclasses import replace
from functools import partial

import pytest
import torch
from torch.testing import assert_close

from elflow.config import SamplerConfig, elf_tiny
from elflow.errors import ELFError
from elflow.flow import uniform_grid, velocity
from elflow.model import ELF, build_model
from elflow.sampling import (
    Condition,
    heun_step,
    ode_step,
    sample_generators,
    sde_step,
)
from elflow.sampling.denoiser import decode_tokens, make_denoiser, sample_model
from elflow.sampling.projection import Projection, project_denoiser, text_rows

E, V, L = 8, 20, 6


def _model(**overrides) -> ELF:
    torch.manual_seed(0)
    model = build_model(elf_tiny(encoder_dim=E, vocab_size=V, max_length=12, **overrides)).eval()
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():  # a fresh flow head predicts 0; give it something to say
        lin = model.final_layer.linear
        lin.weight.copy_(0.3 * torch.randn(lin.weight.shape, generator=g))
        lin.bias.copy_(0.3 * torch.randn(lin.bias.shape, generator=g))
    return model


def _condition(b: int, seed: int = 0) -> Condition:
    g = torch.Generator().manual_seed(seed)
    src = torch.tensor([2, 3, 1, 2, 3, 1][:b])
    mask = (torch.arange(L)[None] < src[:, None]).float()
    return Condition(latents=torch.randn(b, L, E, generator=g), mask=mask)


def _slice(cond: Condition | None, i: int) -> Condition | None:
    if cond is None:
        return None
    return Condition(cond.latents[i : i + 1], cond.mask[i : i + 1])


class _CallCounter:
    def __init__(self, model: ELF) -> None:
        self.rows: list[int] = []
        model.register_forward_pre_hook(lambda m, args: self.rows.append(args[0].shape[0]))


# --- analytic tests of the steps -----------------------------------------------------------------


def _constant_denoiser(c: torch.Tensor, t_eps: float = 1e-6):
    def denoise(z, x_prev, t):
        x = c.expand_as(z)
        return x, velocity(x, z, t, t_eps)

    return denoise


@pytest.mark.parametrize("grid_kind", ["uniform", "random"])
def test_euler_lands_on_constant_prediction(grid_kind):
    g = torch.Generator().manual_seed(0)
    B, N = 3, 8
    c = torch.randn(B, L, E, generator=g)
    if grid_kind == "uniform":
        grid = uniform_grid(N, B)
    else:
        inner = torch.sort(torch.rand(B, N - 1, generator=g) * 0.95, dim=-1).values
        grid = torch.cat([torch.zeros(B, 1), inner, torch.ones(B, 1)], -1)
    z0 = 2.0 * torch.randn(B, L, E, generator=g)
    z, x_prev = z0, torch.zeros_like(z0)
    denoise = _constant_denoiser(c)
    for k in range(N):
        t = grid[:, k]
        z, x_prev = ode_step(denoise, z, x_prev, t, grid[:, k + 1])
        # Every intermediate state lies on the straight line from z0 to c.
        tb = grid[:, k + 1, None, None]
        assert_close(z, (1 - tb) * z0 + tb * c, rtol=1e-4, atol=1e-4)
        assert_close(x_prev, c.expand_as(z))
    assert_close(z, c, rtol=0, atol=1e-5)


@pytest.mark.parametrize("gamma", [0.5, 1.5, 3.0])
def test_sde_then_final_euler_lands_on_constant_prediction(gamma):
    g = torch.Generator().manual_seed(1)
    B, N = 2, 6
    c = torch.randn(B, L, E, generator=g)
    grid = uniform_grid(N, B)
    z, x_prev = 2.0 * torch.randn(B, L, E, generator=g), torch.zeros(B, L, E)
    denoise = _constant_denoiser(c)
    for k in range(N - 1):
        noise = torch.randn(B, L, E, generator=g)
        z, x_prev = sde_step(denoise, z, x_prev, grid[:, k], grid[:, k + 1], gamma, noise, 2.0)
    z, _ = ode_step(denoise, z, x_prev, grid[:, N - 1], grid[:, N])
    assert_close(z, c, rtol=0, atol=1e-5)


@torch.no_grad()
def test_sde_gamma_zero_equals_ode():
    model = _model()
    g = torch.Generator().manual_seed(2)
    z, x_prev = torch.randn(3, L, E, generator=g), torch.randn(3, L, E, generator=g)
    t, t_next = torch.tensor([0.1, 0.4, 0.7]), torch.tensor([0.3, 0.5, 0.95])
    noise = torch.randn(3, L, E, generator=g)
    for cond, cfg in [(None, 1.0), (_condition(3), 2.0)]:
        if cond is not None:  # as in the loop, the state holds the condition at its positions
            c3 = cond.mask.bool()[..., None]
            z, x_prev = torch.where(c3, cond.latents, z), torch.where(c3, cond.latents, x_prev)
        denoise = make_denoiser(model, 3.0, 0.05, cond, cfg)
        z_ode, x_ode = ode_step(denoise, z, x_prev, t, t_next)
        z_sde, x_sde = sde_step(denoise, z, x_prev, t, t_next, 0.0, noise, 2.0, cond)
        assert torch.equal(z_sde, z_ode) and torch.equal(x_sde, x_ode)
        # ... and gamma > 0 does not.
        z_sde, _ = sde_step(denoise, z, x_prev, t, t_next, 1.5, noise, 2.0, cond)
        assert not torch.allclose(z_sde, z_ode)


def _smooth_denoiser(z, x_prev, t):
    x_hat = torch.sin(z) + t[:, None, None]
    return x_hat, velocity(x_hat, z, t, 1e-6)


def _integrate(step, steps: int, z0: torch.Tensor, t_end: float = 0.5) -> torch.Tensor:
    grid = torch.linspace(0.0, t_end, steps + 1, dtype=torch.float64)
    z, x_prev = z0, torch.zeros_like(z0)
    B = z0.shape[0]
    for k in range(steps):
        t, t_next = grid[k].expand(B), grid[k + 1].expand(B)
        z, x_prev = step(_smooth_denoiser, z, x_prev, t, t_next)
    return z


def _rk4(steps: int, z0: torch.Tensor, t_end: float = 0.5) -> torch.Tensor:
    def f(z, t):
        tt = torch.full((z.shape[0],), t, dtype=torch.float64)
        return _smooth_denoiser(z, None, tt)[1]

    h, z = t_end / steps, z0
    for k in range(steps):
        t = k * h
        k1 = f(z, t)
        k2 = f(z + 0.5 * h * k1, t + 0.5 * h)
        k3 = f(z + 0.5 * h * k2, t + 0.5 * h)
        k4 = f(z + h * k3, t + h)
        z = z + h / 6 * (k1 + 2 * k2 + 2 * k3 + k4)
    return z


def test_heun_is_second_order_and_euler_first():
    z0 = 2.0 * torch.randn(2, 4, 3, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    ref = _rk4(1024, z0)
    assert_close(_rk4(512, z0), ref, rtol=0, atol=1e-12)  # the reference has converged
    for step, lo, hi in [(heun_step, 3.0, 5.0), (ode_step, 1.6, 2.4)]:
        errs = [(_integrate(step, n, z0) - ref).abs().max().item() for n in (8, 16, 32)]
        for coarse, fine in itertools.pairwise(errs):
            assert lo < coarse / fine < hi, (step.__name__, errs)


def test_heun_passes_predictor_x_hat_to_corrector():
    seen = []

    def denoise(z, x_prev, t):
        seen.append((x_prev.clone(), t.clone()))
        x_hat = torch.full_like(z, float(len(seen)))
        return x_hat, velocity(x_hat, z, t, 1e-6)

    z = torch.zeros(1, 2, 3)
    x_prev = torch.full_like(z, -1.0)
    _, x_out = heun_step(denoise, z, x_prev, torch.tensor([0.2]), torch.tensor([0.6]))
    assert len(seen) == 2
    assert (seen[0][0] == -1).all() and (seen[1][0] == 1).all()  # corrector sees predictor's x_hat
    assert_close(seen[1][1], torch.tensor([0.6]))
    assert (x_out == 2).all()


# --- make_denoiser --------------------------------------------------------------------------------


def test_make_denoiser_unconditional():
    model = _model()
    g = torch.Generator().manual_seed(3)
    z, x_prev = torch.randn(2, L, E, generator=g), torch.randn(2, L, E, generator=g)
    t = torch.rand(2, generator=g)
    x_hat, v = make_denoiser(model, 2.0, 0.05)(z, x_prev, t)
    with torch.no_grad():
        expected = model(torch.cat([z, x_prev], -1), t, 2.0, 0.0)[0]
    assert_close(x_hat, expected)
    assert_close(v, velocity(expected, z, t, 0.05))


@pytest.mark.parametrize("cfg", [1.0, 2.0, 0.0])
def test_make_denoiser_cfg_equals_two_separate_calls(cfg):
    model = _model()
    B = 3
    cond = _condition(B, seed=4)
    c3 = cond.mask.bool()[..., None]
    g = torch.Generator().manual_seed(5)
    z = torch.where(c3, cond.latents, torch.randn(B, L, E, generator=g))
    x_prev = torch.where(c3, cond.latents, torch.randn(B, L, E, generator=g))
    t = torch.tensor([0.1, 0.5, 0.99])
    t_eps = 0.05
    x_hat, v = make_denoiser(model, 3.0, t_eps, cond, cfg)(z, x_prev, t)
    with torch.no_grad():
        x_c = model(torch.cat([z, x_prev], -1), t, 3.0, 0.0)[0]
        z_u, xp_u = z.masked_fill(c3, 0.0), x_prev.masked_fill(c3, 0.0)
        x_u = model(torch.cat([z_u, xp_u], -1), t, 3.0, 0.0)[0]
    v_c = velocity(x_c, z, t, t_eps)
    v_u = velocity(x_u, z_u, t, t_eps)
    expected_v = torch.where(c3, 0.0, v_u + cfg * (v_c - v_u))
    expected_x = torch.where(c3, cond.latents, x_u + cfg * (x_c - x_u))
    if cfg == 1.0:
        expected_v = torch.where(c3, 0.0, v_c)
        expected_x = torch.where(c3, cond.latents, x_c)
    assert_close(v, expected_v, rtol=1e-5, atol=1e-4)
    assert_close(x_hat, expected_x, rtol=1e-5, atol=1e-5)
    assert (v[c3.expand_as(v)] == 0).all()
    # One time for the whole batch (a 0-dim t, as ELF.forward takes) gives the per-row result.
    same = torch.full((B,), 0.5)
    per_row = make_denoiser(model, 3.0, t_eps, cond, cfg)(z, x_prev, same)
    scalar = make_denoiser(model, 3.0, t_eps, cond, cfg)(z, x_prev, torch.tensor(0.5))
    assert_close(scalar[0], per_row[0])
    assert_close(scalar[1], per_row[1])


# --- the full loop --------------------------------------------------------------------------------

LOOP_CASES = [
    ("ode", "uniform", False),
    ("sde", "logit_normal", False),
    ("heun", "logit_normal", False),
    ("ode", "logit_normal", True),
    ("sde", "uniform", True),
    ("heun", "uniform", True),
]


@pytest.mark.parametrize(("sampler", "grid", "conditional"), LOOP_CASES)
def test_sample_independent_of_batch(sampler, grid, conditional):
    model = _model()
    cfg = SamplerConfig(steps=5, sampler=sampler, time_grid=grid, cfg=2.0 if conditional else 1.0)
    cond = _condition(4) if conditional else None
    batch = sample_model(model, sample_generators(7, [0, 1, 2, 3]), L, cfg, cond=cond)
    assert batch.tokens.shape == (4, L) and batch.z.shape == (4, L, E)
    for i in range(4):
        single = sample_model(model, sample_generators(7, [i]), L, cfg, cond=_slice(cond, i))
        assert_close(single.z, batch.z[i : i + 1], rtol=1e-4, atol=1e-4)
        assert torch.equal(single.tokens, batch.tokens[i : i + 1])
    # Samples differ from each other and from another seed's.
    assert not torch.allclose(batch.z[0], batch.z[1])
    other = sample_model(model, sample_generators(8, [0, 1, 2, 3]), L, cfg, cond=cond)
    assert not torch.allclose(other.z, batch.z)
    # Same seed, same samples.
    again = sample_model(model, sample_generators(7, [0, 1, 2, 3]), L, cfg, cond=cond)
    assert torch.equal(again.z, batch.z) and torch.equal(again.tokens, batch.tokens)


def test_sample_generators_depend_on_seed_and_index():
    a = [torch.randn(3, generator=g) for g in sample_generators(0, [0, 1, 2])]
    b = [torch.randn(3, generator=g) for g in sample_generators(0, [2])]
    c = [torch.randn(3, generator=g) for g in sample_generators(1, [2])]
    assert torch.equal(a[2], b[0])
    assert not torch.equal(a[0], a[1]) and not torch.equal(b[0], c[0])


@pytest.mark.parametrize("sampler", ["ode", "sde", "heun"])
def test_trajectory(sampler):
    model = _model()
    N = 4
    cfg = SamplerConfig(steps=N, sampler=sampler)
    plain = sample_model(model, sample_generators(3, [0, 1]), L, cfg)
    traj = sample_model(model, sample_generators(3, [0, 1]), L, cfg, trajectory=True)
    assert plain.trajectory is None
    assert traj.trajectory.shape == (N, 2, L)
    assert traj.trajectory.dtype == torch.long
    assert ((traj.trajectory >= 0) & (traj.trajectory < V)).all()
    assert torch.equal(traj.tokens, plain.tokens)
    assert torch.equal(traj.z, plain.z)


def test_decode_tokens():
    model = _model()
    z = torch.randn(2, L, E, generator=torch.Generator().manual_seed(6))
    tokens = decode_tokens(model, z, 3.0)
    with torch.no_grad():
        _, hidden = model(torch.cat([z, torch.zeros_like(z)], -1), 1.0, 3.0, 1.0)
        expected = model.decode_logits(hidden).argmax(-1)
    assert torch.equal(tokens, expected)
    assert tokens.shape == (2, L)


@pytest.mark.parametrize("sampler", ["ode", "sde", "heun", "pc"])
@pytest.mark.parametrize("cfg", [1.0, 2.0])
def test_network_calls_and_rows(sampler, cfg):
    model = _model()
    counter = _CallCounter(model)
    B, N = 3, 4
    sampler_cfg = SamplerConfig(steps=N, sampler=sampler, cfg=cfg)
    sample_model(model, sample_generators(0, range(B)), L, sampler_cfg, cond=_condition(B))
    assert (
        len(counter.rows) == SamplerConfig(steps=N, sampler=sampler).nfe + 1
    )  # + the final decode
    step_rows = 2 * B if cfg != 1.0 else B
    assert counter.rows[:-1] == [step_rows] * SamplerConfig(steps=N, sampler=sampler).nfe
    assert counter.rows[-1] == B  # the decode is never guided


def test_unconditional_calls_ignore_cfg():
    model = _model()
    counter = _CallCounter(model)
    sample_model(
        model, sample_generators(0, [0, 1]), L, SamplerConfig(steps=3, sampler="ode", cfg=2.0)
    )
    assert counter.rows == [2, 2, 2, 2]


@pytest.mark.parametrize("sampler", ["ode", "sde", "heun", "pc"])
@pytest.mark.parametrize("cfg", [1.0, 2.0])
def test_condition_positions_stay_clean(sampler, cfg):
    model = _model()
    cond = _condition(3, seed=9)
    out = sample_model(
        model,
        sample_generators(1, range(3)),
        L,
        SamplerConfig(steps=4, sampler=sampler, cfg=cfg),
        cond=cond,
    )
    c3 = cond.mask.bool()[..., None].expand_as(out.z)
    assert torch.equal(out.z[c3], cond.latents[c3])
    assert not torch.allclose(out.z[~c3], torch.zeros_like(out.z[~c3]))


def test_sample_without_scale_tokens():
    model = _model(num_scale_tokens=0)
    out = sample_model(model, sample_generators(0, [0, 1]), L, SamplerConfig(steps=3))
    assert out.tokens.shape == (2, L) and torch.isfinite(out.z).all()


def test_sample_one_step():
    model = _model()
    counter = _CallCounter(model)
    for sampler in ("ode", "sde", "heun", "pc"):
        out = sample_model(
            model, sample_generators(0, [0]), L, SamplerConfig(steps=1, sampler=sampler)
        )
        assert torch.isfinite(out.z).all()
    assert counter.rows == [1, 1] * 4


def test_nfe():
    assert SamplerConfig(steps=32, sampler="ode").nfe == 32
    assert SamplerConfig(steps=32, sampler="sde").nfe == 32
    assert SamplerConfig(steps=32, sampler="heun").nfe == 63
    assert SamplerConfig(steps=1, sampler="heun").nfe == 1
    assert SamplerConfig(steps=1, sampler="ode").nfe == 1
    assert SamplerConfig(steps=32, sampler="pc").nfe == 63


# --- projected sampling (an elflow addition) ----------------------------------------------------


def test_text_rows_cut_after_the_first_eos():
    tokens = torch.tensor([[5, 7, 2, 9, 2, 4], [5, 6, 7, 8, 9, 4], [2, 3, 3, 3, 3, 3]])
    ids, mask = text_rows(tokens, eos_id=2, pad_id=0)
    assert ids.tolist() == [[5, 7, 2, 0, 0, 0], [5, 6, 7, 8, 9, 4], [2, 0, 0, 0, 0, 0]]
    assert mask.tolist() == [[1, 1, 1, 0, 0, 0], [1] * 6, [1, 0, 0, 0, 0, 0]]


class _TableEncoder:
    """encode(ids, mask): a fixed embedding table, recording every call's (ids, mask)."""

    def __init__(self) -> None:
        self.table = torch.randn(V, E, generator=torch.Generator().manual_seed(9))
        self.calls: list[tuple[torch.Tensor, torch.Tensor]] = []

    def __call__(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        self.calls.append((ids, mask))
        return self.table[ids] * mask[..., None]


def test_projection_replaces_late_estimates_by_their_encoded_text():
    model = _model()
    enc = _TableEncoder()
    gens = lambda: sample_generators(4, [0, 1])
    base = SamplerConfig(steps=4, sampler="ode", time_grid="uniform")  # t = 0, .25, .5, .75
    plain = sample_model(model, gens(), L, base)
    # Only the last step's estimate (t 0.75) is projected; the final Euler step lands on it.
    proj = Projection(enc, eos_id=2, pad_id=0)
    late = sample_model(model, gens(), L, replace(base, project_from=0.7), projection=proj)
    assert len(enc.calls) == 1
    ids, mask = enc.calls[0]
    assert ids.shape == (2, L) and ((ids == 2).sum(1) <= 1).all()  # cut at the first EOS
    assert_close(late.z, enc.table[ids] * mask[..., None], rtol=1e-5, atol=1e-5)
    assert not torch.allclose(late.z, plain.z)
    # A threshold above every grid time changes nothing and never encodes.
    enc.calls.clear()
    none = sample_model(model, gens(), L, replace(base, project_from=0.8), projection=proj)
    assert enc.calls == [] and torch.equal(none.z, plain.z)
    # From t 0, every step encodes.
    sample_model(model, gens(), L, replace(base, project_from=0.0), projection=proj)
    assert len(enc.calls) == 4


@pytest.mark.parametrize("sampler", ["sde", "heun"])
def test_projected_sample_independent_of_batch(sampler):
    """Per-sample time grids project different rows at a step; a sample still depends on
    (seed, index) only."""
    model = _model()
    enc = _TableEncoder()
    proj = Projection(enc, eos_id=2, pad_id=0)
    cfg = SamplerConfig(steps=5, sampler=sampler, gamma=1.0, time_mean=0.0, project_from=0.5)
    batch = sample_model(model, sample_generators(7, [0, 1, 2, 3]), L, cfg, projection=proj)
    assert any(0 < len(ids) < 4 for ids, _ in enc.calls)  # some step projected some rows only
    for i in range(4):
        single = sample_model(model, sample_generators(7, [i]), L, cfg, projection=proj)
        assert_close(single.z, batch.z[i : i + 1], rtol=1e-4, atol=1e-4)
        assert torch.equal(single.tokens, batch.tokens[i : i + 1])
    plain = sample_model(
        model, sample_generators(7, [0, 1, 2, 3]), L, replace(cfg, project_from=1.0)
    )
    assert not torch.allclose(plain.z, batch.z)


def test_projection_needs_an_encoder_and_no_condition():
    model = _model()
    cfg = SamplerConfig(steps=2, project_from=0.3)
    with pytest.raises(ELFError, match=r"projection=pipe\.projection\(\)"):
        sample_model(model, sample_generators(0, [0]), L, cfg)
    proj = Projection(_TableEncoder(), eos_id=2, pad_id=0)
    with pytest.raises(ELFError, match="unconditional model"):
        sample_model(model, sample_generators(0, [0]), L, cfg, cond=_condition(1), projection=proj)
    with pytest.raises(ELFError, match=r"project_from must be in \[0, 1\]"):
        SamplerConfig(project_from=1.5)


def test_project_denoiser_with_a_scalar_time_and_per_row_w():
    model = _model()
    enc = _TableEncoder()
    w = torch.tensor([1.0, 3.0])
    denoise = make_denoiser(model, w, 0.05)
    projected = project_denoiser(
        denoise, partial(decode_tokens, model), w, 0.05, Projection(enc, 2, 0), project_from=0.5
    )
    g = torch.Generator().manual_seed(3)
    z, x_prev = torch.randn(2, L, E, generator=g), torch.randn(2, L, E, generator=g)
    x_early, _ = projected(z, x_prev, torch.tensor(0.4))
    assert_close(x_early, denoise(z, x_prev, torch.tensor(0.4))[0])
    assert enc.calls == []
    x_late, v_late = projected(z, x_prev, torch.tensor(0.6))
    ids, mask = enc.calls[0]
    expected_ids = decode_tokens(model, denoise(z, x_prev, torch.tensor(0.6))[0], w)
    assert torch.equal(ids, text_rows(expected_ids, 2, 0)[0])  # each row decoded with its own w
    assert_close(x_late, enc.table[ids] * mask[..., None])
    assert_close(v_late, velocity(x_late, z, torch.tensor(0.6), 0.05))


# --- the sampler zoo: gamma schedules and the predictor-corrector --------------------------------


def test_gamma_schedules_start_at_gamma_and_anneal():
    from elflow.flow import gamma_at

    t = torch.tensor([0.0, 0.5, 1.0])
    assert torch.equal(gamma_at("constant", 1.5, t), torch.full((3,), 1.5))
    assert_close(gamma_at("linear", 2.0, t), torch.tensor([2.0, 1.0, 0.0]))
    assert_close(gamma_at("quadratic", 2.0, t), torch.tensor([2.0, 0.5, 0.0]))
    assert_close(gamma_at("cosine", 2.0, t), torch.tensor([2.0, 1.0, 0.0]))
    with pytest.raises(ValueError, match="unknown gamma schedule"):
        gamma_at("exp", 1.0, t)
    with pytest.raises(ELFError, match=r"sampler\.gamma_schedule must be one of constant"):
        SamplerConfig(gamma_schedule="exp")


def test_a_schedule_changes_the_sde_and_constant_is_the_paper():
    model = _model()
    base = SamplerConfig(steps=4, sampler="sde", gamma=1.5)
    paper = sample_model(model, sample_generators(3, [0, 1]), L, base)
    again = sample_model(
        model, sample_generators(3, [0, 1]), L, replace(base, gamma_schedule="constant")
    )
    linear = sample_model(
        model, sample_generators(3, [0, 1]), L, replace(base, gamma_schedule="linear")
    )
    assert torch.equal(paper.z, again.z)
    assert not torch.allclose(paper.z, linear.z)
    zero = sample_model(model, sample_generators(3, [0, 1]), L, replace(base, gamma=0.0))
    ode = sample_model(model, sample_generators(3, [0, 1]), L, replace(base, sampler="ode"))
    assert_close(zero.z, ode.z)  # any schedule of gamma 0 is the ODE


def test_score_from_x_is_the_gaussian_score():
    from elflow.flow import score_from_x

    g = torch.Generator().manual_seed(0)
    x, z = torch.randn(2, 3, 4, generator=g), torch.randn(2, 3, 4, generator=g)
    t = torch.tensor([0.3, 0.7])
    z = z.requires_grad_(True)
    sigma = (1 - t) * 2.0
    logp = -(((z - t[:, None, None] * x) / sigma[:, None, None]) ** 2).sum() / 2
    (grad,) = torch.autograd.grad(logp, z)
    assert_close(score_from_x(z.detach(), x, t, 2.0, 0.05), grad)


def test_langevin_step_size_follows_the_snr():
    from elflow.flow import langevin_step

    z = torch.zeros(1, 2, 2)
    score = torch.full((1, 2, 2), 2.0)  # |score| = 4
    noise = torch.full((1, 2, 2), 0.5)  # |noise| = 1
    eps = 2 * (0.1 * 1 / 4) ** 2
    out = langevin_step(z, score, noise, snr=0.1)
    assert_close(out, eps * score + (2 * eps) ** 0.5 * noise)


def test_pc_with_a_constant_denoiser_moves_towards_it():
    c = torch.full((2, L, E), 0.7)

    def denoise(z, x_prev, t):
        return c, velocity(c, z, t, 0.05)

    from elflow.sampling import pc_step

    z = torch.randn(2, L, E, generator=torch.Generator().manual_seed(1))
    noise = torch.zeros_like(z)  # no noise: the corrector only follows the score
    t, t_next = torch.tensor([0.2, 0.2]), torch.tensor([0.6, 0.6])
    z_next, x_hat = pc_step(denoise, z, c, t, t_next, noise, 0.1, 2.0, 0.05)
    assert torch.equal(x_hat, c)
    z_pred = z + 0.4 * (c - z) / 0.8
    assert_close(z_next, z_pred)  # a zero-noise Langevin step of size 0 stays put


def test_a_step_count_past_any_use_is_refused():
    from elflow.config import MAX_STEPS

    assert SamplerConfig(steps=MAX_STEPS).steps == MAX_STEPS
    with pytest.raises(ELFError, match=r"^sampler\.steps 99999999999 is over 100000; "):
        SamplerConfig(steps=99_999_999_999)
