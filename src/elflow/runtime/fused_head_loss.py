"""The decoder head's cross-entropy, chunk of tokens by chunk, with its gradients (ELF_SPEC §3
step 10; the head is ``model.DecoderHead``).

:func:`linear_cross_entropy` is ``sum_i weights_i * CE(head(hidden_i), ids_i)`` for the decode-mode
head ``GELU_tanh(h W_p + b_p) W_u + b_u``, computed over chunks of at most :func:`chunk_tokens`
tokens: no more than :data:`CHUNK_BYTES` of fp32 logits exist at once (the full head holds
tokens x V of them: 4.2 GB for 32 rows of 1024 tokens with T5's 32,100). The loss is a weighted
sum, so its gradient is a scalar times a fixed tensor: each chunk's gradients are computed in the
same pass, while its logits exist (Liger-Kernel's fused linear cross-entropy), and the backward
pass only scales them. The head's matrix products run as often as under autograd (two forward,
four backward), none recomputed. Everything runs in fp32 outside any autocast, as spec §3 keeps
the heads.

Eagerly it is an ``autograd.Function`` whose inner ops torch's counters see; under torch.compile
the same loop is one opaque custom op (``elflow::linear_ce``) with a shape function, so the number
of decoder tokens, which changes every step, stays a dynamic size without a graph break or a
recompile (the loop's length depends on it).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

CHUNK_BYTES = 64 << 20
"""The most fp32 logits, in bytes, one chunk holds (the pass also holds their softmax's gradient
in place of them, and a chunk-sized GELU input)."""


def chunk_tokens(vocab_size: int, budget: int = CHUNK_BYTES) -> int:
    """Tokens per chunk whose (tokens, V) fp32 logits fit ``budget`` bytes (at least one)."""
    return max(1, budget // (4 * vocab_size))


def _chunked(
    hidden: Tensor,
    wp: Tensor,
    bp: Tensor,
    wu: Tensor,
    bu: Tensor,
    ids: Tensor,
    weights: Tensor,
    chunk: int,
    need_hidden: bool,
    need_weights: bool,
) -> tuple[Tensor, ...]:
    """(loss (), per-token CE (N,), then the gradients of loss: hidden's (N, D) and W_p, b_p,
    W_u, b_u's; an unneeded one is an empty tensor)."""
    N = hidden.shape[0]
    with torch.autocast(hidden.device.type, enabled=False):
        ce = hidden.new_empty(N, dtype=torch.float32)
        loss = hidden.new_zeros((), dtype=torch.float32)
        g_h = torch.empty_like(hidden) if need_hidden else hidden.new_empty(0)
        g_w = [torch.zeros_like(p) if need_weights else p.new_empty(0) for p in (wp, bp, wu, bu)]
        for start in range(0, N, chunk):
            h, t, w = (v[start : start + chunk] for v in (hidden, ids, weights))
            a = F.linear(h, wp, bp)  # (n, E)
            g = F.gelu(a, approximate="tanh")
            logits = F.linear(g, wu, bu)  # (n, V), fp32
            lse = logits.logsumexp(-1)
            ce_c = lse - logits.gather(1, t[:, None]).squeeze(1)
            ce[start : start + chunk] = ce_c
            loss += (ce_c * w).sum()
            if not (need_hidden or need_weights):
                continue
            # d loss / d logits = w (softmax - onehot), built in the logits' memory.
            d = logits.sub_(lse[:, None]).exp_()
            d.scatter_add_(1, t[:, None], d.new_full((len(t), 1), -1.0)).mul_(w[:, None])
            da = torch.ops.aten.gelu_backward(d @ wu, a, approximate="tanh")  # (n, E)
            if need_weights:
                g_w[0] += da.T @ h
                g_w[1].add_(da.sum(0))
                g_w[2] += d.T @ g
                g_w[3].add_(d.sum(0))
            if need_hidden:
                g_h[start : start + chunk] = da @ wp
    return (loss, ce, g_h, *g_w)


class _LinearCE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, wp, bp, wu, bu, ids, weights, chunk, need_hidden, need_weights):
        loss, ce, *grads = _chunked(
            hidden, wp, bp, wu, bu, ids, weights, chunk, need_hidden, need_weights
        )
        ctx.save_for_backward(*grads)
        ctx.mark_non_differentiable(ce)
        return loss, ce

    @staticmethod
    def backward(ctx, d_loss, _d_ce):
        g_h, *g_w = ctx.saved_tensors
        scaled = [d_loss * g if g.numel() else None for g in g_w]
        return (d_loss * g_h if g_h.numel() else None, *scaled, None, None, None, None, None)


@torch.library.custom_op("elflow::linear_ce", mutates_args=())
def _linear_ce_op(
    hidden: Tensor,
    wp: Tensor,
    bp: Tensor,
    wu: Tensor,
    bu: Tensor,
    ids: Tensor,
    weights: Tensor,
    chunk: int,
    need_hidden: bool,
    need_weights: bool,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    return _chunked(hidden, wp, bp, wu, bu, ids, weights, chunk, need_hidden, need_weights)


@_linear_ce_op.register_fake
def _(hidden, wp, bp, wu, bu, ids, weights, chunk, need_hidden, need_weights):
    params = [p.new_empty(p.shape if need_weights else 0) for p in (wp, bp, wu, bu)]
    ce = hidden.new_empty(hidden.shape[0], dtype=torch.float32)
    g_h = hidden.new_empty(hidden.shape if need_hidden else 0)
    return (hidden.new_empty((), dtype=torch.float32), ce, g_h, *params)


def _setup(ctx, inputs, output) -> None:
    ctx.save_for_backward(*output[2:])
    ctx.need = (inputs[8], inputs[9])


def _backward(ctx, d_loss, _d_ce, *_grads):
    g_h, *g_w = ctx.saved_tensors
    need_hidden, need_weights = ctx.need
    scaled = [d_loss * g if need_weights else None for g in g_w]
    return (d_loss * g_h if need_hidden else None, *scaled, None, None, None, None, None)


torch.library.register_autograd("elflow::linear_ce", _backward, setup_context=_setup)


def linear_cross_entropy(
    hidden: Tensor,
    proj: torch.nn.Linear,
    unembed: torch.nn.Linear,
    ids: Tensor,
    weights: Tensor,
    chunk: int | None = None,
) -> tuple[Tensor, Tensor]:
    """``sum_i weights_i * CE_i`` and the per-token ``CE_i`` (detached) of the head
    ``unembed(GELU_tanh(proj(hidden)))``, in fp32, chunk by chunk.

    Args:
        hidden: (N, D) hidden states, in the head's dtype.
        ids: (N,) target token ids; weights: (N,) fp32 weight of each token's CE (0: none).
        chunk: tokens per chunk (default :func:`chunk_tokens` of the head's vocabulary).
    """
    chunk = chunk or chunk_tokens(unembed.out_features)
    params = (proj.weight, proj.bias, unembed.weight, unembed.bias)
    grad = torch.is_grad_enabled()
    need_hidden = grad and hidden.requires_grad
    need_weights = grad and any(p.requires_grad for p in params)
    args = (hidden, *params, ids.long(), weights.float(), chunk, need_hidden, need_weights)
    if torch.compiler.is_compiling():
        return torch.ops.elflow.linear_ce(*args)[:2]
    return _LinearCE.apply(*args)
