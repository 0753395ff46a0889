"""One prepared check for a CUDA machine: train ELF-B in bf16, sample with every sampler, compare.

Usage:
    python benchmarks/gpu_check.py                         # on a CUDA machine, under 8 minutes
    python benchmarks/gpu_check.py --train-steps 50 --batch 32 --json gpu_check.json
    python benchmarks/gpu_check.py --device cpu --tiny     # the same code as a CPU smoke run

1. Training: ELF-B (E 512, V 32100, L 128) from scratch, the efficient objective, Muon + Adam,
   bf16 autocast, ``--train-steps`` steps on random latents: s/step, tokens/s, first and last
   loss, peak memory.
2. One forward of the trained network at t 0.5: relative L2 error of bf16 (cached weights, the
   sampling path) and of bf16 per-op autocast (the training path) against fp32.
3. Each sampler (ode, sde, heun, pc; ``--steps`` steps, w 3, B ``--batch``) in fp32, bf16 and
   bf16 per-op: s/batch, samples/s, tokens/s, and bf16 against fp32 (the same seeds): the share
   of equal tokens and the relative L2 distance of the final latents.

Exits 1 after printing ``FAILED: ...`` when a loss or an output is not finite or a bf16 forward
is further than ``--tolerance`` from fp32; stops sampling early (and says so) past ``--budget-s``.
``--tiny`` swaps ELF-B for a depth-2 D-64 network at L 16, B 4 and a few steps: seconds on a CPU.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time

import torch

from sample import autocast_for, sample_once  # benchmarks/sample.py

SAMPLERS = ("ode", "sde", "heun", "pc")
BF16 = ("bf16", "bf16-per-op")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-12)).item()


def train(model, args, device: torch.device, dims: tuple[int, int, int, int]) -> dict:
    """``args.train_steps`` bf16 optimizer steps on random latents; the losses and speed."""
    from elflow.config import ObjectiveConfig
    from elflow.network import TrainForward
    from elflow.objective import Batch, elf_loss, sample_draws_keyed
    from elflow.train.optim import OptimConfig, build_optimizer, set_lr

    E, V, L, B = dims
    model.train()
    opt = build_optimizer(model, OptimConfig(lr=args.lr))
    set_lr(opt, args.lr)
    cfg = ObjectiveConfig()
    g = torch.Generator(device=device).manual_seed(args.seed)
    batch = Batch(
        torch.randn(B, L, E, generator=g, device=device),
        torch.randint(0, V, (B, L), generator=g, device=device),
        torch.ones(B, L, device=device),
    )
    losses, times = [], []
    for i in range(args.train_steps):
        draws = sample_draws_keyed(range(i * B, (i + 1) * B), L, E, cfg, args.seed, device)
        _sync(device)
        t0 = time.perf_counter()
        with autocast_for("bf16", device):
            out = elf_loss(TrainForward(model), batch, draws, cfg)
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        _sync(device)
        times.append(time.perf_counter() - t0)
        losses.append(out.loss.item())
    step_s = statistics.median(times[1:] or times)  # the first step pays for warm-up
    return {
        "steps": args.train_steps,
        "s_per_step": step_s,
        "tokens_per_s": B * L / step_s,
        "losses": losses,
        "first_loss": losses[0],
        "last_loss": losses[-1],
    }


def forward_errors(model, device: torch.device, dims: tuple[int, int, int, int]) -> dict:
    """Relative L2 error against fp32 of one bf16 forward: cached weights and per-op autocast."""
    E, _, L, B = dims
    g = torch.Generator(device=device).manual_seed(1)
    x_in = torch.randn(B, L, 2 * E, generator=g, device=device)
    model.eval()
    out = {}
    with torch.no_grad():
        ref = model(x_in, 0.5, 3.0, 0.0)[0]
        for dtype in BF16:
            model.lowp_inference = dtype == "bf16"
            with autocast_for(dtype, device):
                out[dtype] = _rel(model(x_in, 0.5, 3.0, 0.0)[0], ref)
    model.lowp_inference = True
    return out


def sample_all(model, args, device: torch.device, dims, started: float) -> tuple[list, bool]:
    """Every sampler in every dtype; rows of timings and agreement with fp32."""
    from elflow.config import SamplerConfig

    _, _, L, B = dims
    model.eval()
    rows = []
    for name in SAMPLERS:
        if time.perf_counter() - started > args.budget_s:
            print(f"stopping before {name}: past --budget-s {args.budget_s:.0f}", flush=True)
            return rows, True
        cfg = SamplerConfig(steps=args.steps, sampler=name, gamma=1.5 if name == "sde" else 0.0)
        results = {}
        for dtype in ("fp32", *BF16):
            times = []
            for _ in range(1 + args.repeats):  # the first batch is the warm-up
                seconds, out = sample_once(model, B, L, cfg, dtype, device, args.seed)
                times.append(seconds)
            results[dtype] = (statistics.median(times[1:]), out)
        model.lowp_inference = True
        ref = results["fp32"][1]
        for dtype, (s, out) in results.items():
            row = {"sampler": name, "nfe": cfg.nfe, "dtype": dtype, "s_per_batch": s}
            row |= {"samples_per_s": B / s, "tokens_per_s": B * L / s}
            row["finite"] = bool(out.z.isfinite().all())
            if dtype != "fp32":
                row["same_tokens"] = (out.tokens == ref.tokens).float().mean().item()
                row["z_rel_l2"] = _rel(out.z, ref.z)
            rows.append(row)
            agree = ""
            if "same_tokens" in row:
                agree = f"{100 * row['same_tokens']:>6.1f}% {row['z_rel_l2']:>8.4f}"
            print(
                f"{name:<5} {cfg.nfe:>4} {dtype:<11} {s:>8.3f} {row['samples_per_s']:>9.2f} "
                f"{row['tokens_per_s']:>9.1f} {agree}",
                flush=True,
            )
    return rows, False


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda", help="cuda (default) or cpu (with --tiny)")
    p.add_argument("--tiny", action="store_true", help="a depth-2 D-64 network: a smoke run")
    p.add_argument("--train-steps", type=int, help="optimizer steps (default 20; --tiny 2)")
    p.add_argument("--batch", type=int, help="batch size (default 8; --tiny 4)")
    p.add_argument("--steps", type=int, help="sampling steps (default 32; --tiny 4)")
    p.add_argument("--repeats", type=int, default=2, help="timed batches per setting")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tolerance", type=float, default=0.05, help="max bf16 forward rel. error")
    p.add_argument("--budget-s", type=float, default=420.0, help="stop sampling after this")
    p.add_argument("--json", help="also write everything measured to this file")
    args = p.parse_args()
    if args.device not in ("cuda", "cpu") and not args.device.startswith("cuda:"):
        p.error(f"--device: cuda, cuda:N or cpu, got {args.device!r}")
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        sys.exit(
            "gpu_check.py: no CUDA device here (torch.cuda.is_available() is False); run it on "
            "a GPU machine, or pass --device cpu --tiny for a smoke run of the same code"
        )
    for name in ("train_steps", "batch", "steps", "repeats"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1")
    tiny = args.tiny
    args.train_steps = args.train_steps or (2 if tiny else 20)
    args.batch = args.batch or (4 if tiny else 8)
    args.steps = args.steps or (4 if tiny else 32)

    from elflow.config import model_preset
    from elflow.model import build_model

    started = time.perf_counter()
    device = torch.device(args.device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    print(f"torch {torch.__version__}, {name}, {'tiny' if tiny else 'ELF-B'}", flush=True)
    E, V, L = (32, 100, 16) if tiny else (512, 32100, 128)
    dims = (E, V, L, args.batch)
    torch.manual_seed(args.seed)
    preset = "elf-tiny" if tiny else "elf-b"
    model = build_model(model_preset(preset, encoder_dim=E, vocab_size=V, max_length=L), device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    report: dict = {"device": name, "torch": torch.__version__, "tiny": tiny}
    report["train"] = tr = train(model, args, device, dims)
    if device.type == "cuda":
        tr["peak_memory_gb"] = torch.cuda.max_memory_allocated(device) / 2**30
    print(
        f"train (bf16): {tr['steps']} steps, {tr['s_per_step']:.3f} s/step, "
        f"{tr['tokens_per_s']:.0f} tokens/s, loss {tr['first_loss']:.4f} -> "
        f"{tr['last_loss']:.4f}"
        + (f", peak {tr['peak_memory_gb']:.1f} GB" if "peak_memory_gb" in tr else ""),
        flush=True,
    )
    report["forward_rel_l2"] = errs = forward_errors(model, device, dims)
    print(
        "one forward, rel. L2 vs fp32: " + ", ".join(f"{k} {v:.4f}" for k, v in errs.items()),
        flush=True,
    )
    print(
        f"{'sampler':<5} {'NFE':>4} {'dtype':<11} {'s/batch':>8} {'samples/s':>9} {'tokens/s':>9} "
        f"{'same tokens, z rel. L2 vs fp32'}"
    )
    report["sampling"], report["stopped_early"] = sample_all(model, args, device, dims, started)
    report["wall_s"] = time.perf_counter() - started
    failures = []
    if not all(math.isfinite(loss) for loss in tr["losses"]):
        failures.append(f"non-finite training loss {tr['losses']}")
    failures += [
        f"{k} forward rel. L2 {v:.4f} > {args.tolerance}"
        for k, v in errs.items()
        if not v <= args.tolerance
    ]
    failures += [
        f"{r['sampler']} {r['dtype']}: non-finite latents"
        for r in report["sampling"]
        if not r["finite"]
    ]
    report["failures"] = failures
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    print(f"done in {report['wall_s']:.0f} s")
    for failure in failures:
        print(f"FAILED: {failure}")
    if failures:
        sys.exit(1)


if __name__ == "__main__":
    main()
