"""Sampling throughput of the full loop (noise -> N steps -> decode), fp32 and bf16 autocast.

Usage:
    python benchmarks/sample.py                        # ELF-B: B 8 L 128 and B 4 L 64, 32-step SDE
    python benchmarks/sample.py --repeats 3 --threads 1
    python benchmarks/sample.py --sizes elf-b-64 --dtypes fp32,bf16,bf16-per-op --repeats 3
    python benchmarks/sample.py --sizes small --steps 8,16,32
    python benchmarks/sample.py --checkpoint MODEL --steps 32 --dtypes fp32,bf16 --num-samples 32
    python benchmarks/sample.py --sizes elf-b --dtypes bf16 --malloc default   # glibc as it comes

Randomly initialised weights (the speed does not depend on them), self-conditioning CFG w 3,
unconditional, one warm-up batch per setting, then ``--repeats`` timed batches per setting,
interleaved across the dtypes; the median is printed (s/batch, samples/s, tokens/s = B L / s). bf16
is ``torch.autocast``, under which an eval-mode model samples on cached bf16 weights
(``elflow.runtime.bf16_fast_path``); ``bf16-per-op`` turns that off (``ELFLOW_FAST_BF16=0``: per-op
autocast, as training runs it) for comparison. The share of tokens identical to fp32 is printed for
each bf16 row. At ELF-B, B 4, L 64, 32-step SDE the authors' code took 65.3 s (fp32) and 6.77 s
(bf16) per batch on a 2-core Xeon with AMX (measured side by side): ``x authors`` divides those by
ours. With ``--checkpoint`` (any model source) it times ``elflow sample``'s own path
(``sample_records``: sampling, decoding, detokenising) on that model, whose bf16 agreement with fp32
is the meaningful one (a random network's argmax is near-uniform). Sampling on a CPU keeps freed
memory for reuse (``elflow.runtime.hardware.keep_freed_memory``); ``--malloc default`` leaves
glibc's allocator as it comes, as before that change. The setting is process-wide and earlier
settings' allocations warm the allocator for later ones: time one dtype per process to see a user's
first batch.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import time
from dataclasses import replace

import torch

from elflow.config import SamplerConfig, model_preset
from elflow.model import build_model
from elflow.runtime import bf16_fast_path as fastpath
from elflow.runtime.hardware import MALLOC_ENV, keep_freed_memory
from elflow.sampling import sample_generators
from elflow.sampling.denoiser import sample_model

SIZES = {
    # name: (model preset, E, V, L, batch)
    "elf-b": ("elf-b", 512, 32100, 128, 8),
    "elf-b-64": ("elf-b", 512, 32100, 64, 4),
    "small": ("elf-small", 384, 30522, 64, 32),
}
DTYPES = ("fp32", "bf16", "bf16-per-op")
AUTHORS_S_PER_BATCH = {("elf-b-64", "fp32"): 65.3, ("elf-b-64", "bf16"): 6.77}
"""The authors' code at ELF-B, B 4, L 64, 32-step SDE with decode, w 3 (side by side with elflow
on a 2-core Xeon with AMX)."""


def build(name: str, device: str, seed: int) -> torch.nn.Module:
    preset, E, V, L, _ = SIZES[name]
    torch.manual_seed(seed)
    model = build_model(model_preset(preset, encoder_dim=E, vocab_size=V, max_length=L), device)
    with torch.no_grad():
        torch.nn.init.normal_(model.final_layer.linear.weight, std=0.02)
    return model.eval()


def fast_path(on: bool) -> None:
    """The bf16 fast path's switch (read at each network call): off for ``bf16-per-op``."""
    os.environ[fastpath.ENV] = "1" if on else "0"


def autocast_for(dtype: str, device: str | torch.device) -> contextlib.AbstractContextManager:
    """bf16 autocast for ``bf16`` and ``bf16-per-op``, nothing for ``fp32``."""
    if not dtype.startswith("bf16"):
        return contextlib.nullcontext()
    return torch.autocast(device_type=torch.device(device).type, dtype=torch.bfloat16)


def sample_once(model, B: int, L: int, cfg: SamplerConfig, dtype: str, device, seed: int):
    """One batch of ``B`` samples of length ``L`` in ``dtype`` (DTYPES): (seconds, SampleOutput).
    ``bf16`` samples on the cached bf16 weights, ``bf16-per-op`` with per-op autocast."""
    fast_path(dtype != "bf16-per-op")
    gens = sample_generators(seed, range(B), device)
    cuda = torch.device(device).type == "cuda"
    if cuda:
        torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    with autocast_for(dtype, device):
        out = sample_model(model, gens, L, cfg)
    if cuda:
        torch.cuda.synchronize(device)
    return time.perf_counter() - t0, out


def run_random(args: argparse.Namespace) -> None:
    head = f"{'size':<9} {'B':>2} {'L':>4} {'steps':>5} {'NFE':>4} {'dtype':<11} {'s/batch':>8}"
    print(f"{head} {'samples/s':>9} {'tokens/s':>8} {'x authors':>9} {'same tokens as fp32':>19}")
    dtypes = args.dtypes.split(",")
    for name in args.sizes.split(","):
        _, _, _, L, B = SIZES[name]
        model = build(name, args.device, args.seed)
        for steps in (int(s) for s in args.steps.split(",")):
            gamma = 1.5 if args.sampler == "sde" else 0.0
            cfg = SamplerConfig(steps=steps, sampler=args.sampler, gamma=gamma, w=3.0)
            times: dict[str, list[float]] = {d: [] for d in dtypes}
            tokens = {}
            for d in dtypes:  # warm-up (and the tokens compared)
                tokens[d] = sample_once(model, B, L, cfg, d, args.device, args.seed)[1].tokens
            for _ in range(args.repeats):
                for d in dtypes:
                    times[d].append(sample_once(model, B, L, cfg, d, args.device, args.seed)[0])
            for d in dtypes:
                s = statistics.median(times[d])
                ref = AUTHORS_S_PER_BATCH.get((name, d.removesuffix("-per-op")))
                ratio = f"{ref / s:.2f}" if ref and steps == 32 and args.sampler == "sde" else ""
                same = ""
                if d != "fp32" and "fp32" in tokens:
                    same = f"{100 * (tokens[d] == tokens['fp32']).float().mean().item():.1f}%"
                print(
                    f"{name:<9} {B:>2} {L:>4} {steps:>5} {cfg.nfe:>4} {d:<11} {s:>8.2f} "
                    f"{B / s:>9.3f} {B * L / s:>8.1f} {ratio:>9} {same:>19}",
                    flush=True,
                )


def run_checkpoint(args: argparse.Namespace) -> None:
    """samples/s of ``elflow sample``'s path on a real model, fp32 vs bf16 token agreement."""
    from elflow.generation.pipeline import ELFPipeline
    from elflow.generation.records import sample_records, token_agreement

    pipe = ELFPipeline.from_pretrained(args.checkpoint, device=args.device)
    L = pipe.model.cfg.max_length
    head = f"{'steps':>5} {'NFE':>4} {'dtype':<11} {'n':>4} {'batch':>5} {'s':>8} {'samples/s':>9}"
    print(f"{head} {'tokens/s':>8} {'same tokens as fp32':>20}")
    for steps in (int(s) for s in args.steps.split(",")):
        scfg = replace(pipe.sampler, steps=steps, sampler=args.sampler or pipe.sampler.sampler)
        ref = None
        for dtype in args.dtypes.split(","):
            fast_path(dtype != "bf16-per-op")
            kw = {"n": args.num_samples, "seed": args.seed, "batch_size": args.batch_size}
            kw.update(bf16=dtype.startswith("bf16"), save_tokens=True)
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
                f"{steps:>5} {scfg.nfe:>4} {dtype:<11} {len(recs):>4} {args.batch_size:>5} "
                f"{dt:>8.2f} {len(recs) / dt:>9.2f} {len(recs) * L / dt:>8.1f} {agree:>20}"
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="elf-b,elf-b-64", help=f"comma list of {list(SIZES)}")
    parser.add_argument("--steps", default="32")
    parser.add_argument("--sampler", default="sde", choices=["ode", "sde", "heun", "pc"])
    parser.add_argument("--dtypes", default="fp32,bf16", help=f"comma list of {list(DTYPES)}")
    parser.add_argument("--repeats", type=int, default=1, help="timed batches per setting")
    parser.add_argument("--threads", type=int, help="torch.set_num_threads (default: torch's)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--checkpoint", help="time elflow sample's path on this model instead")
    parser.add_argument("--num-samples", type=int, default=32, help="with --checkpoint")
    parser.add_argument("--batch-size", type=int, default=8, help="with --checkpoint")
    parser.add_argument(
        "--malloc",
        default="keep",
        choices=["keep", "default"],
        help="keep freed memory for reuse (what sampling does) or leave glibc as it comes",
    )
    args = parser.parse_args()
    if args.malloc == "default":
        os.environ[MALLOC_ENV] = "0"  # read by keep_freed_memory, which sample_model calls
    for size in args.sizes.split(","):
        if size not in SIZES:
            parser.error(f"--sizes: unknown size {size!r}; choose from {', '.join(SIZES)}")
    for dtype in args.dtypes.split(","):
        if dtype not in DTYPES:
            parser.error(f"--dtypes: unknown dtype {dtype!r}; choose from {', '.join(DTYPES)}")
    if args.repeats < 1:
        parser.error("--repeats must be at least 1")
    if args.threads:
        torch.set_num_threads(args.threads)
    print(
        f"torch {torch.__version__}, device {args.device}, {torch.get_num_threads()} threads, "
        f"malloc {'kept' if keep_freed_memory() else 'as it comes'}, "
        f"{time.strftime('%Y-%m-%d %H:%M')}"
    )
    if args.checkpoint:
        run_checkpoint(args)
    else:
        run_random(args)


if __name__ == "__main__":
    main()
