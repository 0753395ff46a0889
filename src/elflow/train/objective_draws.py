"""The training objective's random draws (paper §3; ELF_SPEC §3 steps 1-4, §9): which rows take
the decoder branch and self-conditioning (a :class:`RowPlan` of host index arrays, so that a step
selects rows without reading the device), and each row's t, SC-CFG scale, noise and dropped
condition (:class:`Draws`), from a generator (:func:`sample_draws`) or, in training, keyed by
(seed, stream position) (:func:`sample_draws_keyed`, :mod:`elflow.runtime.keyed_random`), so a
row's draws do not depend on its batch. Pure maths, like :mod:`elflow.objective`, which uses them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from elflow.config.objective_config import ObjectiveConfig
from elflow.flow import log_uniform_scale, logit_normal
from elflow.runtime.keyed_random import host_normal, host_uniform, keyed_normals


@dataclass(frozen=True)
class RowPlan:
    """Which rows take which branch, as host index arrays (ELF_SPEC §3 steps 3 and 5).

    The objective selects rows with index tensors made from these, never with a boolean mask of
    the device's draws (a data-dependent shape): a training step then never waits for the
    device. :func:`sample_draws_keyed` knows them on the host; :meth:`of` reads hand-made draws.
    """

    decoder: np.ndarray
    """Indices of the decoder-branch rows."""
    self_cond: np.ndarray
    """Indices of the denoiser rows whose input carries the self-conditioning prediction."""

    num_decoder: int | None = None
    """Real entries at the head of ``decoder`` (the rest pad it: :meth:`padded`); None: all."""
    num_self_cond: int | None = None
    """Real entries at the head of ``self_cond``; None: all."""

    @classmethod
    def of(cls, draws: Draws) -> RowPlan:
        """The plan of ``draws``' own tensors (one device read: for draws made by hand)."""
        dec = draws.decoder_active.detach().cpu().numpy() > 0
        sc = (draws.use_self_cond.detach().cpu().numpy() > 0) & ~dec
        return cls(np.flatnonzero(dec), np.flatnonzero(sc))

    def padded(self, batch: int, minimum: int = 2) -> RowPlan:
        """This plan with each index array padded to at least ``minimum`` entries with rows
        outside it (repeated ones when the batch has too few), for a compiled step.

        NOTE: a compiled step keeps the branch sizes dynamic (``torch._dynamo.mark_dynamic``),
        but dynamo specialises a size of 0 or 1 (a recompile each time one occurs); from 2 up one
        graph serves every size. The loss is unchanged: padded decoder rows get CE weight 0 and
        padded self-conditioning rows' no-grad predictions are never read (the target uses them
        only on the real rows); they cost at most ``minimum`` rows of extra work.
        """

        def pad(rows: np.ndarray) -> np.ndarray:
            need = minimum - len(rows)
            if need <= 0:
                return rows
            others = np.setdiff1d(np.arange(batch), rows)
            return np.concatenate([rows, np.resize(others if len(others) else rows, need)])

        n_dec, n_sc = self.real_decoder, self.real_self_cond
        return RowPlan(pad(self.decoder[:n_dec]), pad(self.self_cond[:n_sc]), n_dec, n_sc)

    def arrays(self) -> tuple[np.ndarray, np.ndarray]:
        """(decoder rows, or (2, R) rows and 1/0 real/padding flags when padded; self_cond)."""
        if self.num_decoder is None:
            return self.decoder, self.self_cond
        keep = np.arange(len(self.decoder)) < self.num_decoder
        return np.stack([self.decoder, keep.astype(np.int64)]), self.self_cond

    @property
    def real_decoder(self) -> int:
        return len(self.decoder) if self.num_decoder is None else self.num_decoder

    @property
    def real_self_cond(self) -> int:
        return len(self.self_cond) if self.num_self_cond is None else self.num_self_cond


@dataclass
class BranchRows:
    """A :class:`RowPlan` on the device: the index tensors a step selects rows with."""

    decoder: Tensor
    """(R,) int64 decoder rows (padding included)."""
    self_cond: Tensor
    """(S,) int64 self-conditioned denoiser rows (padding included)."""
    decoder_keep: Tensor | None = None
    """(R,) float 1 at real decoder rows, 0 at padding; None: no padding."""

    @classmethod
    def of(cls, plan: RowPlan, device: torch.device) -> BranchRows:
        """The plan's index tensors on ``device`` (asynchronous copies; no device read)."""
        dec, sc = plan.arrays()
        return cls.of_tensors(host_index(dec, device), host_index(sc, device))

    @classmethod
    def of_tensors(cls, decoder: Tensor, self_cond: Tensor) -> BranchRows:
        """From device copies of :meth:`RowPlan.arrays` (a padded plan's decoder is (2, R))."""
        if decoder.dim() == 1:
            return cls(decoder, self_cond)
        return cls(decoder[0], self_cond, decoder[1].float())


def host_index(rows: np.ndarray, device: torch.device) -> Tensor:
    """A host index array on ``device`` without waiting for it (an asynchronous copy)."""
    return torch.from_numpy(np.ascontiguousarray(rows, dtype=np.int64)).to(
        device, non_blocking=True
    )


@dataclass
class Draws:
    """Every random draw of one objective evaluation (names follow the reference fixtures)."""

    t: Tensor
    """(B,) denoising time, already logit-normal."""
    noise: Tensor
    """(B, L, E) standard normal path noise (scaled by ``noise_scale`` inside)."""
    decoder_active: Tensor
    """(B,) 1 = decoder (cross-entropy) branch at t = 1."""
    decoder_lambda: Tensor
    """(B, L, 1) per-token mixing weight of the decoder branch's corrupted input."""
    decoder_noise: Tensor
    """(B, L, E) standard normal (scaled by ``decoder_noise_scale`` inside)."""
    use_self_cond: Tensor
    """(B,) 1 = the trained pass receives the detached self-conditioning prediction."""
    w: Tensor
    """(B,) SC-CFG scale."""
    plan: RowPlan | None = None
    """The rows of each branch on the host (None: read from the tensors when needed)."""


def sample_draws(
    batch: int,
    length: int,
    dim: int,
    cfg: ObjectiveConfig,
    generator: torch.Generator | None = None,
    device: torch.device | str | None = None,
) -> Draws:
    """Draw every random quantity of the objective from ``generator``."""
    kw = {"generator": generator, "device": device}
    return Draws(
        t=logit_normal(torch.randn(batch, **kw), cfg.time_mean, cfg.time_std),
        noise=torch.randn(batch, length, dim, **kw),
        decoder_active=(torch.rand(batch, **kw) < cfg.decoder_prob).float(),
        decoder_lambda=logit_normal(
            torch.randn(batch, length, 1, **kw), cfg.decoder_mean, cfg.decoder_std
        ),
        decoder_noise=torch.randn(batch, length, dim, **kw),
        use_self_cond=(torch.rand(batch, **kw) < cfg.self_cond_prob).float(),
        w=log_uniform_scale(torch.rand(batch, **kw), cfg.w_min, cfg.w_max),
    )


def sample_draws_keyed(
    positions: Sequence[int] | np.ndarray,
    length: int,
    dim: int,
    cfg: ObjectiveConfig,
    seed: int,
    device: torch.device | str = "cpu",
) -> Draws:
    """Draws for the examples at stream ``positions``: each row's depend only on (seed, its
    position), so N processes, gradient accumulation and a resume see the draws of one process
    (ELF_SPEC §10 "Distributed equality").

    The per-example scalars (t, branch, self-conditioning, w) are drawn on the host, which then
    knows the :class:`RowPlan`; the (L, E) noise and the (L,) decoder mixing weights in one
    batched call on ``device`` (:func:`elflow.runtime.keyed_random.keyed_normals`). A row uses its
    path noise (denoiser rows) or its decoder noise (decoder rows), never both, so the two fields
    are the same tensor.
    """
    scalars, plan = keyed_row_draws(positions, cfg, seed)
    device = torch.device(device)
    pos = np.asarray(positions, dtype=np.int64).reshape(-1)
    draws = keyed_device_draws(
        scalars.to(device, non_blocking=True), host_index(pos, device), length, dim, cfg, seed
    )
    draws.plan = plan
    return draws


def keyed_row_draws(
    positions: Sequence[int] | np.ndarray, cfg: ObjectiveConfig, seed: int
) -> tuple[Tensor, RowPlan]:
    """:func:`sample_draws_keyed`'s host part: the per-example scalars (B, 4) = (t, decoder,
    self-conditioning, w) as a float32 host tensor, and the :class:`RowPlan` they make."""
    pos = np.asarray(positions, dtype=np.int64).reshape(-1)
    dec = host_uniform(pos, seed, "decoder") < cfg.decoder_prob
    sc = host_uniform(pos, seed, "self_cond") < cfg.self_cond_prob
    t = logit_normal(torch.from_numpy(host_normal(pos, seed, "t")), cfg.time_mean, cfg.time_std)
    w = log_uniform_scale(torch.from_numpy(host_uniform(pos, seed, "w")), cfg.w_min, cfg.w_max)
    flags = torch.from_numpy(np.stack([dec, sc]).astype(np.float64))
    scalars = torch.stack([t, flags[0], flags[1], w], dim=1).float()  # (B, 4), on the host
    return scalars, RowPlan(np.flatnonzero(dec), np.flatnonzero(sc & ~dec))


def keyed_device_draws(
    scalars: Tensor, positions: Tensor, length: int, dim: int, cfg: ObjectiveConfig, seed: int
) -> Draws:
    """:func:`sample_draws_keyed`'s device part (no plan): ``scalars`` (B, 4) from
    :func:`keyed_row_draws` and the stream ``positions`` (B,) int64, both on the device; the
    (L, E) noise and the (L,) decoder mixing weights in one batched call. Pure tensor work, so a
    compiled step (``train.compile=step``) holds it."""
    B = positions.shape[0]
    t_, dec_, sc_, w_ = scalars.unbind(1)
    normals = keyed_normals(positions, length * (dim + 1), seed, "noise")  # (B, L (E + 1))
    noise = normals[:, : length * dim].view(B, length, dim)
    lam = logit_normal(
        normals[:, length * dim :].view(B, length, 1), cfg.decoder_mean, cfg.decoder_std
    )
    return Draws(
        t=t_,
        noise=noise,
        decoder_active=dec_,
        decoder_lambda=lam,
        decoder_noise=noise,
        use_self_cond=sc_,
        w=w_,
    )
