"""The bf16 inference fast path: ELF's blocks on a cached low-precision copy of their weights.

Under bf16 (or fp16) autocast, in eval mode and without gradients (sampling, decoding, held-out
losses, a distillation teacher), :func:`forward` runs :meth:`ELF.embed`, then every block through
:func:`lowp_block` on :class:`LowpBlock` weights cast once (norm weights folded into the next
Linear, pre-packed by oneDNN on a CPU), then :meth:`ELF.heads`; anywhere else it is the plain
``model(...)``. The matmuls and attention run in bf16, the residual stream, RMSNorms and RoPE in
fp32 (spec §3); outputs are tested against fp32 and per-op autocast. One switch turns it off:
``ELFLOW_FAST_BF16=0`` (:func:`enabled`). :mod:`elflow.sampling.denoiser` applies it; ``ELF`` never
does.
"""

from __future__ import annotations

import os
import threading
import weakref
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from elflow.model import ELF, Block, RMSNorm
from elflow.runtime.hardware import LowpLinear, full_precision

ENV = "ELFLOW_FAST_BF16"
"""Set to 0 to run inference under autocast per op, as training does (read at every call)."""


def enabled() -> bool:
    """The switch: on unless ``ELFLOW_FAST_BF16=0``. It only matters under bf16/fp16 autocast in
    eval mode without gradients (:func:`lowp_dtype`); fp32 never takes the fast path."""
    return os.environ.get(ENV, "").strip() != "0"


class LowpBlock(NamedTuple):
    """One block's weights for low-precision inference (:func:`lowp_block`): the Linear layers in
    the autocast dtype, norm1's and norm2's weights folded into qkv and w12 (W (g * n) =
    (W diag g) n), w12 split into the SwiGLU's gate and value halves; the QK-norm weights in fp32,
    stacked (2, 1, hd)."""

    qkv: LowpLinear
    qk_norm: Tensor
    proj: LowpLinear
    gate: LowpLinear
    value: LowpLinear
    w3: LowpLinear

    @classmethod
    def of(cls, block: Block, dtype: torch.dtype) -> LowpBlock:
        attn, mlp = block.attn, block.mlp

        def linear(m: nn.Linear, rows: slice = slice(None), norm: RMSNorm | None = None):
            weight = m.weight.detach()[rows].float()
            if norm is not None:
                weight = weight * norm.weight.detach().float()
            return LowpLinear.of(weight, m.bias.detach()[rows], dtype)

        hidden = mlp.w3.in_features
        gate, value = slice(None, hidden), slice(hidden, None)
        qk_norm = torch.stack([attn.q_norm.weight, attn.k_norm.weight]).detach().float()[:, None]
        return cls(
            linear(attn.qkv, norm=block.norm1),
            qk_norm,
            linear(attn.proj),
            linear(mlp.w12, gate, block.norm2),
            linear(mlp.w12, value, block.norm2),
            linear(mlp.w3),
        )


def _rms(x: Tensor, eps: float = 1e-6) -> Tensor:
    """rsqrt(mean(x^2) + eps) over the last dim, (..., 1), in fp32 from one read of x."""
    mean_sq = torch.linalg.vector_norm(x, dim=-1, keepdim=True, dtype=torch.float32).square_()
    return mean_sq.mul_(1 / x.shape[-1]).add_(eps).rsqrt_()


def lowp_block(
    x: Tensor, p: LowpBlock, rotations: Tensor, mask: Tensor | None, heads: int
) -> Tensor:
    """:class:`Block`'s forward for inference with the weights of ``p``: the matmuls and attention
    in their dtype; the residual stream, the RMSNorms (QK-norm included) and RoPE in fp32.

    Args:
        x: (B, N, D) fp32 residual stream (not modified).
        rotations: (N, 1, 1, hd / 2) complex: :meth:`ELF.rotations` laid out for q and k.
    """
    B, N, D = x.shape
    dtype = p.proj.bias.dtype
    qkv = p.qkv((x * _rms(x)).to(dtype)).unflatten(-1, (3, heads, -1))  # (B, N, 3, H, hd)
    qk = qkv[:, :, :2].float()  # (B, N, 2, H, hd): q and k normalised and rotated together
    qk.mul_(_rms(qk)).mul_(p.qk_norm)
    torch.view_as_complex(qk.unflatten(-1, (-1, 2))).mul_(rotations)
    q, k = qk.to(dtype).transpose(1, 3).unbind(2)  # (B, H, N, hd)
    v = qkv[:, :, 2].transpose(1, 2)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask).transpose(1, 2).reshape(B, N, D)
    x = x + p.proj(out)
    h = (x * _rms(x)).to(dtype)
    return x.add_(p.w3(p.value(h, times=p.gate(h, silu=True))))


def lowp_dtype(model: ELF, device: torch.device) -> torch.dtype | None:
    """The autocast dtype when :func:`forward` takes the fast path (switch on, eval mode, no
    grad, autocast on ``device``; plain, unsharded parameters), else None (per-op autocast)."""
    if not enabled() or model.training or torch.is_grad_enabled():
        return None
    if device.type not in ("cpu", "cuda") or not torch.is_autocast_enabled(device.type):
        return None
    if type(model.blocks[0].attn.qkv.weight) is not nn.Parameter:  # e.g. FSDP2's DTensors
        return None
    return torch.get_autocast_dtype(device.type)


_LOCK = threading.Lock()
_CACHE: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
"""model -> (key of the weights cast, the blocks' :class:`LowpBlock`); dropped with the model."""


def lowp_blocks(model: ELF, dtype: torch.dtype) -> list[LowpBlock]:
    """``model``'s blocks cast to ``dtype``: built once (under a lock, so threads sharing a model
    build it once) and kept until a block parameter changes (in place, or replaced) or the model
    is freed. The list and its tensors are never modified, so threads may share them.

    NOTE: holds one low-precision copy of the blocks per model (ELF-B: ~170 MB in bf16).
    """
    key = (dtype, *((p.data_ptr(), p._version) for p in model.blocks.parameters()))
    with _LOCK:
        hit = _CACHE.get(model)
        if hit is not None and hit[0] == key:
            return hit[1]
        _CACHE.pop(model, None)  # free the old copy first
        with torch.no_grad():
            blocks = [LowpBlock.of(block, dtype) for block in model.blocks]
        _CACHE[model] = (key, blocks)
        return blocks


def forward(
    model: ELF,
    x_in: Tensor,
    t: Tensor | float,
    w: Tensor | float | None = None,
    gate: Tensor | float = 0.0,
    key_mask: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """``model(x_in, t, w, gate, key_mask)``, on the fast path where :func:`lowp_dtype` says so.

    Same arguments and outputs as :meth:`ELF.forward`; (x_pred, hidden) in the parameters' dtype.
    """
    dtype = lowp_dtype(model, x_in.device)
    if dtype is None:
        return model(x_in, t, w, gate, key_mask)
    tokens, mask = model.embed(x_in, t, w, gate, key_mask)
    out_dtype, L = tokens.dtype, x_in.shape[1]
    with full_precision(x_in.device):
        rotations = model.rotations(L, x_in.device)[:, None, None]  # (P + L, 1, 1, hd / 2)
        for weights in lowp_blocks(model, dtype):
            tokens = lowp_block(tokens, weights, rotations, mask, model.cfg.num_heads)
    return model.heads(tokens, out_dtype)
