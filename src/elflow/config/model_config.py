"""The ELF network's shape and its presets (ELF_SPEC §1, §2), and the paper's tasks.

A frozen dataclass validated in ``__post_init__``; defaults are the paper's released values, not
the reference code's class defaults. Presets are plain functions in :data:`MODEL_PRESETS`. Each
field's docstring is its documentation and its command-line help. Nothing here imports torch.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from elflow.errors import ELFError, require

T5_SMALL = "google-t5/t5-small"
"""The paper's frozen encoder and tokenizer (ELF_SPEC §1)."""


@dataclass(frozen=True)
class ModelConfig:
    """The ELF network's shape (ELF_SPEC §2)."""

    encoder_dim: int = 512
    """E: width of the frozen encoder's latents (512 for T5-small)."""
    vocab_size: int = 32100
    """V: size of the decoder head, ``len(tokenizer)``."""
    max_length: int = 1024
    """Longest sequence the network accepts (RoPE table size)."""
    hidden_size: int = 768
    """D: transformer width."""
    depth: int = 12
    """Number of transformer blocks."""
    num_heads: int = 12
    """Attention heads; D must be divisible by it."""
    mlp_ratio: float = 4.0
    """SwiGLU hidden size is int(int(mlp_ratio * D) * 2 / 3)."""
    bottleneck_dim: int = 128
    """Width of the input bottleneck E -> bottleneck -> D."""
    num_time_tokens: int = 4
    """Prefix tokens carrying the time embedding."""
    num_scale_tokens: int = 4
    """Prefix tokens carrying the SC-CFG scale w (0: the model has no scale tokens)."""
    num_mode_tokens: int = 4
    """Prefix tokens switching between denoise (gate 0) and decode (gate 1) mode."""
    self_condition: bool = True
    """Input is [z_t, x_selfcond] (2E wide) and goes through ``self_cond_proj``."""
    dropout: float = 0.0
    """Dropout in the middle half of the blocks (0 in every released config)."""
    rope_theta: float = 10000.0
    """RoPE base."""

    def __post_init__(self) -> None:
        for name in ("encoder_dim", "vocab_size", "max_length", "hidden_size", "depth"):
            require(
                getattr(self, name) > 0, f"model.{name} must be positive, got {getattr(self, name)}"
            )
        require(self.num_heads > 0, f"model.num_heads must be positive, got {self.num_heads}")
        require(
            self.hidden_size % self.num_heads == 0,
            f"model.hidden_size {self.hidden_size} is not divisible by num_heads {self.num_heads}",
        )
        require(self.head_dim % 2 == 0, f"model head_dim {self.head_dim} must be even for RoPE")
        require(
            self.bottleneck_dim > 0,
            f"model.bottleneck_dim must be positive, got {self.bottleneck_dim}",
        )
        require(self.mlp_ratio > 0, f"model.mlp_ratio must be positive, got {self.mlp_ratio}")
        for name in ("num_time_tokens", "num_scale_tokens", "num_mode_tokens"):
            require(
                getattr(self, name) >= 0, f"model.{name} must be >= 0, got {getattr(self, name)}"
            )
        require(
            self.num_time_tokens > 0, "model.num_time_tokens must be >= 1 (time must reach the net)"
        )
        require(
            self.num_mode_tokens > 0, "model.num_mode_tokens must be >= 1 (decode mode needs them)"
        )
        require(0.0 <= self.dropout < 1.0, f"model.dropout must be in [0, 1), got {self.dropout}")
        require(self.rope_theta > 0, f"model.rope_theta must be positive, got {self.rope_theta}")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def mlp_hidden(self) -> int:
        return int(int(self.mlp_ratio * self.hidden_size) * 2 / 3)

    @property
    def num_prefix_tokens(self) -> int:
        return self.num_time_tokens + self.num_scale_tokens + self.num_mode_tokens

    @property
    def num_parameters(self) -> int:
        """The network's parameter count, worked out from the shapes alone (no allocation)."""
        D, E, F, B, hd = (
            self.hidden_size,
            self.encoder_dim,
            self.mlp_hidden,
            self.bottleneck_dim,
            self.head_dim,
        )
        embedder = 256 * D + D + D * D + D  # a timestep embedder's two layers
        n = E * B + B * D + D + embedder + (self.num_time_tokens + self.num_mode_tokens) * D
        if self.self_condition:
            n += 2 * E * E + E
        if self.num_scale_tokens:
            n += embedder + self.num_scale_tokens * D
        block = 2 * D + 3 * D * D + 3 * D + 2 * hd + D * D + D + 2 * D * F + 2 * F + F * D + D
        n += self.depth * block
        n += D + D * E + E  # the flow head
        n += D * E + E + E * self.vocab_size + self.vocab_size  # the decoder head
        return n


PAPER_TASKS: dict[str, dict[str, Any]] = {
    "owt": dict(max_length=1024, task="unconditional", max_input_length=0, pad_with_eos=False),
    "de-en": dict(max_length=128, task="conditional", max_input_length=64, pad_with_eos=True),
    "xsum": dict(max_length=1088, task="conditional", max_input_length=1024, pad_with_eos=True),
}
"""The paper's tasks, for the authors' checkpoints, which record none (ELF_SPEC §4, §5)."""


def elf_b(**overrides: Any) -> ModelConfig:
    """ELF-B: depth 12, D 768, 12 heads (ELF_SPEC §2)."""
    return ModelConfig(**{"depth": 12, "hidden_size": 768, "num_heads": 12, **overrides})


def elf_m(**overrides: Any) -> ModelConfig:
    """ELF-M: depth 24, D 1056, 16 heads."""
    return ModelConfig(**{"depth": 24, "hidden_size": 1056, "num_heads": 16, **overrides})


def elf_l(**overrides: Any) -> ModelConfig:
    """ELF-L: depth 32, D 1280, 16 heads."""
    return ModelConfig(**{"depth": 32, "hidden_size": 1280, "num_heads": 16, **overrides})


def elf_small(**overrides: Any) -> ModelConfig:
    """A CPU-sized network: depth 6, D 256, 4 heads (the CPU pilot's size)."""
    return ModelConfig(**{"depth": 6, "hidden_size": 256, "num_heads": 4, **overrides})


def elf_tiny(**overrides: Any) -> ModelConfig:
    """A test-sized network: depth 2, D 64, 4 heads, bottleneck 16."""
    base = {"depth": 2, "hidden_size": 64, "num_heads": 4, "bottleneck_dim": 16}
    return ModelConfig(**{**base, **overrides})


MODEL_PRESETS: dict[str, Callable[..., ModelConfig]] = {
    "elf-b": elf_b,
    "elf-m": elf_m,
    "elf-l": elf_l,
    "elf-small": elf_small,
    "elf-tiny": elf_tiny,
}


def model_preset(name: str, **overrides: Any) -> ModelConfig:
    """Build a registered model preset, e.g. ``model_preset("elf-b", encoder_dim=384)``."""
    if name not in MODEL_PRESETS:
        raise ELFError(f"unknown model preset {name!r}; choose one of {sorted(MODEL_PRESETS)}")
    return MODEL_PRESETS[name](**overrides)
