"""2-process FSDP2 run of a tiny ELF with ShardedMuon + Adam (and torch.optim.Muon on shards).

Run as ``python -m tests.dist.fsdp_muon OUT.pt`` from the repository root; it spawns 2 gloo
processes on a CPU device mesh, trains 3 steps on the same global batches as
:func:`train_reference`, and rank 0 writes the gathered full weights and EMA of each variant to OUT.
The shared helpers (model, batches, loss, step loop) are imported by tests/train/test_optim.py,
so the 1-process reference runs exactly the same code (tests/dist/gloo_work.py launches it with
muon_work's work).
"""

from __future__ import annotations

import sys

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from elflow.config import elf_tiny
from elflow.model import ELF, build_model
from elflow.train.ema import EMA
from elflow.train.optim import OptimConfig, build_optimizer, learning_rate, set_lr
from tests.dist.fork_ranks import fork_gloo

WORLD_SIZE = 2
STEPS = 3
GLOBAL_BATCH = 8
LENGTH = 8
# NOTE: bf16 Newton–Schulz (torch.optim.Muon's) turns the ~1e-7 gradient differences of another
# reduction order into ~1e-3 weight differences (see ShardedMuon's docstring), so the 1e-5
# equality check runs with float32 Newton–Schulz; the bf16 runs are reported, not bounded.
CFG_BF16 = OptimConfig(lr=1e-2, warmup_steps=1, clip_grad_norm=1.0)
CFG_FP32 = OptimConfig(lr=1e-2, warmup_steps=1, clip_grad_norm=1.0, muon_ns_dtype="float32")
EMA_DECAY = 0.9
DIRECT_SHAPES = ((12, 5), (5, 12), (7, 7))  # uneven row shards on 2 ranks
DIRECT_LR = 0.02


def make_model() -> ELF:
    torch.manual_seed(0)
    return build_model(elf_tiny(encoder_dim=8, vocab_size=20, max_length=LENGTH))


def make_batch(step: int) -> dict[str, Tensor]:
    """The global batch of one step (every process draws the same one and keeps its rows)."""
    g = torch.Generator().manual_seed(1000 + step)
    B, L, E, V = GLOBAL_BATCH, LENGTH, 8, 20
    return {
        "x_in": torch.randn(B, L, 2 * E, generator=g),
        "target": torch.randn(B, L, E, generator=g),
        "tokens": torch.randint(0, V, (B, L), generator=g),
        "t": torch.rand(B, generator=g),
        "w": torch.rand(B, generator=g) * 3,
        "gate": (torch.rand(B, generator=g) < 0.5).float(),
    }


def loss_sum(model: nn.Module, batch: dict[str, Tensor]) -> Tensor:
    """Σ (L2 + CE) over the rows given; divide by the GLOBAL token count for the mean."""
    x_pred, hidden = model(batch["x_in"], batch["t"], batch["w"], batch["gate"])
    logits = model.decode_logits(hidden)  # (B, L, V)
    l2 = (x_pred - batch["target"]).square().sum()
    ce = F.cross_entropy(logits.flatten(0, 1), batch["tokens"].flatten(), reduction="sum")
    return l2 + ce


def train(model: nn.Module, cfg: OptimConfig, sharded: bool, rank: int = 0, world: int = 1) -> EMA:
    """STEPS optimizer steps on this rank's rows of each global batch; returns the EMA."""
    opt = build_optimizer(model, cfg, sharded=sharded)
    ema = EMA(model, EMA_DECAY, warmup=True)
    rows = GLOBAL_BATCH // world
    for step in range(STEPS):
        set_lr(opt, learning_rate(cfg, step, STEPS, GLOBAL_BATCH))
        batch = {k: v[rank * rows : (rank + 1) * rows] for k, v in make_batch(step).items()}
        # The global mean's denominator, so the per-rank losses sum to the 1-process loss.
        # NOTE: FSDP2 reduce-scatters with a MEAN over ranks, so the summed gradient is divided by
        # the world size; multiplying the local loss by it undoes that (the alternative is
        # model.set_gradient_divide_factor(1.0) on every FSDP module).
        loss = loss_sum(model, batch) / (GLOBAL_BATCH * LENGTH) * world
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.clip_grad_norm)
        opt.step()
        opt.zero_grad(set_to_none=True)
        ema.update(model)
    return ema


def full_weights(model: nn.Module) -> dict[str, Tensor]:
    from torch.distributed.tensor import DTensor

    return {
        n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
        for n, p in model.named_parameters()
    }


def direct_problem() -> tuple[list[Tensor], list[list[Tensor]]]:
    """Full initial matrices and per-step full gradients for the DTensor-level Muon check."""
    g = torch.Generator().manual_seed(7)
    params = [torch.randn(shape, generator=g) for shape in DIRECT_SHAPES]
    grads = [[torch.randn(shape, generator=g) for shape in DIRECT_SHAPES] for _ in range(STEPS)]
    return params, grads


def run_direct(make_param, make_grad, opt_cls: type) -> list[Tensor]:
    """STEPS Muon steps with exactly the given gradients (no reduction order involved)."""
    init, grads = direct_problem()
    params = [nn.Parameter(make_param(p)) for p in init]
    opt = opt_cls(params, lr=DIRECT_LR, weight_decay=0.0)
    for step in range(STEPS):
        for p, grad in zip(params, grads[step], strict=True):
            p.grad = make_grad(grad)
        opt.step()
    return [p.detach() for p in params]


def _direct(mesh) -> dict[str, object]:
    from torch.distributed.tensor import Shard, distribute_tensor

    from elflow.train.muon import ShardedMuon

    def shard(t: Tensor) -> Tensor:
        return distribute_tensor(t, mesh, [Shard(0)])

    out: dict[str, object] = {}
    for name, cls in (("sharded_muon", ShardedMuon), ("torch_muon", torch.optim.Muon)):
        try:
            out[name] = [p.full_tensor() for p in run_direct(shard, shard, cls)]
        except Exception as e:
            out[name] = f"{type(e).__name__}: {e}".splitlines()[0]
    return out


def _work(rank: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (WORLD_SIZE,))
    results: dict[str, dict] = {"direct": _direct(mesh)}
    # "torch_muon" is the footgun of ELF_SPEC §10: torch.optim.Muon handed the sharded DTensors.
    variants = (
        ("sharded_fp32", CFG_FP32, True),
        ("sharded_bf16", CFG_BF16, True),
        ("torch_muon", CFG_BF16, False),
    )
    for variant, cfg, sharded in variants:
        model = make_model()
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        try:
            ema = train(model, cfg, sharded=sharded, rank=rank, world=WORLD_SIZE)
        except Exception as e:  # report, do not hang the other variant
            results[variant] = {"error": f"{type(e).__name__}: {e}".splitlines()[0]}
            continue
        # EMA state round trip on DTensor shadows (local shards), then the collective gather.
        ema2 = EMA(model, 0.5)
        ema2.load_state_dict(ema.state_dict())
        results[variant] = {
            "weights": full_weights(model),
            "ema": ema.state_dict_for_save(),
            "ema_reloaded": ema2.state_dict_for_save(),
            "ema_updates": ema2.num_updates,
            "local_shapes": {n: tuple(p.to_local().shape) for n, p in model.named_parameters()},
        }
    return results


def main(out: str) -> None:
    fork_gloo(_work, WORLD_SIZE, out)


if __name__ == "__main__":
    main(sys.argv[1])
