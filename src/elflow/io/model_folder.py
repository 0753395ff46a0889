"""Saving and loading a model folder for any network class (ELF_SPEC §10).

The class is an argument, so this module imports no network: :mod:`elflow.io.artifact` gives
these functions :class:`elflow.model.ELF` (``elflow.load_model``, ``elflow.save_model``), and
:class:`elflow.io.pretrained_mixin.PretrainedMixin` the class it is called on
(``ELF.from_pretrained``). A folder holds ``model.safetensors`` (or shards), ``config.json``
(:class:`~elflow.io.artifact_config.ArtifactConfig`) and, for a training checkpoint,
``ema.safetensors``; an authors' checkpoint is converted on loading (:mod:`elflow.io.official`).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any, TypeVar

import torch
from torch import nn

from elflow.errors import ELFError, note_once
from elflow.io.artifact_config import FORMAT, ArtifactConfig, official_artifact_config, read_config
from elflow.io.manifest import intact
from elflow.io.model_sources import (
    CONFIG,
    EMA_WEIGHTS,
    WEIGHTS,
    WEIGHTS_INDEX,
    ResolvedSource,
    guess_task,
    run_checkpoints,
)
from elflow.io.official import load_state_dict_strict, official_to_elflow, read_official_checkpoint
from elflow.io.paths import save_safetensors
from elflow.io.safetensors_files import (
    atomic_write,
    check_finite_weights,
    read_safetensors,
    read_sharded,
    remove_weights,
    shard_bytes,
    weight_files,
    write_weights,
)
from elflow.runtime.hardware import check_fits

Network = TypeVar("Network", bound=nn.Module)

TOKENIZER_DIR, CARD = "tokenizer", "README.md"
MODEL_FILES = (CONFIG, WEIGHTS, WEIGHTS_INDEX, EMA_WEIGHTS, TOKENIZER_DIR, CARD)
"""What a model folder holds (its tokenizer and model card written by ``ELFPipeline``):
:func:`save_network` replaces any of them only with ``overwrite=True``."""


def save_network(
    network: type[nn.Module],
    folder: str | Path,
    model: nn.Module,
    config: ArtifactConfig,
    ema_state: dict[str, torch.Tensor] | None = None,
    *,
    overwrite: bool = False,
    max_shard_size: int | str | None = None,
) -> Path:
    """Write ``model.safetensors`` (+ ``ema.safetensors``) and ``config.json``, each atomically.

    ``model`` may be wrapped (``torch.compile``, DDP): the ``network`` inside is saved.
    Everything is checked before the first file is written. A folder that already holds any of
    :data:`MODEL_FILES` is refused unless ``overwrite``, which replaces the model: the files of
    the earlier one that this save does not write (``ema.safetensors``, ``tokenizer/``,
    ``README.md``) are removed, so that loading never reads them with these weights.
    With ``max_shard_size`` (bytes, or e.g. ``"15MiB"``), weights larger than that are written
    as Hugging Face-style shards (``model-00001-of-0000N.safetensors`` and
    ``model.safetensors.index.json``) instead of one ``model.safetensors``; the EMA weights are
    then not saved beside them (save them as the model's weights).
    """
    folder = Path(folder)
    model = unwrap_network(network, model)
    if config.model != model.cfg:
        raise ELFError("artifact config's model section does not match the network's config")
    if folder.exists() and not folder.is_dir():
        raise ELFError(f"{folder} is a file; save the model to a folder")
    if (folder / "state.json").is_file() or (folder.is_dir() and run_checkpoints(folder)):
        raise ELFError(
            f"{folder} is a training checkpoint or run folder; save the model to another folder"
        )
    held = [
        name for name in MODEL_FILES if (folder / name).exists() or (folder / name).is_symlink()
    ]
    if held and not overwrite:
        raise ELFError(
            f"{folder} already holds {', '.join(held)}; save to a new folder, or pass "
            "overwrite=True to replace that model"
        )
    state = model.state_dict()
    if ema_state is not None:
        _check_ema_state(ema_state, state)
    limit = None if max_shard_size is None else shard_bytes(max_shard_size)
    if limit is not None and ema_state is not None:
        raise ELFError("max_shard_size shards the model's weights alone; save without ema_state")
    folder.mkdir(parents=True, exist_ok=True)

    def weights(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {k: v.detach().to("cpu").contiguous() for k, v in state.items()}

    meta = {"format": FORMAT}
    written = write_weights(folder, weights(state), meta, limit)
    remove_weights(folder, keep=written)  # an earlier save's in the other layout
    if ema_state is not None:
        atomic_write(folder / EMA_WEIGHTS, lambda p: save_safetensors(weights(ema_state), p, meta))
    stale = [EMA_WEIGHTS] if ema_state is None else []
    for name in [*stale, TOKENIZER_DIR, CARD]:
        path = folder / name
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        elif path.exists() or path.is_symlink():
            path.unlink()
    text = json.dumps(config.to_json(), indent=2) + "\n"
    atomic_write(folder / CONFIG, lambda p: Path(p).write_text(text))
    return folder


def unwrap_network(network: type[Network], model: Any) -> Network:
    """The ``network`` inside ``torch.compile`` and DDP wrappers (whose keys carry prefixes)."""
    while not isinstance(model, network):
        inner = getattr(model, "_orig_mod", None) or getattr(model, "module", None)
        if inner is None:
            raise ELFError(
                f"expected an elflow {network.__name__} network, got {type(model).__name__}"
            )
        model = inner
    return model


def _check_ema_state(ema: Any, state: dict[str, torch.Tensor]) -> None:
    """``ema`` must be a tensor per weight of the network, shape for shape (a plain state dict:
    ``EMA.state_dict()["shadow"]``, not the EMA's whole state)."""
    if not isinstance(ema, dict) or not all(isinstance(v, torch.Tensor) for v in ema.values()):
        raise ELFError("ema_state must map weight names to tensors (e.g. EMA.shadow)")
    if set(ema) != set(state):
        missing, extra = sorted(set(state) - set(ema)), sorted(set(ema) - set(state))
        raise ELFError(
            f"ema_state does not match the network: missing {missing[:3]}, extra {extra[:3]}"
        )
    for name, value in state.items():
        if ema[name].shape != value.shape:
            raise ELFError(
                f"ema_state[{name!r}] has shape {tuple(ema[name].shape)}, the network's "
                f"{tuple(value.shape)}; it is another model's EMA"
            )


def load_network(
    network: type[Network],
    resolved: ResolvedSource,
    use_ema: bool,
    device: torch.device | str,
    task: str | None,
) -> tuple[Network, ArtifactConfig]:
    """A resolved model source as a ``network`` (built from the config's ``model`` section) in
    eval mode, with its config; the arguments as :func:`elflow.io.artifact.load_model`'s."""
    if resolved.kind == "official":
        state = read_official_checkpoint(resolved.path, use_ema=use_ema)
        if task is None:
            task, far = guess_task(resolved.name)
            if task is None:
                task, far = guess_task(str(resolved.path))
            if far:
                note_once(
                    f"elflow: note: {resolved.name} taken as the paper's '{task}' task from a "
                    "folder above it; pass --task (task=) if that is wrong"
                )
        if task is None:
            task = "owt"
            note_once(
                f"elflow: note: {resolved.name} names no paper task; taken as 'owt' "
                "(unconditional); pass --task de-en or xsum (task=), or convert it once with "
                "elflow import --task"
            )
        config = official_artifact_config(state, task, origin=resolved.name)
        state = official_to_elflow(state)
    else:
        if task is not None:
            raise ELFError(
                f"task= applies to authors' checkpoints; {resolved.name} is an elflow "
                "model, whose config.json gives its task"
            )
        folder = resolved.path
        ema = folder / EMA_WEIGHTS
        training = (folder / "state.json").is_file()  # checkpoint.STATE (it imports us)
        if use_ema and not ema.is_file() and training:
            raise ELFError(
                f"{folder} is a training checkpoint without its {EMA_WEIGHTS}; restore "
                "the file, or sample its training weights with use_ema=False"
            )
        name = EMA_WEIGHTS if use_ema and ema.is_file() else WEIGHTS
        # A run folder's latest checkpoint, if damaged, gives way to the newest intact one.
        in_run = Path(resolved.name).expanduser().resolve() == folder.parent.resolve()
        sharded = name == WEIGHTS and not (folder / WEIGHTS).is_file()
        files = weight_files(folder) if sharded else [name]
        folder = intact(folder, fallback=in_run, doing="loading", only=[CONFIG, *files])
        config = read_config(folder)
        check_fits(config.model, device, 4, "for its weights")
        state = read_sharded(folder) if sharded else read_safetensors(folder / name)
    check_finite_weights(state, resolved.path if resolved.kind == "official" else folder)
    with torch.device("meta"):
        model = network(config.model)
    model.to_empty(device=device)
    load_state_dict_strict(model, {k: v.to(device) for k, v in state.items()})
    return model.eval(), config
