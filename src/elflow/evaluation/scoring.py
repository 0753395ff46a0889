"""`score_samples`: every metric of a samples file with bootstrap CIs and a protocol card (spec §6).

Protocols (how generative perplexity is computed; entropy, BLEU and ROUGE do not depend on them):
- `paper`: the paper's JAX protocol (§6): judge in fp32, no BOS, first token unscored, the
  end-of-text slot after each sample scored, truncation to the judge's context, corpus-level
  exp(ΣNLL/Σtokens).
- `paper-bf16`: the same with the judge cast to bf16, as the authors' PyTorch port scores.
- `per-sample`: fp32, the mean of per-sample perplexities (what some diffusion-LM codebases report).
Empty/whitespace-only samples are counted (`num_empty`) and excluded from gen PPL, entropy and
MAUVE; they count 0 in `mean_length` and stay in BLEU/ROUGE (scoring 0 there). Beside these: MAUVE
against real text (:mod:`~elflow.evaluation.mauve`), repetition and diversity
(:mod:`~elflow.evaluation.diversity`), and, for samples of several seeds, the summary across
seeds (:mod:`~elflow.evaluation.seeds`). References for BLEU/ROUGE: :mod:`~elflow.evaluation.refs`.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

import numpy as np

from elflow.errors import ELFError
from elflow.evaluation.judge import Judge, load_judge
from elflow.evaluation.judge_protocol import DEFAULT_JUDGE, PROTOCOLS
from elflow.evaluation.metric_table import METRICS, Metric
from elflow.evaluation.refs import align_refs, read_refs
from elflow.evaluation.sample_stats import SampleStats
from elflow.evaluation.seeds import seed_groups, spread
from elflow.evaluation.text_metrics import bootstrap_ci, gen_ppl, unigram_entropies
from elflow.io.jsonl import finite_or_null

__all__ = ["align_refs", "read_refs", "reference_features", "score_samples", "write_metrics"]

SEED_KEYS = tuple(METRICS)
"""The metrics summarised across seeds (``<key>_seed_mean``, ``<key>_seed_sd``): every metric of
:data:`~elflow.evaluation.metric_table.METRICS` (as imported; scoring reads the table live)."""


def _texts(rows: Sequence[Any], what: str) -> list[str]:
    for i, row in enumerate(rows):
        if not isinstance(row, dict) or not isinstance(row.get("text"), str):
            raise ELFError(f"{what} {i}: expected a dict with a string 'text'")
    return [row["text"] for row in rows]


def library_versions() -> dict[str, str | None]:
    out: dict[str, str | None] = {}
    for name in ("torch", "transformers", "sacrebleu", "rouge-score", "elflow"):
        try:
            out[name] = version(name)
        except PackageNotFoundError:
            out[name] = None
    return out


def reference_features(
    texts: Sequence[str], judge: Judge, protocol: str = "paper", batch_size: int = 16
) -> np.ndarray:
    """(M, D) MAUVE features of real ``texts`` (the non-empty ones) under ``judge``: computed once
    and passed as ``score_samples(reference=...)`` to score many sample sets against them."""
    spec = PROTOCOLS[protocol]
    res = gen_ppl(
        list(texts),
        judge,
        dtype=spec.dtype,
        batch_size=batch_size,
        first_token_scored=spec.first_token_scored,
        features=True,
    )
    if res.features is None or len(res.features) < 2:
        raise ELFError("reference= needs at least 2 non-empty texts for MAUVE")
    return res.features


def _selected(metrics: Sequence[str] | None) -> list[Metric]:
    """The metrics to compute, in table order (None: all)."""
    if metrics is None:
        return list(METRICS.values())
    for name in metrics:
        if name not in METRICS:
            raise ELFError(f"unknown metric {name!r} in metrics=; use {', '.join(METRICS)}")
    return [m for m in METRICS.values() if m.name in metrics]


def _summary(stats: SampleStats, chosen: Sequence[Metric], idx: np.ndarray, seed: int) -> dict:
    """Every chosen metric that its inputs allow, over samples ``idx``."""
    out: dict[str, Any] = {"num_samples": len(idx), "num_empty": int(stats.empty[idx].sum())}
    return out | {m.name: m.value(stats, idx, seed) for m in chosen if stats.has(m.needs)}


def score_samples(
    samples: list[dict[str, Any]],
    *,
    judge: str | Judge | None = DEFAULT_JUDGE,
    refs: list[dict[str, Any]] | None = None,
    reference: Sequence[str] | np.ndarray | None = None,
    protocol: str = "paper",
    batch_size: int = 16,
    bootstrap: int = 1000,
    seed: int = 0,
    metrics: Sequence[str] | None = None,
) -> dict[str, Any]:
    """Flat metrics of `samples` (dicts with `text`) plus a `protocol` card (spec §6).

    `judge` is a name/folder for :func:`load_judge`, a loaded :class:`Judge`, or None to skip gen
    PPL, entropy and MAUVE. With `refs`, BLEU (lowercased, paper), cased BLEU and ROUGE are added;
    with `reference` (real texts, or their :func:`reference_features`), MAUVE. Repetition and
    diversity are always added. gen PPL, entropy, BLEU and ROUGE get a `<metric>_ci` [lo, hi] 95%
    percentile-bootstrap interval (`bootstrap` resamples; 0: none). Samples of several seeds
    (each record's `seed`) add `seeds`, `per_seed` and `<metric>_seed_mean` / `_seed_sd`; the
    flat metrics and intervals are then those of all seeds' samples pooled. `seed` seeds the
    bootstrap and MAUVE's k-means. `metrics` names the metrics to compute (default: every one of
    :data:`~elflow.evaluation.metric_table.METRICS`); the judge runs only for those that need it.
    """
    chosen = _selected(metrics)
    if protocol not in PROTOCOLS:
        raise ELFError(f"unknown protocol '{protocol}'; use one of {', '.join(PROTOCOLS)}")
    spec = PROTOCOLS[protocol]
    texts = _texts(samples, "sample")
    if not texts:
        raise ELFError("no samples to score")
    groups = seed_groups(samples)
    ref_texts = None
    if refs is not None:
        _texts(refs, "reference")
        ref_texts = align_refs(samples, refs)
    stats = SampleStats(texts, ref_texts)
    needs = {m.needs for m in chosen}
    if not needs & {"judge", "reference"}:
        judge = None  # nothing chosen needs it
    if "reference" not in needs:
        reference = None
    card: dict[str, Any] = {
        "name": protocol,
        "description": spec.description,
        "num_samples": len(texts),
        "empty_policy": "empty/whitespace-only samples counted, excluded from gen_ppl, entropy "
        "and mauve, length 0 in mean_length",
        "bootstrap": {"method": "percentile", "resamples": bootstrap, "seed": seed, "alpha": 0.05},
        "diversity": "distinct-n and rep-4 over lower-cased word/punctuation tokens; self-BLEU: "
        "sacrebleu sentence BLEU (13a, cased, exp smoothing) against all other samples",
        "versions": library_versions(),
    }
    if reference is not None and judge is None:
        raise ELFError("MAUVE against reference= needs the judge's features; give a judge=")

    if judge is not None:
        j = load_judge(judge) if isinstance(judge, str) else judge
        if reference is not None and not isinstance(reference, np.ndarray):
            reference = reference_features(reference, j, protocol, batch_size)
        stats.ppl = gen_ppl(
            texts,
            j,
            dtype=spec.dtype,
            batch_size=batch_size,
            first_token_scored=spec.first_token_scored,
            score_eos=spec.score_eos,
            aggregate=spec.aggregate,
            features=reference is not None,
        )
        stats.aggregate, stats.features = spec.aggregate, stats.ppl.features
        stats.reference = reference
        stats.entropy = unigram_entropies(texts, j.tokenizer)
        card.update(
            judge=j.name,
            judge_revision=j.revision,
            dtype=spec.dtype,
            bos_id=None,
            eos_id=j.eos_id,
            first_token_scored=spec.first_token_scored,
            eos_slot_scored=spec.score_eos,
            aggregate=spec.aggregate,
            truncation=j.max_length,
            num_truncated=stats.ppl.num_truncated,
            num_scored_tokens=stats.ppl.num_tokens,
        )
        if reference is not None:
            card["mauve"] = (
                "judge's last hidden state at the last token; L2, PCA 90%, k-means "
                f"(k = min(n, m)/10, seed {seed}), 25 mixtures, c = 5; "
                f"{len(reference)} real texts"
            )

    out = _summary(stats, chosen, np.arange(len(texts)), seed)
    signatures = stats.bleu_signatures
    for lowercase in (True, False):
        if lowercase in signatures:
            card[f"sacrebleu_signature{'' if lowercase else '_cased'}"] = signatures[lowercase]
    if stats.rouge_computed:
        card["rouge"] = "rouge-score, use_stemmer=True, F-measure x100 mean over examples"
    card["num_empty"] = out["num_empty"]
    if stats.ppl is not None:
        out["num_truncated"] = stats.ppl.num_truncated
        out["num_scored_tokens"] = stats.ppl.num_tokens
    if bootstrap:
        out |= _intervals(stats, chosen, bootstrap, seed)
    if groups is not None:
        by_seed = {str(s): _summary(stats, chosen, idx, seed) for s, idx in groups.items()}
        out["seeds"] = list(groups)
        out |= spread(by_seed, [m.name for m in chosen])
        out["per_seed"] = by_seed
        card["seeds"] = list(groups)
    out["protocol"] = card
    return out


def _intervals(
    stats: SampleStats, chosen: Sequence[Metric], n: int, seed: int
) -> dict[str, list[float]]:
    """95% percentile-bootstrap intervals over the (pooled) samples."""
    out = {}
    for m in chosen:
        if m.resample is not None and stats.has(m.needs):
            rows, statistic = m.resample(stats)
            out[f"{m.name}_ci"] = list(bootstrap_ci(rows, statistic, n_resamples=n, seed=seed))
    return out


def protocol_line(metrics: dict[str, Any]) -> str:
    """A one-line human summary of the protocol card."""
    c = metrics["protocol"]
    parts = [f"protocol {c['name']}"]
    if "judge" in c:
        rev = (c["judge_revision"] or "unknown revision")[:19]
        first = "scored" if c["first_token_scored"] else "unscored"
        parts.append(
            f"judge {c['judge']} ({rev}), {c['dtype']}, no BOS, EOS id {c['eos_id']}"
            f"{' scored' if c['eos_slot_scored'] else ' unscored'}, first token {first}, "
            f"{c['aggregate']} PPL, truncation {c['truncation']}"
        )
    counts = f"{c['num_samples']} samples, {c['num_empty']} empty"
    if "num_truncated" in c:
        counts += f", {c['num_truncated']} truncated"
    if c.get("seeds"):
        counts += f", seeds {','.join(str(s) for s in c['seeds'])}"
    parts.append(counts)
    return "; ".join(parts)


def write_metrics(path: Path, metrics: dict) -> None:
    """``metrics`` as strict, indented JSON, atomically (temporary name, then rename)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    text = json.dumps(finite_or_null(metrics), indent=2, allow_nan=False)
    tmp.write_text(text + "\n", encoding="utf-8")
    os.replace(tmp, path)
