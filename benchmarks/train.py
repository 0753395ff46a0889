"""Training-step throughput and peak memory: the full step and the latent cache's speed-up.

Usage:
    python benchmarks/train.py                       # every size below, each in its own process
    python benchmarks/train.py --only bible-tiny --precision bf16 --steps 10
    python benchmarks/train.py --only elf-b-L128 --activation-checkpointing

One full optimizer step = objective forward + backward (efficient or reference procedure) +
global-norm clipping + Muon/Adam + EMA, on random latents of the preset's shape. Each
(size, procedure, precision) runs in a fresh subprocess so that its peak RSS is its own.
``--cache`` also times the frozen MiniLM encoder on a batch of real verses (what the latent cache
saves per step) against a cache lookup. ``--matmul`` only prints fp32 and bf16 matmul GFLOP/s
(is bf16 native on this CPU?). ``--newton-schulz`` only times fp32 Newton–Schulz on the decoder
head's matrix (E 384 x V 30522), in the Gram form elflow uses for wide matrices and directly.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import resource
import subprocess
import sys
import time

import torch

SIZES = {
    # name: (model preset, E, V, L, B)
    "bible-tiny": ("elf-small", 384, 30522, 64, 64),
    "elf-b-L128": ("elf-b", 512, 32100, 128, 8),
}


def one(
    size: str, procedure: str, precision: str, steps: int, ns_dtype: str, recompute: bool = False
) -> dict:
    from elflow.config import ObjectiveConfig, model_preset
    from elflow.model import build_model
    from elflow.objective import Batch, elf_loss
    from elflow.runtime.hardware import cpu_has_native_bf16
    from elflow.train.ema import EMA
    from elflow.train.forward import TrainForward
    from elflow.train.objective_draws import sample_draws_keyed
    from elflow.train.optim import OptimConfig, build_optimizer, resolve_ns_dtype, set_lr

    preset, E, V, L, B = SIZES[size]
    torch.manual_seed(0)
    model = build_model(model_preset(preset, encoder_dim=E, vocab_size=V, max_length=L)).train()
    model.activation_checkpointing = recompute
    ema = EMA(model, 0.999)
    opt = build_optimizer(model, OptimConfig(lr=1e-3, muon_ns_dtype=ns_dtype))
    set_lr(opt, 1e-3)
    cfg = ObjectiveConfig()
    g = torch.Generator().manual_seed(0)
    batch = Batch(
        torch.randn(B, L, E, generator=g),
        torch.randint(0, V, (B, L), generator=g),
        torch.ones(B, L),
    )
    autocast = (
        torch.autocast("cpu", dtype=torch.bfloat16)
        if precision == "bf16"
        else contextlib.nullcontext()
    )

    def step(i: int) -> None:
        draws = sample_draws_keyed(range(i * B, (i + 1) * B), L, E, cfg, 0)
        with autocast:
            out = elf_loss(TrainForward(model), batch, draws, cfg, procedure)
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        ema.update(model)

    step(0)
    t0 = time.perf_counter()
    for i in range(1, steps + 1):
        step(i)
    dt = (time.perf_counter() - t0) / steps
    peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return {
        "size": size,
        "procedure": procedure,
        "precision": precision,
        "ns": resolve_ns_dtype(ns_dtype, torch.device("cpu")),
        "s_per_step": dt,
        "tokens_per_s": B * L / dt,
        "peak_rss_mb": peak_mb,
        "activation_checkpointing": recompute,
        "cpu_native_bf16": cpu_has_native_bf16(),
    }


def matmul_rates(n: int = 1024, reps: int = 3) -> dict:
    """GFLOP/s of an n x n matmul in fp32 and in bf16 (emulated on CPUs without native bf16)."""
    rates = {}
    for dtype in (torch.float32, torch.bfloat16):
        a = torch.randn(n, n).to(dtype)
        a @ a
        t0 = time.perf_counter()
        for _ in range(reps):
            a @ a
        rates[str(dtype).removeprefix("torch.")] = (
            2 * n**3 * reps / (time.perf_counter() - t0) / 1e9
        )
    return rates


def newton_schulz_seconds(shape: tuple[int, int] = (30522, 384), reps: int = 3) -> dict:
    """Seconds per fp32 Newton–Schulz of one ``shape`` matrix: Gram form and direct iteration."""
    from elflow.train import muon

    grad = torch.randn(*shape)
    out = {}
    for name, ratio in (("gram", muon.GRAM_RATIO), ("direct", math.inf)):
        args = (grad, muon.NS_COEFFICIENTS, 5, muon.NS_EPS, torch.float32, ratio)
        muon._newton_schulz(*args)
        t0 = time.perf_counter()
        for _ in range(reps):
            muon._newton_schulz(*args)
        out[f"{name}_s"] = (time.perf_counter() - t0) / reps
    return out


def cache_speedup(batches: int = 3) -> dict:
    """Seconds per batch of 64 verses (L 64) through MiniLM vs a latent-cache lookup."""

    import numpy as np
    from transformers import AutoTokenizer

    from elflow.data.latent_cache import LatentCache
    from elflow.examples import web_bible_texts
    from elflow.text.encoder import FrozenEncoder, resolve_pretrained

    tok = AutoTokenizer.from_pretrained(resolve_pretrained("minilm"))
    enc = FrozenEncoder.from_pretrained("minilm", latent_std=0.358)
    texts = web_bible_texts("valid")[: 64 * batches]
    ids = tok(texts, max_length=64, truncation=True, padding="max_length", return_tensors="pt")
    enc(ids["input_ids"][:64], ids["attention_mask"][:64])
    t0 = time.perf_counter()
    latents = [
        enc(ids["input_ids"][i : i + 64], ids["attention_mask"][i : i + 64])
        for i in range(0, 64 * batches, 64)
    ]
    t_enc = (time.perf_counter() - t0) / batches
    cache = LatentCache(torch.cat(latents).to(torch.float16))
    t0 = time.perf_counter()
    for i in range(batches):
        cache.get(np.arange(i * 64, (i + 1) * 64))
    t_cache = (time.perf_counter() - t0) / batches
    return {"encode_s_per_batch": t_enc, "cache_s_per_batch": t_cache}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--only", help="run one size in this process (used by the driver)")
    p.add_argument("--procedure", default="efficient")
    p.add_argument("--precision", default="fp32")
    p.add_argument(
        "--ns",
        default="auto",
        help="Muon Newton-Schulz dtype: auto (bf16 on native-bf16 CPUs), ...",
    )
    p.add_argument("--steps", type=int, default=5)
    p.add_argument(
        "--activation-checkpointing",
        action="store_true",
        help="recompute block activations in the backward (train.activation_checkpointing)",
    )
    p.add_argument("--cache", action="store_true", help="also time encoder vs latent cache")
    p.add_argument("--matmul", action="store_true", help="only print fp32/bf16 matmul GFLOP/s")
    p.add_argument(
        "--newton-schulz", action="store_true", help="only time fp32 Newton-Schulz on V x E"
    )
    args = p.parse_args()
    if args.newton_schulz:
        print(json.dumps({"newton_schulz_30522x384": newton_schulz_seconds()}))
        return
    if args.matmul:
        print(json.dumps({"gflops_1024": matmul_rates()}))
        return
    if args.only:
        r = one(
            args.only,
            args.procedure,
            args.precision,
            args.steps,
            args.ns,
            args.activation_checkpointing,
        )
        print(json.dumps(r))
        return
    from elflow.runtime.hardware import cpu_has_native_bf16

    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, "
        f"CPU native bf16: {'yes' if cpu_has_native_bf16() else 'no (bf16 is emulated)'}"
    )
    print(
        f"{'size':<11} {'procedure':<10} {'prec':<5} {'NS':<9} {'s/step':>7} {'tok/s':>7} "
        f"{'peak RSS MB':>11}"
    )
    rows = []
    for size in SIZES:
        for precision in ("fp32", "bf16"):
            for procedure in ("reference", "efficient"):
                cmd = [
                    sys.executable,
                    __file__,
                    "--only",
                    size,
                    "--procedure",
                    procedure,
                    "--precision",
                    precision,
                    "--steps",
                    str(args.steps),
                    "--ns",
                    args.ns,
                ] + (["--activation-checkpointing"] if args.activation_checkpointing else [])
                r = json.loads(
                    subprocess.run(cmd, capture_output=True, text=True, check=True)
                    .stdout.strip()
                    .splitlines()[-1]
                )
                rows.append(r)
                print(
                    f"{size:<11} {procedure:<10} {precision:<5} {r['ns']:<9} "
                    f"{r['s_per_step']:>7.2f} {r['tokens_per_s']:>7.0f} {r['peak_rss_mb']:>11.0f}",
                    flush=True,
                )
            ref, eff = rows[-2], rows[-1]
            print(
                f"{'':<11} full step efficient / reference ({precision}): "
                f"{eff['s_per_step'] / ref['s_per_step']:.2f}"
            )
    if args.cache:
        c = cache_speedup()
        print(
            f"\nMiniLM encoding of 64 verses (L 64): {c['encode_s_per_batch']:.3f} s/batch; "
            f"latent-cache lookup: {c['cache_s_per_batch'] * 1e3:.1f} ms/batch "
            f"({c['encode_s_per_batch'] / c['cache_s_per_batch']:.0f}x less per step)"
        )


if __name__ == "__main__":
    main()
