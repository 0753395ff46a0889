"""Repetition and diversity of a set of samples, judge-free (an elflow addition to spec §6).

Low generative perplexity is easy to buy with repetitive or collapsed text; these numbers show it:

- ``distinct_n`` (Li et al., 2016): unique n-grams / all n-grams over the whole set (n = 1, 2, 3);
- ``rep_4`` (Welleck et al., 2019, seq-rep-4): per sample, the share of its 4-grams that repeat an
  earlier 4-gram of the same sample, averaged over samples that have one;
- ``self_bleu`` (Zhu et al., 2018): mean sentence BLEU-4 of each sample against all the others
  as references (sacrebleu: 13a, cased, exponential smoothing, effective order); high = alike;
- ``empty_share``: empty or whitespace-only samples; ``duplicate_share``: non-empty samples that
  repeat an earlier non-empty sample exactly (leading and trailing space ignored).

n-grams are over lower-cased word and punctuation tokens (:func:`elflow.evaluation.copying.words`),
so no model's tokenizer enters. Empty samples count only in ``empty_share``.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence

import numpy as np

from elflow.evaluation.copying import words

DISTINCT_ORDERS = (1, 2, 3)
REP_ORDER = 4


def _ngrams(tokens: Sequence[str], n: int) -> list[tuple[str, ...]]:
    return [tuple(tokens[i : i + n]) for i in range(len(tokens) - n + 1)]


def _non_empty(texts: Sequence[str]) -> list[str]:
    return [t for t in texts if t.strip()]


def distinct_n(texts: Sequence[str], n: int) -> float:
    """Unique n-grams / all n-grams of ``texts`` together (NaN when there are none)."""
    grams = [g for t in texts for g in _ngrams(words(t), n)]
    return len(set(grams)) / len(grams) if grams else math.nan


def repeated_ngrams(texts: Sequence[str], n: int = REP_ORDER) -> np.ndarray:
    """(M,) per sample with at least one n-gram: 1 - unique n-grams / n-grams of that sample."""
    out = []
    for text in texts:
        grams = _ngrams(words(text), n)
        if grams:
            out.append(1.0 - len(set(grams)) / len(grams))
    return np.array(out, dtype=np.float64)


def self_bleu(texts: Sequence[str]) -> float:
    """Mean sacrebleu sentence BLEU of each non-empty text against all the other non-empty texts.

    Equal to ``mean(BLEU(effective_order=True).sentence_score(t, others))``, computed from
    n-gram counts in one pass (the references' maximum count of each n-gram, excluding the
    hypothesis itself), so it takes seconds, not minutes, for a thousand samples.
    """
    from sacrebleu.metrics import BLEU

    metric = BLEU(effective_order=True)
    kept = _non_empty(texts)
    if len(kept) < 2:
        return math.nan
    tokens = [metric._preprocess_segment(t).split() for t in kept]
    lengths = np.array([len(t) for t in tokens])
    orders = range(1, metric.max_ngram_order + 1)
    counts = [[Counter(_ngrams(t, n)) for n in orders] for t in tokens]
    # For each n-gram: the largest count in any text, the text holding it, and the runner-up,
    # so that "the most in any other text" is one lookup.
    best: dict[tuple[str, ...], list[int]] = {}
    for i, per_order in enumerate(counts):
        for counter in per_order:
            for gram, c in counter.items():
                top = best.setdefault(gram, [0, -1, 0])
                if c > top[0]:
                    top[:] = [c, i, top[0]]
                elif c > top[2]:
                    top[2] = c
    scores = []
    for i, per_order in enumerate(counts):
        correct = [
            sum(min(c, best[g][2] if best[g][1] == i else best[g][0]) for g, c in counter.items())
            for counter in per_order
        ]
        total = [max(0, int(lengths[i]) - n + 1) for n in orders]
        others = np.delete(lengths, i)
        diff = np.abs(others - lengths[i])
        ref_len = int(others[diff == diff.min()].min())  # closest, ties to the shorter
        score = BLEU.compute_bleu(
            correct,
            total,
            int(lengths[i]),
            ref_len,
            smooth_method=metric.smooth_method,
            effective_order=True,
        )
        scores.append(score.score)
    return float(np.mean(scores))


def empty_share(texts: Sequence[str]) -> float:
    """Share of empty or whitespace-only texts."""
    return (len(texts) - len(_non_empty(texts))) / len(texts) if texts else math.nan


def duplicate_share(texts: Sequence[str]) -> float:
    """Share of non-empty texts that repeat an earlier non-empty text (NaN when all are empty)."""
    kept = [t.strip() for t in _non_empty(texts)]
    return 1.0 - len(set(kept)) / len(kept) if kept else math.nan


def diversity(texts: Sequence[str]) -> dict[str, float]:
    """This module's numbers for ``texts`` at once (``elflow score`` computes each as a metric of
    :data:`elflow.evaluation.metric_table.METRICS`)."""
    kept = _non_empty(texts)
    rep = repeated_ngrams(kept)
    return {
        **{f"distinct_{n}": distinct_n(kept, n) for n in DISTINCT_ORDERS},
        f"rep_{REP_ORDER}": float(rep.mean()) if len(rep) else math.nan,
        "self_bleu": self_bleu(kept),
        "empty_share": empty_share(texts),
        "duplicate_share": duplicate_share(texts),
    }


def degenerate(texts: Sequence[str]) -> str | None:
    """A one-line warning when every text is empty or all are the same text, else None."""
    if not texts:
        return None
    kept = [t.strip() for t in texts]
    if not any(kept):
        return f"all {len(texts)} samples are empty; check the model and the sampler settings"
    if len(texts) > 1 and len(set(kept)) == 1:
        shown = kept[0] if len(kept[0]) <= 60 else kept[0][:57] + "..."
        return f"all {len(texts)} samples are the same text ({shown!r}); the model has collapsed"
    return None
