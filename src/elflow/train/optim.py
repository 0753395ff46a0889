"""The optimiser: Muon for 2-D weight matrices, Adam(W) for everything else, the lr schedule.

Implements the "Optimiser" paragraph of ELF_SPEC §3: Muon (momentum 0.95, Nesterov, 5 Newton–Schulz
steps, update scaled by sqrt(max(1, fan_out/fan_in)), no weight decay) on every 2-D weight, Adam on
biases, norms and token parameters, one shared lr = blr · global_batch / 256 with a linear warm-up.
``torch.optim.Muon`` is used as is on plain tensors; on FSDP2 shards, and for fp32 Newton–Schulz,
:class:`elflow.train.muon.ShardedMuon`.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from elflow.config.optim_config import OptimConfig
from elflow.errors import ELFError, require
from elflow.runtime.hardware import fast_bf16
from elflow.train.muon import ShardedMuon


def peak_lr(cfg: OptimConfig, global_batch: int) -> float:
    """The lr after warm-up: ``cfg.lr`` if set, else blr * global_batch / 256 (ELF_SPEC §3)."""
    require(global_batch > 0, f"global batch must be positive, got {global_batch}")
    return cfg.lr if cfg.lr > 0 else cfg.blr * global_batch / 256


def learning_rate(cfg: OptimConfig, step: int, total_steps: int, global_batch: int) -> float:
    """The lr for the optimizer step with 0-based index ``step``.

    Linear warm-up from 0 (step 0 has lr 0, step ``warmup_steps`` reaches the peak), then constant,
    cosine from the peak down to ``min_lr_ratio * peak`` at ``total_steps``, or (wsd) constant
    until ``total_steps - decay_steps`` and linear down to ``min_lr_ratio * peak`` at
    ``total_steps``. The schedule depends only on the step, so a resumed run follows it exactly.
    """
    peak = peak_lr(cfg, global_batch)
    if step < cfg.warmup_steps:
        return peak * step / cfg.warmup_steps
    if cfg.schedule == "constant":
        return peak
    floor = cfg.min_lr_ratio * peak
    if cfg.schedule == "wsd":
        start = max(cfg.warmup_steps, total_steps - cfg.decay_steps)
        progress = min(1.0, max(0, step - start) / max(1, total_steps - start))
        return peak + (floor - peak) * progress
    span = max(1, total_steps - cfg.warmup_steps)
    progress = min(1.0, (step - cfg.warmup_steps) / span)
    return floor + (peak - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))


def param_groups(model: nn.Module) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
    """Split trainable parameters into (Muon set, Adam set).

    The Muon set is every 2-D tensor: all nn.Linear weights, including the timestep embedders and
    the decoder head (ELF_SPEC §3). Biases, norm scales and the (1, n, D) prefix-token parameters
    go to Adam.
    """
    muon, adam = [], []
    for p in model.parameters():
        if p.requires_grad:
            (muon if p.ndim == 2 else adam).append(p)
    return muon, adam


class CombinedOptimizer:
    """Several optimizers stepped as one: Muon for the matrices, Adam(W) for the rest.

    ``param_groups`` lists the sub-optimizers' groups (the same dict objects), so setting
    ``group["lr"]`` on each of them sets the shared lr. ``state_dict()`` is a dict of the
    sub-optimizers' state dicts by name; it survives ``torch.load(weights_only=True)``.
    """

    def __init__(self, optimizers: dict[str, torch.optim.Optimizer]) -> None:
        self.optimizers = optimizers

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return [g for opt in self.optimizers.values() for g in opt.param_groups]

    @torch.no_grad()
    def step(self) -> None:
        for opt in self.optimizers.values():
            opt.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for opt in self.optimizers.values():
            opt.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict[str, Any]:
        return {name: opt.state_dict() for name, opt in self.optimizers.items()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if set(state) != set(self.optimizers):
            raise ELFError(
                f"optimizer state has parts {sorted(state)} but this optimizer has "
                f"{sorted(self.optimizers)}; was it saved with another optim.optimizer?"
            )
        for name, opt in self.optimizers.items():
            opt.load_state_dict(state[name])


def set_lr(optimizer: CombinedOptimizer | torch.optim.Optimizer, lr: float) -> None:
    """Set the shared lr on every parameter group (Muon scales it per matrix internally)."""
    for group in optimizer.param_groups:
        group["lr"] = lr


def resolve_ns_dtype(name: str, device: torch.device) -> str:
    """``optim.muon_ns_dtype`` on ``device``: 'auto' is bfloat16 where bf16 is fast (CUDA, a CPU
    with native bf16; emulated bf16 makes each step ~8x slower), else float32."""
    if name != "auto":
        return name
    return "bfloat16" if fast_bf16(device) else "float32"


def build_optimizer(
    model: nn.Module, cfg: OptimConfig, sharded: bool = False, distributed: bool = False
) -> CombinedOptimizer | torch.optim.Optimizer:
    """The optimiser for ``model`` (ELF_SPEC §3), created with lr = the peak lr at batch 256.

    NOTE: call :func:`set_lr` with :func:`learning_rate` before every step; the initial lr is a
    placeholder. ``sharded=True`` is required when the parameters are FSDP2 DTensors: it swaps
    ``torch.optim.Muon`` (silently wrong on shards, ELF_SPEC §10) for :class:`ShardedMuon`, which
    is also used for ``muon_ns_dtype="float32"`` and, with ``distributed=True`` (replicated
    parameters under DDP), to share the Newton–Schulz work among the processes.
    """
    lr = peak_lr(cfg, 256)
    betas = (cfg.beta1, cfg.beta2)
    muon_params, adam_params = param_groups(model)
    if cfg.optimizer == "adamw":
        groups = [
            {"params": muon_params, "weight_decay": cfg.weight_decay},
            {"params": adam_params, "weight_decay": 0.0},
        ]
        return torch.optim.AdamW(groups, lr=lr, betas=betas, eps=cfg.eps)
    muon_kwargs: dict[str, Any] = {
        "lr": lr,
        # NOTE: torch.optim.Muon defaults to 0.1; the paper uses 0 (optim.weight_decay's default)
        "weight_decay": cfg.weight_decay,
        "momentum": cfg.muon_momentum,
        "nesterov": cfg.muon_nesterov,
        "ns_steps": cfg.muon_ns_steps,
    }
    ns_name = resolve_ns_dtype(cfg.muon_ns_dtype, next(model.parameters()).device)
    if sharded or distributed or ns_name != "bfloat16":
        ns_dtype = getattr(torch, ns_name)
        muon: torch.optim.Optimizer = ShardedMuon(
            muon_params, ns_dtype=ns_dtype, distributed=distributed, **muon_kwargs
        )
    else:
        muon = torch.optim.Muon(muon_params, **muon_kwargs)
    # AdamW with weight_decay 0 is Adam exactly (the decay multiplies by 1.0).
    adam = torch.optim.AdamW(adam_params, lr=lr, betas=betas, eps=cfg.eps, weight_decay=0.0)
    return CombinedOptimizer({"muon": muon, "adam": adam})
