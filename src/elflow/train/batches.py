"""Training batches: dataset rows to clean latents, keyed by their stream positions (ELF_SPEC §3).

A batch is made in two halves. :func:`host_batch` does the host's part: the rows, a conditional
example's label drop and span conditioning (functions of the stream position and the seed, so
every process, accumulation split and resume draws the same ones), and the cached latents when
the run keeps a latent cache, in pinned memory when the device is a GPU. :meth:`HostBatch.
to_device` copies that without waiting for the device and runs the frozen encoder when nothing is
cached. :class:`BatchLoader` makes the next step's host halves in a background thread while the
device works on this step's.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from elflow.config.train_config import RunConfig
from elflow.data.latent_cache import LatentCache
from elflow.data.row_order import StreamOrder, keyed_bernoulli, keyed_uniform, rank_positions
from elflow.objective import Batch
from elflow.text.encoder import FrozenEncoder


@dataclass
class HostBatch:
    """The host's half of a batch: CPU tensors (pinned for a GPU) and what the loss covers."""

    positions: np.ndarray
    """(B,) stream positions (they key every random draw)."""
    input_ids: Tensor
    attention_mask: Tensor
    source_mask: Tensor | None
    """(B, L) the dataset's source positions (conditional data), which the encoder sees."""
    cond_mask: Tensor | None
    """(B, L) the objective's condition: the source, or a span-conditioning row's kept text."""
    label_drop: Tensor | None
    latents: Tensor | None
    """(B, L, E) cached latents, or None (the encoder runs on the device)."""
    loss_tokens: float
    """Tokens the ELF loss covers (its normaliser's share of this batch, ELF_SPEC §3 step 9)."""
    text_tokens: int
    """Valid (non-padding) tokens, condition included: what tokens/s counts."""

    def to_device(self, encoder: FrozenEncoder, device: torch.device) -> Batch:
        """The batch on ``device``: asynchronous copies, the encoder when nothing is cached."""

        def move(t: Tensor | None) -> Tensor | None:
            return None if t is None else t.to(device, non_blocking=True)

        ids, attn, drop = move(self.input_ids), move(self.attention_mask), move(self.label_drop)
        if self.latents is not None:
            x = move(self.latents).float()
        else:
            x = encoder(ids, attn, move(self.source_mask), drop)
        cond = move(self.cond_mask)
        return Batch(x, ids, attn, cond, drop, loss_tokens=self.loss_tokens)


def host_batch(
    cfg: RunConfig,
    dataset,
    cache: LatentCache | None,
    row_idx: np.ndarray,
    positions: np.ndarray,
    pin: bool = False,
) -> HostBatch:
    """The host half of the batch of dataset rows ``row_idx`` at stream ``positions``."""
    rows = dataset.get_rows(row_idx)
    source = rows["cond_mask"] if dataset.conditional else None
    drop = None
    if dataset.conditional and cfg.objective.label_drop_prob > 0:
        drop = keyed_bernoulli(
            positions, cfg.objective.label_drop_prob, cfg.train.seed, "label_drop"
        )
    latents = cache.get(row_idx, drop) if cache is not None else None
    cond = source
    if cfg.objective.span_cond_prob > 0 and not dataset.conditional:
        cond = span_condition(rows["attention_mask"], positions, cfg)
    valid = rows["attention_mask"].astype(bool)
    covered = np.ones_like(valid) if cfg.objective.pad_with_eos else valid
    if cond is not None:
        covered = covered & (cond == 0)

    def tensor(a: np.ndarray | None) -> Tensor | None:
        if a is None:
            return None
        t = torch.from_numpy(np.ascontiguousarray(a))
        return t.pin_memory() if pin else t

    return HostBatch(
        positions=np.asarray(positions, dtype=np.int64),
        input_ids=tensor(rows["input_ids"]),
        attention_mask=tensor(rows["attention_mask"]),
        source_mask=tensor(source),
        cond_mask=tensor(cond),
        label_drop=tensor(drop),
        latents=None if latents is None else (latents.pin_memory() if pin else latents),
        loss_tokens=float(covered.sum()),
        text_tokens=int(valid.sum()),
    )


def make_batch(
    cfg: RunConfig,
    dataset,
    cache: LatentCache | None,
    encoder: FrozenEncoder,
    device: torch.device,
    row_idx: np.ndarray,
    positions: np.ndarray,
) -> Batch:
    """The batch of dataset rows ``row_idx`` at stream ``positions`` (which key the label drop),
    on ``device``: :func:`host_batch`, then :meth:`HostBatch.to_device`."""
    return host_batch(cfg, dataset, cache, row_idx, positions).to_device(encoder, device)


class BatchLoader:
    """A process's host batches of each optimizer step, the next step's made in a background
    thread (the host work then overlaps the device's; the batches are pure functions of the
    step, so the order of making them changes nothing)."""

    def __init__(
        self,
        cfg: RunConfig,
        dataset,
        cache: LatentCache | None,
        order: StreamOrder,
        geometry,
        rank: int,
        world_size: int,
        pin: bool,
    ) -> None:
        self.cfg, self.dataset, self.cache, self.order = cfg, dataset, cache, order
        self.geometry, self.rank, self.world_size, self.pin = geometry, rank, world_size, pin
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="elflow-batches")
        self._next: tuple[int, Future] | None = None

    def make(self, step: int) -> list[HostBatch]:
        """The host batches of ``step`` (one per micro-step), made now."""
        g = self.geometry
        out = []
        for k in range(g.accum):
            pos = rank_positions(step, g.global_batch, self.world_size, self.rank, g.micro, k)
            out.append(
                host_batch(self.cfg, self.dataset, self.cache, self.order.rows(pos), pos, self.pin)
            )
        return out

    def get(self, step: int) -> list[HostBatch]:
        """The host batches of ``step``; starts making those of ``step + 1`` unless ``step`` is
        the run's last."""
        batches = None
        if self._next is not None:
            ahead, future = self._next
            if ahead == step:
                batches = future.result()
            elif not future.cancel():  # another step's: let it finish (the order's cache is
                future.exception()  # not shared between threads), and drop it
        if batches is None:
            batches = self.make(step)
        more = step + 1 < self.geometry.total_steps
        self._next = (step + 1, self._pool.submit(self.make, step + 1)) if more else None
        return batches

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)


SPAN_FRACTION = (0.1, 0.6)
"""The share of a row's text that span conditioning leaves to fill (uniform in this range)."""


def span_condition(attention: np.ndarray, positions: np.ndarray, cfg: RunConfig) -> np.ndarray:
    """(B, L) int64: for the rows that draw span conditioning (``objective.span_cond_prob``),
    1 everywhere but one span of 10-60% of the text between its first and last valid token
    (the row's start and end tokens stay kept, as infilling templates keep them); 0 for the
    other rows. Every draw is keyed by the stream position, like the label drop."""
    seed = cfg.train.seed
    chosen = keyed_bernoulli(positions, cfg.objective.span_cond_prob, seed, "span")
    share = keyed_uniform(positions, seed, "span_share")
    where = keyed_uniform(positions, seed, "span_start")
    lo, hi = SPAN_FRACTION
    out = np.zeros(attention.shape, dtype=np.int64)
    for b, n_valid in enumerate(attention.sum(axis=1)):
        text = int(n_valid) - 2  # between the first and the last valid token
        if not chosen[b] or text < 1:
            continue
        k = max(1, round((lo + (hi - lo) * share[b]) * text))
        start = 1 + int(where[b] * (text - k + 1))
        out[b] = 1
        out[b, start : start + k] = 0
    return out
