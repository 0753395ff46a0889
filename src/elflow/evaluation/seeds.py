"""Several sampling seeds: samples grouped by their ``seed``, metrics summarised across seeds.

``elflow sample --seeds 0,1,2`` writes one file whose records carry their ``seed`` (sample ``id``
counts from 0 within each seed). Scoring such a file reports, for each metric ``m``:

- ``m``: the metric of all samples pooled (every seed's samples are independent draws from the
  same model and sampler, so pooling is a larger sample), with ``m_ci``, its percentile-bootstrap
  interval over the pooled samples;
- ``m_seed_mean`` and ``m_seed_sd``: the mean over seeds of the per-seed values, and their sample
  standard deviation (ddof 1): the between-seed spread, what a reader who re-runs with another
  seed should expect;
- ``per_seed``: every seed's own metrics.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from elflow.errors import ELFError


def seed_groups(samples: Sequence[dict[str, Any]]) -> dict[Any, np.ndarray] | None:
    """Seed -> (K,) indices of its samples, in order of first appearance; None unless every
    sample has a ``seed`` and there are at least two seeds. A (seed, id) pair seen twice (a file
    concatenated or given twice), with one seed or several, is refused: it would count samples
    twice."""
    seeds = [s.get("seed") for s in samples]
    if not seeds or any(v is None for v in seeds):
        return None
    if all("id" in s for s in samples):  # one seed or several: a sample counted twice is wrong
        seen: set[tuple[Any, Any]] = set()
        for s in samples:
            key = (s["seed"], s["id"])
            if key in seen:
                raise ELFError(
                    f"sample {s['id']!r} of seed {s['seed']!r} appears twice; "
                    "score each seed's samples once"
                )
            seen.add(key)
    if len(set(seeds)) < 2:
        return None
    values = np.array([str(v) for v in seeds])
    return {v: np.flatnonzero(values == str(v)) for v in dict.fromkeys(seeds)}


def spread(per_seed: dict[str, dict[str, Any]], keys: Sequence[str]) -> dict[str, float]:
    """``<key>_seed_mean`` and ``<key>_seed_sd`` (ddof 1) over the seeds where ``key`` is a
    finite number; NaN when fewer than one (mean) or two (sd) seeds have it."""
    out: dict[str, float] = {}
    for key in keys:
        values = [m.get(key) for m in per_seed.values()]
        if not any(isinstance(v, (int, float)) for v in values):
            continue
        finite = np.array([v for v in values if isinstance(v, (int, float)) and math.isfinite(v)])
        out[f"{key}_seed_mean"] = float(finite.mean()) if len(finite) else math.nan
        out[f"{key}_seed_sd"] = float(finite.std(ddof=1)) if len(finite) > 1 else math.nan
    return out


def parse_seeds(text: str, flag: str = "seeds=") -> list[int]:
    """``"0,1,2"`` -> ``[0, 1, 2]``: integers, at least one, none twice."""
    try:
        seeds = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise ELFError(f"{flag} must be a comma-separated list of integers, got {text!r}") from None
    if not seeds:
        raise ELFError(f"{flag} is empty; give seeds such as 0,1,2")
    twice = sorted({s for s in seeds if seeds.count(s) > 1})
    if twice:
        raise ELFError(f"{flag} lists seed {twice[0]} twice; give each seed once")
    return seeds
