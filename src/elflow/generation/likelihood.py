"""A text's negative log-likelihood under an ELF model, in bits per token (an elflow addition).

For each text: its training row, the frozen encoder's latents x, a draw z = t1 x + (1 - t1) s eps
from the flow's own path at t1 (default :data:`DEFAULT_T1`), the exact change of variables along
the probability-flow ODE from z back to noise
(:func:`elflow.sampling.likelihood_maths.ode_log_density`), and the decoder's cross-entropy of the
row's tokens at z. Together they bound -log p(text) for the model "integrate the flow to t1, then
decode" (:func:`elflow.sampling.likelihood_maths.nll_bound`): an estimate with stated
assumptions, not the paper's sampler's exact likelihood. Assumptions: the velocity is the
network's x-prediction without self-conditioning (the input's second half zeros, whose training
target is the plain flow velocity for every w), RK4 with ``steps`` steps integrates the ODE
accurately, and Hutchinson's trace estimate (``probes`` > 0) is unbiased for the
log-density though noisy per text; ``probes`` = 0 takes the exact trace (one backward pass per
latent dimension: small models only).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from elflow.errors import ELFError
from elflow.flow import velocity
from elflow.sampling.likelihood_maths import nll_bound, ode_log_density, rademacher
from elflow.text.tokens import tokenize

if TYPE_CHECKING:
    from elflow.generation.pipeline import ELFPipeline

DEFAULT_T1 = 0.1
"""Where the flow stops and the decoder takes over. The bound is loosest near t1 = 1 (the draw's
narrow Gaussian must fall where the model's density is as sharp) and, on the demo model, was
tightest of 0.1, 0.3 and 0.95 at 0.1 while still ranking real verses above shuffled ones
(docs/results/2026-12-03-beyond-the-paper.md)."""


@dataclass
class Likelihood:
    """Per-text bounds and how they were computed."""

    bits_per_token: list[float]
    """The bound per text (bits per token of its training row's valid tokens)."""
    tokens: list[int]
    """Valid tokens per text (its row up to and including the end token)."""
    settings: dict
    """t1, steps, probes (0: exact), samples, seed."""


def text_generator(seed: int, index: int, device) -> torch.Generator:
    digest = hashlib.sha256(f"elflow-likelihood:{seed}:{index}".encode()).digest()
    return torch.Generator(device=device).manual_seed(int.from_bytes(digest[:8], "little") >> 1)


def text_likelihood(
    pipe: ELFPipeline,
    texts: Sequence[str],
    *,
    steps: int = 16,
    probes: int = 1,
    samples: int = 1,
    seed: int = 0,
    batch_size: int = 16,
    t1: float | None = None,
    truncate: bool = False,
) -> Likelihood:
    """The bound of each of ``texts`` under ``pipe``'s unconditional model (see the module
    docstring); text i's noise and probes depend on (seed, i) only. A text longer than the
    model's rows is refused unless ``truncate`` (then its first ``max_length`` tokens are
    scored, as ``elflow train`` cuts rows, and ``settings['truncated']`` counts them)."""
    cfg = pipe.config
    if cfg.conditional:
        raise ELFError("likelihood applies to unconditional models; this one is conditional")
    L = cfg.model.max_length
    tokens = tokenize(pipe.tokenizer, list(texts))  # once: checked here, rows made below
    long = [i for i, ids in enumerate(tokens) if len(ids) > L]
    if long and not truncate:
        raise ELFError(
            f"text {long[0]} is {len(tokens[long[0]])} tokens, more than the model's {L} "
            f"({len(long)} of {len(texts)} texts are); shorten or split them, or pass "
            "truncate=True to score their first tokens"
        )
    for name, value, least in (
        ("steps=", steps, 1),
        ("samples=", samples, 1),
        ("probes=", probes, 0),
    ):
        if value < least:
            raise ELFError(f"{name} must be >= {least}, got {value}")
    if batch_size < 1:
        raise ELFError(f"batch_size= must be >= 1, got {batch_size}")
    t1 = DEFAULT_T1 if t1 is None else t1
    if not 0.0 < t1 < 1.0:
        raise ELFError(f"t1= must be in (0, 1), got {t1}")
    encoder = pipe.frozen_encoder("likelihood")
    model, dev, s = pipe.model, pipe.device, cfg.noise_scale
    w = pipe.sampler.w if cfg.model.num_scale_tokens > 0 else None

    def v(z: Tensor, t: Tensor) -> Tensor:
        x_hat = model(torch.cat([z, torch.zeros_like(z)], -1), t, w, 0.0)[0].float()
        return velocity(x_hat, z, t, cfg.t_eps)

    bits: list[float] = []
    counts: list[int] = []
    for start in range(0, len(texts), batch_size):
        chunk = tokens[start : start + batch_size]
        ids, mask = pipe.rows_of(chunk)
        ids, mask = ids.to(dev), mask.to(dev)
        with torch.no_grad():
            x = encoder(ids, mask)  # (B, L, E)
        total = torch.zeros(len(chunk), dtype=torch.float64, device=dev)
        gens = [text_generator(seed, start + i, dev) for i in range(len(chunk))]
        for _ in range(samples):
            eps = torch.stack([torch.randn(x.shape[1:], generator=g, device=dev) for g in gens])
            z = t1 * x + (1.0 - t1) * s * eps
            probe = None
            if probes:
                probe = torch.stack(
                    [rademacher((probes, *x.shape[1:]), g, dev) for g in gens], dim=1
                )
            log_p_z, _ = ode_log_density(v, z, t1, steps, s, probe)
            with torch.no_grad():
                _, hidden = model(torch.cat([z, torch.zeros_like(z)], -1), 1.0, w, 1.0)
                logp = torch.log_softmax(model.decode_logits(hidden).float(), -1)
            log_p_text = (logp.gather(-1, ids[..., None])[..., 0] * mask).sum(1)
            total += nll_bound(log_p_z, log_p_text, eps, (1.0 - t1) * s, mask.sum(1))
        bits += (total / samples).tolist()
        counts += mask.sum(1).tolist()
    settings = {"t1": t1, "steps": steps, "probes": probes, "samples": samples, "seed": seed}
    settings["truncated"] = len(long)
    return Likelihood(bits, counts, settings)
