"""2 gloo processes share ShardedMuon's Newton–Schulz work on replicated (DDP-style) parameters.

Run as ``python -m tests.dist.muon_work OUT.pt`` from the repository root: every process holds
the same tiny ELF and the same gradients, steps ShardedMuon(distributed=True) twice (fp32 and bf16
Newton–Schulz), and rank 0 writes the weights and each rank's counted Newton–Schulz FLOPs. The
test compares them with one process doing all the work.
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist
from torch.utils.flop_counter import FlopCounterMode

from elflow.train.muon import ShardedMuon
from tests.dist.fork_ranks import fork_gloo
from tests.dist.fsdp_muon import make_model

WORLD_SIZE = 2
STEPS = 2


def gradients(model, step: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return [torch.randn(p.shape, generator=g) for p in model.parameters() if p.ndim == 2]


def run(ns_dtype: torch.dtype, distributed: bool) -> tuple[dict[str, torch.Tensor], int]:
    """STEPS Muon steps on the tiny model's matrices; (weights, this process's NS FLOPs)."""
    model = make_model()
    params = [p for p in model.parameters() if p.ndim == 2]
    opt = ShardedMuon(params, lr=0.02, weight_decay=0.0, ns_dtype=ns_dtype, distributed=distributed)
    flops = 0
    for step in range(STEPS):
        for p, g in zip(params, gradients(model, step), strict=True):
            p.grad = g
        with FlopCounterMode(display=False) as counter:
            opt.step()
        flops += counter.get_total_flops()
    weights = {n: p.detach().clone() for n, p in model.named_parameters() if p.ndim == 2}
    return weights, flops


def _work(rank: int) -> dict:
    results = {}
    for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        weights, flops = run(dtype, distributed=True)
        every = [None] * WORLD_SIZE
        dist.all_gather_object(every, flops)
        results[name] = {"weights": weights, "flops": every}
    return results


def main(out: str) -> None:
    fork_gloo(_work, WORLD_SIZE, out)


if __name__ == "__main__":
    main(sys.argv[1])
