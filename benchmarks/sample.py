"""Sampling throughput of the full loop (noise -> N steps -> decode), fp32 and bf16 autocast.

Usage:
    python benchmarks/sample.py                               # small size at 8/16/32 steps
    python benchmarks/sample.py --sizes elf-b --steps 32      # ELF-B, L 128, batch 8, 32-step SDE
    python benchmarks/sample.py --dtypes fp32,bf16
    python benchmarks/sample.py --checkpoint MODEL --steps 32 --dtypes fp32,bf16 --num-samples 32

Randomly initialised weights (the speed does not depend on them); one warm-up batch per setting.
bf16 runs the network under torch.autocast and reports the share of tokens identical to fp32.
With ``--checkpoint`` (any model source) it times ``elflow sample``'s own path
(``sample_records``: sampling, decoding, detokenising) on that model, whose bf16
agreement with fp32 is the meaningful one (a random network's argmax is near-uniform).
"""

from __future__ import annotations

import argparse
import contextlib
import time
from dataclasses import replace

import torch

from elflow.config import SamplerConfig, model_preset
from elflow.model import build_model
from elflow.network import sample_model
from elflow.sampling import sample_generators

SIZES = {
    # name: (model preset, E, V, L, batch)
    "elf-b": ("elf-b", 512, 32100, 128, 8),
    "small": ("elf-small", 384, 30522, 64, 32),
}


def run(name: str, steps: int, sampler: str, dtype: str, device: str, seed: int) -> dict:
    preset, E, V, L, B = SIZES[name]
    torch.manual_seed(seed)
    model = build_model(model_preset(preset, encoder_dim=E, vocab_size=V, max_length=L), device)
    with torch.no_grad():
        torch.nn.init.normal_(model.final_layer.linear.weight, std=0.02)
    model.eval()
    cfg = SamplerConfig(steps=steps, sampler=sampler, gamma=1.5 if sampler == "sde" else 0.0)
    autocast = (
        torch.autocast(device_type=torch.device(device).type, dtype=torch.bfloat16)
        if dtype == "bf16"
        else contextlib.nullcontext()
    )

    def once():
        with autocast:
            out = sample_model(model, sample_generators(seed, range(B), device), L, cfg)
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        return out.tokens

    once()  # warm-up
    t0 = time.perf_counter()
    tokens = once()
    dt = time.perf_counter() - t0
    return {"samples_per_s": B / dt, "s_per_batch": dt, "tokens": tokens, "B": B, "L": L}


def run_checkpoint(args: argparse.Namespace) -> None:
    """samples/s of ``elflow sample``'s path on a real model, fp32 vs bf16 token agreement."""
    from elflow.generation.pipeline import ELFPipeline
    from elflow.generation.records import sample_records, token_agreement

    pipe = ELFPipeline.from_pretrained(args.checkpoint, device=args.device)
    head = f"{'steps':>5} {'NFE':>4} {'dtype':<5} {'n':>4} {'batch':>5} {'s':>8} {'samples/s':>9}"
    print(f"{head} {'same tokens as fp32':>20}")
    for steps in (int(s) for s in args.steps.split(",")):
        scfg = replace(pipe.sampler, steps=steps, sampler=args.sampler or pipe.sampler.sampler)
        ref = None
        for dtype in args.dtypes.split(","):
            kw = {"n": args.num_samples, "seed": args.seed, "batch_size": args.batch_size}
            kw.update(bf16=dtype == "bf16", save_tokens=True)
            sample_records(pipe, scfg, **{**kw, "n": min(args.batch_size, args.num_samples)})
            if args.device.startswith("cuda"):
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            recs = sample_records(pipe, scfg, **kw).records
            if args.device.startswith("cuda"):
                torch.cuda.synchronize()
            dt = time.perf_counter() - t0
            agree = ""
            if dtype == "fp32":
                ref = recs
            elif ref is not None:
                agree = f"{100 * token_agreement(ref, recs):.1f}%"
            print(
                f"{steps:>5} {scfg.nfe:>4} {dtype:<5} {len(recs):>4} "
                f"{args.batch_size:>5} {dt:>8.2f} {len(recs) / dt:>9.2f} {agree:>20}"
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="small")
    parser.add_argument("--steps", default="8,16,32")
    parser.add_argument("--sampler", default="sde", choices=["ode", "sde", "heun"])
    parser.add_argument("--dtypes", default="fp32", help="comma list of fp32, bf16")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--checkpoint", help="time elflow sample's path on this model instead")
    parser.add_argument("--num-samples", type=int, default=32, help="with --checkpoint")
    parser.add_argument("--batch-size", type=int, default=8, help="with --checkpoint")
    args = parser.parse_args()
    print(f"torch {torch.__version__}, device {args.device}, {torch.get_num_threads()} threads")
    if args.checkpoint:
        run_checkpoint(args)
        return
    print(
        f"{'size':<6} {'steps':>5} {'NFE':>4} {'dtype':<5} {'batch':>5} {'s/batch':>8} "
        f"{'samples/s':>9} {'same tokens as fp32':>20}"
    )
    for name in args.sizes.split(","):
        for steps in (int(s) for s in args.steps.split(",")):
            ref = None
            nfe = SamplerConfig(steps=steps, sampler=args.sampler).nfe
            for dtype in args.dtypes.split(","):
                r = run(name, steps, args.sampler, dtype, args.device, args.seed)
                agree = ""
                if dtype == "fp32":
                    ref = r["tokens"]
                elif ref is not None:
                    agree = f"{100 * (r['tokens'] == ref).float().mean().item():.1f}%"
                print(
                    f"{name:<6} {steps:>5} {nfe:>4} {dtype:<5} {r['B']:>5} "
                    f"{r['s_per_batch']:>8.2f} {r['samples_per_s']:>9.2f} {agree:>20}"
                )


if __name__ == "__main__":
    main()
