"""Deterministic, resumable order; rank/micro-batch sharding; keyed per-example draws (spec §10)."""

import numpy as np
import pytest

from elflow.data import StreamOrder, keyed_bernoulli, rank_positions
from elflow.errors import ELFError


def test_each_epoch_is_a_permutation_and_deterministic():
    order = StreamOrder(num_rows=37, seed=3)
    rows = order.rows(np.arange(37 * 4))
    for e in range(4):
        assert sorted(rows[e * 37 : (e + 1) * 37]) == list(range(37))
    assert not np.array_equal(rows[:37], rows[37:74])  # a fresh shuffle each epoch
    assert np.array_equal(rows, StreamOrder(37, seed=3).rows(np.arange(37 * 4)))
    assert not np.array_equal(rows, StreamOrder(37, seed=4).rows(np.arange(37 * 4)))
    assert order.epoch(73) == 1 and order.epoch(74) == 2
    plain = StreamOrder(5, seed=0, shuffle=False).rows(np.arange(12))
    assert plain.tolist() == [0, 1, 2, 3, 4, 0, 1, 2, 3, 4, 0, 1]


def test_resume_from_a_position_equals_continuing():
    batch, n = 8, 29
    straight = StreamOrder(n, seed=11)
    seen = [straight.rows(np.arange(s * batch, (s + 1) * batch)) for s in range(20)]
    resumed = StreamOrder(n, seed=11)  # a fresh object, as after a restart at step 9
    again = [resumed.rows(np.arange(s * batch, (s + 1) * batch)) for s in range(9, 20)]
    for a, b in zip(seen[9:], again, strict=True):
        assert np.array_equal(a, b)


@pytest.mark.parametrize("world,micro", [(2, 4), (2, 2), (1, 2), (4, 1)])
def test_rank_positions_reproduce_the_global_batch(world, micro):
    G = 8
    for step in range(3):
        parts = [
            rank_positions(step, G, world, r, micro, k)
            for r in range(world)
            for k in range(G // (world * micro))
        ]
        assert np.concatenate(parts).tolist() == list(range(step * G, (step + 1) * G))
    with pytest.raises(ELFError, match="not divisible by world size 3"):
        rank_positions(0, 8, 3, 0, 1, 0)
    with pytest.raises(ELFError, match="not divisible"):
        rank_positions(0, 8, 2, 0, 3, 0)


def test_keyed_bernoulli_rate_and_batch_independence():
    pos = np.arange(200_000)
    drop = keyed_bernoulli(pos, 0.1, seed=5, salt="label_drop")
    assert abs(drop.mean() - 0.1) < 0.004
    chunks = np.concatenate([keyed_bernoulli(c, 0.1, 5, "label_drop") for c in np.split(pos, 40)])
    assert np.array_equal(drop, chunks)
    shuffled = np.random.default_rng(0).permutation(pos)
    assert np.array_equal(keyed_bernoulli(shuffled, 0.1, 5, "label_drop"), drop[shuffled])
    other = keyed_bernoulli(pos, 0.1, 5, "other")
    assert abs((drop & other).mean() - 0.01) < 0.002  # salts give independent streams
    assert not np.array_equal(drop, keyed_bernoulli(pos, 0.1, 6, "label_drop"))
    assert not keyed_bernoulli(pos[:100], 0.0, 5, "x").any()
    assert keyed_bernoulli(pos[:100], 1.0, 5, "x").all()
    with pytest.raises(ELFError, match=r"\[0, 1\]"):
        keyed_bernoulli(pos, 1.5, 5, "x")
