"""The copy (memorisation) check."""

import math

import pytest

from elflow.evaluation.copying import copies, copy_share, ngram_set, words

CORPUS = ["In the beginning God created the heavens and the earth.", "Jesus wept."]


def test_words_lowercase_and_split_punctuation():
    assert words("Jesus wept.") == ["jesus", "wept", "."]


def test_copy_share_counts_any_shared_span():
    samples = [
        "and so in the beginning god created the heavens and more",  # copies 8 words
        "in the beginning god created the sky",  # only 7 shared in a row
        "",
    ]
    grams = ngram_set(CORPUS, 8)
    assert copies(samples, grams, 8).tolist() == [True, False, False]
    assert copy_share(samples, CORPUS, 8) == 1 / 3
    assert copy_share(samples, CORPUS, 3) == 2 / 3
    assert math.isnan(copy_share([], CORPUS))
    with pytest.raises(ValueError, match="n must be >= 1"):
        copy_share(samples, CORPUS, 0)  # every text would "copy" the empty span
