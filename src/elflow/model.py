"""The ELF network (paper §3; ELF_SPEC §2).

A pre-norm transformer over [time tokens | SC-CFG scale tokens | mode tokens | L sequence tokens].
All conditioning is in-context (no adaLN). The flow head predicts clean latents (x-prediction); the
decoder head turns the final hidden states into token logits and is only evaluated when asked for
(:meth:`ELF.decode_logits`), so denoising never pays for the V-way projection. Inference under
bf16 autocast (eval mode, no gradients: sampling) runs the blocks through :func:`lowp_block` on a
cached bf16 copy of their weights instead of casting every weight at every call.

The network knows nothing about noise, time grids or guidance: see ``flow.py`` and ``sampling.py``.
Parameter names follow the authors' released state dicts so the import key map stays small.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from elflow.config import ModelConfig
from elflow.errors import ELFError
from elflow.hardware import LowpLinear, full_precision, memory_bytes


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
        rotations: (N, 1, 1, hd / 2) complex, :meth:`ELF.rotations` with ``lowp=True``.
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

    def forward(self, h: Tensor) -> Tensor:
        return self.unembed(F.gelu(self.proj(h), approximate="tanh"))


class ELF(nn.Module):
    """The ELF network. Build on any device (``meta`` included), then call :meth:`init_weights`."""

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
        self.lowp_inference = True
        """Under bf16 (or fp16) autocast in eval mode without gradients, run the blocks on cached
        low-precision weights (:meth:`lowp_blocks`); False: per-op autocast, as in training."""
        self._rope: dict[tuple[int, torch.device], tuple[Tensor, Tensor]] = {}
        self._lowp: tuple[tuple, list[LowpBlock]] | None = None

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
        """One network evaluation.

        Args:
            x_in: (B, L, 2E) = [z, x_selfcond], or (B, L, E) without self-conditioning.
            t: time per row (B,) or a scalar; t = 1 is data.
            w: SC-CFG scale per row (B,) or a scalar; required iff the model has scale tokens.
            gate: mode gate per row (B,) or a scalar: 0 denoise, 1 decode.
            key_mask: optional (B, L) attention key mask, 1 = valid (prefix keys always valid).

        Returns:
            (x_pred (B, L, E), hidden (B, L, D)); feed ``hidden`` to :meth:`decode_logits`.
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
        P, dtype = cfg.num_prefix_tokens, tokens.dtype

        mask = None
        if key_mask is not None:
            if key_mask.shape != (B, L):
                raise ELFError(f"key_mask must be (B, L) = {(B, L)}, got {tuple(key_mask.shape)}")
            full = torch.cat([key_mask.new_ones(B, P), key_mask], dim=1).bool()  # (B, P+L)
            mask = full[:, None, None, :]  # (B, 1, 1, P+L)
        lowp = self._lowp_dtype(dev)
        if lowp is not None:  # inference under autocast: the blocks on cached bf16 weights
            with full_precision(dev):
                rotations = self.rotations(L, dev, lowp=True)
                for weights in self.lowp_blocks(lowp):
                    tokens = lowp_block(tokens, weights, rotations, mask, cfg.num_heads)
        else:
            rotations = self.rotations(L, dev)
            recompute = self.activation_checkpointing and self.training and torch.is_grad_enabled()
            for block in self.blocks:
                if recompute:  # the RNG state is replayed, so dropout masks match (tested)
                    tokens = checkpoint(block, tokens, rotations, mask, use_reentrant=False)
                else:
                    tokens = block(tokens, rotations, mask)
        hidden = tokens[:, P:].to(dtype)  # (B, L, D)
        with full_precision(dev):
            return self.final_layer(hidden), hidden

    def rotations(self, length: int, device: torch.device, lowp: bool = False) -> Tensor:
        """:func:`rope_tables` for ``length`` sequence tokens, computed once per (length, device);
        ``lowp``: laid out (P + L, 1, 1, hd / 2) for :func:`lowp_block`."""
        key = (length, torch.device(device))
        if key not in self._rope:
            with torch.inference_mode(False):  # usable by a later training forward
                cfg = self.cfg
                table = rope_tables(
                    cfg.num_prefix_tokens, length, cfg.head_dim, cfg.rope_theta, device
                )
                self._rope[key] = (table, table[:, None, None])
        return self._rope[key][lowp]

    def _lowp_dtype(self, device: torch.device) -> torch.dtype | None:
        """The autocast dtype when the blocks run on cached low-precision weights (eval mode, no
        grad, autocast on; plain, unsharded parameters), else None (per-op autocast, as trained)."""
        if self.training or torch.is_grad_enabled() or not self.lowp_inference:
            return None
        if device.type not in ("cpu", "cuda") or not torch.is_autocast_enabled(device.type):
            return None
        if type(self.blocks[0].attn.qkv.weight) is not nn.Parameter:  # e.g. FSDP2's DTensors
            return None
        return torch.get_autocast_dtype(device.type)

    def lowp_blocks(self, dtype: torch.dtype) -> list[LowpBlock]:
        """The blocks' weights cast to ``dtype``, kept until a parameter changes (in place, or
        replaced) or the model goes back to training mode.

        NOTE: holds one low-precision copy of the blocks (ELF-B: ~170 MB in bf16) while cached.
        """
        params = self.blocks.parameters()
        key = (dtype, *((p.data_ptr(), p._version) for p in params))
        if self._lowp is None or self._lowp[0] != key:
            self._lowp = None  # free the old copy first
            with torch.no_grad():
                self._lowp = (key, [LowpBlock.of(block, dtype) for block in self.blocks])
        return self._lowp[1]

    def train(self, mode: bool = True) -> ELF:
        if mode:
            self._lowp = None  # training changes the weights: drop the low-precision copy
        return super().train(mode)

    def __getstate__(self) -> dict:
        # Copies and pickles leave the cache behind (oneDNN's packed weights have no storage).
        return {**super().__getstate__(), "_lowp": None}

    def decode_logits(self, hidden: Tensor) -> Tensor:
        """Decoder head on hidden states (..., D) -> logits (..., V), outside any autocast."""
        with full_precision(hidden.device):
            return self.decoder(hidden.to(self.decoder.proj.weight.dtype))


def _per_row(value: Tensor | float, batch: int, device: torch.device) -> Tensor:
    if isinstance(value, Tensor):
        value = value.to(device=device, dtype=torch.float32)
        if value.dim() == 0:
            return value.expand(batch)
        if value.shape != (batch,):
            raise ELFError(f"per-row scalars must have shape ({batch},), got {tuple(value.shape)}")
        return value
    return torch.full((batch,), float(value), device=device)


def check_fits(
    cfg: ModelConfig, device: torch.device | str, bytes_per_parameter: float, purpose: str
) -> None:
    """A one-line error, before anything is allocated, when ``cfg``'s network needs more than
    ``device`` has: ``bytes_per_parameter`` times its parameter count (4: fp32 weights)."""
    n = cfg.num_parameters
    need, have = n * bytes_per_parameter, memory_bytes(device)
    if have is not None and need > have:
        raise ELFError(
            f"the model config (hidden_size {cfg.hidden_size}, depth {cfg.depth}, vocab_size "
            f"{cfg.vocab_size}, encoder_dim {cfg.encoder_dim}) gives a network of {n:.3g} "
            f"parameters, which needs about {need / 1e9:.3g} GB {purpose}, more than the "
            f"{have / 1e9:.3g} GB of {torch.device(device).type}; check the config's model "
            "section"
        )


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
