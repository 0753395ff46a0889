"""Held-out loss during training: the run's own objective on fixed rows with fixed draws.

The logged training loss is measured on the raw weights over a new batch and new draws every
step, so it is noisy and cannot show over-fitting. Every ``train.eval_every`` steps the trainer
evaluates the EMA weights (the ones that are sampled and shipped) on the first
``train.eval_rows`` rows of the validation split and of the training split. Row i always gets
the draws of stream position i (ELF_SPEC §3; keyed like training), so two evaluations differ only
through the weights, and the two splits' gap measures over-fitting, not noise.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np
import torch

from elflow.distributed import all_reduce_sum
from elflow.objective import Batch

BatchMaker = Callable[[np.ndarray, np.ndarray], Batch]
"""(row indices, stream positions) -> Batch."""


@dataclass(frozen=True)
class HeldOutSplit:
    """Fixed rows of one split, evaluated in chunks of ``chunk`` rows."""

    name: str
    """Metric prefix: ``valid`` or ``train_rows``."""
    make_batch: BatchMaker
    rows: np.ndarray
    """This process's share of the fixed row indices (they double as stream positions)."""
    chunk: int

    def batches(self) -> Iterator[tuple[np.ndarray, Batch]]:
        for start in range(0, len(self.rows), self.chunk):
            idx = self.rows[start : start + self.chunk]
            yield idx, self.make_batch(idx, idx)


def fixed_rows(num_rows: int, limit: int, rank: int = 0, world_size: int = 1) -> np.ndarray:
    """The first ``limit`` row indices of a split, dealt round-robin over the processes."""
    return np.arange(min(limit, num_rows), dtype=np.int64)[rank::world_size]


@torch.no_grad()
def heldout_loss(
    objective,
    forward: torch.nn.Module,
    split: HeldOutSplit,
    device: torch.device | str,
    autocast: contextlib.AbstractContextManager | None = None,
) -> dict[str, float]:
    """``{name}_loss``, ``{name}_l2`` and ``{name}_ce`` of the split, summed over processes.

    ``objective`` is the training objective (``ELFObjective`` or the distillation one): the loss
    is normalised exactly like a training step's, over all of the split's rows at once.
    """
    totals = torch.zeros(5, dtype=torch.float64, device=device)
    for positions, batch in split.batches():
        with autocast if autocast is not None else contextlib.nullcontext():
            out = objective(forward, batch, positions)
        totals[0] += objective.denominator(batch)
        totals[1:] += out.stats.to(totals)
    denom, l2_sum, ce_sum, l2_n, ce_n = all_reduce_sum(totals).tolist()
    return {
        f"{split.name}_loss": (l2_sum + ce_sum) / max(denom, 1.0),
        f"{split.name}_l2": l2_sum / max(l2_n, 1.0),
        f"{split.name}_ce": ce_sum / max(ce_n, 1.0),
    }
