"""Sample lengths against the data's: free length, ``length_range=data``, and a fixed range.

    python benchmarks/lengths.py --model demo --num 1024 --out lengths.json
    python benchmarks/lengths.py --model demo --settings data,10:20

For each setting (``free``: where the model puts its end token; else a ``length_range``),
``--num`` samples (seed 0); each one's text length in tokens (its row up to the first end token,
less the tokenizer's own special tokens) is compared with the validation verses' (prepared like
training rows): the total-variation distance between the two length histograms, the mean
lengths, and the share of samples that end before the row limit.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import replace

import numpy as np

from elflow.examples import web_bible_texts
from elflow.generation.pipeline import ELFPipeline
from elflow.text.tokens import special_token_count


def text_lengths(pipe: ELFPipeline, tokens) -> tuple[np.ndarray, np.ndarray]:
    """(text tokens, ended before the row limit) per generated row."""
    eos = (tokens == pipe.tokens.eos_id).numpy()
    ended = eos.any(1)
    first = np.where(ended, eos.argmax(1), tokens.shape[1])
    return first + 1 - special_token_count(pipe.tokenizer), ended


def tv_distance(a: np.ndarray, b: np.ndarray) -> float:
    """Total variation between the empirical distributions of two integer samples."""
    top = int(max(a.max(), b.max())) + 1
    pa = np.bincount(a, minlength=top) / len(a)
    pb = np.bincount(b, minlength=top) / len(b)
    return float(0.5 * np.abs(pa - pb).sum())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="demo", help="an unconditional model (default: demo)")
    p.add_argument("--num", type=int, default=1024, help="samples per setting")
    p.add_argument(
        "--settings",
        default="free,data,10:20",
        help="comma-separated: free (the model's own end token) and length_range values",
    )
    p.add_argument("--batch-size", type=int, default=64, help="samples per forward")
    p.add_argument("--out", help="JSON file for the lengths and the table")
    args = p.parse_args()
    if args.num < 1:
        p.error("--num must be >= 1")
    pipe = ELFPipeline.from_pretrained(args.model)
    L = pipe.config.model.max_length
    verses = web_bible_texts("valid")
    ids = pipe.tokenizer(verses, max_length=L, truncation=True)["input_ids"]
    real = np.array([len(x) for x in ids]) - special_token_count(pipe.tokenizer)
    record = {"model": args.model, "num": args.num, "real": real.tolist(), "rows": []}
    print(f"validation verses: {len(real)}, mean {real.mean():.1f} tokens")
    hist = np.asarray(pipe.config.length_histogram, dtype=float)
    if hist.sum() > 0:  # what sampling noise alone gives: exact draws from the training lengths
        rng = np.random.default_rng(0)
        p_len = hist / hist.sum()
        draws = [tv_distance(rng.choice(len(hist), args.num, p=p_len), real) for _ in range(200)]
        lo, hi = np.percentile(draws, [2.5, 97.5])
        record["floor"] = {"mean": float(np.mean(draws)), "range": [float(lo), float(hi)]}
        print(
            f"floor: {args.num} exact draws from the training lengths are at TV "
            f"{np.mean(draws):.3f} ({lo:.3f}-{hi:.3f}, 200 draws) from the verses"
        )
    print(f"{'setting':<14} {'mean':>6} {'TV to real':>11} {'ended':>6} {'seconds':>8}")
    for setting in [s for s in args.settings.split(",") if s]:
        sampler = pipe.sampler if setting == "free" else replace(pipe.sampler, length_range=setting)
        t0 = time.perf_counter()
        out = pipe.generate_full(args.num, sampler=sampler, seed=0, batch_size=args.batch_size)
        seconds = time.perf_counter() - t0
        lengths, ended = text_lengths(pipe, out.tokens)
        row = {"setting": setting, "mean": float(lengths.mean()), "tv": tv_distance(lengths, real)}
        row |= {"ended": float(ended.mean()), "seconds": round(seconds, 1)}
        record["rows"].append(row | {"lengths": lengths.tolist()})
        print(
            f"{setting:<14} {row['mean']:>6.1f} {row['tv']:>11.3f} {100 * row['ended']:>5.1f}% "
            f"{seconds:>8.0f}"
        )
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            json.dump(record, f)


if __name__ == "__main__":
    main()
