"""Deterministic, resumable example order and per-example random draws keyed by position (§10).

Training consumes an infinite *stream* of rows: stream position p lies in epoch e = p // N and is
row ``perm_e[p % N]``, where perm_e is a permutation drawn from a generator seeded by (seed, e). The
order is a pure function of (seed, position), so resuming at a saved position replays exactly what
an uninterrupted run would have seen. Global batch g covers positions [g*G, (g+1)*G); under N
processes rank r takes a contiguous slice and gradient accumulation splits that slice further, so
any (world size, accumulation) reproduces the one-process batch. Random draws tied to an example
(label drop) are keyed by (seed, salt, position) (:mod:`elflow.runtime.keyed_random`), independent
of batching.
"""

from __future__ import annotations

from collections import OrderedDict

import numpy as np

from elflow.errors import ELFError

_PERM_CACHE = 2  # the current epoch and the next one (a batch may straddle them)


class StreamOrder:
    """Maps stream positions to row indices: a fresh permutation of the rows each epoch."""

    def __init__(self, num_rows: int, seed: int, shuffle: bool = True):
        if num_rows <= 0:
            raise ELFError(f"the dataset has no rows (num_rows={num_rows}); add data")
        self.num_rows, self.seed, self.shuffle = int(num_rows), int(seed), shuffle
        self._perms: OrderedDict[int, np.ndarray] = OrderedDict()

    def permutation(self, epoch: int) -> np.ndarray:
        """perm_e: the row order of `epoch` (identity without shuffle)."""
        if not self.shuffle:
            return np.arange(self.num_rows, dtype=np.int64)
        if epoch not in self._perms:
            rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence([self.seed, epoch])))
            self._perms[epoch] = rng.permutation(self.num_rows).astype(np.int64)
            while len(self._perms) > _PERM_CACHE:
                self._perms.popitem(last=False)
        return self._perms[epoch]

    def epoch(self, position: int) -> int:
        return int(position) // self.num_rows

    def rows(self, positions: np.ndarray) -> np.ndarray:
        """Row indices of stream `positions` (any shape of non-negative ints)."""
        positions = np.asarray(positions, dtype=np.int64)
        if positions.size and positions.min() < 0:
            raise ValueError("stream positions must be non-negative")
        epochs = positions // self.num_rows
        out = np.empty_like(positions)
        for e in np.unique(epochs):
            sel = epochs == e
            out[sel] = self.permutation(int(e))[positions[sel] % self.num_rows]
        return out


def rank_positions(
    step: int, global_batch: int, world_size: int, rank: int, micro_batch: int, micro_step: int
) -> np.ndarray:
    """Stream positions of micro-step `micro_step` of rank `rank` in global batch `step`.

    Rank r owns positions [step*G + r*G/W, step*G + (r+1)*G/W); micro-step k takes the k-th
    `micro_batch` of that slice, so concatenating ranks and micro-steps in order gives the
    one-process batch.
    """
    if world_size <= 0 or micro_batch <= 0 or global_batch <= 0:
        raise ELFError("global_batch, world_size and micro_batch must be positive")
    if global_batch % (world_size * micro_batch):
        raise ELFError(
            f"global batch {global_batch} is not divisible by world size {world_size} x "
            f"micro batch {micro_batch}; change the batch size or the number of processes"
        )
    accum = global_batch // (world_size * micro_batch)
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} outside [0, {world_size})")
    if not 0 <= micro_step < accum:
        raise ValueError(f"micro_step {micro_step} outside [0, {accum})")
    start = step * global_batch + rank * (global_batch // world_size) + micro_step * micro_batch
    return np.arange(start, start + micro_batch, dtype=np.int64)


def keyed_uniform(positions: np.ndarray, seed: int, salt: str) -> np.ndarray:
    """A float64 in (0, 1) per position, a pure function of (seed, salt, position)
    (:func:`elflow.runtime.keyed_random.host_uniform`, the training draws' generator)."""
    from elflow.runtime.keyed_random import host_uniform

    return host_uniform(positions, seed, salt)


def keyed_bernoulli(positions: np.ndarray, prob: float, seed: int, salt: str) -> np.ndarray:
    """True with probability `prob` per position, independent of how positions are batched."""
    if not 0.0 <= prob <= 1.0:
        raise ELFError(f"probability must be in [0, 1], got {prob}")
    return keyed_uniform(positions, seed, salt) < prob
