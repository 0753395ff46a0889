"""Muon's orthogonalised update, also on FSDP2 shards (ELF_SPEC §3 "Optimiser", §10).

Newton–Schulz turns the Nesterov momentum of a weight matrix into its nearest semi-orthogonal
matrix (5 quintic steps, Keller Jordan's coefficients). ``torch.optim.Muon`` runs it in bf16 on
whatever tensor it is given, which is silently wrong on an FSDP2 shard; :class:`ShardedMuon`
gathers each matrix once, orthogonalises it whole (bf16 with torch's own function, or fp32 as the
reference does, on the Gram matrix for wide matrices) and applies this rank's shard of the update.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor, distribute_tensor

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
