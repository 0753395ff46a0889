"""Sampling throughput of the full loop (noise -> N steps -> decode), fp32 and bf16 autocast.

Usage:
    python benchmarks/sample.py                               # small size at 8/16/32 steps
    python benchmarks/sample.py --sizes elf-b --steps 32      # ELF-B, L 128, batch 8, 32-step SDE
    python benchmarks/sample.py --dtypes fp32,bf16

Randomly initialised weights (the speed does not depend on them); one warm-up batch per setting.
bf16 runs the network under torch.autocast and reports the share of tokens identical to fp32.
"""

from __future__ import annotations

import argparse
import contextlib
import time

import torch

from elflow.config import SamplerConfig, model_preset
from elflow.model import build_model
from elflow.sampling import nfe, sample, sample_generators

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
            out = sample(model, sample_generators(seed, range(B), device), L, cfg)
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        return out.tokens

    once()  # warm-up
    t0 = time.perf_counter()
    tokens = once()
    dt = time.perf_counter() - t0
    return {"samples_per_s": B / dt, "s_per_batch": dt, "tokens": tokens, "B": B, "L": L}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="small")
    parser.add_argument("--steps", default="8,16,32")
    parser.add_argument("--sampler", default="sde", choices=["ode", "sde", "heun"])
    parser.add_argument("--dtypes", default="fp32", help="comma list of fp32, bf16")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    print(f"torch {torch.__version__}, device {args.device}, {torch.get_num_threads()} threads")
    print(
        f"{'size':<6} {'steps':>5} {'NFE':>4} {'dtype':<5} {'batch':>5} {'s/batch':>8} "
        f"{'samples/s':>9} {'same tokens as fp32':>20}"
    )
    for name in args.sizes.split(","):
        for steps in (int(s) for s in args.steps.split(",")):
            ref = None
            for dtype in args.dtypes.split(","):
                r = run(name, steps, args.sampler, dtype, args.device, args.seed)
                agree = ""
                if dtype == "fp32":
                    ref = r["tokens"]
                elif ref is not None:
                    agree = f"{100 * (r['tokens'] == ref).float().mean().item():.1f}%"
                print(
                    f"{name:<6} {steps:>5} {nfe(args.sampler, steps):>4} {dtype:<5} {r['B']:>5} "
                    f"{r['s_per_batch']:>8.2f} {r['samples_per_s']:>9.2f} {agree:>20}"
                )


if __name__ == "__main__":
    main()
