"""The ELF network (paper §3; ELF_SPEC §2).

A pre-norm transformer over [time tokens | SC-CFG scale tokens | mode tokens | L sequence tokens].
All conditioning is in-context (no adaLN). The flow head predicts clean latents (x-prediction); the
decoder head turns the final hidden states into token logits and is only evaluated when asked for
(:meth:`ELF.decode_logits`), so denoising never pays for the V-way projection. :meth:`ELF.forward`
is the one implementation and keeps no state between calls; the bf16 inference fast path (the
blocks on a cached bf16 copy of their weights) lives in ``runtime/bf16_fast_path.py``, applied
by ``sampling/denoiser.py``. Reading and writing model folders is inherited
(``io/pretrained_mixin.py``).

The network knows nothing about noise, time grids or guidance: see ``flow.py`` and ``sampling/``.
Parameter names follow the authors' released state dicts so the import key map stays small.
"""

from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from elflow.config import ModelConfig
from elflow.errors import ELFError
from elflow.io.pretrained_mixin import PretrainedMixin
from elflow.runtime.fused_head_loss import linear_cross_entropy
from elflow.runtime.hardware import check_fits, full_precision

__all__ = ["ELF", "build_model", "check_fits", "count_parameters"]


class RMSNorm(nn.Module):
    """weight * x * rsqrt(mean(x^2) + eps), the mean taken in fp32."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(dim))

    def forward(self, x: Tensor) -> Tensor:
        if x.dtype == self.weight.dtype:  # one fused kernel on CUDA; the same ops on a CPU
            return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * normed.type_as(x)


class TimestepEmbedder(nn.Module):
    """Scalar -> sinusoidal features (cos first, raw scalar, no x1000) -> MLP."""

    def __init__(self, dim: int, freq_dim: int = 256) -> None:
        super().__init__()
        self.freq_dim = freq_dim
        self.mlp = nn.Sequential(nn.Linear(freq_dim, dim), nn.SiLU(), nn.Linear(dim, dim))

    def forward(self, s: Tensor) -> Tensor:
        half = self.freq_dim // 2
        freqs = torch.exp(
            -math.log(10000.0) * torch.arange(half, device=s.device, dtype=torch.float32) / half
        )
        args = s.float()[:, None] * freqs[None]  # (B, half)
        feats = torch.cat([torch.cos(args), torch.sin(args)], dim=-1)  # (B, freq_dim)
        return self.mlp(feats.to(self.mlp[0].weight.dtype))  # (B, D)


class TextProjection(nn.Module):
    """E -> bottleneck (no bias) -> D, no activation in between."""

    def __init__(self, in_dim: int, bottleneck: int, dim: int) -> None:
        super().__init__()
        self.proj1 = nn.Linear(in_dim, bottleneck, bias=False)
        self.proj2 = nn.Linear(bottleneck, dim)

    def forward(self, x: Tensor) -> Tensor:
        return self.proj2(self.proj1(x))


def rope_tables(
    num_prefix: int, length: int, head_dim: int, theta: float, device: torch.device
) -> Tensor:
    """Complex rotations (P + L, head_dim / 2); prefix rows get the identity rotation.

    Pair i = (2i, 2i + 1) of position j is rotated by angle j * theta^(-2i/head_dim).
    """
    freqs = theta ** (-torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim)
    pos = torch.arange(length, device=device, dtype=torch.float32)
    angles = torch.cat(
        [torch.zeros(num_prefix, head_dim // 2, device=device), pos[:, None] * freqs]
    )
    return torch.polar(torch.ones_like(angles), angles)


@functools.lru_cache(maxsize=64)
def _shared_rope_tables(
    num_prefix: int, length: int, head_dim: int, theta: float, device: torch.device
) -> Tensor:
    """:func:`rope_tables`, computed once per arguments and shared (read-only) by every caller."""
    with torch.inference_mode(False):  # usable by a later training forward
        return rope_tables(num_prefix, length, head_dim, theta, device)


def apply_rope(x: Tensor, rotations: Tensor) -> Tensor:
    """Rotate adjacent pairs: (a, b) -> (a cos - b sin, b cos + a sin). x: (B, H, N, hd).

    As a complex product (a + ib) e^{i angle}: one fused multiply instead of four strided ones.
    """
    pairs = torch.view_as_complex(x.float().reshape(*x.shape[:-1], x.shape[-1] // 2, 2))
    return torch.view_as_real(pairs * rotations).flatten(-2).type_as(x)


class Attention(nn.Module):
    """Fused-qkv attention with QK-RMSNorm (shared across heads) applied before RoPE."""

    def __init__(self, dim: int, num_heads: int, dropout: float = 0.0) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = dim // num_heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.q_norm = RMSNorm(self.head_dim)
        self.k_norm = RMSNorm(self.head_dim)
        self.proj = nn.Linear(dim, dim)
        self.proj_drop = nn.Dropout(dropout)

    def forward(self, x: Tensor, rotations: Tensor, mask: Tensor | None) -> Tensor:
        B, N, D = x.shape
        qkv = self.qkv(x).reshape(B, N, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.unbind(0)  # each (B, H, N, hd)
        q = apply_rope(self.q_norm(q), rotations)
        k = apply_rope(self.k_norm(k), rotations)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)  # (B, H, N, hd)
        return self.proj_drop(self.proj(out.transpose(1, 2).reshape(B, N, D)))


class SwiGLU(nn.Module):
    """w3(silu(a) * b) with (a, b) = split(w12(x)); the first half is gated."""

    def __init__(self, dim: int, hidden: int, dropout: float = 0.0) -> None:
        super().__init__()
        self.w12 = nn.Linear(dim, 2 * hidden)
        self.w3 = nn.Linear(hidden, dim)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: Tensor) -> Tensor:
        a, b = self.w12(x).chunk(2, dim=-1)
        return self.w3(self.drop(F.silu(a) * b))


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, dropout: float) -> None:
        super().__init__()
        self.norm1 = RMSNorm(cfg.hidden_size)
        self.attn = Attention(cfg.hidden_size, cfg.num_heads, dropout)
        self.norm2 = RMSNorm(cfg.hidden_size)
        self.mlp = SwiGLU(cfg.hidden_size, cfg.mlp_hidden, dropout)

    def forward(self, x: Tensor, rotations: Tensor, mask: Tensor | None) -> Tensor:
        x = x + self.attn(self.norm1(x), rotations, mask)
        return x + self.mlp(self.norm2(x))


class FinalLayer(nn.Module):
    """Flow head: RMSNorm then Linear(D -> E), zero-initialised."""

    def __init__(self, dim: int, out_dim: int) -> None:
        super().__init__()
        self.norm_final = RMSNorm(dim)
        self.linear = nn.Linear(dim, out_dim)

    def forward(self, h: Tensor) -> Tensor:
        return self.linear(self.norm_final(h))


class DecoderHead(nn.Module):
    """Decode-mode head: GELU_tanh(h W_p + b_p) W_u + b_u, on the un-normalised hidden states.

    NOTE: kept as nn.Linear layers (the reference stores bare (in, out) kernels) so that Muon's
    per-matrix lr scaling treats ``unembed`` as an (E -> V) matrix, as the reference does.
    """

    def __init__(self, dim: int, encoder_dim: int, vocab_size: int) -> None:
        super().__init__()
        self.proj = nn.Linear(dim, encoder_dim)
        self.unembed = nn.Linear(encoder_dim, vocab_size)

    def forward(
        self, h: Tensor, ids: Tensor | None = None, weights: Tensor | None = None
    ) -> Tensor | tuple[Tensor, Tensor]:
        """Logits (..., V) of ``h`` (..., D); with target ``ids`` (...) and per-token ``weights``
        (...), instead (sum(weights x CE), the per-token CE (...) detached), in fp32 chunks of
        tokens that never hold all the logits
        (:func:`elflow.runtime.fused_head_loss.linear_cross_entropy`)."""
        if ids is None:
            return self.unembed(F.gelu(self.proj(h), approximate="tanh"))
        flat = h.reshape(-1, h.shape[-1])
        loss, ce = linear_cross_entropy(
            flat, self.proj, self.unembed, ids.reshape(-1), weights.reshape(-1)
        )
        return loss, ce.view(ids.shape)


class ELF(PretrainedMixin, nn.Module):
    """The ELF network. Build on any device (``meta`` included), then call :meth:`init_weights`;
    :meth:`from_pretrained` and :meth:`save_pretrained` read and write model folders."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        D, E = cfg.hidden_size, cfg.encoder_dim
        if cfg.self_condition:
            self.self_cond_proj = nn.Linear(2 * E, E)
        self.text_proj = TextProjection(E, cfg.bottleneck_dim, D)
        self.t_embedder = TimestepEmbedder(D)
        self.t_emb_tokens = nn.Parameter(torch.empty(1, cfg.num_time_tokens, D))
        if cfg.num_scale_tokens > 0:
            self.self_cond_cfg_embedder = TimestepEmbedder(D)
            self.self_cond_cfg_tokens = nn.Parameter(torch.empty(1, cfg.num_scale_tokens, D))
        self.mode_tokens = nn.Parameter(torch.empty(1, cfg.num_mode_tokens, D))
        lo, hi = cfg.depth // 4, 3 * cfg.depth // 4
        self.blocks = nn.ModuleList(
            Block(cfg, cfg.dropout if lo <= i < hi else 0.0) for i in range(cfg.depth)
        )
        self.final_layer = FinalLayer(D, E)
        self.decoder = DecoderHead(D, E, cfg.vocab_size)
        self.activation_checkpointing = False
        """Recompute each block's activations in the backward pass instead of keeping them
        (``train.activation_checkpointing``): less memory, about one more forward per step."""
        self.residual_dtype: torch.dtype | None = None
        """The residual stream's dtype between blocks under autocast (``train.residual_dtype``;
        None: the parameters' dtype, fp32). Experimental: bf16 halves the stream's traffic."""

    @torch.no_grad()
    def init_weights(self) -> None:
        """The paper's initialisation (ELF_SPEC §2); the flow head is zero-initialised."""
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.xavier_uniform_(module.weight)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
            elif isinstance(module, RMSNorm):
                nn.init.ones_(module.weight)
        embedders = [self.t_embedder]
        if self.cfg.num_scale_tokens > 0:
            embedders.append(self.self_cond_cfg_embedder)
            nn.init.normal_(self.self_cond_cfg_tokens, std=0.02)
        for emb in embedders:
            nn.init.normal_(emb.mlp[0].weight, std=0.02)
            nn.init.normal_(emb.mlp[2].weight, std=0.02)
        nn.init.normal_(self.t_emb_tokens, std=0.02)
        nn.init.normal_(self.mode_tokens, std=0.02)
        nn.init.zeros_(self.final_layer.linear.weight)  # zero-init flow head
        nn.init.zeros_(self.final_layer.linear.bias)

    def forward(
        self,
        x_in: Tensor,
        t: Tensor | float,
        w: Tensor | float | None = None,
        gate: Tensor | float = 0.0,
        key_mask: Tensor | None = None,
    ) -> tuple[Tensor, Tensor]:
        """One network evaluation: :meth:`embed`, the blocks, :meth:`heads`.

        Args:
            x_in: (B, L, 2E) = [z, x_selfcond], or (B, L, E) without self-conditioning.
            t: time per row (B,) or a scalar; t = 1 is data.
            w: SC-CFG scale per row (B,) or a scalar; required iff the model has scale tokens.
            gate: mode gate per row (B,) or a scalar: 0 denoise, 1 decode.
            key_mask: optional (B, L) attention key mask, 1 = valid (prefix keys always valid);
                an all-ones mask on the host is dropped (attention then runs unmasked).

        Returns:
            (x_pred (B, L, E), hidden (B, L, D)); feed ``hidden`` to :meth:`decode_logits`.
        """
        tokens, mask = self.embed(x_in, t, w, gate, key_mask)
        dtype = tokens.dtype
        if self.residual_dtype is not None and torch.is_autocast_enabled(x_in.device.type):
            tokens = tokens.to(self.residual_dtype)  # the heads cast back to ``dtype``
        rotations = self.rotations(x_in.shape[1], x_in.device)
        recompute = self.activation_checkpointing and self.training and torch.is_grad_enabled()
        for block in self.blocks:
            if recompute:  # the RNG state is replayed, so dropout masks match (tested)
                tokens = checkpoint(block, tokens, rotations, mask, use_reentrant=False)
            else:
                tokens = block(tokens, rotations, mask)
        return self.heads(tokens, dtype)

    def embed(
        self,
        x_in: Tensor,
        t: Tensor | float,
        w: Tensor | float | None = None,
        gate: Tensor | float = 0.0,
        key_mask: Tensor | None = None,
    ) -> tuple[Tensor, Tensor | None]:
        """:meth:`forward`'s input side (arguments as there), outside any autocast (spec §3).

        Returns:
            (tokens (B, P+L, D) = [prefix | projected input] in the parameters' dtype, the
            attention mask (B, 1, 1, P+L) from ``key_mask`` or None).
        """
        cfg = self.cfg
        E = cfg.encoder_dim
        widths = (E, 2 * E) if cfg.self_condition else (E,)
        if x_in.dim() != 3 or x_in.shape[-1] not in widths:
            raise ELFError(
                f"network input must be (B, L, E) or (B, L, 2E) with E={E}"
                f" (2E needs self_condition), got {tuple(x_in.shape)}"
            )
        B, L, _ = x_in.shape
        if cfg.max_length < L:
            raise ELFError(
                f"sequence length {L} exceeds the model's max_length {cfg.max_length}; "
                "truncate the input or use a model built with a larger max_length"
            )
        dev = x_in.device
        t = _per_row(t, B, dev)
        gate = _per_row(gate, B, dev)
        if cfg.num_scale_tokens > 0 and w is None:
            raise ELFError("this model has SC-CFG scale tokens: pass a guidance scale w")
        with full_precision(dev):  # under bf16 autocast only the blocks run in bf16 (spec §3)
            # The reference projects only 2E-wide inputs: an E-wide input skips self_cond_proj.
            x = self.self_cond_proj(x_in) if x_in.shape[-1] == 2 * E else x_in  # (B, L, E)
            x = self.text_proj(x)  # (B, L, D)
            prefix = [self.t_emb_tokens + self.t_embedder(t)[:, None, :]]  # (B, n_t, D)
            if cfg.num_scale_tokens > 0:
                w = _per_row(w, B, dev)
                scale = self.self_cond_cfg_embedder(w)[:, None, :]
                prefix.append(self.self_cond_cfg_tokens + scale)
            # NOTE: in denoise mode the mode tokens are zero vectors that still occupy positions.
            prefix.append(self.mode_tokens * gate.to(self.mode_tokens.dtype)[:, None, None])
            tokens = torch.cat([p.expand(B, -1, -1) for p in prefix] + [x], dim=1)  # (B, P+L, D)
        if key_mask is None:
            return tokens, None
        if key_mask.shape != (B, L):
            raise ELFError(f"key_mask must be (B, L) = {(B, L)}, got {tuple(key_mask.shape)}")
        if key_mask.device.type == "cpu" and bool(key_mask.all()):
            # No padding: no mask, so attention takes its fused kernels (flash, cuDNN). Only a
            # mask on the host is read; one on an accelerator is kept (reading it would wait).
            return tokens, None
        full = torch.cat([key_mask.new_ones(B, cfg.num_prefix_tokens), key_mask], dim=1).bool()
        return tokens, full[:, None, None, :]  # (B, 1, 1, P+L)

    def heads(self, tokens: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """:meth:`forward`'s output side: (x_pred (B, L, E), hidden (B, L, D) in ``dtype``, the
        dtype :meth:`embed` gave) from the blocks' output tokens (B, P+L, D)."""
        hidden = tokens[:, self.cfg.num_prefix_tokens :].to(dtype)  # (B, L, D)
        with full_precision(tokens.device):
            return self.final_layer(hidden), hidden

    def rotations(self, length: int, device: torch.device) -> Tensor:
        """:func:`rope_tables` (P + L, hd / 2) for ``length`` sequence tokens, computed once per
        (length, device) and shared read-only (kept outside the model: forward changes nothing)."""
        cfg = self.cfg
        return _shared_rope_tables(
            cfg.num_prefix_tokens, length, cfg.head_dim, cfg.rope_theta, torch.device(device)
        )

    def decode_logits(self, hidden: Tensor) -> Tensor:
        """Decoder head on hidden states (..., D) -> logits (..., V), outside any autocast."""
        with full_precision(hidden.device):
            return self.decoder(hidden.to(self.decoder.proj.weight.dtype))

    def decode_loss(self, hidden: Tensor, ids: Tensor, weights: Tensor) -> tuple[Tensor, Tensor]:
        """The decoder head's cross-entropy on hidden states (R, L, D) against ``ids`` (R, L):
        (sum of ``weights`` (R, L) x CE, the per-token CE (R, L), detached), in fp32, never
        holding the (R, L, V) logits (:class:`DecoderHead` with targets)."""
        return self.decoder(hidden.to(self.decoder.proj.weight.dtype), ids, weights)


def _per_row(value: Tensor | float, batch: int, device: torch.device) -> Tensor:
    if isinstance(value, Tensor):
        value = value.to(device=device, dtype=torch.float32)
        if value.dim() == 0:
            return value.expand(batch)
        if value.shape != (batch,):
            raise ELFError(f"per-row scalars must have shape ({batch},), got {tuple(value.shape)}")
        return value
    return torch.full((batch,), float(value), device=device)


def build_model(cfg: ModelConfig, device: torch.device | str | None = None) -> ELF:
    """Construct and initialise a model (three steps: shapes, placement, init)."""
    check_fits(cfg, device or "cpu", 4, "for its weights")
    with torch.device("meta"):
        model = ELF(cfg)
    model.to_empty(device=device or "cpu")
    model.init_weights()
    return model


def count_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())
