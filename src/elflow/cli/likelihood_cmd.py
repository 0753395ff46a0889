"""``elflow likelihood``: a bound on each text's negative log-likelihood under an unconditional
model, in bits per token, with a bootstrap interval over the texts (an elflow addition;
:mod:`elflow.generation.likelihood` says what is computed and under which assumptions)."""

from __future__ import annotations

import argparse
import json
import random
import sys

from elflow.cli.common import add_device_argument, add_model_argument, model_from_args
from elflow.errors import ELFError
from elflow.io.paths import input_file, output_file


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_model_argument(p, "the (unconditional) model")
    p.add_argument("--texts", required=True, metavar="FILE", help="JSONL(.gz), one text a line")
    p.add_argument("--text-field", default="text", help="field of --texts holding the text")
    p.add_argument("-n", "--num-samples", type=int, metavar="N", help="score the first N texts")
    p.add_argument("--steps", type=int, default=16, help="RK4 steps of the probability-flow ODE")
    p.add_argument(
        "--probes",
        type=int,
        default=1,
        help="Hutchinson probes per text for the divergence (0: the exact trace, one backward "
        "pass per latent dimension: small models only)",
    )
    p.add_argument("--samples", type=int, default=1, help="draws of z per text, averaged")
    p.add_argument(
        "--t1",
        type=float,
        help="where the flow stops and the decoder takes over, in (0, 1) (default 0.1: near 1 the "
        "bound is far looser; docs/likelihood)",
    )
    p.add_argument("--shuffle-words", action="store_true", help="a control: shuffle each text")
    p.add_argument(
        "--truncate",
        action="store_true",
        help="score the first max_length tokens of a longer text (default: refuse it)",
    )
    p.add_argument("--seed", type=int, default=0, help="text i's draws depend on (seed, i) only")
    p.add_argument("--batch-size", type=int, default=16, help="texts per batch")
    add_device_argument(p)
    p.add_argument("--out", help="JSON file for the per-text values and the summary")
    p.add_argument("--overwrite", action="store_true", help="replace an existing --out")


def run(args: argparse.Namespace) -> int:
    import numpy as np

    from elflow.cli.common import load_pipeline
    from elflow.evaluation.text_metrics import bootstrap_ci
    from elflow.generation.likelihood import text_likelihood
    from elflow.io.jsonl import read_jsonl
    from elflow.runtime.distributed import resolve_device

    model = model_from_args(args)
    if args.out:  # before any work; its missing parent folders are made now, as everywhere
        output_file(args.out, "--out", overwrite=args.overwrite)
    rows = read_jsonl(input_file(args.texts, "--texts"), args.text_field, field_flag="--text-field")
    texts = [r[args.text_field] for r in rows]
    if args.num_samples is not None:
        if args.num_samples < 1:
            raise ELFError(f"--num-samples must be >= 1, got {args.num_samples}")
        texts = texts[: args.num_samples]
    if not texts:
        raise ELFError(f"--texts {args.texts} holds no texts")
    if args.shuffle_words:
        rng = random.Random(args.seed)
        texts = [" ".join(rng.sample(t.split(), len(t.split()))) for t in texts]
    pipe = load_pipeline(model, resolve_device(args.device).device)
    result = text_likelihood(
        pipe,
        texts,
        steps=args.steps,
        probes=args.probes,
        samples=args.samples,
        seed=args.seed,
        batch_size=args.batch_size,
        t1=args.t1,
        truncate=args.truncate,
    )
    bits = np.asarray(result.bits_per_token)
    lo, hi = bootstrap_ci(bits, lambda b: float(b.mean()), seed=args.seed)
    summary = {"bits_per_token": float(bits.mean()), "bits_per_token_ci": [lo, hi]}
    summary |= {"num_texts": len(texts), **result.settings, "shuffle_words": args.shuffle_words}
    print(
        f"{summary['bits_per_token']:.4f} bits per token (95% CI [{lo:.4f}, {hi:.4f}]) over "
        f"{len(texts)} texts; t1 {result.settings['t1']:.3f}, {args.steps} RK4 steps, "
        f"{'exact divergence' if not args.probes else f'{args.probes} Hutchinson probe(s)'}"
    )
    if args.out:
        record = {**summary, "texts": texts, "per_text": result.bits_per_token}
        with open(args.out, "w", encoding="utf-8") as f:
            json.dump(record | {"tokens": result.tokens, "model": model}, f, indent=1)
        print(f"wrote {args.out}", file=sys.stderr)
    return 0
