"""How much of a real text a trained ELF recovers from its noised latents, per time t (spec §5).

Usage:
    python benchmarks/reconstruct.py --model src/elflow/demo_model --num 128

Real validation rows (encoded like the training rows) are noised to z_t with fixed noise; the
denoiser predicts x̂ at the model's w in two passes, the first with zeros as the
self-conditioning input and the second with the first's prediction (the sampler feeds the
previous step's x̂ instead, which this model hardly uses; see benchmarks/selfcond.py), and decode
mode turns x̂ into tokens. Printed per t: the share of real tokens recovered, the share of
adjacent repeated tokens, and the mean square error of x̂. The sampler's last step decodes the
x̂ of its last grid point, so the share recovered there is about how much of the final text that
last jump still decides.
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
from elflow.sampling.denoiser import decode_tokens


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True, help="an unconditional elflow model or run")
    p.add_argument("--valid", default=web_bible("valid"))
    p.add_argument("--num", type=int, default=128, help="validation rows")
    p.add_argument("--times", default="0.1,0.2,0.3,0.4,0.5,0.6,0.8")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()

    pipe = ELFPipeline.from_pretrained(args.model)
    cfg, model = pipe.config, pipe.model.float().eval()
    enc = model_encoder(cfg)
    with gzip.open(Path(args.valid), "rt") as f:
        texts = [json.loads(line)["text"] for line in islice(f, args.num)]
    ids, mask = pipe.training_rows(texts)  # as elflow train pads them
    mask = mask.bool()
    B = len(ids)
    w = cfg.sampler.w if cfg.model.num_scale_tokens > 0 else None  # as the sampler passes it
    gen = torch.Generator().manual_seed(args.seed)

    def recovered(tokens: torch.Tensor) -> float:
        return ((tokens == ids) & mask).sum().item() / mask.sum().item()

    def repeats(tokens: torch.Tensor) -> float:
        same = (tokens[:, 1:] == tokens[:, :-1]) & mask[:, 1:]
        return same.sum().item() / mask[:, 1:].sum().item()

    print("| t | tokens recovered | adjacent repeats | mse(x̂, x) |")
    print("|---|---|---|---|")
    with torch.no_grad():
        x = enc(ids, mask.long())
        for t in (float(v) for v in args.times.split(",")):
            tt = torch.full((B,), t)
            z = interpolate(x, torch.randn(x.shape, generator=gen), tt, cfg.noise_scale)

            def f(sc: torch.Tensor, z: torch.Tensor = z, tt: torch.Tensor = tt) -> torch.Tensor:
                return model(torch.cat([z, sc], -1), tt, w, 0.0)[0].float()

            x_hat = f(f(torch.zeros_like(x)))
            tokens = decode_tokens(model, x_hat, w)
            mse = (x_hat - x).pow(2).mean().item()
            print(f"| {t:.1f} | {recovered(tokens):.3f} | {repeats(tokens):.3f} | {mse:.3f} |")
        clean = decode_tokens(model, x, w)
        print(f"| clean x | {recovered(clean):.3f} | {repeats(clean):.3f} | 0 |")
    print(f"(real text: adjacent repeats {repeats(ids):.3f}; {B} rows, seed {args.seed}, w {w})")


if __name__ == "__main__":
    main()
