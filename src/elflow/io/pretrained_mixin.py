"""``from_pretrained`` and ``save_pretrained`` for a network class (ELF_SPEC §10).

:class:`elflow.model.ELF` inherits :class:`PretrainedMixin`; the mixin hands its own class to
:mod:`elflow.io.model_folder`, so model I/O never imports the network.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

import torch

from elflow.io.model_folder import load_network, save_network
from elflow.io.model_sources import resolve_source

if TYPE_CHECKING:
    from elflow.io.artifact_config import ArtifactConfig

Network = TypeVar("Network", bound="PretrainedMixin")


class PretrainedMixin:
    """Model-folder I/O for an ``nn.Module`` built from its ``ModelConfig``
    (``cls(config.model)``)."""

    @classmethod
    def from_pretrained(
        cls: type[Network],
        source: str | Path,
        *,
        use_ema: bool = True,
        device: torch.device | str = "cpu",
        task: str | None = None,
    ) -> Network:
        """The network of any model source, in eval mode: :func:`elflow.io.artifact.load_model`
        without its config (an elflow folder, an authors' checkpoint, or a Hub id of either)."""
        return load_network(cls, resolve_source(source), use_ema, device, task)[0]

    def save_pretrained(
        self, folder: str | Path, config: ArtifactConfig, *, overwrite: bool = False
    ) -> Path:
        """Write this network and ``config`` as a model folder that :meth:`from_pretrained`
        loads: :func:`elflow.io.artifact.save_model`, whose checks apply (an existing model in
        ``folder`` is replaced only with ``overwrite=True``)."""
        return save_network(type(self), folder, self, config, overwrite=overwrite)
