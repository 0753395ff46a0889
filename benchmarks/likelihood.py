"""Likelihood checks on a trained model: real verses against shuffled ones and against samples of
the untrained network, at several stopping times t1, beside a unigram model's bits per token.

    python benchmarks/likelihood.py --model demo --num 256 --out likelihood.json

For each t1: the bound in bits per token (mean over texts, bootstrap 95% interval) of ``--num``
validation verses, the same verses with their words shuffled, and ``--num`` samples of the same
architecture with its initial (untrained) weights, all scored by ``--model``. A sound estimate
ranks the real verses first.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import time

import numpy as np
import torch

from elflow.evaluation.text_metrics import bootstrap_ci
from elflow.examples import web_bible_texts
from elflow.generation.likelihood import text_likelihood
from elflow.generation.pipeline import ELFPipeline
from elflow.model import build_model


def unigram_bits(tokenizer, texts: list[str], max_length: int) -> float:
    """Bits per token of ``texts``' rows (special tokens included, each text's mean, then the
    mean over texts, as the bound is reported) under a unigram model of the training verses with
    add-one smoothing: a reference point for the bound."""
    train = web_bible_texts("train")
    counts = np.ones(len(tokenizer))
    for ids in tokenizer(train, max_length=max_length, truncation=True)["input_ids"]:
        np.add.at(counts, ids, 1)
    log_p = np.log2(counts / counts.sum())
    rows = tokenizer(texts, max_length=max_length, truncation=True)["input_ids"]
    return float(np.mean([-log_p[ids].mean() for ids in rows]))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="demo", help="an unconditional model (default: demo)")
    p.add_argument("--num", type=int, default=256, help="texts per set")
    p.add_argument("--t1", default="0.1,0.3", help="comma list of stopping times")
    p.add_argument("--steps", type=int, default=16, help="RK4 steps")
    p.add_argument("--probes", type=int, default=1, help="Hutchinson probes (0: exact)")
    p.add_argument("--batch-size", type=int, default=32, help="texts per batch")
    p.add_argument("--out", help="JSON file for the table")
    args = p.parse_args()
    if args.num < 1:
        p.error("--num must be >= 1")
    pipe = ELFPipeline.from_pretrained(args.model)
    verses = web_bible_texts("valid")
    rng = random.Random(0)
    real = rng.sample(verses, min(args.num, len(verses)))
    shuffled = [" ".join(rng.sample(t.split(), len(t.split()))) for t in real]
    torch.manual_seed(0)
    untrained = ELFPipeline(
        build_model(pipe.config.model).eval(), pipe.config, pipe.tokenizer, pipe.encoder
    )
    noise = untrained.generate(len(real), sampler=pipe.sampler, seed=0)
    sets = {"real verses": real, "shuffled words": shuffled, "untrained samples": noise}
    unigram = unigram_bits(pipe.tokenizer, real, pipe.config.model.max_length)
    uniform = math.log2(len(pipe.tokenizer))
    print(f"reference on the real verses: unigram {unigram:.3f} bits/token, uniform {uniform:.3f}")
    rows = []
    print(f"{'t1':>5} {'texts':<18} {'bits/token [95% CI]':>30} {'seconds':>8}")
    for t1 in (float(x) for x in args.t1.split(",")):
        for name, texts in sets.items():
            t0 = time.perf_counter()
            result = text_likelihood(
                pipe,
                texts,
                steps=args.steps,
                probes=args.probes,
                t1=t1,
                batch_size=args.batch_size,
            )
            bits = np.asarray(result.bits_per_token)
            lo, hi = bootstrap_ci(bits, lambda b: float(b.mean()))
            seconds = time.perf_counter() - t0
            rows.append({"t1": t1, "texts": name, "bits": float(bits.mean()), "ci": [lo, hi]})
            print(
                f"{t1:>5.2f} {name:<18} {bits.mean():>10.3f} [{lo:.3f}, {hi:.3f}] {seconds:>8.0f}"
            )
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            json.dump(
                {
                    "model": args.model,
                    "num": len(real),
                    "steps": args.steps,
                    "probes": args.probes,
                    "unigram_bits": unigram,
                    "rows": rows,
                },
                f,
                indent=1,
            )


if __name__ == "__main__":
    main()
