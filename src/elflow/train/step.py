"""One optimizer step's gradients: micro-batches, the objective, and the global normaliser
(ELF_SPEC §3, §10 "Distributed equality").

Every process loads its micro-batches (stream positions from the global order, so the union over
processes and accumulation steps is the global batch), draws every random quantity keyed by the
example's global position, and back-propagates numerator x W / D, with D the objective's
normaliser over the whole global batch (all-reduced): N processes and gradient accumulation give
the update of one process. The objective is pluggable (``objective_factory``: distillation's).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch
from torch import Tensor

from elflow.data.order import rank_positions
from elflow.distributed import all_reduce_sum
from elflow.objective import Batch, elf_loss, sample_draws_keyed
from elflow.train.batches import make_batch
from elflow.train.config import RunConfig


@dataclass
class StepLoss:
    """One micro-batch's contribution: a differentiable sum and logging sums."""

    numerator: Tensor
    """Summed loss of this micro-batch; the step loss is its total over the global batch / D."""
    stats: Tensor
    """(4,) float64: l2 sum, ce sum, l2 count, ce count (for the logged l2 and ce means)."""


class Objective(Protocol):
    """What the loop needs of a loss: its normaliser's share of a batch, and the loss."""

    def denominator(self, batch: Batch) -> float: ...

    def __call__(self, forward: Any, batch: Batch, positions: np.ndarray) -> StepLoss: ...


class ELFObjective:
    """The ELF training loss (§3), normalised by the global batch's loss-mask total."""

    def __init__(self, cfg: RunConfig) -> None:
        self.cfg = cfg

    def denominator(self, batch: Batch) -> float:
        return float(loss_mask(batch, self.cfg.objective.pad_with_eos).sum())

    def __call__(self, forward, batch: Batch, positions: np.ndarray) -> StepLoss:
        cfg = self.cfg
        L, E = batch.x.shape[1], batch.x.shape[2]
        draws = sample_draws_keyed(
            positions.tolist(), L, E, cfg.objective, cfg.train.seed, batch.x.device
        )
        out = elf_loss(forward, batch, draws, cfg.objective, cfg.train.procedure)
        den_rows = ~draws.decoder_active.bool().to(batch.x.device)
        mask = loss_mask(batch, cfg.objective.pad_with_eos)
        l2_tokens = (mask * den_rows.float()[:, None]).sum()
        ce_tokens = mask.sum() - l2_tokens
        stats = torch.stack([out.l2_sum.detach(), out.ce_sum.detach(), l2_tokens, ce_tokens])
        return StepLoss(out.l2_sum + out.ce_sum, stats.double())


def loss_mask(batch: Batch, pad_with_eos: bool) -> Tensor:
    """(B, L) float: the tokens the loss covers (all but the condition under EOS padding)."""
    valid = (
        torch.ones_like(batch.attention_mask, dtype=torch.bool)
        if pad_with_eos
        else batch.attention_mask.bool()
    )
    if batch.cond_mask is not None:
        valid = valid & ~batch.cond_mask.bool()
    return valid.float()


class StepContext:
    """Builds the micro-batches of one optimizer step and back-propagates them."""

    def __init__(self, run: Any, objective: Objective, autocast: Any) -> None:
        self.run, self.objective, self.autocast = run, objective, autocast

    def batch(self, positions: np.ndarray) -> Batch:
        run = self.run
        row_idx = run.order.rows(positions)
        return make_batch(
            run.cfg, run.dataset, run.cache, run.encoder, run.info.device, row_idx, positions
        )

    def accumulate(self, step: int) -> dict[str, Any]:
        """Back-propagate step ``step``'s global batch; its loss and logging sums."""
        run, info = self.run, self.run.info
        g = run.geometry
        W = info.world_size
        parts = []
        for k in range(g.accum):
            pos = rank_positions(step, g.global_batch, W, info.rank, g.micro, k)
            parts.append((pos, self.batch(pos)))
        # D: the objective's normaliser over the whole global batch (ELF: the loss-mask total;
        # distillation: the row count), all-reduced (spec §10 "Distributed equality").
        local = sum(self.objective.denominator(b) for _, b in parts)
        denom = all_reduce_sum(torch.tensor([float(local)], device=info.device)).item()
        stats = torch.zeros(4, device=info.device, dtype=torch.float64)
        for k, (pos, batch) in enumerate(parts):
            sync = contextlib.nullcontext()
            if k < g.accum - 1 and hasattr(run.forward, "no_sync"):
                sync = run.forward.no_sync()
            with sync:
                with self.autocast:
                    out = self.objective(run.forward, batch, pos)
                # DDP/FSDP2 average gradients over processes: scale by W to get the sum.
                (out.numerator * (W / max(denom, 1.0))).backward()
            stats += out.stats
        stats = all_reduce_sum(stats).tolist()
        return {"loss": (stats[0] + stats[1]) / max(denom, 1.0), "stats": stats}
