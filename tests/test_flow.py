"""Analytic tests of the rectified-flow maths (elflow.flow)."""

import pytest
import torch
from torch.testing import assert_close

from elflow.flow import (
    euler_step,
    interpolate,
    log_uniform_scale,
    logit_normal,
    logit_normal_grid,
    sde_backtrack,
    uniform_grid,
    velocity,
    x_from_velocity,
)


def _tensors(seed: int = 0, shape=(3, 5, 4)):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g), torch.randn(shape, generator=g), g


def test_interpolate_endpoints():
    x, noise, _ = _tensors()
    B = x.shape[0]
    assert_close(interpolate(x, noise, torch.ones(B), 2.0), x, rtol=0, atol=0)
    assert_close(interpolate(x, noise, torch.zeros(B), 2.0), 2.0 * noise, rtol=0, atol=0)


def test_interpolate_per_row_time():
    x, noise, _ = _tensors()
    t = torch.tensor([0.0, 0.25, 1.0])
    z = interpolate(x, noise, t, 3.0)
    for i in range(3):
        assert_close(z[i], t[i] * x[i] + (1 - t[i]) * 3.0 * noise[i])


@pytest.mark.parametrize("t_eps", [0.05, 1e-6])
def test_velocity_and_x_from_velocity_invert(t_eps):
    x, z, _ = _tensors(1)
    t = torch.tensor([0.1, 0.97, 1.0])  # 0.97 and 1.0 hit the t_eps clamp when t_eps = 0.05
    v = velocity(x, z, t, t_eps)
    assert_close(x_from_velocity(v, z, t, t_eps), x, rtol=1e-5, atol=1e-5)
    v2 = velocity(x_from_velocity(v, z, t, t_eps), z, t, t_eps)
    assert_close(v2, v, rtol=1e-4, atol=1e-4)


def test_velocity_clamp():
    x, z, _ = _tensors(2)
    t = torch.tensor([0.5, 0.99, 1.0])
    v = velocity(x, z, t, 0.05)
    assert_close(v[0], (x[0] - z[0]) / 0.5)
    assert_close(v[1], (x[1] - z[1]) / 0.05)
    assert_close(v[2], (x[2] - z[2]) / 0.05)
    assert torch.isfinite(v).all()


def test_velocity_points_along_the_path():
    # On the path z_t = t x + (1 - t) s eps, the exact velocity dz/dt = x - s eps equals
    # (x - z_t) / (1 - t) for t < 1 - t_eps.
    x, noise, _ = _tensors(3)
    t = torch.tensor([0.0, 0.3, 0.9])
    z = interpolate(x, noise, t, 2.0)
    assert_close(velocity(x, z, t, 0.05), x - 2.0 * noise, rtol=1e-5, atol=1e-5)


def test_euler_step():
    z, v, _ = _tensors(4)
    t = torch.tensor([0.0, 0.5, 0.2])
    t_next = torch.tensor([0.1, 1.0, 0.2])
    out = euler_step(z, v, t, t_next)
    for i in range(3):
        assert_close(out[i], z[i] + (t_next[i] - t[i]) * v[i])
    assert_close(out[2], z[2], rtol=0, atol=0)


def test_euler_step_exact_on_the_path():
    # One Euler step with the exact velocity moves along the straight path exactly.
    x, noise, _ = _tensors(5)
    t = torch.tensor([0.1, 0.2, 0.3])
    t_next = torch.tensor([0.6, 0.9, 1.0])
    z = interpolate(x, noise, t, 2.0)
    z_next = euler_step(z, velocity(x, z, t, 1e-6), t, t_next)
    assert_close(z_next, interpolate(x, noise, t_next, 2.0), rtol=1e-5, atol=1e-5)


def test_sde_backtrack_gamma_zero_is_identity():
    z, noise, _ = _tensors(6)
    t = torch.tensor([0.0, 0.3, 0.8])
    t_next = torch.tensor([0.2, 0.5, 1.0])
    z_back, t_back = sde_backtrack(z, t, t_next, 0.0, noise, 2.0)
    assert_close(z_back, z, rtol=0, atol=0)
    assert_close(t_back, t, rtol=0, atol=0)


def test_sde_backtrack_full_reinjection():
    z, noise, _ = _tensors(7)
    t = torch.tensor([0.2, 0.3, 0.5])
    t_next = torch.tensor([0.7, 0.8, 1.0])  # h = 0.5: gamma 2 -> gamma h = 1; gamma 5 -> 2.5
    for gamma in (2.0, 5.0):
        z_back, t_back = sde_backtrack(z, t, t_next, gamma, noise, 2.0)
        assert_close(t_back, torch.zeros(3), rtol=0, atol=0)
        assert_close(z_back, 2.0 * noise, rtol=0, atol=1e-6)


def test_sde_backtrack_partial():
    z, noise, _ = _tensors(8)
    t = torch.tensor([0.4, 0.4, 0.4])
    t_next = torch.tensor([0.5, 0.6, 0.8])
    z_back, t_back = sde_backtrack(z, t, t_next, 1.5, noise, 2.0)
    alpha = 1 - 1.5 * (t_next - t)
    assert_close(t_back, alpha * t)
    for i in range(3):
        assert_close(z_back[i], alpha[i] * z[i] + (1 - alpha[i]) * 2.0 * noise[i])


def test_sde_backtrack_stays_on_the_path():
    # Backtracking a point of the path with the path's own noise lands on the path at t_back.
    x, noise, _ = _tensors(9)
    t = torch.tensor([0.3, 0.5, 0.9])
    t_next = t + 0.1
    z = interpolate(x, noise, t, 2.0)
    z_back, t_back = sde_backtrack(z, t, t_next, 1.5, noise, 2.0)
    assert_close(z_back, interpolate(x, noise, t_back, 2.0), rtol=1e-5, atol=1e-5)


def test_logit_normal_grid():
    g = torch.Generator().manual_seed(0)
    B, N = 5, 16
    grid = logit_normal_grid(torch.randn(B, N - 1, generator=g) * 3, -1.5, 0.8)
    assert grid.shape == (B, N + 1)
    assert (grid[:, 0] == 0).all() and (grid[:, -1] == 1).all()
    assert (grid[:, 1:] >= grid[:, :-1]).all()
    assert ((grid[:, 1:-1] > 0) & (grid[:, 1:-1] < 1)).all()
    # Different rows draw different grids.
    assert not torch.equal(grid[0], grid[1])


def test_logit_normal_grid_one_step():
    grid = logit_normal_grid(torch.empty(3, 0), -1.5, 0.8)
    assert_close(grid, torch.tensor([[0.0, 1.0]] * 3), rtol=0, atol=0)


def test_logit_normal():
    assert_close(logit_normal(torch.zeros(2), -1.5, 0.8), torch.sigmoid(torch.full((2,), -1.5)))
    assert_close(logit_normal(torch.ones(1), 0.8, 0.8), torch.sigmoid(torch.tensor([1.6])))


@pytest.mark.parametrize("steps", [1, 4, 32])
def test_uniform_grid(steps):
    grid = uniform_grid(steps, batch=3)
    assert grid.shape == (3, steps + 1)
    expected = torch.arange(steps + 1, dtype=torch.float32) / steps
    for row in grid:
        assert_close(row, expected)
    assert grid[0, 0] == 0 and grid[0, -1] == 1


def test_log_uniform_scale():
    w = log_uniform_scale(torch.tensor([0.0, 1.0, 0.5]), 0.5, 5.0)
    assert_close(w[0], torch.tensor(0.5))
    assert_close(w[1], torch.tensor(5.0))
    assert_close(w[2], torch.tensor((1.5 * 6.0) ** 0.5 - 1.0))  # geometric mean of 1 + w
    u = torch.rand(1000, generator=torch.Generator().manual_seed(0))
    w = log_uniform_scale(u, 0.5, 5.0)
    assert (w >= 0.5 - 1e-6).all() and (w <= 5.0 + 1e-6).all()
    # log(1 + w) is uniform: its mean is the midpoint of [log 1.5, log 6].
    mid = 0.5 * (torch.log(torch.tensor(1.5)) + torch.log(torch.tensor(6.0)))
    assert abs(torch.log1p(w).mean() - mid) < 0.05
