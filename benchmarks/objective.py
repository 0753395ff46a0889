"""Time the training objective's forward + backward: efficient vs reference procedure.

Usage:
    python benchmarks/objective.py                      # ELF-B (E 512, V 32100, L 128, B 8) + small
    python benchmarks/objective.py --sizes small --steps 20

For each size both procedures run on the same batch and the same draws (a fixed seed; the branch
draws are binomial, so each step differs), and the script asserts that they give the same loss.
It reports ms/step, tokens/s, the FLOPs of one step (counted with torch's FlopCounterMode),
the achieved FLOP/s, and the machine's measured fp32 matmul peak in the same run.
"""

from __future__ import annotations

import argparse
import json
import time

import torch
from torch.utils.flop_counter import FlopCounterMode

from elflow.config import ObjectiveConfig, model_preset
from elflow.model import build_model, count_parameters
from elflow.objective import Batch, elf_loss
from elflow.train.forward import TrainForward
from elflow.train.objective_draws import sample_draws

SIZES = {
    # name: (model preset, E, V, L, B)
    "elf-b": ("elf-b", 512, 32100, 128, 8),
    "small": ("elf-small", 384, 30522, 64, 64),
}


def matmul_peak(n: int = 2048, repeats: int = 10) -> float:
    """Measured fp32 matmul FLOP/s (best of ``repeats``)."""
    a, b = torch.randn(n, n), torch.randn(n, n)
    a @ b
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - t0)
    return 2 * n**3 / best


def make_batch(E: int, V: int, L: int, B: int, g: torch.Generator) -> Batch:
    return Batch(
        x=torch.randn(B, L, E, generator=g),
        input_ids=torch.randint(0, V, (B, L), generator=g),
        attention_mask=torch.ones(B, L),
    )


def run_size(name: str, steps: int, seed: int) -> dict:
    preset, E, V, L, B = SIZES[name]
    torch.manual_seed(seed)
    model = build_model(model_preset(preset, encoder_dim=E, vocab_size=V, max_length=L))
    with torch.no_grad():  # a non-zero flow head, as after some training
        torch.nn.init.normal_(model.final_layer.linear.weight, std=0.02)
    model.train()
    cfg = ObjectiveConfig()
    batch = make_batch(E, V, L, B, torch.Generator().manual_seed(seed))
    draws = [
        sample_draws(B, L, E, cfg, torch.Generator().manual_seed(seed + 1 + i))
        for i in range(steps + 1)
    ]

    def step(procedure: str, d) -> float:
        model.zero_grad(set_to_none=True)
        out = elf_loss(TrainForward(model), batch, d, cfg, procedure)
        out.loss.backward()
        return out.loss.item()

    result = {"size": name, "params": count_parameters(model), "E": E, "V": V, "L": L, "B": B}
    procedures = ("reference", "efficient")
    losses: dict[str, list[float]] = {p: [] for p in procedures}
    seconds = dict.fromkeys(procedures, 0.0)
    flops = dict.fromkeys(procedures, 0)
    for procedure in procedures:
        step(procedure, draws[0])  # warm-up
        for d in draws[1:3]:
            with FlopCounterMode(display=False) as counter:
                step(procedure, d)
            flops[procedure] += counter.get_total_flops() // 2
    # Interleave the procedures step by step so that drift in machine load hits both alike.
    for d in draws[1:]:
        for procedure in procedures:
            t0 = time.perf_counter()
            losses[procedure].append(step(procedure, d))
            seconds[procedure] += time.perf_counter() - t0
    for procedure in procedures:
        dt = seconds[procedure] / steps
        result[procedure] = {
            "ms_per_step": 1e3 * dt,
            "tokens_per_s": B * L / dt,
            "gflop_per_step": flops[procedure] / 1e9,
            "achieved_gflops": flops[procedure] / dt / 1e9,
        }
    torch.testing.assert_close(
        torch.tensor(losses["efficient"]), torch.tensor(losses["reference"]), rtol=1e-5, atol=1e-6
    )
    result["ratio"] = result["efficient"]["ms_per_step"] / result["reference"]["ms_per_step"]
    result["decoder_rows"] = sum(int(d.decoder_active.sum()) for d in draws[1:])
    result["sc_rows"] = sum(
        int((d.use_self_cond.bool() & ~d.decoder_active.bool()).sum()) for d in draws[1:]
    )
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="elf-b,small", help=f"comma list of {sorted(SIZES)}")
    parser.add_argument("--steps", type=int, default=10, help="timed steps per procedure (>= 10)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--json", help="also write the results to this file")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    peak = matmul_peak()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, fp32")
    print(f"measured fp32 matmul peak: {peak / 1e9:.1f} GFLOP/s")
    results = []
    for name in args.sizes.split(","):
        r = run_size(name, args.steps, args.seed)
        results.append(r)
        print(
            f"\n{name}: {r['params'] / 1e6:.1f}M params, E {r['E']}, V {r['V']}, L {r['L']}, "
            f"B {r['B']}; {args.steps} steps: {r['decoder_rows']} decoder rows, "
            f"{r['sc_rows']} self-conditioned rows of {args.steps * r['B']}"
        )
        print(f"{'procedure':<10} {'ms/step':>9} {'tok/s':>9} {'GFLOP/step':>11} {'GFLOP/s':>9}")
        for proc in ("reference", "efficient"):
            p = r[proc]
            print(
                f"{proc:<10} {p['ms_per_step']:>9.1f} {p['tokens_per_s']:>9.0f} "
                f"{p['gflop_per_step']:>11.1f} {p['achieved_gflops']:>9.1f} "
                f"({100 * p['achieved_gflops'] * 1e9 / peak:.0f}% of peak)"
            )
        print(f"efficient / reference time: {r['ratio']:.2f}  (losses equal: yes)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"peak_gflops": peak / 1e9, "results": results}, f, indent=2)


if __name__ == "__main__":
    main()
