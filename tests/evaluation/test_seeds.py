"""Scoring samples of several seeds: per-seed metrics, their spread, the pooled interval."""

from __future__ import annotations

import argparse

import numpy as np
import pytest

from elflow.cli.common import add_seed_arguments, seeds_from_args
from elflow.errors import ELFError
from elflow.evaluation import score_samples
from elflow.evaluation.scoring import SEED_KEYS
from elflow.evaluation.seeds import parse_seeds, seed_groups

TEXTS = [
    "the cat sat on the mat .",
    "a dog ran in the park",
    "the the the the",
    "",
    "a cat sat , the dog ran .",
    "park park dog",
    "the mat",
    "h g f e d c b a",
    "the cat sat on the mat .",
]


def _records() -> list[dict]:
    return [{"id": i % 3, "seed": 10 + i // 3, "text": t} for i, t in enumerate(TEXTS)]


def test_per_seed_metrics_are_each_seeds_own_score_and_pooled_is_all(judge):
    records = _records()
    refs = [{"text": t} for t in reversed(TEXTS)]
    m = score_samples(records, judge=judge, refs=refs, reference=TEXTS[:6], bootstrap=50)
    assert m["seeds"] == [10, 11, 12] and m["protocol"]["seeds"] == [10, 11, 12]
    for k, seed in enumerate((10, 11, 12)):
        part = records[3 * k : 3 * k + 3]
        alone = score_samples(
            [{"text": r["text"]} for r in part],  # no seed field: one group
            judge=judge,
            refs=refs[3 * k : 3 * k + 3],
            reference=TEXTS[:6],
            bootstrap=0,
        )
        per = m["per_seed"][str(seed)]
        for key in ("gen_ppl", "entropy", "mean_length", "distinct_2", "self_bleu", "bleu"):
            assert per[key] == pytest.approx(alone[key], nan_ok=True), key
        assert per["num_samples"] == 3
    for key in ("gen_ppl", "entropy", "distinct_1", "rougeL"):
        values = np.array([m["per_seed"][s][key] for s in ("10", "11", "12")])
        assert m[f"{key}_seed_mean"] == pytest.approx(values.mean())
        assert m[f"{key}_seed_sd"] == pytest.approx(values.std(ddof=1))
    assert set(SEED_KEYS) >= {"gen_ppl", "mauve", "self_bleu", "bleu"}
    # The flat numbers and intervals are those of all samples pooled.
    pooled = score_samples(
        [{"text": t} for t in TEXTS], judge=judge, refs=refs, reference=TEXTS[:6], bootstrap=50
    )
    for key in ("gen_ppl", "entropy", "gen_ppl_ci", "bleu", "mauve", "num_empty"):
        assert m[key] == pooled[key], key
    assert "seeds" not in pooled and "per_seed" not in pooled


def test_seed_groups_refuse_a_sample_counted_twice():
    records = _records()
    assert seed_groups(records[:3]) is None  # one seed: nothing to summarise
    assert seed_groups([{"text": "a", "seed": 1}, {"text": "b"}]) is None
    assert [g.tolist() for g in seed_groups(records).values()] == [[0, 1, 2], [3, 4, 5], [6, 7, 8]]
    with pytest.raises(ELFError, match="sample 0 of seed 10 appears twice"):
        seed_groups(records + records[:1])
    with pytest.raises(ELFError, match="appears twice"):  # one seed's file given twice
        seed_groups(records[:3] + records[:3])


def test_seed_flags():
    p = argparse.ArgumentParser()
    add_seed_arguments(p)
    assert seeds_from_args(p.parse_args([])) == [0]
    assert seeds_from_args(p.parse_args(["--seed", "7"])) == [7]
    assert seeds_from_args(p.parse_args(["--seeds", "0, 1,2"])) == [0, 1, 2]
    with pytest.raises(ELFError, match="not both"):
        seeds_from_args(p.parse_args(["--seed", "1", "--seeds", "0,1"]))
    with pytest.raises(ELFError, match="lists seed 1 twice"):
        parse_seeds("1,2,1")
    with pytest.raises(ELFError, match="integers"):
        parse_seeds("0,x")
    with pytest.raises(ELFError, match="empty"):
        parse_seeds(",")
