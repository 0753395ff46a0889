"""The frozen encoder a model's latents come from (ELF_SPEC §1, §10): the one description of it.

A run config's ``encoder`` section and a model folder's encoder fields (its ``config.json`` keeps
its flat keys: ``encoder``, ``encoder_layer``, ``tokenizer``, ``latent_mean``, ``latent_std``;
:attr:`elflow.io.artifact_config.ArtifactConfig.encoder_config`) are both this dataclass;
:func:`elflow.text.encoder.load_encoder` builds the encoder from it.
"""

from __future__ import annotations

from dataclasses import dataclass

from elflow.config.model_config import T5_SMALL
from elflow.errors import ELFError


@dataclass(frozen=True)
class EncoderConfig:
    """The frozen encoder and its latent normalisation (ELF_SPEC §1, §10)."""

    name: str = T5_SMALL
    """Hub id, local folder, or the offline alias 'minilm'."""
    tokenizer: str = ""
    """Tokenizer id or folder; empty = the encoder's own."""
    latent_mean: float = 0.0
    """Latents are (h - latent_mean) / latent_std."""
    latent_std: float = 0.2
    """0.2 for T5-small (the paper's); 0 = measure it on the training data at start-up."""
    layer: int = 0
    """0 = the encoder's output (the paper's); k = its block k's output (docs/differences.md)."""
    precision: str = "auto"
    """The frozen encoder's compute dtype in training: auto (bf16 on CUDA, fp32 elsewhere),
    bf16 or fp32 (the latents' last bits; a latent cache built in one is not reused by the
    other)."""

    def __post_init__(self) -> None:
        if self.precision not in ("auto", "bf16", "fp32"):
            raise ELFError(f"encoder.precision must be auto, bf16 or fp32, got {self.precision!r}")
        if self.latent_std < 0:
            raise ELFError(f"encoder.latent_std must be >= 0 (0 = measure), got {self.latent_std}")
        if self.layer < 0:
            raise ELFError(f"encoder.layer must be >= 0 (0 = the output), got {self.layer}")

    @property
    def tokenizer_name(self) -> str:
        return self.tokenizer or self.name
