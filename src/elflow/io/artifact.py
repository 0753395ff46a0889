"""elflow's model artifact: the model folder, its config, saving and loading (ELF_SPEC §10).

A model is a folder with ``model.safetensors`` (the weights to sample with) and ``config.json``
(:class:`ArtifactConfig`: network dims, encoder and tokenizer, latent normalisation, lengths, task,
padding policy, noise scale, t_eps, sampler defaults). A training checkpoint folder adds
``ema.safetensors`` (preferred for sampling). :func:`load_model` accepts any model source: such a
folder, a run folder (its latest ``checkpoint-<step>``), an elflow model on the Hub, or an authors'
checkpoint (pickle file, folder of ``checkpoint_<step>`` files, or a Hub id), resolved by
:mod:`elflow.io.model_sources`.

This module is the public face for the :class:`~elflow.model.ELF` network: the config lives in
:mod:`elflow.io.artifact_config`, the weight files in :mod:`elflow.io.safetensors_files`, and
saving and loading for any network class in :mod:`elflow.io.model_folder`; their names used from
here before are importable from here still.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from elflow.errors import ELFError
from elflow.io.artifact_config import (
    FORMAT,
    FORMAT_VERSION,
    KEYS_SINCE_0_2,
    SAMPLER_KEYS_SINCE_0_2,
    ArtifactConfig,
    official_artifact_config,
    read_config,
)
from elflow.io.model_folder import (
    CARD,
    MODEL_FILES,
    TOKENIZER_DIR,
    load_network,
    save_network,
    unwrap_network,
)
from elflow.io.model_sources import ResolvedSource, resolve_source
from elflow.io.safetensors_files import (
    check_finite_weights,
    read_sharded,
    shard_bytes,
    weight_files,
)
from elflow.model import ELF

__all__ = [
    "CARD",
    "FORMAT",
    "FORMAT_VERSION",
    "KEYS_SINCE_0_2",
    "MODEL_FILES",
    "SAMPLER_KEYS_SINCE_0_2",
    "TOKENIZER_DIR",
    "ArtifactConfig",
    "check_finite_weights",
    "import_official",
    "load_model",
    "load_resolved",
    "official_artifact_config",
    "read_config",
    "read_sharded",
    "save_model",
    "shard_bytes",
    "unwrap",
    "weight_files",
]


def save_model(
    folder: str | Path,
    model: ELF,
    config: ArtifactConfig,
    ema_state: dict[str, torch.Tensor] | None = None,
    *,
    overwrite: bool = False,
    max_shard_size: int | str | None = None,
) -> Path:
    """Write ``model.safetensors`` (+ ``ema.safetensors``) and ``config.json``, each atomically
    (:func:`elflow.io.model_folder.save_network`, whose checks and options apply).

    ``model`` may be wrapped (``torch.compile``, DDP): its :class:`ELF` is saved. A folder that
    already holds a model is refused unless ``overwrite``; ``max_shard_size`` (bytes, or e.g.
    ``"15MiB"``) writes larger weights as Hugging Face-style shards.
    """
    return save_network(
        ELF,
        folder,
        model,
        config,
        ema_state,
        overwrite=overwrite,
        max_shard_size=max_shard_size,
    )


def unwrap(model: Any) -> ELF:
    """The :class:`ELF` inside ``torch.compile`` and DDP wrappers (whose keys carry prefixes)."""
    return unwrap_network(ELF, model)


def load_model(
    source: str | Path,
    *,
    use_ema: bool = True,
    device: torch.device | str = "cpu",
    task: str | None = None,
) -> tuple[ELF, ArtifactConfig]:
    """Load any model source into an :class:`ELF` in eval mode, with its config.

    Args:
        source: an elflow model/checkpoint/run folder, an authors' checkpoint file or folder, or a
            Hub id of either.
        use_ema: sample with the EMA weights when the source has them (the default everywhere).
        task: for authors' checkpoints only: the paper task ('owt', 'de-en', 'xsum'); guessed from
            the name when None.
    """
    return load_resolved(resolve_source(source), use_ema, device, task)


def load_resolved(
    resolved: ResolvedSource, use_ema: bool, device: torch.device | str, task: str | None
) -> tuple[ELF, ArtifactConfig]:
    """:func:`load_model` of a source already resolved (:func:`resolve_source`)."""
    return load_network(ELF, resolved, use_ema, device, task)


def import_official(
    source: str | Path, out: str | Path, *, task: str | None = None, use_ema: bool = True, **fields
) -> Path:
    """Convert an authors' checkpoint into an elflow model folder (EMA weights by default)."""
    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ELFError(f"out={out} already exists and is not an empty folder; give a new folder")
    resolved = resolve_source(source)
    if resolved.kind != "official":
        raise ELFError(f"{source!r} is not an authors' checkpoint (it is already an elflow model)")
    model, config = load_resolved(resolved, use_ema, "cpu", task)
    return save_model(out, model, replace(config, **fields))
