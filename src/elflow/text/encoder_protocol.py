"""What elflow needs of a frozen text encoder (ELF_SPEC §1, §3 step 1, §10): the
:class:`Encoder` protocol.

Training, the latent cache, held-out losses, projected sampling and conditional generation use an
encoder only through these members; :class:`elflow.text.encoder.FrozenEncoder` (a Hugging Face
T5-family or BERT-like stack) implements it, and a new encoder family implements the same members.
"""

from __future__ import annotations

from typing import Protocol, TypeVar, runtime_checkable

import torch
from torch import Tensor

Self_ = TypeVar("Self_", bound="Encoder")


@runtime_checkable
class Encoder(Protocol):
    """A frozen encoder: token ids in, normalised fp32 latents out; never trained."""

    name: str | None
    """The encoder's name or folder as it was loaded (recorded beside measured statistics)."""
    latent_mean: float
    """Latents are (h - latent_mean) / latent_std (spec §10)."""
    latent_std: float
    """See ``latent_mean``; set after measuring it on the training data."""
    layer: int
    """0: the encoder's output; k > 0: the output of its block k."""

    @property
    def hidden_size(self) -> int:
        """E, the width of the latents."""
        ...

    @property
    def dtype(self) -> torch.dtype:
        """The encoder's compute dtype (its latents are fp32 whatever it is)."""
        ...

    @property
    def device(self) -> torch.device:
        """Where the encoder's weights are."""
        ...

    @property
    def max_positions(self) -> int | None:
        """The longest row it embeds, or None when any length goes."""
        ...

    def check_length(self, length: int) -> None:
        """A one-line error for rows longer than :attr:`max_positions`."""
        ...

    def encode_raw(
        self,
        input_ids: Tensor,
        attention_mask: Tensor,
        cond_mask: Tensor | None = None,
        label_drop: Tensor | None = None,
    ) -> Tensor:
        """Unnormalised fp32 hidden states (B, L, E) of (B, L) ids under the spec §4 mask
        (``cond_mask``: source positions; ``label_drop``: rows whose target ignores the source)."""
        ...

    def __call__(
        self,
        input_ids: Tensor,
        attention_mask: Tensor,
        cond_mask: Tensor | None = None,
        label_drop: Tensor | None = None,
    ) -> Tensor:
        """Normalised latents (B, L, E) in fp32: :meth:`encode_raw`, then the normalisation."""
        ...

    def to(self: Self_, *args, **kwargs) -> Self_:
        """The encoder moved to a device (and dtype), as ``nn.Module.to``."""
        ...
