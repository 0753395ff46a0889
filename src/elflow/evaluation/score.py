"""`score_samples`: every metric of a samples file with bootstrap CIs and a protocol card (spec §6).

Protocols (how generative perplexity is computed; entropy, BLEU and ROUGE do not depend on them):
- `paper`: the paper's JAX protocol (§6): judge in fp32, no BOS, first token unscored, the
  end-of-text slot after each sample scored, truncation to the judge's context, corpus-level
  exp(ΣNLL/Σtokens).
- `paper-bf16`: the same with the judge cast to bf16, as the authors' PyTorch port scores.
- `per-sample`: fp32, the mean of per-sample perplexities (what some diffusion-LM codebases report).
Empty/whitespace-only samples are counted (`num_empty`) and excluded from gen PPL and entropy; they
count 0 in `mean_length` and stay in BLEU/ROUGE (scoring 0 there). References align by `id` when
every sample and reference has one, by order when none has.
"""

from __future__ import annotations

import json
import math
import os
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

import numpy as np

from elflow.errors import ELFError
from elflow.evaluation.judge import Judge, load_judge
from elflow.evaluation.metrics import (
    bleu,
    bleu_from_stats,
    bootstrap_ci,
    gen_ppl,
    ppl_from_sums,
    rouge_per_example,
    unigram_entropies,
)
from elflow.evaluation.protocol import DEFAULT_JUDGE, PROTOCOLS
from elflow.jsonl import finite_or_null, read_jsonl


def _texts(rows: list[dict[str, Any]], what: str) -> list[str]:
    for i, row in enumerate(rows):
        if not isinstance(row, dict) or not isinstance(row.get("text"), str):
            raise ELFError(f"{what} {i}: expected a dict with a string 'text'")
    return [row["text"] for row in rows]


def align_refs(samples: list[dict[str, Any]], refs: list[dict[str, Any]]) -> list[str]:
    """Reference texts in sample order: by id when every row on both sides has one, else order.

    A conditional sample's own `id` is its row number; the id of the source line it came from is
    `source_id` (written by `elflow sample`), which is what references are matched on. Without
    source ids, a conditional record of `elflow sample` (with `source` and its settings) takes the
    reference on its row's line.
    """
    key = "source_id" if samples and all("source_id" in s for s in samples) else "id"
    written = ("source", "sampler", "nfe")  # a conditional record of `elflow sample`
    positional = key == "id" and samples and all(all(k in s for k in written) for s in samples)
    if positional and all(isinstance(s.get("id"), int) for s in samples):
        # elflow sample's conditional records whose sources had no ids: `id` is the source's
        # line number, so the reference is the same line of --refs (whatever ids it carries).
        bad = [s["id"] for s in samples if not 0 <= s["id"] < len(refs)]
        if bad:
            raise ELFError(
                f"sample id {bad[0]} (its source's line) is past the {len(refs)} references; "
                "give the references of the --sources file, line for line"
            )
        return [refs[s["id"]]["text"] for s in samples]
    for rows, k, what in ((samples, key, "sample"), (refs, "id", "reference")):
        have = [k in r for r in rows]
        if any(have) and not all(have):  # order alignment would then be silently wrong
            raise ELFError(
                f"{what} {have.index(False)} has no {k!r} while others do; give every {what} "
                "one, or none (then samples and references align by order)"
            )
    if all(key in r for r in samples) and all("id" in r for r in refs):
        by_id: dict[Any, str] = {}
        for r in refs:
            if r["id"] in by_id:
                raise ELFError(f"reference id {r['id']!r} appears twice; ids must be unique")
            by_id[r["id"]] = r["text"]
        missing = [s[key] for s in samples if s[key] not in by_id]
        if missing:
            raise ELFError(
                f"{len(missing)} sample ids have no reference (first: {missing[0]!r}); "
                "check that --refs matches --samples"
            )
        return [by_id[s[key]] for s in samples]
    if len(samples) != len(refs):
        raise ELFError(
            f"{len(samples)} samples but {len(refs)} references; without ids on both sides they "
            "align by order and must have the same length"
        )
    return [r["text"] for r in refs]


def library_versions() -> dict[str, str | None]:
    out: dict[str, str | None] = {}
    for name in ("torch", "transformers", "sacrebleu", "rouge-score", "elflow"):
        try:
            out[name] = version(name)
        except PackageNotFoundError:
            out[name] = None
    return out


def _ci(stats: np.ndarray, fn, n: int, seed: int) -> list[float]:
    return list(bootstrap_ci(stats, fn, n_resamples=n, seed=seed))


def score_samples(
    samples: list[dict[str, Any]],
    *,
    judge: str | Judge | None = DEFAULT_JUDGE,
    refs: list[dict[str, Any]] | None = None,
    protocol: str = "paper",
    batch_size: int = 16,
    bootstrap: int = 1000,
    seed: int = 0,
) -> dict[str, Any]:
    """Flat metrics of `samples` (dicts with `text`) plus a `protocol` card (spec §6).

    `judge` is a name/folder for :func:`load_judge`, a loaded :class:`Judge`, or None to skip gen
    PPL and entropy. With `refs`, BLEU (lowercased, paper), cased BLEU and ROUGE are added. Each
    metric gets a `<metric>_ci` [lo, hi] 95% percentile-bootstrap interval (`bootstrap` resamples;
    0: none).
    """
    if protocol not in PROTOCOLS:
        raise ELFError(f"unknown protocol '{protocol}'; use one of {', '.join(PROTOCOLS)}")
    spec = PROTOCOLS[protocol]
    texts = _texts(samples, "sample")
    out: dict[str, Any] = {"num_samples": len(texts)}
    card: dict[str, Any] = {
        "name": protocol,
        "description": spec.description,
        "num_samples": len(texts),
        "empty_policy": "empty/whitespace-only samples counted, excluded from gen_ppl and "
        "entropy, length 0 in mean_length",
        "bootstrap": {"method": "percentile", "resamples": bootstrap, "seed": seed, "alpha": 0.05},
        "versions": library_versions(),
    }
    out["num_empty"] = sum(1 for t in texts if not t.strip())
    card["num_empty"] = out["num_empty"]

    if judge is not None:
        j = load_judge(judge) if isinstance(judge, str) else judge
        res = gen_ppl(
            texts,
            j,
            dtype=spec.dtype,
            batch_size=batch_size,
            first_token_scored=spec.first_token_scored,
            score_eos=spec.score_eos,
            aggregate=spec.aggregate,
        )
        ent = unigram_entropies(texts, j.tokenizer)
        out["gen_ppl"] = res.value
        out["entropy"] = float(ent.mean()) if len(ent) else math.nan
        # Per sample, an empty one counting 0: a model that writes empties is not "longer".
        out["mean_length"] = float(res.lengths.sum()) / len(texts) if texts else math.nan
        out["num_truncated"] = res.num_truncated
        out["num_scored_tokens"] = res.num_tokens
        if bootstrap:
            pairs = np.stack([res.nll, res.counts.astype(np.float64)], axis=1)  # (N, 2)
            out["gen_ppl_ci"] = _ci(
                pairs, lambda s: ppl_from_sums(s[:, 0], s[:, 1], spec.aggregate), bootstrap, seed
            )
            out["entropy_ci"] = _ci(ent, np.mean, bootstrap, seed)
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
            num_truncated=res.num_truncated,
            num_scored_tokens=res.num_tokens,
        )

    if refs is not None:
        _texts(refs, "reference")
        ref_texts = align_refs(samples, refs)
        for key, lowercase in (("bleu", True), ("bleu_cased", False)):
            b = bleu(texts, ref_texts, lowercase=lowercase)
            out[key] = b.score
            card[f"sacrebleu_signature{'' if lowercase else '_cased'}"] = b.signature
            if bootstrap:
                fn = lambda s, lc=lowercase: bleu_from_stats(s, lowercase=lc)
                out[f"{key}_ci"] = _ci(b.stats, fn, bootstrap, seed)
        for key, values in rouge_per_example(texts, ref_texts).items():
            out[key] = float(values.mean()) if len(values) else math.nan
            if bootstrap:
                out[f"{key}_ci"] = _ci(values, np.mean, bootstrap, seed)
        card["rouge"] = "rouge-score, use_stemmer=True, F-measure x100 mean over examples"
    out["protocol"] = card
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
    parts.append(counts)
    return "; ".join(parts)


def write_metrics(path: Path, metrics: dict) -> None:
    """``metrics`` as strict, indented JSON, atomically (temporary name, then rename)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    text = json.dumps(finite_or_null(metrics), indent=2, allow_nan=False)
    tmp.write_text(text + "\n", encoding="utf-8")
    os.replace(tmp, path)


def read_refs(path: str, field: str) -> list[dict]:
    """``--refs`` rows with the reference (in ``field``, ``--ref-field``) as their ``text``."""
    rows = read_jsonl(path, field, field_flag="--ref-field")
    if not rows:
        raise ELFError(f"--refs {path} holds no references")
    return [{**r, "text": r[field]} for r in rows]
