"""Training batches: dataset rows to clean latents, keyed by their stream positions (ELF_SPEC §3).

A batch's latents come from the latent cache when the run keeps one, else from the frozen encoder;
a conditional example's label drop (§3 step 10) is a function of its stream position and the seed,
so every process, accumulation split and resume draws the same one.
"""

from __future__ import annotations

import numpy as np
import torch

from elflow.data.latent_cache import LatentCache
from elflow.data.order import keyed_bernoulli
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
    return Batch(x=x, input_ids=ids, attention_mask=attn, cond_mask=cond, label_drop=drop)
