"""Training batches: dataset rows to clean latents, keyed by their stream positions (ELF_SPEC §3).

A batch's latents come from the latent cache when the run keeps one, else from the frozen encoder;
a conditional example's label drop (§3 step 10) is a function of its stream position and the seed,
so every process, accumulation split and resume draws the same one.
"""

from __future__ import annotations

import numpy as np
import torch

from elflow.data.latent_cache import LatentCache
from elflow.data.order import keyed_bernoulli, keyed_uniform
from elflow.encoder import FrozenEncoder
from elflow.objective import Batch
from elflow.train.config import RunConfig


def make_batch(
    cfg: RunConfig,
    dataset,
    cache: LatentCache | None,
    encoder: FrozenEncoder,
    device: torch.device,
    row_idx: np.ndarray,
    positions: np.ndarray,
) -> Batch:
    """The batch of dataset rows ``row_idx`` at stream ``positions`` (which key the label drop)."""
    rows = dataset.get_rows(row_idx)
    ids = torch.from_numpy(rows["input_ids"]).to(device)
    attn = torch.from_numpy(rows["attention_mask"]).to(device)
    cond = torch.from_numpy(rows["cond_mask"]).to(device) if dataset.conditional else None
    drop_np = None
    if dataset.conditional and cfg.objective.label_drop_prob > 0:
        drop_np = keyed_bernoulli(
            positions, cfg.objective.label_drop_prob, cfg.train.seed, "label_drop"
        )
    drop = torch.from_numpy(drop_np).to(device) if drop_np is not None else None
    if cache is not None:
        x = cache.get(row_idx, drop_np).to(device)
    else:
        x = encoder(ids, attn, cond, drop)
    if cfg.objective.span_cond_prob > 0 and not dataset.conditional:
        spans = span_condition(rows["attention_mask"], positions, cfg)
        cond = torch.from_numpy(spans).to(device)
    return Batch(x=x, input_ids=ids, attention_mask=attn, cond_mask=cond, label_drop=drop)


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
