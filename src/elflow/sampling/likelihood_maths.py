"""The likelihood's maths, over a velocity callable: the probability-flow ODE's log-density and a
variational bound on a text's NLL (an elflow addition; the paper reports none).

The flow maps noise z_0 ~ N(0, s^2 I) (t = 0) to data (t = 1) by dz/dt = v(z, t). Along an ODE
trajectory d log p_t(z_t) / dt = -div v(z_t, t), so integrating backwards from z at time t1 to z_0
gives the exact log-density log p_t1(z) = log N(z_0; 0, s^2 I) - int_0^t1 div v dt
(:func:`ode_log_density`; fixed-step RK4; the divergence exact, by one vector-Jacobian product per
dimension, or Hutchinson's unbiased estimate with a fixed set of Rademacher probes). Everything
here takes a velocity callable ``v(z, t) -> (B, ...)``; :mod:`elflow.generation.likelihood`
builds it from a model.

A text is discrete; its latents are a deterministic function of it. The bound
(:func:`nll_bound`) is the usual variational one for the model "integrate the flow to t1, then
decode": with z ~ q(z | x) = N(t1 x, ((1 - t1) s)^2 I) (the flow's own path at t1),
-log p(text) <= E_q[-log p_t1(z) - log p_dec(text | z) + log q(z | x)].
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import Tensor

Velocity = Callable[[Tensor, Tensor], Tensor]
"""``v(z, t) -> dz/dt`` with z (B, ...) and t (B,)."""
DIVERGENCES = ("exact", "hutchinson")


def gaussian_log_density(z: Tensor, mean: Tensor | float, std: float) -> Tensor:
    """log N(z; mean, std^2 I) summed over all but the first dim, in float64: (B, ...) -> (B,)."""
    z = z.double()
    d = z[0].numel()
    sq = (((z - mean) / std) ** 2).flatten(1).sum(1)
    return -0.5 * sq - d * math.log(std) - 0.5 * d * math.log(2 * math.pi)


def rademacher(shape: tuple[int, ...], generator: torch.Generator, device=None) -> Tensor:
    """+-1 entries, each with probability 1/2."""
    bits = torch.randint(0, 2, shape, generator=generator, device=device)
    return bits.float() * 2.0 - 1.0


def velocity_and_divergence(
    v: Velocity, z: Tensor, t: Tensor, probes: Tensor | None
) -> tuple[Tensor, Tensor]:
    """(v(z, t), div_z v) per row (float64). ``probes`` (K, B, ...): Hutchinson's estimate
    mean_k p_k^T (dv/dz) p_k; None: the exact trace, one vector-Jacobian product per dimension."""
    with torch.enable_grad():
        z = z.detach().requires_grad_(True)
        out = v(z, t)
        if probes is not None:
            total = torch.zeros(z.shape[0], dtype=torch.float64, device=z.device)
            for k, p in enumerate(probes):
                last = k == len(probes) - 1
                (g,) = torch.autograd.grad(out, z, p, retain_graph=not last)
                total += (g * p).flatten(1).sum(1).double()
            return out.detach(), total / len(probes)
        flat = out.flatten(1)
        trace = torch.zeros(z.shape[0], dtype=torch.float64, device=z.device)
        n = flat.shape[1]
        for i in range(n):
            (g,) = torch.autograd.grad(flat[:, i].sum(), z, retain_graph=i < n - 1)
            trace += g.flatten(1)[:, i].double()
        return out.detach(), trace


def ode_log_density(
    v: Velocity,
    z: Tensor,
    t1: float,
    steps: int,
    noise_scale: float,
    probes: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """(log p_t1(z), z_0): the exact change of variables along the probability-flow ODE, from
    ``z`` at t1 < 1 back to noise at t = 0 (ELF's prior N(0, s^2 I)), in float64 nats per row.

    NOTE: near the data an x-prediction's velocity (x_hat - z) / (1 - t) and its divergence
    (about -D / (1 - t)) are stiff; ``steps`` RK4 steps are taken uniform in u = -log(1 - t),
    where dz/du = (1 - t) v is smooth, so a few dozen steps integrate terms of ~D log(1 - t1)
    nats to a small fraction of a nat per dimension."""
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    if not 0.0 < t1 < 1.0:
        raise ValueError(f"t1 must be in (0, 1), got {t1}")
    B = z.shape[0]
    u1 = -math.log1p(-t1)
    h = -u1 / steps  # backwards: from u1 (t = t1) to 0 (t = 0)

    def f(state: Tensor, u: float) -> tuple[Tensor, Tensor]:
        scale = math.exp(-u)  # 1 - t = dt/du
        t = torch.full((B,), 1.0 - scale, device=z.device)
        out, div = velocity_and_divergence(v, state, t, probes)
        return scale * out, scale * div

    integral = torch.zeros(B, dtype=torch.float64, device=z.device)  # int_t1^0 div dt
    state = z.detach().float()
    for k in range(steps):
        u = u1 + k * h
        k1, d1 = f(state, u)
        k2, d2 = f(state + 0.5 * h * k1, u + 0.5 * h)
        k3, d3 = f(state + 0.5 * h * k2, u + 0.5 * h)
        k4, d4 = f(state + h * k3, u + h)
        state = state + (h / 6.0) * (k1 + 2 * k2 + 2 * k3 + k4)
        integral += (h / 6.0) * (d1 + 2 * d2 + 2 * d3 + d4)
    # log p_t1(z) = log p_0(z_0) - int_0^t1 div dt = log p_0(z_0) + int_t1^0 div dt
    return gaussian_log_density(state, 0.0, noise_scale) + integral, state


def nll_bound(
    log_p_z: Tensor, log_p_text: Tensor, noise: Tensor, sigma: float, tokens: Tensor
) -> Tensor:
    """The variational bound in bits per token: -(log p_t1(z) + log p_dec(text | z)
    - log q(z | x)) / (tokens ln 2), with z = t1 x + sigma noise, so log q(z | x) =
    log N(noise; 0, I) - D log sigma."""
    d = noise[0].numel()
    log_q = gaussian_log_density(noise, 0.0, 1.0) - d * math.log(sigma)
    return -(log_p_z + log_p_text.double() - log_q) / (tokens.double() * math.log(2.0))
