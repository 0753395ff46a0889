"""Shared by the quality tables (demo_quality.py, fewstep.py): timed sampling and one scoring setup.

Every row of both tables is scored the same way: ``elflow score``'s paper protocol (fp32) with
1000 seeded bootstrap resamples for the 95% intervals.
"""

from __future__ import annotations

import time
from dataclasses import replace
from typing import Any

from elflow.evaluation import score_samples
from elflow.generation.pipeline import ELFPipeline


def timed_generate(
    pipe: ELFPipeline, n: int, *, seed: int, batch_size: int, **changes: Any
) -> tuple[list[str], float]:
    """``n`` texts with the model's sampler changed by the non-None ``changes`` (SamplerConfig
    fields), and the wall time in seconds."""
    sampler = replace(pipe.sampler, **{k: v for k, v in changes.items() if v is not None})
    t0 = time.perf_counter()
    texts = pipe.generate(n, sampler=sampler, seed=seed, batch_size=batch_size)
    return texts, time.perf_counter() - t0


def score(texts: list[str], judge: Any) -> dict[str, Any]:
    """Paper-protocol metrics of ``texts`` with bootstrap 95% intervals (1000 resamples, seed 0)."""
    return score_samples([{"text": t} for t in texts], judge=judge, bootstrap=1000, seed=0)
