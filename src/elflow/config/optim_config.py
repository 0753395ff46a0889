"""The optimiser's settings (ELF_SPEC §3 "Optimiser"): the ``optim`` section of a run config.

Plain data, so that configs import no torch: :mod:`elflow.train.optim` builds the optimiser and
the lr schedule from it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from elflow.errors import require


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
