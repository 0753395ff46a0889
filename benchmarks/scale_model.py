"""Predicted step time and MFU of the paper's presets on H100 clusters, worked out on paper.

Usage:
    python benchmarks/scale_model.py                 # owt-b, owt-m, owt-l on 8 and 32 H100s
    python benchmarks/scale_model.py --json scale.json

Per GPU and optimizer step (global batch 512 rows of L 1024, ``512 / W`` rows per GPU in
micro-batches that fit its memory):

    t = t_matmul + t_elementwise + t_optimizer + t_comm (exposed) + t_syncs

- **t_matmul**: the executed FLOPs of :mod:`elflow.train.flops` (docs/training.md, "FLOPs and
  MFU": flash attention's recomputed product included) by the dtype they run in, at ``GEMM_EFF``
  of the dtype's peak. *Before*: the frozen encoder, the input projections, embedders and heads
  in plain fp32 (TF32 was never switched on); *after*: the encoder in bf16, those parts in TF32.
  The blocks are bf16 in both.
- **t_elementwise**: everything that is not a matrix product (norms, RoPE, casts, the objective,
  the optimizers' elementwise passes...), memory-bound. Calibrated on the one GPU measurement
  there is (docs/results/2026-12-04-gpu-check-h200.md): ELF-B at L 1024 on one H200 took
  ``MEASURED_STEP_S`` per 64-row step (eager; and with per-block compile), of which the matrix
  products' share is t_matmul at the same efficiency; the rest, per row, scales with the model's
  depth x width (activation traffic) and with 1 / HBM bandwidth. *Before* multiplies it by the
  ratio of the counted elementwise traffic per token, before against after
  (``benchmarks/step_profile.py`` on the same reduced model).
- **t_optimizer**: Newton–Schulz FLOPs per GPU (before: every matrix on every GPU, fp32; after:
  the largest share of :func:`elflow.train.muon.assign_owners`, bf16) at ``NS_EFF``.
- **t_comm**: payload bytes per GPU (DDP: fp32 gradients once a step; FSDP2: parameter
  all-gathers per micro-batch for forward and backward, gradient reduce-scatters, Muon's
  exchange) through ring algorithms at the link's bus bandwidth (NVLink inside a node,
  InfiniBand between nodes), ``OVERLAP`` of the gradient and parameter traffic hidden behind
  compute; Muon's exchange after the backward is exposed.
- **t_syncs**: host syncs per step (counted by the step profile) x ``SYNC_S``.

MFU is model FLOPs over the bf16 peak, HFU executed FLOPs over it. The last column, the ceiling,
is the MFU if the elementwise work took no time at all, everything else as predicted: what
fusing it away could give at this GEMM efficiency. Every constant is printed with the result.
Figures are predictions, not measurements.
"""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import dataclass

# --- hardware (vendor datasheets; dense, no sparsity) ------------------------------------------


@dataclass(frozen=True)
class GPU:
    name: str
    bf16: float  # FLOP/s
    tf32: float
    fp32: float
    hbm: float  # bytes/s
    memory: float  # bytes
    nvlink_bus: float  # bytes/s a ring collective achieves inside a node
    ib_bus: float  # bytes/s per GPU between nodes (one 400 Gb/s NIC per GPU)


H100 = GPU("H100 SXM", 989e12, 494.7e12, 66.9e12, 3.35e12, 80e9, 360e9, 45e9)
H200 = GPU("H200", 989e12, 494.7e12, 66.9e12, 4.8e12, 141e9, 360e9, 45e9)

# --- assumptions ---------------------------------------------------------------------------------

GEMM_EFF = 0.45
"""Share of the peak that the step's matrix products reach (mixed shapes, attention included):
measured in the profiled H200 step (~52 TFLOP of products in ~115 ms of their kernels)."""
NS_EFF = 0.40
"""Share of the peak that Newton–Schulz's small square products reach."""
OVERLAP = 0.7
"""Share of gradient all-reduce / FSDP2 all-gather time hidden behind compute."""
SYNC_S = 100e-6
"""Cost of one host sync: the device queue drains and the host's next launches are exposed."""
NODE = 8
"""GPUs per node."""
MEMORY_USE = 0.85
"""Share of GPU memory the micro-batch may fill."""

# --- calibration: measured on one H200 (docs/results/2026-12-04-gpu-check-h200.md) --------------

MEASURED_STEP_S = {"eager": 0.392, "compile": 0.260}
"""owt-b at L 1024, 64 rows in two micro-batches of 32, bf16, one H200 (gpu_check.py)."""
MEASURED_MEMORY = 24.8e9
"""Its peak allocated memory (micro-batch 32 x 1024 tokens, eager)."""
MEASURED_ROWS = 64

# --- counted on a CPU (docs/results/2026-12-04-training-step-profile.md) -----------------------

SYNCS_PER_STEP = {"before": 2 * 13.5 + 1, "after": 0.0}
"""Host syncs per optimizer step of two micro-batches (steady state; logging every 10 steps
adds 2 reads per 10 steps, 0.2 a step, counted with the after figure)."""
TRAFFIC_RATIO = 1.0
"""Elementwise traffic per token, before / after: the step profile counts the same within the
step-to-step noise (562 against 648 KiB a token at one micro-batch, 587 against 524 at two; the
fusions that cut it, F.rms_norm's kernel and compile, act on CUDA only)."""


def model_flops(preset: str) -> dict:
    """Per-row FLOPs of ``preset`` split as the dtypes see them (ELF-B's shapes for owt-b...)."""
    from transformers import T5Config

    from elflow.config.run_presets import preset as get
    from elflow.train.flops import (
        encoder_flops_per_token,
        executed_row_flops,
        model_row_flops,
        pass_flops,
    )
    from elflow.train.muon import newton_schulz_flops

    cfg = get(preset)
    m, o = cfg.model, cfg.objective
    L = m.max_length
    t5 = T5Config(d_model=512, d_kv=64, num_heads=8, d_ff=2048, num_layers=6)
    p = pass_flops(m, L)
    sc, dec = o.self_cond_prob * (1 - o.decoder_prob), o.decoder_prob
    blocks = p.blocks * (3 + sc) + 0.5 * p.attention  # flash attention's recomputed product
    rest = (p.body - p.blocks) * (3 + sc) - p.first_layers + 3 * dec * p.head
    encoder = encoder_flops_per_token(t5, L) * L
    import torch

    with torch.device("meta"):
        from elflow.model import ELF

        net = ELF(m)
    shapes = tuple(tuple(q.shape) for q in net.parameters() if q.ndim == 2)
    params = sum(q.numel() for q in net.parameters())
    return {
        "cfg": cfg,
        "blocks": blocks,
        "rest": rest,
        "encoder": encoder,
        "model_row": model_row_flops(m, o, L, encoder / L),
        "executed_row": executed_row_flops(m, o, L, encoder / L),
        "shapes": shapes,
        "params": params,
        "muon_params": sum(math.prod(s) for s in shapes),
        "ns_total": sum(newton_schulz_flops(s, 5) for s in shapes),
        "width_depth": m.hidden_size * m.depth,
    }


def ring(bytes_: float, world: int, bus: float, factor: float) -> float:
    """Seconds of a ring collective: ``factor`` (W - 1) / W x bytes / bus bandwidth."""
    return 0.0 if world == 1 else factor * (world - 1) / world * bytes_ / bus


def predict(
    preset: str,
    world: int,
    when: str,
    gpu: GPU = H100,
    mode: str = "eager",
    traffic_ratio: float = TRAFFIC_RATIO,
) -> dict:
    """The predicted step of ``preset`` on ``world`` GPUs ``when`` (before / after)."""
    from elflow.train.muon import assign_owners, newton_schulz_flops

    f = model_flops(preset)
    b = model_flops("owt-b")
    rows = 512 // world
    after = when == "after"
    # Memory: activations per row scale with depth x width (measured for ELF-B eager).
    states = 16 * b["params"]  # fp32 weights, grads, two Adam moments / momentum, EMA
    act_row = (MEASURED_MEMORY - states) / (MEASURED_ROWS / 2) * f["width_depth"] / b["width_depth"]
    micro = max(1, min(rows, int((MEMORY_USE * gpu.memory - 16 * f["params"]) // act_row)))
    accum = math.ceil(rows / micro)
    # Matrix products.
    plain = 0 if after else 1
    rest_peak = gpu.tf32 if after else gpu.fp32
    enc_peak = gpu.bf16 if after else gpu.fp32
    t_matmul = (
        rows * (f["blocks"] / gpu.bf16 + f["rest"] / rest_peak + f["encoder"] / enc_peak) / GEMM_EFF
    )
    # Elementwise: the H200 measurement's residual per row, scaled.
    b_matmul = (
        MEASURED_ROWS
        * (b["blocks"] / H200.bf16 + b["rest"] / H200.tf32 + b["encoder"] / H200.bf16)
        / GEMM_EFF
    )
    residual_row = (MEASURED_STEP_S[mode] - b_matmul) / MEASURED_ROWS
    scale = f["width_depth"] / b["width_depth"] * H200.hbm / gpu.hbm
    t_elem = rows * residual_row * scale * (1.0 if after else traffic_ratio)
    # Optimizer: Newton–Schulz, plus Adam/EMA/Muon elementwise passes (~60 bytes a parameter).
    if after:
        owners = assign_owners(f["shapes"], world)
        loads = [0.0] * world
        for s, r in zip(f["shapes"], owners, strict=True):
            loads[r] += newton_schulz_flops(s, 5)
        t_ns = max(loads) / (gpu.bf16 * NS_EFF)
    else:
        t_ns = f["ns_total"] / (gpu.fp32 * NS_EFF)
    t_opt = t_ns + 60 * f["params"] / gpu.hbm
    # Communication.
    bus = gpu.nvlink_bus if world <= NODE else gpu.ib_bus
    fsdp = preset == "owt-l"
    P, Pm = f["params"], f["muon_params"]
    if fsdp:
        gather = 2 * (2 if after else 4) * P  # forward and backward all-gathers, per micro-batch
        scatter = 4 * P * (1 if after else accum)  # reduce-scatter: last micro-batch / every one
        hidden = ring(gather * accum, world, bus, 1) + ring(scatter, world, bus, 1)
        muon = ring(2 * 2 * Pm, world, bus, 1) if after else 0.0  # two all-to-alls of bf16
    else:
        hidden = ring(4 * P, world, bus, 2)  # fp32 gradient all-reduce, once a step
        muon = ring(2 * Pm, world, bus, 1) if after else 0.0  # all-gather of bf16 updates
    t_comm = (1 - OVERLAP) * hidden + muon
    syncs = SYNCS_PER_STEP[when] * accum / 2 + (0 if after else 1)
    t_sync = syncs * SYNC_S
    t = t_matmul + t_elem + t_opt + t_comm + t_sync
    mfu = rows * f["model_row"] / t / gpu.bf16
    hfu = rows * f["executed_row"] / t / gpu.bf16
    # The ceiling: the MFU if the elementwise work took no time at all (fused into the products).
    ceiling = rows * f["model_row"] / (t - t_elem) / gpu.bf16
    return {
        "preset": preset,
        "world": world,
        "when": when,
        "mode": mode,
        "micro_batch": micro,
        "accum": accum,
        "t_matmul": t_matmul,
        "t_elementwise": t_elem,
        "t_optimizer": t_opt,
        "t_comm": t_comm,
        "t_syncs": t_sync,
        "step_s": t,
        "mfu": mfu,
        "hfu": hfu,
        "mfu_without_elementwise": ceiling,
        "plain_fp32_parts": bool(plain),
    }


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--traffic-ratio",
        type=float,
        default=TRAFFIC_RATIO,
        help="elementwise traffic per token, before / after (benchmarks/step_profile.py)",
    )
    p.add_argument("--gpus", default="8,32", help="cluster sizes (GPUs)")
    p.add_argument("--json", help="write the predictions to this file")
    args = p.parse_args(argv)
    worlds = [int(w) for w in args.gpus.split(",")]
    if any(w < 1 or 512 % w for w in worlds):
        p.error(f"--gpus: each must divide the global batch 512, got {args.gpus}")
    print(
        f"assumptions: GEMM {GEMM_EFF:.0%} of peak, Newton-Schulz {NS_EFF:.0%}, {OVERLAP:.0%} "
        f"of gradient/parameter traffic hidden, {SYNC_S * 1e6:.0f} us per host sync, "
        f"{NODE} GPUs a node; elementwise calibrated on one H200 (ELF-B, L 1024: "
        f"{MEASURED_STEP_S['eager']} s eager, {MEASURED_STEP_S['compile']} s compiled per 64 "
        f"rows), before x{args.traffic_ratio:.2f} (counted traffic ratio)"
    )
    out = []
    print(
        f"{'preset':<6} {'GPUs':>4} {'code':<15} {'micro':>5} {'matmul':>7} {'elemwise':>8} "
        f"{'optim':>6} {'comm':>6} {'syncs':>6} {'step s':>7} {'MFU':>6} {'HFU':>6} {'ceiling':>9}"
    )
    for preset in ("owt-b", "owt-m", "owt-l"):
        for world in worlds:
            for when, mode in (("before", "eager"), ("after", "eager"), ("after", "compile")):
                r = predict(preset, world, when, H100, mode, args.traffic_ratio)
                out.append(r)
                label = when + (" +compile" if mode == "compile" else "")
                print(
                    f"{preset:<6} {world:>4} {label:<15} {r['micro_batch']:>2}x{r['accum']:<2} "
                    f"{r['t_matmul']:>7.3f} {r['t_elementwise']:>8.3f} {r['t_optimizer']:>6.3f} "
                    f"{r['t_comm']:>6.3f} {r['t_syncs']:>6.3f} {r['step_s']:>7.3f} "
                    f"{100 * r['mfu']:>5.1f}% {100 * r['hfu']:>5.1f}% "
                    f"{100 * r['mfu_without_elementwise']:>8.1f}%"
                )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
