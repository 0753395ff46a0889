"""The optimiser: Muon for 2-D weight matrices, Adam(W) for everything else, the lr schedule.

Implements the "Optimiser" paragraph of ELF_SPEC §3: Muon (momentum 0.95, Nesterov, 5 Newton–Schulz
steps, update scaled by sqrt(max(1, fan_out/fan_in)), no weight decay) on every 2-D weight, Adam on
biases, norms and token parameters, one shared lr = blr · global_batch / 256 with a linear warm-up.
``torch.optim.Muon`` is used as is on plain tensors. Under FSDP2 (ELF_SPEC §10) Newton–Schulz must
see whole matrices: :class:`ShardedMuon` gathers each matrix once, orthogonalises it and applies the
local shard of the update (bitwise equal to ``torch.optim.Muon`` on plain tensors and on DTensors).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor, distribute_tensor

from elflow.errors import ELFError, require
from elflow.hardware import cpu_has_native_bf16

GRAM_RATIO = 4
"""Long side / short side from which fp32 Newton–Schulz iterates on the Gram matrix."""
GRAM_RESTART = 3
"""Gram-form Newton–Schulz steps between recomputations of X and its Gram matrix."""


def _newton_schulz(
    grad: Tensor,
    ns_coefficients: tuple[float, float, float],
    ns_steps: int,
    eps: float,
    dtype: torch.dtype,
    gram_ratio: float = GRAM_RATIO,
) -> Tensor:
    """torch.optim.Muon's quintic Newton–Schulz, run in ``dtype`` (torch hard-codes bf16).

    Each step is X <- P(A) X with P(A) = aI + bA + cA² and A = X Xᵀ (the short side's Gram
    matrix). For a wide matrix in fp32/fp64 (long side >= ``gram_ratio`` x the short one, e.g.
    the decoder head's E x V) the same steps run on the Gram matrix alone: X_k = M_k X_0 with
    M_{k+1} = P(A_k) M_k and A_{k+1} = P(A_k) A_k P(A_k), all short x short. X_k and its Gram
    matrix are recomputed every ``GRAM_RESTART`` steps, which keeps near-low-rank inputs about as
    close to the fp64 iteration as the direct one (tests/test_optim.py: within 1.5x; without the
    restart we measured up to 3.5x). With 5 steps, four products touch the long side instead of
    ten. This is also the path of fp32 Newton–Schulz on GPUs (``muon_ns_dtype`` auto there), so
    updates differ from the direct iteration's by rounding.
    """
    a, b, c = ns_coefficients
    ortho = grad.to(dtype)
    if grad.size(0) > grad.size(1):
        ortho = ortho.T
    # Out of place: with dtype == grad.dtype, .to() aliases the input (the momentum buffer).
    ortho = ortho / ortho.norm().clamp(min=eps)
    if dtype in (torch.float32, torch.float64) and ortho.size(1) >= gram_ratio * ortho.size(0):
        mixer = None
        for k in range(ns_steps):
            if k % GRAM_RESTART == 0:  # X_k itself, and its Gram matrix afresh
                if mixer is not None:
                    ortho = mixer @ ortho
                gram, mixer = ortho @ ortho.T, None
            poly = torch.addmm(gram, gram, gram, beta=b, alpha=c)
            poly.diagonal().add_(a)
            mixer = poly if mixer is None else poly @ mixer
            if (k + 1) % GRAM_RESTART and k + 1 < ns_steps:  # else the next Gram is not this one
                gram = poly @ gram @ poly
        if mixer is not None:
            ortho = mixer @ ortho
    else:
        for _ in range(ns_steps):
            gram = ortho @ ortho.T
            gram_update = torch.addmm(gram, gram, gram, beta=b, alpha=c)
            ortho = torch.addmm(ortho, gram_update, ortho, beta=a)
    if grad.size(0) > grad.size(1):
        ortho = ortho.T
    return ortho


try:  # NOTE: private torch API; the fallbacks are copies of the same algorithm.
    from torch.optim._muon import _adjust_lr, _zeropower_via_newtonschulz
except ImportError:  # pragma: no cover - depends on the torch version

    def _zeropower_via_newtonschulz(
        grad: Tensor, ns_coefficients: tuple[float, float, float], ns_steps: int, eps: float
    ) -> Tensor:
        return _newton_schulz(grad, ns_coefficients, ns_steps, eps, torch.bfloat16)

    def _adjust_lr(lr: float, adjust_lr_fn: str | None, param_shape: torch.Size) -> float:
        A, B = param_shape[:2]
        if adjust_lr_fn is None or adjust_lr_fn == "original":
            return lr * math.sqrt(max(1, A / B))
        if adjust_lr_fn == "match_rms_adamw":
            return lr * 0.2 * math.sqrt(max(A, B))
        return lr


def _orthogonalise(
    update: Tensor,
    ns_coefficients: tuple[float, float, float],
    ns_steps: int,
    eps: float,
    dtype: torch.dtype,
) -> Tensor:
    if dtype == torch.bfloat16:  # torch's own function: bitwise equal to torch.optim.Muon
        return _zeropower_via_newtonschulz(update, ns_coefficients, ns_steps, eps)
    return _newton_schulz(update, ns_coefficients, ns_steps, eps, dtype)


# torch.optim.Muon's defaults (Keller Jordan's coefficients), repeated so ShardedMuon matches it.
NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
NS_EPS = 1e-7


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
    """Decoupled weight decay of the Adam(W) group (Muon's is always 0, the paper's value)."""
    muon_momentum: float = 0.95
    """Muon momentum."""
    muon_nesterov: bool = True
    """Nesterov momentum in Muon."""
    muon_ns_steps: int = 5
    """Newton–Schulz iterations per Muon step."""
    muon_ns_dtype: str = "float32"
    """Newton–Schulz precision: bfloat16 (torch.optim.Muon's) or float32 (the reference's;
    reproducible across process counts, see ShardedMuon); auto = bfloat16 on a CPU with native
    bf16, else float32 (see ``elflow.hardware``)."""
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


def _apply_muon_update(
    param: Tensor,
    grad: Tensor,
    buf: Tensor,
    *,
    lr: float,
    weight_decay: float,
    momentum: float,
    nesterov: bool,
    ns_coefficients: tuple[float, float, float],
    ns_steps: int,
    eps: float,
    adjust_lr_fn: str | None,
    ns_dtype: torch.dtype,
) -> None:
    # Same op sequence as torch.optim._muon._single_tensor_muon, so plain tensors match bitwise.
    buf.lerp_(grad, 1 - momentum)  # the momentum buffer stays on the local shard
    update = grad.lerp(buf, momentum) if nesterov else buf
    if isinstance(update, DTensor):
        # NOTE: Newton–Schulz is not elementwise: it must see the whole matrix, never a shard.
        # (torch 2.13's DTensor dispatch makes torch.optim.Muon exact in fp32 on shards, but via
        # implicit collectives per NS matmul whose bf16 partial sums change the result.)
        full = _orthogonalise(update.full_tensor(), ns_coefficients, ns_steps, eps, ns_dtype)
        # Every rank holds the same full update, so slicing needs no communication.
        local = distribute_tensor(
            full, param.device_mesh, param.placements, src_data_rank=None
        ).to_local()
        # DTensor.shape is the global shape, so the fan_out/fan_in scale is the full matrix's.
        adjusted_lr = _adjust_lr(lr, adjust_lr_fn, param.shape)
        param_local = param.to_local()
        param_local.mul_(1 - lr * weight_decay)
        param_local.add_(local, alpha=-adjusted_lr)
        return
    update = _orthogonalise(update, ns_coefficients, ns_steps, eps, ns_dtype)
    adjusted_lr = _adjust_lr(lr, adjust_lr_fn, param.shape)
    param.mul_(1 - lr * weight_decay)
    param.add_(update, alpha=-adjusted_lr)


class ShardedMuon(torch.optim.Optimizer):
    """``torch.optim.Muon`` that is correct on FSDP2 (DTensor) parameters.

    The momentum buffer lives on the local shard; the Nesterov update is gathered to the full
    matrix, orthogonalised with torch's own bf16 Newton–Schulz, scaled by the full shape, and only
    this rank's shard is applied. Every rank orthogonalises every matrix (redundant compute, no
    extra communication beyond one all-gather per matrix). Same defaults and state layout as
    ``torch.optim.Muon`` (weight_decay 0.1 by default: pass 0 for the paper's setting).

    ``ns_dtype`` is bf16 by default (torch's choice, bitwise equal to ``torch.optim.Muon``).
    NOTE: bf16 Newton–Schulz amplifies its own rounding noise in the near-null directions of
    low-rank updates, so a 1e-7 relative change of the gradient (e.g. another all-reduce order)
    moves the weights by ~10% of the step. ``torch.float32`` (the reference's choice) makes N
    processes match one process to ~1e-6.
    """

    def __init__(
        self,
        params: Iterable[Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        weight_decay: float = 0.1,
        momentum: float = 0.95,
        nesterov: bool = True,
        ns_coefficients: tuple[float, float, float] = NS_COEFFICIENTS,
        eps: float = NS_EPS,
        ns_steps: int = 5,
        adjust_lr_fn: str | None = None,
        ns_dtype: torch.dtype = torch.bfloat16,
    ) -> None:
        if lr < 0 or momentum < 0 or weight_decay < 0:
            raise ValueError(
                f"lr, momentum, weight_decay must be >= 0: {lr}, {momentum}, {weight_decay}"
            )
        defaults = {
            "lr": lr,
            "weight_decay": weight_decay,
            "momentum": momentum,
            "nesterov": nesterov,
            "ns_coefficients": ns_coefficients,
            "eps": eps,
            "ns_steps": ns_steps,
            "adjust_lr_fn": adjust_lr_fn,
            "ns_dtype": ns_dtype,
        }
        super().__init__(params, defaults)
        for group in self.param_groups:
            for p in group["params"]:
                if p.ndim != 2:
                    raise ValueError(
                        f"Muon only supports 2-D parameters, got shape {tuple(p.shape)}"
                    )

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(
                        p.grad, memory_format=torch.preserve_format
                    )
                _apply_muon_update(
                    p,
                    p.grad,
                    state["momentum_buffer"],
                    lr=float(group["lr"]),
                    weight_decay=group["weight_decay"],
                    momentum=group["momentum"],
                    nesterov=group["nesterov"],
                    ns_coefficients=group["ns_coefficients"],
                    ns_steps=group["ns_steps"],
                    eps=group["eps"],
                    adjust_lr_fn=group["adjust_lr_fn"],
                    ns_dtype=group["ns_dtype"],
                )
        return loss


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
    """``optim.muon_ns_dtype`` on ``device``: 'auto' is bfloat16 only on a CPU with native bf16
    (emulated bf16 makes each step ~8x slower); on CUDA float32, the reference's."""
    if name != "auto":
        return name
    return "bfloat16" if device.type == "cpu" and cpu_has_native_bf16() else "float32"


def build_optimizer(
    model: nn.Module, cfg: OptimConfig, sharded: bool = False
) -> CombinedOptimizer | torch.optim.Optimizer:
    """The optimiser for ``model`` (ELF_SPEC §3), created with lr = the peak lr at batch 256.

    NOTE: call :func:`set_lr` with :func:`learning_rate` before every step; the initial lr is a
    placeholder. ``sharded=True`` is required when the parameters are FSDP2 DTensors: it swaps
    ``torch.optim.Muon`` (silently wrong on shards, ELF_SPEC §10) for :class:`ShardedMuon`, which
    is also used for ``muon_ns_dtype="float32"``.
    """
    lr = peak_lr(cfg, 256)
    betas = (cfg.beta1, cfg.beta2)
    if cfg.optimizer == "adamw":
        params = [p for p in model.parameters() if p.requires_grad]
        return torch.optim.AdamW(
            params, lr=lr, betas=betas, eps=cfg.eps, weight_decay=cfg.weight_decay
        )
    muon_params, adam_params = param_groups(model)
    muon_kwargs: dict[str, Any] = {
        "lr": lr,
        "weight_decay": 0.0,  # NOTE: torch.optim.Muon defaults to 0.1; the paper uses 0
        "momentum": cfg.muon_momentum,
        "nesterov": cfg.muon_nesterov,
        "ns_steps": cfg.muon_ns_steps,
    }
    ns_name = resolve_ns_dtype(cfg.muon_ns_dtype, next(model.parameters()).device)
    if sharded or ns_name != "bfloat16":
        ns_dtype = getattr(torch, ns_name)
        muon: torch.optim.Optimizer = ShardedMuon(muon_params, ns_dtype=ns_dtype, **muon_kwargs)
    else:
        muon = torch.optim.Muon(muon_params, **muon_kwargs)
    # AdamW with weight_decay 0 is Adam exactly (the decay multiplies by 1.0).
    adam = torch.optim.AdamW(
        adam_params, lr=lr, betas=betas, eps=cfg.eps, weight_decay=cfg.weight_decay
    )
    return CombinedOptimizer({"muon": muon, "adam": adam})
