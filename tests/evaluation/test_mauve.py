"""MAUVE from the paper's definition: known answers on synthetic features and histograms."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from elflow.errors import ELFError
from elflow.evaluation import score_samples
from elflow.evaluation.mauve import kmeans, mauve, mauve_from_histograms
from elflow.evaluation.text_metrics import gen_ppl


def test_histograms_equal_score_one_disjoint_near_zero():
    p = np.array([0.5, 0.5, 0.0, 0.0])
    assert mauve_from_histograms(p, p) == pytest.approx(1.0, abs=1e-12)
    assert mauve_from_histograms(p, p[::-1].copy()) < 0.01
    q = np.array([0.4, 0.4, 0.1, 0.1])
    between = mauve_from_histograms(p, q)
    assert 0.01 < between < 1 and between == pytest.approx(mauve_from_histograms(q, p))


def test_features_of_one_distribution_score_near_one_of_two_near_zero():
    rng = np.random.default_rng(0)
    a, b = rng.normal(size=(400, 24)), rng.normal(size=(400, 24))
    far = rng.normal(size=(400, 24)) + np.r_[8.0, np.zeros(23)]
    near = rng.normal(size=(400, 24)) + np.r_[1.0, np.zeros(23)]
    same, apart, partly = mauve(a, b).mauve, mauve(a, far).mauve, mauve(a, near).mauve
    assert same > 0.9 and apart < 0.05 and apart < partly < same
    assert mauve(a, a).mauve == pytest.approx(1.0)  # the same points: the same clusters
    assert mauve(a, b, seed=3).mauve == mauve(a, b, seed=3).mauve  # seeded
    assert len(mauve(a, b).p_hist) == 40  # min(n, m) / 10 clusters, as the paper's package
    with pytest.raises(ELFError, match="features"):
        mauve(a, b[:, :3])


def test_kmeans_finds_separated_clusters():
    rng = np.random.default_rng(1)
    centres = np.array([[0.0, 0.0], [10.0, 0.0], [0.0, 10.0]])
    x = np.vstack([c + 0.1 * rng.normal(size=(30, 2)) for c in centres])
    labels = kmeans(x, 3, seed=0)
    assert len(set(labels[:30])) == len(set(labels[30:60])) == len(set(labels[60:])) == 1
    assert len(set(labels)) == 3


def test_judge_features_are_the_last_tokens_final_hidden_state(judge):
    texts = ["the cat sat on mat", "", "a dog ran"]
    res = gen_ppl(texts, judge, features=True, batch_size=2)
    assert res.features.shape == (2, judge.model.config.n_embd)  # the empty text has none
    ids = judge.tokenizer("a dog ran", add_special_tokens=False, return_tensors="pt")["input_ids"]
    with torch.inference_mode():
        hidden = judge.model(input_ids=ids, output_hidden_states=True).hidden_states[-1]
    np.testing.assert_allclose(res.features[1], hidden[0, -1].numpy(), atol=1e-5)
    assert gen_ppl(texts, judge).features is None


def test_score_samples_mauve_against_real_text(judge):
    rng = np.random.default_rng(0)

    def texts(words: str) -> list[str]:
        return [" ".join(rng.choice(words.split(), size=6)) for _ in range(40)]

    real = texts("the cat sat on mat dog ran in park")
    same = score_samples([{"text": t} for t in real], judge=judge, reference=real, bootstrap=0)
    assert same["mauve"] == pytest.approx(1.0) and "40 real texts" in same["protocol"]["mauve"]
    like = [{"text": t} for t in texts("the cat sat on mat dog ran in park")]
    collapsed = [{"text": "c c c c c c"}] * 40  # a model that writes one text: one cluster
    near = score_samples(like, judge=judge, reference=real, bootstrap=0)["mauve"]
    far = score_samples(collapsed, judge=judge, reference=real, bootstrap=0)["mauve"]
    assert far < 0.1 < 0.5 < near
    assert "mauve" not in score_samples(like, judge=judge, bootstrap=0)
    with pytest.raises(ELFError, match="needs the judge"):
        score_samples(like, judge=None, reference=real)
