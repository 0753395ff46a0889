"""Memorisation check: the share of samples that copy an n-token span of the training text.

A sample "copies" when any run of ``n`` consecutive word tokens (lower-cased; words and punctuation
marks are tokens, so the check does not depend on any model's tokenizer) also occurs somewhere in
the training corpus. The demo model's bar is at most 5% of samples copying an 8-token span.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence

import numpy as np

_WORD = re.compile(r"\w+|[^\w\s]")


def words(text: str) -> list[str]:
    """Lower-cased word and punctuation tokens."""
    return _WORD.findall(text.lower())


def ngram_set(texts: Iterable[str], n: int) -> set[int]:
    """Hashes of every n-gram of word tokens in ``texts`` (one document per text)."""
    out: set[int] = set()
    for text in texts:
        toks = words(text)
        out.update(hash(tuple(toks[i : i + n])) for i in range(len(toks) - n + 1))
    return out


def copies(texts: Sequence[str], corpus_ngrams: set[int], n: int) -> np.ndarray:
    """(N,) bool: whether each text shares at least one n-gram with the corpus."""
    flags = []
    for text in texts:
        toks = words(text)
        grams = (hash(tuple(toks[i : i + n])) for i in range(len(toks) - n + 1))
        flags.append(any(g in corpus_ngrams for g in grams))
    return np.array(flags, dtype=bool)


def copy_share(texts: Sequence[str], corpus: Iterable[str], n: int = 8) -> float:
    """Share of ``texts`` that copy an ``n``-token span of ``corpus`` verbatim."""
    if n < 1:
        raise ValueError(f"the span length n must be >= 1, got {n}")
    if not texts:
        return float("nan")
    return float(copies(texts, ngram_set(corpus, n), n).mean())
