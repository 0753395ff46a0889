"""``elflow score``: score samples (gen PPL, entropy, MAUVE, repetition, BLEU, ROUGE; spec §6).

Writes metrics.json (flat numbers with bootstrap CIs plus a ``protocol`` card) and prints a short
summary. Samples of several seeds (``elflow sample --seeds``, or several ``--samples`` files) are
also summarised across seeds: mean, between-seed spread and the pooled interval.
"""

from __future__ import annotations

import argparse
import math

from elflow.errors import ELFError
from elflow.evaluation.judge_protocol import DEFAULT_JUDGE, PROTOCOLS
from elflow.evaluation.metric_table import METRICS
from elflow.io.jsonl import read_jsonl
from elflow.io.paths import output_file


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--samples",
        required=True,
        nargs="+",
        metavar="FILE",
        help="JSONL file(s), one object with 'text' per line (several: scored together, by seed)",
    )
    p.add_argument("--out", required=True, help="metrics.json to write")
    p.add_argument("--refs", help="JSONL references (aligned by 'id' or by order)")
    p.add_argument(
        "--reference",
        metavar="FILE",
        help="JSONL of real text ('text') for MAUVE with the judge's features (prepared like "
        "the model's training rows, e.g. a sweep's reference.jsonl)",
    )
    add_judge_arguments(p, "--batch-size", "--seed")
    p.add_argument(
        "--metrics",
        metavar="NAME,...",
        help="compute only these metrics (default: all): " + ", ".join(METRICS),
    )
    p.add_argument("--overwrite", action="store_true", help="replace an existing --out")
    p.formatter_class = argparse.RawDescriptionHelpFormatter  # one line per metric
    p.epilog = "metrics:\n" + "\n".join(f"  {m.name:<16} {m.line}" for m in METRICS.values())


def add_judge_arguments(p: argparse.ArgumentParser, batch_flag: str, seed_flag: str) -> None:
    """How samples are scored (``score`` and ``sweep``)."""
    p.add_argument(
        "--judge",
        default=DEFAULT_JUDGE,
        help="causal LM for gen PPL/entropy: Hub id, folder, smollm2-135m (offline) or none",
    )
    p.add_argument("--ref-field", default="text", help="field of --refs holding the reference")
    p.add_argument("--protocol", default="paper", choices=list(PROTOCOLS), help="PPL protocol")
    p.add_argument(batch_flag, type=int, default=16, help="samples per judge forward")
    p.add_argument("--bootstrap", type=int, default=1000, help="bootstrap resamples (0: no CIs)")
    p.add_argument(seed_flag, type=int, default=0, help="bootstrap seed")


def _fmt(value: float) -> str:
    return "nan" if value is None or not math.isfinite(value) else f"{value:.2f}"


def summary(metrics: dict) -> str:
    """Each metric with its CI, then the protocol one-liner."""
    from elflow.evaluation.scoring import protocol_line

    lines = []
    for key in (m.name for m in METRICS.values() if m.summary):
        if key not in metrics:
            continue
        line = f"{key:<15} {_fmt(metrics[key]):>8}"
        if f"{key}_ci" in metrics:
            lo, hi = metrics[f"{key}_ci"]
            line += f"  95% CI [{_fmt(lo)}, {_fmt(hi)}]"
        if f"{key}_seed_sd" in metrics:
            mean, sd = metrics[f"{key}_seed_mean"], metrics[f"{key}_seed_sd"]
            line += f"  seeds {_fmt(mean)} ± {_fmt(sd)}"
        lines.append(line)
    lines.append(protocol_line(metrics))
    return "\n".join(lines)


def check_counts(batch_size: int, bootstrap: int, batch_flag: str = "--batch-size") -> None:
    """One-line errors for the judge batch size and the bootstrap count, before any work."""
    if batch_size < 1:
        raise ELFError(f"{batch_flag} must be >= 1, got {batch_size}")
    if bootstrap < 0:
        raise ELFError(f"--bootstrap must be >= 0 (0: no intervals), got {bootstrap}")


def run(args: argparse.Namespace) -> int:
    from elflow.evaluation import score_samples
    from elflow.evaluation.scoring import read_refs, write_metrics

    check_counts(args.batch_size, args.bootstrap)
    chosen = [k.strip() for k in args.metrics.split(",") if k.strip()] if args.metrics else None
    unknown = [k for k in chosen or () if k not in METRICS]
    if unknown:
        raise ELFError(f"unknown metric {unknown[0]!r} in --metrics; use {', '.join(METRICS)}")
    out = output_file(args.out, "--out", overwrite=args.overwrite)
    samples = [r for path in args.samples for r in read_jsonl(path)]
    if not samples:
        raise ELFError(f"--samples {' '.join(args.samples)} holds no samples")
    refs = read_refs(args.refs, args.ref_field) if args.refs else None
    judge = None if args.judge.lower() == "none" else args.judge
    reference = None
    if args.reference:
        if judge is None:
            raise ELFError("--reference (MAUVE) needs the judge's features; drop --judge none")
        reference = [r["text"] for r in read_jsonl(args.reference)]
        if len(reference) < 2:
            raise ELFError(f"--reference {args.reference} needs at least 2 texts for MAUVE")
    metrics = score_samples(
        samples,
        judge=judge,
        refs=refs,
        reference=reference,
        protocol=args.protocol,
        batch_size=args.batch_size,
        bootstrap=args.bootstrap,
        seed=args.seed,
        metrics=chosen,
    )
    write_metrics(out, metrics)
    print(summary(metrics))
    print(f"wrote {out}")
    return 0
