"""How much a trained ELF uses its self-conditioning input and its SC-CFG scale token (spec §3).

Usage:
    python benchmarks/selfcond.py --model runs/bible-tiny --num 48

On real validation rows (encoded like the training rows) and fixed noise, at several times t it
prints the mean-square error of the denoiser's x-prediction f0 = f([z_t, 0]) against the clean
latents x, the change when f0 is fed back as the self-conditioning input (f1 = f([z_t, f0]), what
the sampler does), the change between scale tokens w = 0.5 and w = 5 (the training range), and the
error with the clean x itself as the self-conditioning input (an oracle). SC-CFG can only amplify
f1 - f0: when that difference is tiny, w has nothing to scale.
"""

from __future__ import annotations

import argparse
import gzip
import json
from itertools import islice
from pathlib import Path

import torch

from elflow.examples import web_bible
from elflow.flow import interpolate
from elflow.generation.pipeline import ELFPipeline, model_encoder


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True, help="an unconditional elflow model or run")
    p.add_argument("--valid", default=web_bible("valid"))
    p.add_argument("--num", type=int, default=48, help="validation rows")
    p.add_argument("--times", default="0.1,0.3,0.5,0.7,0.9")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()

    pipe = ELFPipeline.from_pretrained(args.model)
    cfg, model = pipe.config, pipe.model
    enc = model_encoder(cfg)
    with gzip.open(Path(args.valid), "rt") as f:
        texts = [json.loads(line)["text"] for line in islice(f, args.num)]
    ids, mask = pipe.training_rows(texts)  # as elflow train pads them
    gen = torch.Generator().manual_seed(args.seed)
    B = len(ids)

    def mse(a: torch.Tensor, b: torch.Tensor) -> float:
        return (a - b).pow(2).mean().item()

    print("| t | mse(f0, x) | mse(f1, x) | mse(f1, f0) | mse(f1 w5, f1 w0.5) | mse(f(x), x) |")
    print("|---|---|---|---|---|---|")
    with torch.no_grad():
        x = enc(ids, mask)
        for t in (float(v) for v in args.times.split(",")):
            tt = torch.full((B,), t)
            z = interpolate(x, torch.randn(x.shape, generator=gen), tt, cfg.noise_scale)

            def f(sc: torch.Tensor, w: float, z: torch.Tensor = z, tt: torch.Tensor = tt):
                return model(torch.cat([z, sc], -1), tt, torch.full((B,), w), 0.0)[0].float()

            f0 = f(torch.zeros_like(x), 1.0)
            f1 = f(f0, 1.0)
            print(
                f"| {t:.1f} | {mse(f0, x):.4f} | {mse(f1, x):.4f} | {mse(f1, f0):.4f} | "
                f"{mse(f(f0, 5.0), f(f0, 0.5)):.5f} | {mse(f(x, 1.0), x):.4f} |"
            )
    print(f"(mean square of x: {x.pow(2).mean().item():.3f}; {B} rows, seed {args.seed})")


if __name__ == "__main__":
    main()
