"""The training objective's settings (ELF_SPEC §3): a frozen dataclass validated in
``__post_init__``, defaults the released OWT values. Nothing here imports torch."""

from __future__ import annotations

from dataclasses import dataclass

from elflow.errors import require


@dataclass(frozen=True)
class ObjectiveConfig:
    """The training objective's settings (ELF_SPEC §3); defaults are the released OWT values."""

    t_eps: float = 0.05
    """Velocity denominators are max(1 - t, t_eps)."""
    noise_scale: float = 2.0
    """s: the path's noise scale, z_t = t x + (1 - t) s eps."""
    time_mean: float = -1.5
    """t = sigmoid(N(time_mean, time_std))."""
    time_std: float = 0.8
    """See ``time_mean``."""
    decoder_prob: float = 0.2
    """p: probability that an example takes the decoder (cross-entropy) branch."""
    decoder_noise_scale: float = 5.0
    """sigma_d of the decoder branch's corrupted input (5 for OWT, 1 for seq2seq)."""
    decoder_mean: float = 0.8
    """Decoder branch mixing weight lambda = sigmoid(N(decoder_mean, decoder_std)) per token."""
    decoder_std: float = 0.8
    """See ``decoder_mean``."""
    self_cond_prob: float = 0.5
    """Probability that the trained pass receives the self-conditioning prediction."""
    w_min: float = 0.5
    """Smallest SC-CFG scale w (1 + w is log-uniform on [1 + w_min, 1 + w_max])."""
    w_max: float = 5.0
    """Largest SC-CFG scale w."""
    label_drop_prob: float = 0.0
    """Conditional tasks: probability that an example's condition is dropped (0.1 in the paper)."""
    pad_with_eos: bool = False
    """True when the task pads with EOS (seq2seq): padding positions are then trained on."""
    span_cond_prob: float = 0.0
    """Infilling training, an elflow addition (0 = the paper's): the share of unconditional rows
    that keep all but one random span of their text (10-60% of it) as clean condition, as
    infilling samples with it."""

    def __post_init__(self) -> None:
        for name in ("decoder_prob", "self_cond_prob", "label_drop_prob", "span_cond_prob"):
            v = getattr(self, name)
            require(0.0 <= v <= 1.0, f"objective.{name} must be in [0, 1], got {v}")
        require(0.0 < self.t_eps <= 1.0, f"objective.t_eps must be in (0, 1], got {self.t_eps}")
        for name in ("noise_scale", "decoder_noise_scale", "time_std", "decoder_std"):
            require(getattr(self, name) > 0, f"objective.{name} must be positive")
        require(
            -1.0 < self.w_min <= self.w_max,
            f"objective needs -1 < w_min <= w_max, got w_min={self.w_min}, w_max={self.w_max}",
        )
