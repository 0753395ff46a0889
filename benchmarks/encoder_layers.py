"""How well each encoder layer's latents keep token identity under the flow's noise (spec §1, §3).

Usage:
    python benchmarks/encoder_layers.py --encoder minilm --train 3000 --test 300

Encodes training verses one per row (as ``elflow train`` does, EOS padding excluded), normalises
each layer's latents by their RMS, and builds one centroid per token id. On held-out verses it
prints, per layer (0 = embeddings, k = the output of block k), the mean cosine similarity of
adjacent tokens' latents and the share of tokens whose nearest centroid is their own id, for the
clean latents and for x̂ = z_t / t with z_t = t x + (1 - t) s ε (the path of §3 at s = 2). The
sampler's last logit-normal grid point is near t = 0.5, so a layer that loses token identity there
leaves the final decode little to go on. ``elflow train --set encoder.layer=k`` trains on layer k.
"""

from __future__ import annotations

import argparse
import gzip
import json
import random

import torch

from elflow.examples import web_bible
from elflow.flow import interpolate
from elflow.text.encoder import FrozenEncoder
from elflow.text.tokenizer import load_tokenizer
from elflow.text.tokens import build_unconditional_row, token_spec, tokenize


def encode_layers(enc, tokenizer, texts, L, pad_id, batch=64):
    """(K + 1, N, E) latents of the N real tokens, their (N,) ids, (K + 1,) adjacent cosines."""
    rows = [build_unconditional_row(ids, L, pad_id) for ids in tokenize(tokenizer, texts)]
    ids = torch.tensor([r[0] for r in rows])
    mask = torch.tensor([r[1] for r in rows])
    states = []
    with torch.no_grad():
        for i in range(0, len(rows), batch):
            out = enc.model(
                input_ids=ids[i : i + batch],
                attention_mask=mask[i : i + batch],
                output_hidden_states=True,
            )
            states.append(torch.stack(out.hidden_states).float())  # (K+1, B, L, E)
    h = torch.cat(states, 1)  # (K+1, N_rows, L, E)
    valid = mask.bool()
    pairs = valid[:, 1:] & valid[:, :-1]
    adjacent = torch.nn.functional.cosine_similarity(h[:, :, 1:], h[:, :, :-1], dim=-1)
    return h[:, valid], ids[valid], adjacent[:, pairs].mean(1)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--encoder", default="minilm")
    p.add_argument("--data", default=web_bible("train"))
    p.add_argument("--train", type=int, default=3000, help="verses for the centroids")
    p.add_argument("--test", type=int, default=300, help="held-out verses to identify")
    p.add_argument("--max-length", type=int, default=64)
    p.add_argument("--times", default="1.0,0.7,0.5,0.3")
    p.add_argument("--noise-scale", type=float, default=2.0)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()

    enc = FrozenEncoder.from_pretrained(args.encoder, latent_std=1.0)
    tokenizer = load_tokenizer(args.encoder)
    with gzip.open(args.data, "rt") as f:
        texts = [json.loads(line)["text"] for line in f]
    random.Random(args.seed).shuffle(texts)
    pad = token_spec(tokenizer).eos_id
    train_h, train_ids, _ = encode_layers(enc, tokenizer, texts[: args.train], args.max_length, pad)
    test_h, test_ids, adjacent = encode_layers(
        enc, tokenizer, texts[args.train : args.train + args.test], args.max_length, pad
    )
    times = [float(v) for v in args.times.split(",")]
    gen = torch.Generator().manual_seed(args.seed)
    header = " | ".join(f"nearest id, t {t}" for t in times)
    print(f"| layer | RMS | adjacent cosine | {header} |")
    print("|---|---|---|" + "---|" * len(times))
    vocab, inverse = torch.unique(train_ids, return_inverse=True)
    counts = torch.zeros(len(vocab)).index_add_(0, inverse, torch.ones(len(train_ids)))
    for k in range(train_h.shape[0]):
        rms = train_h[k].pow(2).mean().sqrt()
        x_train, x = train_h[k] / rms, test_h[k] / rms
        centroids = torch.zeros(len(vocab), x.shape[1]).index_add_(0, inverse, x_train)
        centroids /= counts[:, None]
        accuracy = []
        for t in times:
            tt = torch.full((x.shape[0],), t)
            noise = torch.randn(x.shape, generator=gen)
            x_hat = interpolate(x, noise, tt, args.noise_scale) / t
            nearest = vocab[torch.cdist(x_hat, centroids).argmin(1)]
            accuracy.append((nearest == test_ids).float().mean().item())
        cells = " | ".join(f"{a:.3f}" for a in accuracy)
        print(f"| {k} | {rms:.3f} | {adjacent[k]:.3f} | {cells} |")
    print(f"({args.train} + {args.test} verses, {len(test_ids)} test tokens, seed {args.seed})")


if __name__ == "__main__":
    main()
