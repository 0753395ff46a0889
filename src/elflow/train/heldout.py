"""Held-out loss during training: the run's own objective on fixed rows with fixed draws.

The logged training loss is measured on the raw weights over a new batch and new draws every
step, so it is noisy and cannot show over-fitting. Every ``train.eval_every`` steps the trainer
evaluates the EMA weights (the ones that are sampled and shipped) on ``train.eval_rows`` evenly
spaced rows of the validation split and of the training split. The j-th row of either split always
gets the draws of stream position j (ELF_SPEC §3; keyed like training), so two evaluations differ
only through the weights and the two splits see the same draws.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np
import torch

from elflow.config import ModelConfig
from elflow.config.train_config import RunConfig
from elflow.data.latent_cache import LatentCache
from elflow.data.rows import RowDataset, build_dataset
from elflow.errors import ELFError
from elflow.objective import Batch
from elflow.runtime.distributed import DistInfo, all_reduce_sum
from elflow.text.encoder import FrozenEncoder
from elflow.train.batches import make_batch
from elflow.train.ema import EMA, ema_network
from elflow.train.forward import TrainForward

BatchMaker = Callable[[np.ndarray, np.ndarray], Batch]
"""(row indices into the split's rows, draw keys) -> Batch."""


@dataclass(frozen=True)
class HeldOutSplit:
    """Fixed rows of one split, evaluated in chunks of ``chunk`` rows."""

    name: str
    """Metric prefix: ``valid`` or ``train_rows``."""
    make_batch: BatchMaker
    keys: np.ndarray
    """This process's draw keys, one per row (row j of the split's rows gets ``keys[j]``)."""
    chunk: int

    def batches(self) -> Iterator[tuple[np.ndarray, Batch]]:
        for start in range(0, len(self.keys), self.chunk):
            idx = np.arange(start, min(start + self.chunk, len(self.keys)))
            yield self.keys[idx], self.make_batch(idx, self.keys[idx])


def spread_rows(
    num_rows: int, limit: int, rank: int = 0, world_size: int = 1
) -> tuple[np.ndarray, np.ndarray]:
    """``limit`` evenly spaced row indices of a split (all rows when it has fewer) and their draw
    keys 0, 1, ..., dealt round-robin over the processes: (this process's rows, its keys).

    Evenly spaced rather than the first rows: a corpus in document order (the Bible in book
    order) would otherwise compare Genesis with whatever the validation file starts with.
    """
    k = min(limit, num_rows)
    rows = np.linspace(0, num_rows - 1, k).round().astype(np.int64)
    keys = np.arange(k, dtype=np.int64)
    return rows[rank::world_size], keys[rank::world_size]


class RowSubset:
    """Rows ``rows`` of a row dataset, re-indexed 0..n-1 (for batches and a latent cache)."""

    def __init__(self, dataset, rows: np.ndarray) -> None:
        self.dataset, self.rows = dataset, rows
        self.max_length, self.conditional = dataset.max_length, dataset.conditional

    def __len__(self) -> int:
        return len(self.rows)

    def get_rows(self, idx: np.ndarray) -> dict[str, np.ndarray]:
        return self.dataset.get_rows(self.rows[idx])

    def get_batch(self, idx: np.ndarray) -> dict[str, torch.Tensor]:
        return self.dataset.get_batch(self.rows[idx])


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
    totals = torch.zeros(6, dtype=torch.float64, device=device)
    for keys, batch in split.batches():
        with autocast if autocast is not None else contextlib.nullcontext():
            out = objective(forward, batch, keys)
        totals[0] += objective.denominator(batch)
        totals[1:] += out.stats.to(totals)
    denom, l2_sum, ce_sum, l2_n, ce_n, _ = all_reduce_sum(totals).tolist()
    l2, ce = branch_means(l2_sum, ce_sum, l2_n, ce_n)
    return {
        f"{split.name}_loss": (l2_sum + ce_sum) / max(denom, 1.0),
        f"{split.name}_l2": l2,
        f"{split.name}_ce": ce,
    }


def branch_means(l2_sum: float, ce_sum: float, l2_n: float, ce_n: float) -> tuple[float, float]:
    """The denoiser (l2) and decoder (ce) branch means of summed losses and their counts (a
    StepLoss's stats); NaN, not 0, for a branch that had no token (a handful of rows)."""
    return (l2_sum / l2_n if l2_n else math.nan, ce_sum / ce_n if ce_n else math.nan)


def valid_rows(cfg: RunConfig, tokenizer, pad_id: int, info: DistInfo) -> RowDataset | None:
    """The rows of ``data.valid_path`` (None without one), read at start-up so that a bad path
    or bad data is an error before any encoding. With ``train.eval_every=0`` nothing uses them,
    so they are not read (a line says so)."""
    if not cfg.data.valid_path:
        return None
    if not cfg.train.eval_every:  # unused, so not read (a Hub dataset would be downloaded)
        if info.is_main:
            print("elflow train: data.valid_path is not used, as train.eval_every=0", flush=True)
        return None
    L = cfg.model.max_length
    valid = build_dataset(
        cfg.data, tokenizer, L, cfg.max_input_length, pad_id, "valid", cfg.task == "conditional"
    )
    if len(valid) == 0:
        raise ELFError(
            f"validation data {cfg.data.valid_path!r} yields no rows; fix data.valid_path"
        )
    return valid


def heldout_splits(
    cfg: RunConfig,
    valid: RowDataset | None,
    dataset: RowDataset,
    encoder: FrozenEncoder,
    info: DistInfo,
    chunk: int,
) -> list[HeldOutSplit]:
    """The splits ``train.eval_every`` evaluates: the fixed validation rows (`valid`, from
    ``data.valid_path``, or None) and training rows, with their latents cached once when the run
    caches."""
    sources = [("train_rows", dataset)]
    if valid is not None:
        sources.insert(0, ("valid", valid))
    elif info.is_main:
        print(
            "elflow train: no data.valid_path, so the held-out loss covers training rows only",
            flush=True,
        )
    splits = []
    for name, data in sources:
        rows, keys = spread_rows(len(data), cfg.train.eval_rows, info.rank, info.world_size)
        subset = RowSubset(data, rows)
        cache = None
        if cfg.data.latent_cache and len(subset):
            cache = LatentCache.build(subset, encoder, dtype=cfg.data.latent_cache_dtype)

        def make(idx, keys, subset=subset, cache=cache):
            return make_batch(cfg, subset, cache, encoder, info.device, idx, keys)

        splits.append(HeldOutSplit(name, make, keys, chunk))
    return splits


def heldout_scores(
    splits: list[HeldOutSplit],
    model_cfg: ModelConfig,
    ema: EMA,
    objective,
    autocast: contextlib.AbstractContextManager,
    info: DistInfo,
) -> dict[str, float]:
    """The held-out losses of the EMA weights, in a network built for the occasion."""
    net = ema_network(model_cfg, ema.state_dict_for_save(), info.device)  # collective: FSDP2
    net.requires_grad_(False)
    metrics: dict[str, float] = {}
    for split in splits:
        metrics |= heldout_loss(objective, TrainForward(net), split, info.device, autocast)
    return metrics
