"""Metric functions against hand computations and direct library calls (spec §6)."""

from __future__ import annotations

import math
import time

import numpy as np
import pytest
import torch
from rouge_score import rouge_scorer
from sacrebleu.metrics import BLEU

from elflow.errors import ELFError
from elflow.evaluation import bleu, bleu_cased, bootstrap_ci, gen_ppl, rouge, unigram_entropy
from elflow.evaluation.text_metrics import bleu_from_stats, ppl_from_sums
from tests.builders import tiny_judge

TEXTS = [
    "the cat sat on the mat .",
    "a b",
    "dog ran in the park , the dog ran",
    "c",
    "a b c d e f g h a b c",
]


def reference_sample(model, ids, eos, *, first_scored, score_eos, max_len):
    """(NLL, count, truncated) of one sample by an explicit loop: spec §6 written out longhand."""
    budget = max_len - int(first_scored)
    seq = [eos] * first_scored + ids[:budget] + [eos] * (score_eos and len(ids) < budget)
    with torch.no_grad():
        logp = torch.log_softmax(model(torch.tensor([seq])).logits[0].double(), dim=-1)
    nll, count, seen_eos = 0.0, 0, False
    for pos in range(1, len(seq)):  # the token at position 0 has no context: never scored
        tok = seq[pos]
        if tok == eos:
            if score_eos and not seen_eos:
                nll, count = nll - float(logp[pos - 1, tok]), count + 1
            seen_eos = True
        else:
            nll, count = nll - float(logp[pos - 1, tok]), count + 1
    return nll, count, len(ids) > budget


def reference(judge, texts, *, first_scored=False, score_eos=True):
    out = [
        reference_sample(
            judge.model,
            judge.tokenizer(t, add_special_tokens=False)["input_ids"],
            judge.eos_id,
            first_scored=first_scored,
            score_eos=score_eos,
            max_len=judge.max_length,
        )
        for t in texts
    ]
    return np.array([o[0] for o in out]), np.array([o[1] for o in out]), sum(o[2] for o in out)


def test_eos_is_end_of_text_by_name(judge):
    assert judge.eos_id == 0 and judge.max_length == 64 and not judge.add_bos


def test_paper_protocol_counts(judge):
    res = gen_ppl(["the cat sat"], judge)
    assert res.num_tokens == 3  # "cat", "sat" and the end-of-text slot; "the" is unscored
    assert gen_ppl(["the cat sat"], judge, first_token_scored=True).num_tokens == 4
    assert gen_ppl(["the cat sat"], judge, score_eos=False).num_tokens == 2


@pytest.mark.parametrize("first_scored", [False, True])
@pytest.mark.parametrize("score_eos", [True, False])
def test_gen_ppl_matches_hand_computation(judge, first_scored, score_eos):
    nll, counts, _ = reference(judge, TEXTS, first_scored=first_scored, score_eos=score_eos)
    kw = dict(first_token_scored=first_scored, score_eos=score_eos, batch_size=2)
    res = gen_ppl(TEXTS, judge, **kw)
    np.testing.assert_allclose(res.nll, nll, rtol=1e-5)
    np.testing.assert_array_equal(res.counts, counts)
    assert res.value == pytest.approx(math.exp(nll.sum() / counts.sum()), rel=1e-5)
    per_sample = gen_ppl(TEXTS, judge, aggregate="sample", **kw)
    keep = counts > 0
    expected = np.mean(np.exp(nll[keep] / counts[keep]))
    assert per_sample.value == pytest.approx(expected, rel=1e-5)
    assert per_sample.value != pytest.approx(res.value, rel=1e-3)


def test_eos_inside_text_scored_once(judge):
    # Targets are the non-EOS tokens plus the *first* EOS slot, wherever it falls (spec §6).
    text = "a b <|endoftext|> c <|endoftext|> d"
    nll, counts, _ = reference(judge, [text])
    res = gen_ppl([text], judge)
    assert res.counts[0] == counts[0] == 4  # b, first EOS, c, d; the appended EOS is not scored
    assert res.nll[0] == pytest.approx(nll[0], rel=1e-5)


def test_truncated_samples_have_no_eos_slot():
    judge = tiny_judge(n_positions=8)
    texts = ["a b c d e f g h a b", "a b c", "a b c d e f g"]  # 10, 3 and 7 tokens
    res = gen_ppl(texts, judge)
    assert res.num_truncated == 1
    # 8 text tokens kept and no end-of-text slot; 3 + slot; 7 + slot; the first never scored.
    assert list(res.counts) == [7, 3, 7]
    nll, _, truncated = reference(judge, texts)
    assert truncated == 1
    np.testing.assert_allclose(res.nll, nll, rtol=1e-5)
    assert list(res.lengths) == [10, 3, 7]


def test_batching_does_not_change_result(judge):
    one = gen_ppl(TEXTS, judge, batch_size=1)
    three = gen_ppl(TEXTS, judge, batch_size=3)
    np.testing.assert_allclose(one.nll, three.nll, rtol=1e-5)
    np.testing.assert_array_equal(one.counts, three.counts)
    assert one.value == pytest.approx(three.value, rel=1e-6)


def test_empty_samples_counted_and_excluded(judge):
    texts = ["a b c", "", "   \n\t", "the cat sat"]
    res = gen_ppl(texts, judge)
    assert res.num_empty == 2 and len(res.nll) == 2
    clean = gen_ppl(["a b c", "the cat sat"], judge)
    assert res.value == pytest.approx(clean.value, rel=1e-12)
    assert math.isnan(gen_ppl(["", " "], judge).value)
    assert gen_ppl(["", " "], judge).num_empty == 2


def test_bf16_really_runs_in_bf16(judge):
    seen = []
    block = judge.model.transformer.h[0]  # hooks on the caller's model see the bf16 copy too
    hook = block.register_forward_hook(lambda mod, inp, out: seen.append(out[0].dtype))
    try:
        bf16 = gen_ppl(TEXTS, judge, dtype="bf16")
    finally:
        hook.remove()
    assert seen and all(d == torch.bfloat16 for d in seen)
    assert next(judge.model.parameters()).dtype == torch.float32  # the caller's weights untouched
    fp32 = gen_ppl(TEXTS, judge)
    assert bf16.value != fp32.value
    assert bf16.value == pytest.approx(fp32.value, rel=0.05)
    assert bf16.dtype == "bf16"


def test_bad_options(judge):
    with pytest.raises(ELFError, match="dtype"):
        gen_ppl(TEXTS, judge, dtype="int8")
    with pytest.raises(ELFError, match="aggregate"):
        gen_ppl(TEXTS, judge, aggregate="median")


def test_unigram_entropy_hand_computed(judge):
    tok = judge.tokenizer
    assert unigram_entropy(["a a b b"], tok) == pytest.approx(math.log(2))
    assert unigram_entropy(["a a a"], tok) == 0.0
    assert unigram_entropy(["a b c d"], tok) == pytest.approx(math.log(4))
    # p = (1/2, 1/4, 1/4): H = 1.5 ln 2; whitespace-only samples are excluded from the mean
    mixed = unigram_entropy(["a a b c", "a a a", "  "], tok)
    assert mixed == pytest.approx((1.5 * math.log(2) + 0.0) / 2)
    assert math.isnan(unigram_entropy([""], tok))


HYPS = ["The cat sat on the mat.", "A dog ran in the park", "hello world", ""]
REFS = ["the cat sat on a mat.", "The dog runs in the park.", "Hello, world!", "nothing"]


def test_bleu_equals_sacrebleu():
    ours = bleu(HYPS, REFS)
    direct = BLEU(lowercase=True, tokenize="13a", effective_order=True).corpus_score(HYPS, [REFS])
    assert ours.score == pytest.approx(direct.score, abs=1e-12)
    assert "case:lc" in ours.signature and "tok:13a" in ours.signature
    cased = bleu_cased(HYPS, REFS)
    direct = BLEU(tokenize="13a", effective_order=True).corpus_score(HYPS, [REFS])
    assert cased.score == pytest.approx(direct.score, abs=1e-12)
    assert "case:mixed" in cased.signature and cased.score < ours.score
    assert bleu_from_stats(ours.stats) == pytest.approx(ours.score, abs=1e-12)
    with pytest.raises(ELFError, match="align"):
        bleu(HYPS, REFS[:2])


def test_rouge_equals_rouge_score():
    ours = rouge(HYPS, REFS)
    types = ["rouge1", "rouge2", "rougeL", "rougeLsum"]
    scorer = rouge_scorer.RougeScorer(types, use_stemmer=True)
    for t in types:
        pairs = zip(HYPS, REFS, strict=True)
        direct = np.mean([100 * scorer.score(r, h)[t].fmeasure for h, r in pairs])
        assert ours[t] == pytest.approx(direct, abs=1e-12)


def test_bootstrap_coverage():
    # A 95% percentile interval for the mean of 100 normal draws should cover the true mean ~95%.
    rng = np.random.default_rng(1234)
    covered = 0
    for rep in range(200):
        x = rng.normal(3.0, 2.0, size=100)
        lo, hi = bootstrap_ci(x, np.mean, n_resamples=400, seed=rep)
        covered += lo <= 3.0 <= hi
    assert 0.90 <= covered / 200 <= 0.99


def test_bootstrap_ratio_and_bleu_fast():
    rng = np.random.default_rng(0)
    pairs = np.stack([rng.uniform(10, 30, 1000), rng.integers(5, 15, 1000)], axis=1)
    point = ppl_from_sums(pairs[:, 0], pairs[:, 1])
    lo, hi = bootstrap_ci(pairs, lambda s: ppl_from_sums(s[:, 0], s[:, 1]), n_resamples=200)
    assert lo < point < hi
    words = "the cat sat on a mat dog ran in park".split()
    hyps = [" ".join(rng.choice(words, 12)) for _ in range(1000)]
    refs = [" ".join(rng.choice(words, 12)) for _ in range(1000)]
    res = bleu(hyps, refs)
    start = time.perf_counter()
    lo, hi = bootstrap_ci(res.stats, bleu_from_stats, n_resamples=1000)
    assert time.perf_counter() - start < 5.0
    assert lo < res.score < hi
    assert all(math.isnan(v) for v in bootstrap_ci(np.array([]), np.mean))
