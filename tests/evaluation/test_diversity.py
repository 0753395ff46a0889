"""Repetition and diversity numbers, against hand counts and sacrebleu."""

from __future__ import annotations

import math
import random

import pytest
from sacrebleu.metrics import BLEU

from elflow.evaluation.diversity import (
    degenerate,
    distinct_n,
    diversity,
    duplicate_share,
    empty_share,
    repeated_ngrams,
    self_bleu,
)


def test_distinct_and_repeated_ngrams_by_hand():
    texts = ["the cat the cat", "The dog."]
    # words: [the, cat, the, cat] and [the, dog, .]: 7 unigrams, 4 unique (the, cat, dog, .)
    assert distinct_n(texts, 1) == pytest.approx(4 / 7)
    # bigrams: (the cat) (cat the) (the cat) | (the dog) (dog .): 5, 4 unique
    assert distinct_n(texts, 2) == pytest.approx(4 / 5)
    assert math.isnan(distinct_n(["a"], 2))
    # 2-grams of sample 1 repeat once in 3; sample 2 never
    assert repeated_ngrams(texts, 2).tolist() == pytest.approx([1 / 3, 0.0])
    assert len(repeated_ngrams(["too short"], 4)) == 0  # no 4-gram: not counted


def test_self_bleu_equals_sacrebleu_sentence_bleu_against_the_others():
    rng = random.Random(0)
    words = "the cat sat on a mat . and dog ran in park , then It".split()
    texts = [" ".join(rng.choice(words) for _ in range(rng.randint(1, 14))) for _ in range(25)]
    texts += ["the cat sat on the mat .", "the cat sat on the mat .", "x"]  # ties, a duplicate
    metric = BLEU(effective_order=True)
    expected = [
        metric.sentence_score(t, [o for j, o in enumerate(texts) if j != i]).score
        for i, t in enumerate(texts)
    ]
    assert self_bleu([*texts, "", "  "]) == pytest.approx(sum(expected) / len(expected), abs=1e-9)
    assert math.isnan(self_bleu(["only one", ""]))


def test_empty_and_duplicate_shares():
    texts = ["a b", "", "a b ", "c", " "]
    assert empty_share(texts) == 2 / 5
    assert duplicate_share(texts) == pytest.approx(1 / 3)  # "a b " repeats "a b"
    assert math.isnan(duplicate_share(["", " "]))
    d = diversity(texts)
    assert d["empty_share"] == 2 / 5 and d["distinct_1"] == pytest.approx(3 / 5)


def test_degenerate_sets_get_one_line():
    assert degenerate(["", " ", "\n"]) == (
        "all 3 samples are empty; check the model and the sampler settings"
    )
    line = degenerate(["amen amen", " amen amen"])
    assert line.startswith("all 2 samples are the same text ('amen amen')") and "\n" not in line
    assert degenerate(["a", "b"]) is None and degenerate(["a"]) is None and degenerate([]) is None
