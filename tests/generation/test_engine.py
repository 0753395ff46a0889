"""The one generation path (elflow.generation.engine): rows of different requests, seeds and
lengths batched together give, bitwise in fp32, what each gives alone; steps stream as texts."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from elflow import ELFError, ELFPipeline
from elflow.generation.engine import Row, make_rows, run_rows
from elflow.generation.infill import InfillRequest, length_template, parse_template


@pytest.fixture(scope="module")
def pipe(infill_model):
    return ELFPipeline.from_pretrained(infill_model)


@pytest.fixture(scope="module")
def cond_pipe(cond_model):
    return ELFPipeline.from_pretrained(cond_model)


def _infill(text: str) -> InfillRequest:
    return InfillRequest(parts=parse_template(text))


def test_rows_of_different_lengths_and_seeds_batch_together_as_alone(pipe):
    rows = [
        Row(3, 0, infill=InfillRequest(parts=length_template(2, 2))),
        Row(8, 1, infill=_infill("In the beginning [___4]")),
        Row(3, 1, infill=InfillRequest(parts=length_template(7, 7))),
        Row(5, 0, infill=_infill("[___1] said Moses [___3]")),
    ]
    together = run_rows(pipe, rows, pipe.sampler)
    lengths = [int((~together_keep).sum()) for together_keep in _keeps(pipe, rows)]
    assert lengths == [2, 4, 7, 4]  # the gaps really differ in length
    for b, row in enumerate(rows):
        alone = run_rows(pipe, [row], pipe.sampler)
        assert torch.equal(alone.tokens[0], together.tokens[b]), b
        assert alone.texts[0] == together.texts[b]
    assert together.texts[1].startswith("In the beginning")  # the kept text, verbatim


def _keeps(pipe, rows):
    from elflow.generation.infill import build_template

    t = build_template(
        pipe.tokenizer,
        [r.infill for r in rows],
        length=pipe.config.model.max_length,
        pad_id=pipe.row_pad_id,
        eos_id=pipe.tokens.eos_id,
        indices=[r.index for r in rows],
        seed=[r.seed for r in rows],
    )
    return [k | ~t.attention[b].bool() for b, k in enumerate(t.keep)]


def test_free_rows_of_a_conditional_model_batch_as_alone(cond_pipe):
    rows = make_rows([0, 1, 0], seed=[4, 4, 9], sources=["a short source", "another one here", "x"])
    together = run_rows(cond_pipe, rows, cond_pipe.sampler)
    for b, row in enumerate(rows):
        assert torch.equal(
            run_rows(cond_pipe, [row], cond_pipe.sampler).tokens[0], together.tokens[b]
        )
    # the pipeline's own call is these rows: sample i of seed s
    assert (
        cond_pipe(sources=["a short source", "another one here"], seed=4).texts
        == (together.texts[:2])
    )


def test_each_step_streams_the_trajectory_texts(pipe):
    seen: list[tuple[int, list[str]]] = []
    rows = make_rows([0, 1], seed=2, infill=[_infill("[___5]"), _infill("God [___3]")])
    out = run_rows(
        pipe, rows, pipe.sampler, trajectory=True, on_step=lambda k, t: seen.append((k, t))
    )
    assert [k for k, _ in seen] == list(range(pipe.sampler.steps))
    assert [t for _, t in seen] == out.trajectory
    assert all(len(texts) == 2 for _, texts in seen)
    # decoding the steps changes nothing in the result
    assert torch.equal(run_rows(pipe, rows, pipe.sampler).tokens, out.tokens)


def test_length_control_rows_equal_the_pipelines_length_controlled_samples(pipe):
    sampler = replace(pipe.sampler, length_range="3:6")
    want = pipe(3, seed=7, sampler=sampler, batch_size=2).tokens
    got = run_rows(pipe, make_rows([2, 0], seed=7), sampler).tokens
    assert torch.equal(got[0], want[2]) and torch.equal(got[1], want[0])


def test_a_batch_of_mixed_kinds_is_refused(pipe):
    rows = [Row(0, 0), Row(0, 1, infill=_infill("[___2]"))]
    with pytest.raises(ELFError, match="mixes free and infill rows"):
        run_rows(pipe, rows, pipe.sampler)


def test_seeds_and_indices_cannot_swap_silently():
    """make_rows takes the seeds by keyword: two int sequences side by side would swap unseen."""
    with pytest.raises(TypeError):
        make_rows([0, 1], [3, 8])
    rows = make_rows([0, 1], seed=[3, 8])
    assert [(r.seed, r.index) for r in rows] == [(3, 0), (8, 1)]


def test_batches_join_in_order_with_their_steps(pipe):
    """Generation.joined: batches of one run as one result (what pipe(n, batch_size=...) does)."""
    from elflow.generation.outputs import Generation

    whole = pipe(3, seed=5, trajectory=True)
    parts = [pipe.sample_batch(idx, pipe.sampler, seed=5, trajectory=True) for idx in ([0, 1], [2])]
    joined = Generation.joined(parts)
    assert joined.texts == whole.texts and torch.equal(joined.tokens, whole.tokens)
    assert joined.trajectory == whole.trajectory
