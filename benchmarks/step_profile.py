"""Exact counts of one steady-state training step of a preset, through the real trainer.

Usage:
    python benchmarks/step_profile.py                      # owt-b, reduced size, as on CUDA
    python benchmarks/step_profile.py --preset owt-l --world 2 --parallel fsdp2
    python benchmarks/step_profile.py --micro-batch 64 --accum 1 --json after.json
    python benchmarks/step_profile.py --compare before.json after.json   # a before/after table
    python benchmarks/step_profile.py --full --device cuda  # full size, on a GPU
    python benchmarks/step_profile.py --compile-modes blocks step   # compiled steps compared

The run is built by ``elflow.train.setup.prepare_run`` from the preset, with a T5-shaped random
encoder of the preset's encoder width (``--encoder-dim``), the packaged tokenizer and the packaged
Bible verses as data. ``--warmup`` optimizer steps run first (optimizer state, caches); the next
step is counted with :class:`elflow.runtime.profiling.OpCounter`: host syncs and aten ops per
micro-batch and per step outside them, FLOPs per token by the dtype the matrix products compute in,
the bytes autograd saves per token, the collective payload bytes per rank, and the optimiser's FLOPs
per rank (Muon's Newton-Schulz). ``--as-cuda`` (default on) sets what a CUDA run resolves 'auto' to:
bf16 autocast, the encoder in bf16, bf16 Newton-Schulz, TF32 allowed; ``--no-as-cuda`` takes the
settings as given. ``--world N`` runs N gloo processes on this machine (DDP or FSDP2).

``--compile-modes blocks step`` compares ``train.compile`` settings at ELF-B width (``--depth``
blocks): dynamo's graphs, graph breaks and recompiles (its ``counters``), inductor's generated
kernels and the bytes they access per token (``torch._inductor.metrics``, reset before the
first, compiling step: each graph's kernels are generated once), and, under torch's profiler,
the kernels one later step runs per micro-batch, inside the compiled graphs and outside them.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

REDUCED = {"depth": 2, "hidden_size": 128, "num_heads": 4, "max_length": 64}
"""The default reduced size on a CPU (per-token counts scale; the op and sync counts do not)."""


def build_assets(root: Path, encoder_dim: int, encoder_layers: int, data: str | None) -> dict:
    """A T5-shaped random encoder (64-wide heads) and the packaged tokenizer, saved in ``root``;
    with ``data`` ('text' or 'pairs'), Bible verses as training data in ``root/train.jsonl``.
    (gpu_check.py builds its encoder here too.)"""
    from transformers import AutoTokenizer, T5Config, T5EncoderModel

    import elflow
    from elflow.examples import web_bible_texts

    tok_dir = Path(elflow.__file__).resolve().parent / "demo_model" / "tokenizer"
    tokenizer = AutoTokenizer.from_pretrained(str(tok_dir))
    heads = max(1, encoder_dim // 64)
    torch.manual_seed(0)
    encoder = T5EncoderModel(
        T5Config(
            vocab_size=len(tokenizer),
            d_model=encoder_dim,
            d_kv=encoder_dim // heads,
            d_ff=4 * encoder_dim,
            num_layers=encoder_layers,
            num_heads=heads,
        )
    )
    encoder.save_pretrained(root / "encoder")
    assets = {"encoder": str(root / "encoder"), "tokenizer": str(tok_dir), "data": str(root)}
    if data is None:
        return assets
    verses = web_bible_texts("train")[:4096]
    with (root / "train.jsonl").open("w") as f:
        if data == "pairs":
            for a, b in zip(verses[::2], verses[1::2], strict=False):
                f.write(json.dumps({"source": a, "target": b}) + "\n")
        else:
            for v in verses:
                f.write(json.dumps({"text": v}) + "\n")
    return assets


def run_config(args, assets: dict):
    """The preset at the profiled size, on the profile's assets."""
    from dataclasses import fields, replace

    from elflow.config.run_presets import preset
    from elflow.config.train_config import apply_overrides

    base = preset(args.preset)
    sets = [
        f"encoder.name={assets['encoder']}",
        f"encoder.tokenizer={assets['tokenizer']}",
        f"data.path={assets['data']}/train.jsonl",
        "data.valid_path=",
        "data.format=" + ("pairs" if base.task == "conditional" else "jsonl"),
        "data.latent_cache=false",
        f"train.global_batch={args.micro_batch * args.accum * args.world}",
        f"train.micro_batch={args.micro_batch}",
        f"train.max_steps={args.warmup + 2}",
        "train.save_every=1000000",
        "train.log_every=1000000",
        "train.sample_every=0",
        "train.eval_every=0",
        "train.tensorboard=false",
        f"train.parallel={args.parallel}",
        f"train.device={args.device}",
        "optim.warmup_steps=0",
        "train.warmup_epochs=0",
    ]
    if not args.full:
        sets += [f"model.{k}={v}" for k, v in REDUCED.items() if k != "max_length"]
        sets.append(f"model.max_length={args.length}")
        if base.task == "conditional":
            sets.append(f"max_input_length={args.length // 2}")
    elif args.length:
        sets.append(f"model.max_length={args.length}")
    if args.as_cuda:
        sets += ["train.precision=bf16", "optim.muon_ns_dtype=bfloat16"]
        if "precision" in {f.name for f in fields(base.encoder)}:  # (older elflow had none)
            sets.append("encoder.precision=bf16")
    sets += args.set
    cfg = apply_overrides(replace(base, preset=args.preset), None, sets)
    return cfg


def _stepper(run):
    """(take step k, the object whose ``accumulate`` makes a step's gradients, the host tensors,
    close): through the trainer's Trainer, or, on purpose, an older elflow's loop function (the
    'before' figures of the results page come from an older checkout with this file copied in)."""
    from elflow.runtime.profiling import optimizer_host_tensors
    from elflow.train import loop
    from elflow.train.step import ELFObjective

    if hasattr(loop, "Trainer"):
        trainer = loop.Trainer(run, ELFObjective(run.cfg))
        host = lambda: [*optimizer_host_tensors(run.optimizer), trainer.stop.flag]
        return trainer.step, trainer.grads, host, trainer.close
    from elflow.runtime.hardware import bf16_autocast
    from elflow.train.step import StepContext

    grads = StepContext(run, ELFObjective(run.cfg), bf16_autocast(run.bf16, run.info.device))
    norm = run.optim.clip_grad_norm

    def step(k):
        loop.optimizer_step(run, grads, k, norm, None)

    return step, grads, lambda: optimizer_host_tensors(run.optimizer), lambda: None


def profile(args) -> dict:
    """Set up the run, take the warm-up steps, count one step; this process's figures."""
    from elflow.runtime.profiling import OpCounter
    from elflow.train.setup import prepare_run

    if args.as_cuda:
        torch.backends.cuda.matmul.allow_tf32 = True
    tmp = Path(tempfile.mkdtemp(prefix="elflow-profile-"))
    data = "pairs" if args.preset in SEQ2SEQ else "text"
    assets = build_assets(tmp, args.encoder_dim, args.encoder_layers, data)
    cfg = run_config(args, assets)
    run = prepare_run(cfg, tmp / "run", "never")
    step, grads, host_tensors, close = _stepper(run)
    weights = [*run.model.parameters(), *run.encoder.parameters()]
    accumulate, opt_step = grads.accumulate, run.optimizer.step
    for k in range(args.warmup - 1):
        step(k)
    # The last warm-up step: what autograd saves (its hooks would add ops to the counted step).
    saved = OpCounter(weights, saved_activations=True, host=host_tensors())

    def saving(k):
        with saved:
            return accumulate(k)

    grads.accumulate = saving
    step(args.warmup - 1)
    host = host_tensors()
    micro, whole, optim = (OpCounter(weights, host=host) for _ in range(3))

    def counted_accumulate(k):
        with micro:
            return accumulate(k)

    def counted_optimizer_step(*a, **kw):
        with optim:
            return opt_step(*a, **kw)

    grads.accumulate = counted_accumulate
    run.optimizer.step = counted_optimizer_step
    # Inside the micro-batches: the frozen encoder, the network's forwards and the backward
    # passes, each counted on its own; what is left is the objective's own work (draws, noising,
    # targets, losses, row selection) and the batch's transfer.
    parts = {name: OpCounter(weights, host=host) for name in ("encoder", "network", "backward")}
    for part in parts.values():
        part.share_weights(micro)
    encoder_forward, network_forward = run.encoder.forward, run.model.forward
    tensor_backward = torch.Tensor.backward

    def counted(name, fn):
        def call(*a, **kw):
            with parts[name]:
                return fn(*a, **kw)

        return call

    run.encoder.forward = counted("encoder", encoder_forward)
    run.model.forward = counted("network", network_forward)
    torch.Tensor.backward = counted("backward", tensor_backward)
    t0 = time.perf_counter()
    try:
        with whole:
            step(args.warmup)
    finally:
        torch.Tensor.backward = tensor_backward
    seconds = time.perf_counter() - t0
    close()
    g = run.geometry
    L = run.cfg.model.max_length
    tokens = g.micro * L * g.accum
    m, w, o = micro.counts, whole.counts, optim.counts
    outside_syncs = w.syncs.copy()
    outside_syncs.subtract(m.syncs)
    return {
        "preset": args.preset,
        "world": run.info.world_size,
        "rank": run.info.rank,
        "parallel": run.cfg.train.parallel,
        "activation_checkpointing": str(run.cfg.train.activation_checkpointing),
        "model": {k: getattr(run.cfg.model, k) for k in ("depth", "hidden_size", "num_heads")},
        "length": L,
        "micro_batch": g.micro,
        "accum": g.accum,
        "encoder_dim": run.encoder.hidden_size,
        "bf16": run.bf16,
        "syncs_per_micro_batch": m.num_syncs / g.accum,
        "sync_reasons_per_micro_batch": {k: v / g.accum for k, v in m.syncs.items()},
        "syncs_per_step_outside": sum(v for v in outside_syncs.values() if v > 0),
        "sync_reasons_outside": {k: v for k, v in outside_syncs.items() if v > 0},
        "sync_sites": dict(w.sync_sites),
        "ops_per_micro_batch": m.num_ops / g.accum,
        "kernels_per_micro_batch": m.kernels / g.accum,
        "ops_per_step_outside": w.num_ops - m.num_ops,
        "ops_per_micro_batch_by_part": {
            **{k: c.counts.num_ops / g.accum for k, c in parts.items()},
            "objective": (m.num_ops - sum(c.counts.num_ops for c in parts.values())) / g.accum,
        },
        "kernels_per_step_outside": w.kernels - m.kernels,
        "flops_per_token": {k: v / tokens for k, v in m.flops.items()},
        "traffic_bytes_per_token": m.traffic_bytes / tokens,
        "activation_traffic_per_token": sum(m.activation_traffic.values()) / tokens,
        "activation_traffic_per_token_by_part": {
            **{k: sum(c.counts.activation_traffic.values()) / tokens for k, c in parts.items()},
            "objective": (
                sum(m.activation_traffic.values())
                - sum(sum(c.counts.activation_traffic.values()) for c in parts.values())
            )
            / tokens,
        },
        "activation_traffic_per_token_by_op": {
            k: v / tokens for k, v in m.activation_traffic.most_common(12)
        },
        "activation_traffic_per_token_by_part_op": {
            k: {op: v / tokens for op, v in c.counts.activation_traffic.most_common(8)}
            for k, c in parts.items()
        },
        "weight_traffic_per_micro_batch": m.weight_traffic_bytes / g.accum,
        "saved_bytes_per_token": {k: v / tokens for k, v in saved.counts.saved_bytes.items()},
        "comm_bytes_per_step": dict(w.comm_bytes),
        "comm_calls_per_step": dict(w.comm_calls),
        "optimizer_flops": dict(o.flops),
        "step_seconds": seconds,
    }


SEQ2SEQ = ("de-en-b", "xsum-b", "de-en-tiny", "summ-tiny")

ELF_B_WIDTH = {"hidden_size": 768, "num_heads": 12}
"""``--compile-modes`` runs at ELF-B's width (``--depth`` blocks)."""


def _profiled_kernels(fn) -> dict:
    """Run ``fn()`` under torch's CPU profiler; the kernels it ran: inductor's generated ones
    (named ``cpp_fused_*`` / ``triton_*``: needs ``cpp.enable_kernel_profile``), the extern
    kernels (matrix products) inductor's graphs call, the eager ops outside any compiled
    graph, and the compiled graphs called."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    fused = extern = eager = graphs = 0
    for e in prof.events():
        name, parent = e.name, e.cpu_parent
        inside = parent is not None and parent.name.startswith("## Call CompiledFxGraph")
        if name.startswith("## Call CompiledFxGraph"):
            graphs += 1
        elif "cpp_fused" in name or "triton_" in name:
            fused += 1
        elif name.startswith("aten::") and inside:
            extern += 1
        elif name.startswith("aten::") and _top_level_aten(e):
            eager += 1
    return {"fused": fused, "extern": extern, "eager": eager, "graph_calls": graphs}


_VIEWS = {"aten::view", "aten::as_strided", "aten::expand", "aten::t", "aten::transpose",
          "aten::reshape", "aten::slice", "aten::select", "aten::unsqueeze", "aten::squeeze",
          "aten::permute", "aten::detach", "aten::alias", "aten::_unsafe_view", "aten::unbind",
          "aten::empty", "aten::empty_strided", "aten::resolve_conj", "aten::resolve_neg",
          "aten::lift_fresh", "aten::split", "aten::chunk", "aten::narrow"}  # fmt: skip
"""aten ops that launch no kernel (views, allocations)."""


def _top_level_aten(event) -> bool:
    """An eager op that computes: not a view, not inside another aten op or a compiled graph."""
    if event.name in _VIEWS:
        return False
    parent = event.cpu_parent
    while parent is not None:
        if parent.name.startswith(("aten::", "## Call CompiledFxGraph")):
            return False
        parent = parent.cpu_parent
    return True


def compile_profile(args, mode: str) -> dict:
    """``train.compile=mode`` at ELF-B width: inductor's metrics and dynamo's counters over the
    first (compiling) step, dynamo's over ``args.warmup`` further steps (recompiles), then one
    step's kernels under the profiler."""
    import torch._inductor.config as inductor_config
    from torch._dynamo.utils import counters
    from torch._inductor import metrics

    from elflow.train.setup import prepare_run

    inductor_config.cpp.enable_kernel_profile = True  # name each generated kernel to the profiler
    torch._logging.set_logs(inductor_metrics=True)  # inductor counts bytes only when it logs them
    inductor_config.fx_graph_cache = False  # compile afresh: a cached graph is not counted
    torch._functorch.config.enable_autograd_cache = False
    torch._dynamo.reset()
    counters.clear()
    tmp = Path(tempfile.mkdtemp(prefix="elflow-profile-"))
    assets = build_assets(tmp, args.encoder_dim, args.encoder_layers, "text")
    args.set = [*args.set, f"train.compile={mode}"]
    args.set += [f"model.{k}={v}" for k, v in {**ELF_B_WIDTH, "depth": args.depth}.items()]
    cfg = run_config(args, assets)
    args.set = args.set[:-4]
    run = prepare_run(cfg, tmp / "run", "never")
    step, grads, _, close = _stepper(run)
    metrics.reset()
    t0 = time.perf_counter()
    step(0)
    compile_s = time.perf_counter() - t0
    kernels, nbytes = metrics.generated_kernel_count, metrics.num_bytes_accessed
    graphs = counters["stats"]["unique_graphs"]
    for k in range(1, args.warmup + 1):
        step(k)
    recompiles = counters["stats"]["unique_graphs"] - graphs
    accumulate, ran = grads.accumulate, {}

    def profiled(k):  # the micro-batches only: not the optimizer, EMA or logging
        out = []
        ran.update(_profiled_kernels(lambda: out.append(accumulate(k))))
        return out[0]

    grads.accumulate = profiled
    before = counters["stats"]["unique_graphs"]
    t0 = time.perf_counter()
    step(args.warmup + 1)
    seconds = time.perf_counter() - t0
    profiled_compiles = counters["stats"]["unique_graphs"] - before
    close()
    g = run.geometry
    tokens = g.micro * run.cfg.model.max_length
    return {
        "mode": mode,
        "model": {k: getattr(run.cfg.model, k) for k in ("depth", "hidden_size", "num_heads")},
        "length": run.cfg.model.max_length,
        "micro_batch": g.micro,
        "accum": g.accum,
        "bf16": run.bf16,
        "generated_kernels": kernels,
        "bytes_accessed_per_token": nbytes / tokens,
        "graphs": graphs,
        "graph_breaks": sum(counters["graph_break"].values()),
        "recompiles": recompiles,
        "steady_steps": args.warmup,
        "profiled_compiles": profiled_compiles,
        "per_micro_batch": {k: v / g.accum for k, v in ran.items()},
        "compile_s": compile_s,
        "step_s": seconds,
    }


def print_compile_table(reports: list[dict]) -> None:
    """The before/after table of ``--compile-modes``."""
    r0 = reports[0]
    m = r0["model"]
    print(
        f"{len(reports)} compile modes at ELF-B width: D {m['hidden_size']}, {m['num_heads']} "
        f"heads, depth {m['depth']} (reduced from 12 for CPU time), L {r0['length']}, "
        f"micro-batch {r0['micro_batch']} x {r0['accum']}, {'bf16' if r0['bf16'] else 'fp32'}, "
        f"torch {torch.__version__}"
    )
    rows_ = [
        ("graphs compiled (dynamo unique_graphs, first step)", lambda r: f"{r['graphs']}"),
        ("graph breaks", lambda r: f"{r['graph_breaks']}"),
        (
            "recompiles over the next steps (new graphs)",
            lambda r: f"{r['recompiles']} in {r['steady_steps']}",
        ),
        ("inductor kernels generated (first step)", lambda r: f"{r['generated_kernels']}"),
        (
            "bytes the generated kernels access per token, one call of each graph",
            lambda r: _fmt_bytes(r["bytes_accessed_per_token"]),
        ),
        (
            "new graphs in the profiled step (its eager ops then include compiling)",
            lambda r: f"{r['profiled_compiles']}",
        ),
        ("compiled-graph calls per micro-batch", lambda r: _n(r, "graph_calls")),
        ("  inductor kernels run per micro-batch", lambda r: _n(r, "fused")),
        ("  extern kernels (matmuls) in the graphs", lambda r: _n(r, "extern")),
        ("  eager ops outside the graphs (encoder included)", lambda r: _n(r, "eager")),
        (
            "kernels run per micro-batch, total",
            lambda r: f"{sum(r['per_micro_batch'][k] for k in ('fused', 'extern', 'eager')):.0f}",
        ),
        ("first step seconds (compiling)", lambda r: f"{r['compile_s']:.1f}"),
        ("profiled step seconds on this CPU", lambda r: f"{r['step_s']:.2f}"),
    ]
    print("| measure | " + " | ".join(f'"{r["mode"]}"' for r in reports) + " |")
    print("|---|" + "---|" * len(reports))
    for name, cell in rows_:
        print(f"| {name} | " + " | ".join(cell(r) for r in reports) + " |")


def _n(report: dict, key: str) -> str:
    return f"{report['per_micro_batch'][key]:.0f}"


def _worker(rank: int, world: int, port: int, args, queue) -> None:
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    torch.set_num_threads(1)
    queue.put(profile(args))


def gather_ranks(args) -> list[dict]:
    """``profile`` in ``args.world`` gloo processes; every rank's figures."""
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [
        ctx.Process(target=_worker, args=(r, args.world, port, args, queue))
        for r in range(args.world)
    ]
    for p in procs:
        p.start()
    results = [queue.get(timeout=1800) for _ in procs]
    for p in procs:
        p.join()
    return sorted(results, key=lambda r: r["rank"])


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return str(n)


def _int(value: float | None) -> str:
    return "—" if value is None else f"{value:.0f}"


def rows(report: dict) -> list[tuple[str, str]]:
    """(measure, value) lines of one report (rank 0's, with every rank's optimiser FLOPs)."""
    out = [
        ("host syncs per micro-batch", f"{report['syncs_per_micro_batch']:g}"),
        ("host syncs per step, outside micro-batches", f"{report['syncs_per_step_outside']:g}"),
        ("aten ops per micro-batch", f"{report['ops_per_micro_batch']:.0f}"),
        ("computing ops (kernels) per micro-batch", _int(report.get("kernels_per_micro_batch"))),
        *(
            (f"  ops in the {part}", f"{n:.0f}")
            for part, n in report.get("ops_per_micro_batch_by_part", {}).items()
        ),
        ("aten ops per step, outside micro-batches", f"{report['ops_per_step_outside']:.0f}"),
        ("computing ops per step, outside", _int(report.get("kernels_per_step_outside"))),
    ]
    fl = report["flops_per_token"]
    total = sum(fl.values()) or 1
    for dtype in sorted(fl):
        out.append(
            (
                f"FLOPs per token in {dtype}",
                f"{fl[dtype] / 1e6:.2f} M ({100 * fl[dtype] / total:.0f}%)",
            )
        )
    traffic = report.get("traffic_bytes_per_token")
    out.append(("elementwise traffic per token", "—" if traffic is None else _fmt_bytes(traffic)))
    act = report.get("activation_traffic_per_token")
    if act is not None:
        out.append(("  on activations (grows with the tokens)", _fmt_bytes(act)))
        for part, n in report.get("activation_traffic_per_token_by_part", {}).items():
            out.append((f"    in the {part}", _fmt_bytes(n)))
        out.append(
            (
                "  on weights, per micro-batch",
                _fmt_bytes(report.get("weight_traffic_per_micro_batch", 0)),
            )
        )
    sb = report["saved_bytes_per_token"]
    total_saved = sum(sb.values()) or 1
    out.append(("saved activations per token", _fmt_bytes(sum(sb.values()))))
    for dtype in sorted(sb):
        out.append((f"  of which {dtype}", f"{100 * sb[dtype] / total_saved:.0f}%"))
    for kind, n in sorted(report["comm_bytes_per_step"].items()):
        calls = report["comm_calls_per_step"].get(kind, 0)
        out.append((f"{kind} payload per rank per step", f"{_fmt_bytes(n)} in {calls} calls"))
    per_rank = report.get("optimizer_flops_per_rank") or [sum(report["optimizer_flops"].values())]
    out.append(
        ("optimiser FLOPs per rank per step", ", ".join(f"{f / 1e9:.2f} G" for f in per_rank))
    )
    out.append(("step seconds on this machine", f"{report['step_seconds']:.2f}"))
    return out


def print_table(reports: list[tuple[str, dict]]) -> None:
    names = [n for n, _ in reports]
    table = [rows(r) for _, r in reports]
    keys = []
    for t in table:
        for k, _ in t:
            if k not in keys:
                keys.append(k)
    print("| measure | " + " | ".join(names) + " |")
    print("|---|" + "---|" * len(names))
    for k in keys:
        vals = [dict(t).get(k, "—") for t in table]
        print(f"| {k} | " + " | ".join(vals) + " |")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="owt-b")
    p.add_argument("--full", action="store_true", help="the preset's full size (a GPU's work)")
    p.add_argument("--length", type=int, default=64, help="sequence length at reduced size")
    p.add_argument("--micro-batch", type=int, default=64)
    p.add_argument("--accum", type=int, default=2, help="micro-batches per step per process")
    p.add_argument("--world", type=int, default=1, help="gloo processes (CPU)")
    p.add_argument("--parallel", default="ddp", choices=("ddp", "fsdp2"))
    p.add_argument("--device", default="cpu")
    p.add_argument("--encoder-dim", type=int, default=64, help="the random T5 encoder's width")
    p.add_argument("--encoder-layers", type=int, default=2)
    p.add_argument("--warmup", type=int, default=2, help="optimizer steps before the counted one")
    p.add_argument("--as-cuda", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--set", action="append", default=[], help="KEY=VALUE config overrides")
    p.add_argument("--json", help="write the figures to this file")
    p.add_argument("--compare", nargs="+", help="print a table of these JSON files and exit")
    p.add_argument(
        "--compile-modes",
        nargs="+",
        choices=("blocks", "step"),
        help="instead: inductor's kernels and bytes, dynamo's graph breaks and recompiles of "
        "these train.compile modes at ELF-B width, side by side",
    )
    p.add_argument("--depth", type=int, default=2, help="blocks with --compile-modes")
    args = p.parse_args(argv)
    if args.compile_modes:
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        reports = [compile_profile(args, mode) for mode in args.compile_modes]
        print_compile_table(reports)
        if args.json:
            Path(args.json).write_text(json.dumps(reports, indent=1))
        return
    if args.compare:
        print_table([(Path(f).stem, json.loads(Path(f).read_text())) for f in args.compare])
        return
    if args.full:
        args.encoder_dim, args.encoder_layers = 512, 6
        args.length = args.length if args.length != 64 else 0
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    ranks = gather_ranks(args) if args.world > 1 else [profile(args)]
    report = ranks[0]
    report["optimizer_flops_per_rank"] = [sum(r["optimizer_flops"].values()) for r in ranks]
    print(
        f"{report['preset']}: depth {report['model']['depth']}, D {report['model']['hidden_size']},"
        f" L {report['length']}, E {report['encoder_dim']}, micro-batch {report['micro_batch']} x "
        f"{report['accum']}, {report['world']} process(es) {report['parallel']}, "
        f"{'bf16' if report['bf16'] else 'fp32'}, torch {torch.__version__}"
    )
    print_table([("this step", report)])
    for k, v in report["sync_reasons_per_micro_batch"].items():
        print(f"  sync per micro-batch: {v:g} x {k}")
    for k, v in report["sync_reasons_outside"].items():
        print(f"  sync per step outside: {v:g} x {k}")
    for k, v in report["sync_sites"].items():
        print(f"  syncs at {k}: {v}")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    sys.exit(main())
