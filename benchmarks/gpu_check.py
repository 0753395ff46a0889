"""One prepared check for a CUDA machine: the real training path, then every sampler.

Usage:
    python benchmarks/gpu_check.py                 # relaunches itself: torchrun --nproc_per_node 1
    python benchmarks/gpu_check.py --steps 60 --json gpu_check.json
    python benchmarks/gpu_check.py --device cpu --tiny   # the same code as a CPU smoke run (gloo)

Training goes through ``elflow.train.loop.train`` under torchrun (NCCL, one process: the DDP and
FSDP2 wrappers, the process-group collectives and ShardedMuon's all-gather all run): the owt-b
preset at L 256 on the packaged Bible verses (packed rows of real text: every batch differs),
with a T5-small-shaped random encoder built here (d_model 512, 6 layers, 8 heads) and the
packaged WordPiece tokenizer. Runs, each ``--steps`` optimizer steps of a ``--batch``-row global
batch in two micro-batches:

1. ``ddp``: bf16, compile off; 2. ``ddp-compile``: per-block torch.compile; 3. ``fsdp2``: bf16
   compute, fp32 reduction; 4. ``fp32``: precision fp32 with TF32 off (the loss curve's
   reference); 5. and 6. ``ddp-1024`` and ``compile-1024``: the paper's L 1024 (4x the tokens
   per micro-batch); 7. ``resume``: from ``ddp``'s middle checkpoint to the end, against
   ``ddp``'s end. One steady step of ``ddp`` and of ``ddp-1024`` runs under torch.profiler: its
   wall time against the device's busy time, and the busiest kernels.

For each: s/step, tokens/s, MFU and peak memory from the run's own log lines, the loss at each
logged step, and the host syncs of every step counted with ``torch.cuda.set_sync_debug_mode``
(steps that log or save read the device on purpose; the others should read it 0 times). Then the
trained ELF-B samples with each sampler in fp32, bf16 and bf16 per-op (s/batch, tokens/s, bf16
against fp32). Exits 1 after printing ``FAILED: ...`` when a loss is not finite, a steady step
syncs, or a bf16 forward is further than ``--tolerance`` from fp32.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import math
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
from pathlib import Path

import torch

from sample import autocast_for, fast_path, sample_once  # benchmarks/sample.py
from step_profile import build_assets as profile_assets  # benchmarks/step_profile.py

SAMPLERS = ("ode", "sde", "heun", "pc")
BF16 = ("bf16", "bf16-per-op")
RUNS = ("ddp", "ddp-compile", "fsdp2", "fp32", "ddp-1024", "compile-1024")
LONG = 1024
"""The ``-1024`` runs train at the paper's length (4x the tokens per micro-batch)."""


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-12)).item()


def build_assets(root: Path, tiny: bool) -> dict[str, str]:
    """A T5-small-shaped random encoder (tiny: two 32-wide layers) and the packaged tokenizer
    (step_profile.py's)."""
    return profile_assets(root, 32 if tiny else 512, 2 if tiny else 6, data=None)


def run_config(args, assets: dict[str, str], name: str):
    """owt-b (tiny: elf-tiny) at L 256 (tiny: 32) on the packed Bible verses, for run ``name``."""
    from elflow.config.run_presets import preset
    from elflow.config.train_config import apply_overrides
    from elflow.examples import web_bible

    micro = max(1, args.batch // 2)
    length = LONG if name.endswith("-1024") else args.length
    sets = [
        f"model.max_length={length}",
        f"encoder.name={assets['encoder']}",
        f"encoder.tokenizer={assets['tokenizer']}",
        "encoder.latent_std=0.2",
        f"data.path={web_bible('train')}",
        "data.valid_path=",
        "data.format=jsonl",
        "data.packing=true",
        "data.latent_cache=false",
        f"data.max_rows={args.max_rows}",
        f"train.global_batch={args.batch}",
        f"train.micro_batch={micro}",
        f"train.max_steps={args.steps}",
        f"train.save_every={args.steps // 2}",
        f"train.log_every={args.log_every}",
        "train.keep_last=3",
        "train.tensorboard=false",
        "train.sample_every=0",
        "train.eval_every=0",
        "train.warmup_epochs=0",
        "optim.warmup_steps=5",
        f"train.device={args.device_kind}",
        "train.parallel=" + ("fsdp2" if name == "fsdp2" else "ddp"),
        "train.compile=" + ("true" if "compile" in name else "false"),
        "train.precision=" + ("fp32" if name == "fp32" else args.precision),
        "train.tf32=" + ("false" if name == "fp32" else "true"),
    ]
    if args.tiny:
        sets += ["model.depth=2", "model.hidden_size=64", "model.num_heads=4"]
    return apply_overrides(preset("owt-b"), sets=sets)


class SyncCounter:
    """Host syncs per optimizer step (CUDA's sync debug mode), by whether the step logs."""

    def __init__(self, cuda: bool, profile_step: int | None = None) -> None:
        self.cuda, self.steps, self.sites = cuda, [], collections.Counter()
        self.profile_step, self.profile = profile_step, None

    @contextlib.contextmanager
    def counting(self):
        from elflow.train import loop

        original = loop.Trainer.step
        counter = self

        def step(trainer, k):
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                if k == counter.profile_step:
                    counter.profiled(original, trainer, k)
                else:
                    original(trainer, k)
            found = [w for w in caught if "synchroniz" in str(w.message)]
            counter.steps.append((k, trainer.report.due(k + 1), len(found)))
            if found and k >= 3 and not trainer.report.due(k + 1):
                counter.sites.update(f"{w.filename}:{w.lineno}" for w in found)

        loop.Trainer.step = step
        if self.cuda:
            torch.cuda.set_sync_debug_mode("warn")
        try:
            yield self
        finally:
            loop.Trainer.step = original
            if self.cuda:
                torch.cuda.set_sync_debug_mode("default")

    def profiled(self, original, trainer, k):
        """Step ``k`` under torch.profiler: where its host and device time go."""
        from torch.profiler import ProfilerActivity, profile

        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.cuda else [])
        t0 = time.perf_counter()
        with profile(activities=acts) as prof:
            original(trainer, k)
            if self.cuda:
                torch.cuda.synchronize()
        wall = time.perf_counter() - t0
        events = prof.key_averages()
        device = sum(getattr(e, "self_device_time_total", 0) for e in events) / 1e6
        kernels = sum(e.count for e in events if getattr(e, "self_device_time_total", 0) > 0)
        ops = sum(e.count for e in events if e.key.startswith("aten::"))
        self.profile = {"step": k, "wall_s": wall, "device_busy_s": device, "kernels": kernels}
        self.profile["aten_ops"] = ops
        try:
            key = "self_device_time_total" if self.cuda else "self_cpu_time_total"
            self.profile["table"] = events.table(
                sort_by=key, row_limit=15, max_name_column_width=50
            )
        except Exception as e:  # the table's columns differ across torch versions
            self.profile["table"] = f"({type(e).__name__}: {e})"

    def steady(self, warmup: int = 3) -> list[int]:
        """Syncs of each step after ``warmup`` that neither logs nor saves."""
        return [n for k, due, n in self.steps if k >= warmup and not due]


def train_run(args, assets, name: str, root: Path) -> dict:
    """One training run through train(); its figures from the metrics file."""
    from elflow.train.loop import train

    cfg = run_config(args, assets, name)
    out = root / name
    profile_step = args.steps // 2 + 5 if name in ("ddp", "ddp-1024") else None
    counter = SyncCounter(args.device_kind == "cuda", profile_step)
    if args.device_kind == "cuda":
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    with counter.counting():
        train(cfg, out, "never")
    wall = time.perf_counter() - t0
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    lines = [x for x in lines if "loss" in x]
    steady = counter.steady()
    timed = lines[1:] or lines  # the first window pays for warm-up (and compilation)
    report = {
        "run": name,
        "wall_s": wall,
        "losses": {x["step"]: x["loss"] for x in lines},
        "s_per_step": statistics.median(x["step_s"] for x in timed),
        "tokens_per_s": statistics.median(x["tokens_per_s"] for x in timed),
        "mfu": statistics.median(x.get("mfu", math.nan) for x in timed),
        "peak_memory_gb": max(x["peak_memory_gb"] for x in lines),
        "steady_steps": len(steady),
        "steady_syncs": sum(steady),
        "syncs_by_step": counter.steps,
        "steady_sync_sites": dict(counter.sites),
    }
    print(
        f"{name:<12} {args.steps:>5} {report['s_per_step']:>7.3f} {report['tokens_per_s']:>9.0f} "
        f"{100 * report['mfu']:>5.1f}% {report['peak_memory_gb']:>7.1f} "
        f"{report['steady_syncs']:>4} in {len(steady):>3} {lines[0]['loss']:>8.4f} -> "
        f"{lines[-1]['loss']:.4f}  ({wall:.0f} s)",
        flush=True,
    )
    for site, n in counter.sites.items():
        print(f"  {n} syncs from {site}", flush=True)
    if counter.profile:
        pr = report["profile"] = counter.profile
        print(
            f"  profiled step {pr['step']}: {pr['wall_s']:.3f} s wall, device busy "
            f"{pr['device_busy_s']:.3f} s, {pr['kernels']} kernels, {pr['aten_ops']} aten ops",
            flush=True,
        )
        if args.device_kind == "cuda":
            print(pr["table"], flush=True)
    return report


def resume_run(args, assets, root: Path) -> dict:
    """``ddp`` resumed from its middle checkpoint, against its own end (same config)."""
    from safetensors.torch import load_file

    from elflow.train.loop import train

    half = args.steps // 2
    out = root / "resume"
    out.mkdir()
    shutil.copytree(root / "ddp" / f"checkpoint-{half}", out / f"checkpoint-{half}")
    train(run_config(args, assets, "ddp"), out, "auto")
    a = load_file(str(root / "ddp" / f"checkpoint-{args.steps}" / "model.safetensors"))
    b = load_file(str(out / f"checkpoint-{args.steps}" / "model.safetensors"))
    diff = max((a[k] - b[k]).abs().max().item() for k in a)
    moved = max(
        (a[k] - load_file(str(out / f"checkpoint-{half}" / "model.safetensors"))[k]).abs().max()
        for k in a
    ).item()
    print(
        f"resume {half}->{args.steps}: max |weight difference| to the straight run {diff:.3g} "
        f"(the weights moved up to {moved:.3g} over those steps)",
        flush=True,
    )
    return {"max_weight_diff": diff, "max_weight_change": moved}


def forward_errors(model, device: torch.device, L: int, B: int) -> dict:
    """Relative L2 error against fp32 of one bf16 forward: cached weights and per-op autocast."""
    E = model.cfg.encoder_dim
    g = torch.Generator(device=device).manual_seed(1)
    x_in = torch.randn(B, L, 2 * E, generator=g, device=device)
    from elflow.runtime import bf16_fast_path as fastpath

    model.eval()
    out = {}
    with torch.no_grad():
        ref = model(x_in, 0.5, 3.0, 0.0)[0]
        for dtype in BF16:
            fast_path(dtype == "bf16")
            with autocast_for(dtype, device):
                out[dtype] = _rel(fastpath.forward(model, x_in, 0.5, 3.0, 0.0)[0], ref)
    fast_path(True)
    return out


def sample_all(model, args, device: torch.device, started: float) -> tuple[list, bool]:
    """Every sampler in every dtype; rows of timings and agreement with fp32."""
    from elflow.config import SamplerConfig

    L, B = args.length, args.sample_batch
    model.eval()
    rows = []
    for name in SAMPLERS:
        if time.perf_counter() - started > args.budget_s:
            print(f"stopping before {name}: past --budget-s {args.budget_s:.0f}", flush=True)
            return rows, True
        cfg = SamplerConfig(steps=args.sample_steps, sampler=name, gamma=1.5 * (name == "sde"))
        results = {}
        for dtype in ("fp32", *BF16):
            times = []
            for _ in range(1 + args.repeats):  # the first batch is the warm-up
                seconds, out = sample_once(model, B, L, cfg, dtype, device, args.seed)
                times.append(seconds)
            results[dtype] = (statistics.median(times[1:]), out)
        fast_path(True)
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


def worker(args) -> int:
    """Everything, in this process (rank 0 of a one-process group)."""
    import torch.distributed as dist

    from elflow.io.artifact import load_model
    from elflow.runtime.distributed import launched_by_torchrun, setup, teardown

    started = time.perf_counter()
    cuda = args.device_kind == "cuda"
    if launched_by_torchrun():
        setup(args.device_kind)  # what train() does first: the NCCL group (and a gloo one)
    elif not dist.is_initialized():  # --tiny on a CPU: a one-process gloo group, as torchrun's
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        dist.init_process_group(
            "nccl" if cuda else "gloo",
            init_method=f"tcp://127.0.0.1:{port}",
            rank=0,
            world_size=1,
        )
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    name = torch.cuda.get_device_name(device) if cuda else "CPU"
    print(
        f"torch {torch.__version__}, {name}, {dist.get_backend()} group of "
        f"{dist.get_world_size()}, {'elf-tiny' if args.tiny else 'ELF-B'} at L {args.length}, "
        f"global batch {args.batch} in 2 micro-batches, {args.steps} steps per run",
        flush=True,
    )
    root = Path(tempfile.mkdtemp(prefix="elflow-gpu-check-"))
    assets = build_assets(root, args.tiny)
    report: dict = {"device": name, "torch": torch.__version__, "tiny": args.tiny, "runs": {}}
    print(
        f"{'run':<12} {'steps':>5} {'s/step':>7} {'tokens/s':>9} {'MFU':>6} {'peak GB':>7} "
        f"{'syncs in steady steps':>14} {'loss first -> last'}",
        flush=True,
    )
    failures = []
    for run in args.runs.split(","):
        try:
            report["runs"][run] = r = train_run(args, assets, run, root)
        except Exception as e:  # report it and go on: one device session must say everything
            failures.append(f"{run}: {type(e).__name__}: {e}".splitlines()[0])
            traceback.print_exc(limit=-8)
            continue
        if not all(math.isfinite(v) for v in r["losses"].values()):
            failures.append(f"{run}: non-finite loss {r['losses']}")
        if r["steady_syncs"] and cuda:
            failures.append(
                f"{run}: {r['steady_syncs']} host syncs in steps that neither log nor save"
            )
    if "ddp" in report["runs"]:
        try:
            report["resume"] = resume_run(args, assets, root)
        except Exception as e:
            failures.append(f"resume: {type(e).__name__}: {e}".splitlines()[0])
            traceback.print_exc(limit=-8)
    if {"ddp", "fp32"} <= set(report["runs"]):
        print("loss at each logged step: bf16 (ddp) against fp32", flush=True)
        a, b = report["runs"]["ddp"]["losses"], report["runs"]["fp32"]["losses"]
        for step in sorted(a):
            print(f"  step {step:>4}: bf16 {a[step]:.4f}  fp32 {b.get(step, math.nan):.4f}")
    teardown()
    if "ddp" in report["runs"] and not args.no_sampling:
        model, _ = load_model(root / "ddp", device=device)
        report["forward_rel_l2"] = errs = forward_errors(model, device, args.length, 8)
        print(
            "one forward, rel. L2 vs fp32: " + ", ".join(f"{k} {v:.4f}" for k, v in errs.items()),
            flush=True,
        )
        failures += [
            f"{k} forward rel. L2 {v:.4f} > {args.tolerance}"
            for k, v in errs.items()
            if not v <= args.tolerance
        ]
        print(
            f"{'sampler':<5} {'NFE':>4} {'dtype':<11} {'s/batch':>8} {'samples/s':>9} "
            f"{'tokens/s':>9} same tokens, z rel. L2 vs fp32",
            flush=True,
        )
        report["sampling"], report["stopped_early"] = sample_all(model, args, device, started)
        failures += [
            f"{r['sampler']} {r['dtype']}: non-finite latents"
            for r in report["sampling"]
            if not r["finite"]
        ]
    report["wall_s"] = time.perf_counter() - started
    report["failures"] = failures
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1, default=str))
    print(f"done in {report['wall_s']:.0f} s")
    for failure in failures:
        print(f"FAILED: {failure}")
    shutil.rmtree(root, ignore_errors=True)
    return 1 if failures else 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda", help="cuda (default) or cpu (with --tiny)")
    p.add_argument("--tiny", action="store_true", help="a depth-2 D-64 network: a smoke run")
    p.add_argument("--steps", type=int, help="optimizer steps per run (default 60; --tiny 4)")
    p.add_argument("--batch", type=int, help="global batch (default 64; --tiny 4)")
    p.add_argument("--length", type=int, help="sequence length (default 256; --tiny 32)")
    p.add_argument("--runs", default=",".join(RUNS), help=f"some of {','.join(RUNS)}")
    p.add_argument("--log-every", type=int, help="steps per log line (default 10; --tiny 2)")
    p.add_argument("--max-rows", type=int, default=0, help="read at most this many verses")
    p.add_argument("--precision", default="bf16", choices=("bf16", "auto"))
    p.add_argument("--sample-steps", type=int, help="sampling steps (default 32; --tiny 2)")
    p.add_argument("--sample-batch", type=int, help="sampling batch (default 8; --tiny 2)")
    p.add_argument("--repeats", type=int, default=2, help="timed batches per sampler setting")
    p.add_argument("--no-sampling", action="store_true", help="training only")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tolerance", type=float, default=0.05, help="max bf16 forward rel. error")
    p.add_argument("--budget-s", type=float, default=420.0, help="stop sampling after this")
    p.add_argument("--json", help="also write everything measured to this file")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.device not in ("cuda", "cpu") and not args.device.startswith("cuda:"):
        p.error(f"--device: cuda, cuda:N or cpu, got {args.device!r}")
    for name in ("steps", "batch", "length", "repeats", "sample_steps", "sample_batch"):
        value = getattr(args, name)
        if value is not None and value < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1")
    unknown = set(args.runs.split(",")) - set(RUNS)
    if unknown:
        p.error(f"--runs: unknown {sorted(unknown)}; choose from {','.join(RUNS)}")
    args.device_kind = "cuda" if args.device.startswith("cuda") else "cpu"
    if args.device_kind == "cuda" and not torch.cuda.is_available():
        sys.exit(
            "gpu_check.py: no CUDA device here (torch.cuda.is_available() is False); run it on "
            "a GPU machine, or pass --device cpu --tiny for a smoke run of the same code"
        )
    tiny = args.tiny
    args.steps = args.steps or (4 if tiny else 60)
    args.batch = args.batch or (4 if tiny else 64)
    args.length = args.length or (32 if tiny else 256)
    args.log_every = args.log_every or (2 if tiny else 10)
    args.sample_steps = args.sample_steps or (2 if tiny else 32)
    args.sample_batch = args.sample_batch or (2 if tiny else 8)
    if args.steps < 2:
        p.error("--steps must be at least 2 (the resume starts from the middle)")
    if args.device_kind == "cuda" and not args.worker and "TORCHELASTIC_RUN_ID" not in os.environ:
        # The real launch path: torchrun, one process, NCCL.
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1"]
        cmd += [__file__, "--worker", *(argv if argv is not None else sys.argv[1:])]
        return subprocess.call(cmd)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    return worker(args)


if __name__ == "__main__":
    sys.exit(main())
