"""Rectified-flow maths as pure tensor functions (paper §2–§3; ELF_SPEC §3, §5).

Time runs from t = 0 (noise) to t = 1 (data): z_t = t x + (1 - t) s noise. The network predicts x;
velocities are v = (x_pred - z_t) / max(1 - t, t_eps). Every function takes its randomness as an
explicit tensor (standard normals or uniforms) so that it can be tested with fixed inputs; nothing
here touches the network.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from elflow.config.sampler_config import GAMMA_SCHEDULES


def _bcast(t: Tensor, like: Tensor) -> Tensor:
    """(B,) -> (B, 1, ..., 1) broadcastable against ``like``."""
    return t.reshape(t.shape + (1,) * (like.dim() - t.dim()))


def logit_normal(normal: Tensor, mean: float, std: float) -> Tensor:
    """sigmoid(mean + std * normal): the logit-normal time distribution."""
    return torch.sigmoid(mean + std * normal)


def log_uniform_scale(u: Tensor, w_min: float, w_max: float) -> Tensor:
    """SC-CFG scale w with 1 + w log-uniform on [1 + w_min, 1 + w_max]; u ~ U(0, 1)."""
    a, b = 1.0 + w_min, 1.0 + w_max
    return a * torch.exp(u * math.log(b / a)) - 1.0


def interpolate(x: Tensor, noise: Tensor, t: Tensor, noise_scale: float) -> Tensor:
    """z_t = t x + (1 - t) s noise, t per row."""
    tb = _bcast(t, x)
    return tb * x + (1.0 - tb) * noise_scale * noise


def velocity(x_pred: Tensor, z: Tensor, t: Tensor, t_eps: float) -> Tensor:
    """v = (x_pred - z) / max(1 - t, t_eps)."""
    return (x_pred - z) / _bcast(torch.clamp(1.0 - t, min=t_eps), z)


def x_from_velocity(v: Tensor, z: Tensor, t: Tensor, t_eps: float) -> Tensor:
    """Inverse of :func:`velocity`: x = z + max(1 - t, t_eps) v."""
    return z + _bcast(torch.clamp(1.0 - t, min=t_eps), z) * v


def euler_step(z: Tensor, v: Tensor, t: Tensor, t_next: Tensor) -> Tensor:
    """z + (t_next - t) v."""
    return z + _bcast(t_next - t, z) * v


def backtrack_alpha(t: Tensor, t_next: Tensor, gamma: float | Tensor) -> Tensor:
    """The SDE's step-back factor alpha = clip(1 - gamma (t_next - t), 0, 1): it evaluates the
    network at alpha t (:func:`sde_backtrack`)."""
    return torch.clamp(1.0 - gamma * (t_next - t), 0.0, 1.0)


def sde_backtrack(
    z: Tensor, t: Tensor, t_next: Tensor, gamma: float | Tensor, noise: Tensor, noise_scale: float
) -> tuple[Tensor, Tensor]:
    """The SDE's noise re-injection: step back along the path before the Euler step.

    alpha = clip(1 - gamma h, 0, 1), t_back = alpha t, z_back = alpha z + (1 - alpha) s noise.
    gamma = 0 gives alpha = 1 (the ODE); ``gamma`` may be per row (a schedule's value at t).
    """
    alpha = backtrack_alpha(t, t_next, gamma)
    ab = _bcast(alpha, z)
    return ab * z + (1.0 - ab) * noise_scale * noise, alpha * t


def uniform_grid(steps: int, batch: int = 1, device: torch.device | str | None = None) -> Tensor:
    """(batch, steps + 1) evenly spaced times from 0 to 1."""
    return torch.linspace(0.0, 1.0, steps + 1, device=device).expand(batch, -1).contiguous()


def logit_normal_grid(normal: Tensor, mean: float, std: float) -> Tensor:
    """(B, N + 1) grid: the N - 1 logit-normal draws per row, sorted, between 0 and 1.

    Args:
        normal: (B, N - 1) standard normals.
    """
    inner = torch.sort(logit_normal(normal, mean, std), dim=-1).values
    zeros = inner.new_zeros(inner.shape[0], 1)
    return torch.cat([zeros, inner, zeros + 1.0], dim=-1)


def gamma_at(schedule: str, gamma: float, t: Tensor) -> Tensor:
    """The SDE's noise rate at time t (an elflow addition; the paper's is constant): ``gamma``
    times a shape that is 1 at t = 0 (noise) and anneals towards the data: linear 1 - t,
    quadratic (1 - t)^2, cosine (1 + cos(pi t)) / 2."""
    if schedule == "constant":
        return torch.full_like(t, gamma)
    if schedule == "linear":
        return gamma * (1.0 - t)
    if schedule == "quadratic":
        return gamma * (1.0 - t) ** 2
    if schedule == "cosine":
        return gamma * 0.5 * (1.0 + torch.cos(math.pi * t))
    raise ValueError(f"unknown gamma schedule {schedule!r}; use one of {GAMMA_SCHEDULES}")


def score_from_x(z: Tensor, x_hat: Tensor, t: Tensor, noise_scale: float, t_eps: float) -> Tensor:
    """The score of p_t at z implied by an x-prediction: z_t = t x + (1 - t) s noise gives
    grad log p_t(z) = -(z - t x_hat) / ((1 - t) s)^2, with 1 - t clamped at t_eps."""
    sigma = torch.clamp(1.0 - t, min=t_eps) * noise_scale
    return -(z - _bcast(t, z) * x_hat) / _bcast(sigma, z) ** 2


def langevin_step(z: Tensor, score: Tensor, noise: Tensor, snr: float) -> Tensor:
    """One Langevin corrector move z + eps score + sqrt(2 eps) noise with the step size set per
    row by a signal-to-noise ratio, eps = 2 (snr |noise| / |score|)^2 (Song et al., 2021)."""
    ratio = noise.flatten(1).norm(dim=1) / score.flatten(1).norm(dim=1).clamp_min(1e-12)
    eps = _bcast(2.0 * (snr * ratio) ** 2, z)
    return z + eps * score + torch.sqrt(2.0 * eps) * noise
