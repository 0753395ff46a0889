"""What a run's start records and says about its data: the model config each checkpoint records
(:func:`run_artifact`, with the training texts' lengths from :func:`text_lengths`), and the notes
on how the documents became rows (:func:`data_notes`)."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import numpy as np

from elflow.config.train_config import RunConfig
from elflow.data.rows import RowDataset
from elflow.io.artifact_config import ArtifactConfig
from elflow.text.tokens import special_token_count
from elflow.train.resume import local_absolute

LENGTH_SAMPLE = 20_000
"""Rows :func:`text_lengths` reads (evenly spaced over the data)."""


def text_lengths(dataset: RowDataset, tokenizer: Any) -> tuple[tuple[int, ...], float]:
    """(how many texts have 0, 1, 2, ... tokens, their mean tokens per word), from up to
    ``LENGTH_SAMPLE`` rows: what ``sampler.length_range`` draws lengths from. A text's tokens
    are its row's valid tokens less its source and the tokenizer's own special tokens."""
    n = len(dataset)
    idx = np.unique(np.linspace(0, n - 1, min(n, LENGTH_SAMPLE)).astype(np.int64))
    rows = dataset.get_rows(idx)
    specials = special_token_count(tokenizer)
    valid = rows["attention_mask"].sum(1) - rows["cond_mask"].sum(1) - specials
    counts = np.bincount(np.clip(valid, 0, None), minlength=1)
    texts = tokenizer.batch_decode(rows["input_ids"][:2000].tolist(), skip_special_tokens=True)
    words = sum(len(t.split()) for t in texts)
    tokens = int(np.clip(valid[:2000], 0, None).sum())
    return tuple(int(c) for c in counts), round(tokens / max(words, 1), 4)


def run_artifact(
    cfg: RunConfig, tokenizer_hash: str, lengths: tuple[tuple[int, ...], float] = ((), 0.0)
) -> ArtifactConfig:
    """What a checkpoint of this run records to be loaded as a model (spec §10), with its
    training texts' length histogram and tokens per word (:func:`text_lengths`)."""
    return ArtifactConfig(
        model=cfg.model,
        sampler=cfg.sampler,
        **ArtifactConfig.encoder_fields(
            replace(
                cfg.encoder,
                name=local_absolute(cfg.encoder.name),
                tokenizer=local_absolute(cfg.encoder.tokenizer_name),
            )
        ),
        tokenizer_hash=tokenizer_hash,
        task=cfg.task,
        max_input_length=cfg.max_input_length if cfg.task == "conditional" else 0,
        pad_with_eos=cfg.objective.pad_with_eos,
        packed=cfg.data.packing,
        noise_scale=cfg.objective.noise_scale,
        t_eps=cfg.objective.t_eps,
        length_histogram=lengths[0],
        tokens_per_word=lengths[1],
        origin=f"elflow train (preset {cfg.preset or 'custom'})"
        + (f", fine-tuned from {cfg.train.init}" if cfg.train.init else ""),
    )


TRUNCATION_WARNING = 0.05
"""The share of truncated documents above which the trainer warns."""


def data_notes(dataset: RowDataset, cfg: RunConfig) -> list[str]:
    """What start-up says about how the documents became rows: documents kept one per row
    although packing was asked for, and the share of documents truncated (a warning above
    ``TRUNCATION_WARNING``)."""
    notes = []
    G = cfg.train.global_batch
    if len(dataset) < G:
        notes.append(
            f"elflow train: warning: only {len(dataset)} rows for train.global_batch {G}: every "
            f"step sees each row about {G / max(len(dataset), 1):.0f} times; give more data or "
            "lower train.global_batch"
        )
    if dataset.prechunked:
        notes.append(
            f"elflow train: the documents are already rows of {dataset.max_length} tokens: "
            "kept one per row (data.packing packs longer documents)"
        )
    n, docs = dataset.num_truncated, dataset.num_docs
    if n:
        share = n / max(docs, 1)
        what = f"{n} of {docs} documents ({100 * share:.1f}%) are longer than a row"
        if share <= TRUNCATION_WARNING:
            notes.append(f"elflow train: {what} and lose their end")
        else:
            fix = (
                "raise max_input_length or model.max_length"
                if dataset.conditional
                else "set data.packing=true or raise model.max_length"
            )
            notes.append(f"elflow train: warning: {what} and lose their end; {fix}")
    return notes
