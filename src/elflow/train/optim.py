"""The optimiser: Muon for 2-D weight matrices, Adam(W) for everything else, the lr schedule.

Implements the "Optimiser" paragraph of ELF_SPEC §3: Muon (momentum 0.95, Nesterov, 5 Newton–Schulz
steps, update scaled by sqrt(max(1, fan_out/fan_in)), no weight decay) on every 2-D weight, Adam on
biases, norms and token parameters, one shared lr = blr · global_batch / 256 with a linear warm-up.
``torch.optim.Muon`` is used as is on plain tensors; on FSDP2 shards, and for fp32 Newton–Schulz,
:class:`elflow.train.muon.ShardedMuon`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from elflow.errors import ELFError, require
from elflow.runtime.hardware import fast_bf16
from elflow.train.muon import ShardedMuon


@dataclass(frozen=True)
class OptimConfig:
    """Optimiser and lr schedule (ELF_SPEC §3); defaults are the paper's values."""

    optimizer: str = "muon"
    """muon (Muon for 2-D weights + Adam for the rest, the paper's) or adamw (AdamW for all)."""
    blr: float = 1e-3
    """Base lr; the peak lr is blr * global_batch / 256."""
    lr: float = 0.0
    """Absolute peak lr; if > 0 it overrides the blr scaling."""
    warmup_steps: int = 0
    """Optimizer steps of linear warm-up from lr 0."""
    schedule: str = "constant"
    """After warm-up: constant (the paper's), cosine (decays to min_lr_ratio * lr over the run) or
    wsd (warm-up, stable, decay: constant, then linear to min_lr_ratio * lr over the last
    ``decay_steps``)."""
    min_lr_ratio: float = 0.0
    """Floor of the cosine and wsd schedules as a fraction of the peak lr."""
    decay_steps: int = 0
    """Length of the wsd schedule's final linear decay, in optimizer steps."""
    beta1: float = 0.9
    """Adam first-moment decay."""
    beta2: float = 0.999
    """Adam second-moment decay."""
    eps: float = 1e-8
    """Adam epsilon."""
    weight_decay: float = 0.0
    """Decoupled weight decay of the weight matrices (Muon's set; AdamW's 2-D parameters under
    ``optimizer=adamw``). Biases, norm scales and prefix tokens never decay. 0 is the paper's."""
    muon_momentum: float = 0.95
    """Muon momentum."""
    muon_nesterov: bool = True
    """Nesterov momentum in Muon."""
    muon_ns_steps: int = 5
    """Newton–Schulz iterations per Muon step."""
    muon_ns_dtype: str = "auto"
    """Newton–Schulz precision: bfloat16 (torch.optim.Muon's) or float32 (the reference's;
    reproducible across process counts, see ShardedMuon); auto = bfloat16 on CUDA and on a CPU
    with native bf16, else float32 (see ``elflow.runtime.hardware``)."""
    clip_grad_norm: float = 1.0
    """Clip the global gradient norm to this value (0 disables clipping)."""

    def __post_init__(self) -> None:
        require(
            self.optimizer in ("muon", "adamw"),
            f"optim.optimizer must be 'muon' or 'adamw', got {self.optimizer!r}",
        )
        require(
            self.schedule in ("constant", "cosine", "wsd"),
            f"optim.schedule must be 'constant', 'cosine' or 'wsd', got {self.schedule!r}",
        )
        require(self.decay_steps >= 0, f"optim.decay_steps must be >= 0, got {self.decay_steps}")
        require(
            self.schedule != "wsd" or self.decay_steps > 0,
            "optim.schedule=wsd needs optim.decay_steps > 0 (the length of the final decay)",
        )
        for name in ("blr", "lr", "eps", "weight_decay", "clip_grad_norm"):
            value = getattr(self, name)
            require(math.isfinite(value) and value >= 0, f"optim.{name} must be >= 0, got {value}")
        require(self.eps > 0, f"optim.eps must be positive, got {self.eps}")
        require(
            self.lr > 0 or self.blr > 0,
            "optim.blr and optim.lr are both 0: set blr (scaled by batch) or lr (absolute)",
        )
        require(self.warmup_steps >= 0, f"optim.warmup_steps must be >= 0, got {self.warmup_steps}")
        require(
            0.0 <= self.min_lr_ratio <= 1.0,
            f"optim.min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}",
        )
        for name in ("beta1", "beta2", "muon_momentum"):
            value = getattr(self, name)
            require(0.0 <= value < 1.0, f"optim.{name} must be in [0, 1), got {value}")
        require(
            self.muon_ns_dtype in ("bfloat16", "float32", "auto"),
            "optim.muon_ns_dtype must be 'bfloat16', 'float32' or 'auto', got "
            f"{self.muon_ns_dtype!r}",
        )
        require(
            self.muon_ns_steps >= 1, f"optim.muon_ns_steps must be >= 1, got {self.muon_ns_steps}"
        )
        require(
            self.muon_ns_steps < 100,
            f"optim.muon_ns_steps must be < 100 (5 is the paper's), got {self.muon_ns_steps}",
        )


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
