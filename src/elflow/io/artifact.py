"""elflow's model artifact: the model folder, its config, saving and loading (ELF_SPEC §10).

A model is a folder with ``model.safetensors`` (the weights to sample with) and ``config.json``
(:class:`ArtifactConfig`: network dims, encoder and tokenizer, latent normalisation, lengths, task,
padding policy, noise scale, t_eps, sampler defaults). A training checkpoint folder adds
``ema.safetensors`` (preferred for sampling). :func:`load_model` accepts any model source: such a
folder, a run folder (its latest ``checkpoint-<step>``), an elflow model on the Hub, or an authors'
checkpoint (pickle file, folder of ``checkpoint_<step>`` files, or a Hub id), resolved by
:mod:`elflow.io.model_sources`.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from elflow.config import (
    PAPER_TASKS,
    T5_SMALL,
    ModelConfig,
    SamplerConfig,
    check_guidance,
    check_task,
    from_dict,
    to_dict,
)
from elflow.errors import ELFError, first_line, note_once
from elflow.io.manifest import intact
from elflow.io.model_sources import (
    CONFIG,
    EMA_WEIGHTS,
    WEIGHTS,
    WEIGHTS_INDEX,
    ResolvedSource,
    guess_task,
    resolve_source,
    run_checkpoints,
)
from elflow.io.official import (
    infer_model_config,
    load_state_dict_strict,
    official_to_elflow,
    read_official_checkpoint,
)
from elflow.io.paths import save_safetensors
from elflow.model import ELF, check_fits

FORMAT = "elflow-model"
FORMAT_VERSION = 1
TOKENIZER_DIR, CARD = "tokenizer", "README.md"
MODEL_FILES = (CONFIG, WEIGHTS, WEIGHTS_INDEX, EMA_WEIGHTS, TOKENIZER_DIR, CARD)
"""What a model folder holds (its tokenizer and model card written by ``ELFPipeline``):
:func:`save_model` replaces any of them only with ``overwrite=True``."""


SAMPLER_KEYS_SINCE_0_2 = {
    "gamma_schedule": "constant",
    "pc_snr": 0.1,
    "length": 0,
    "length_range": "",
    "refresh_from": 0.0,
}
"""Sampler keys a model's config.json leaves out at their defaults, so that elflow 0.1 loads it."""


@dataclass(frozen=True)
class ArtifactConfig:
    """Everything needed to sample from a model without guessing (ELF_SPEC §10)."""

    model: ModelConfig
    """Network dims and token counts."""
    sampler: SamplerConfig = field(default_factory=SamplerConfig)
    """Sampler defaults for this model."""
    encoder: str = T5_SMALL
    """Hub id or local folder of the frozen encoder."""
    encoder_layer: int = 0
    """0 = the encoder's output; k = the output of its block k."""
    tokenizer: str = T5_SMALL
    """Hub id or local folder of the tokenizer (a ``tokenizer/`` subfolder of the model wins)."""
    tokenizer_hash: str | None = None
    """sha256 of the tokenizer vocabulary (checked when the tokenizer is loaded)."""
    latent_mean: float = 0.0
    """Latents are (encoder output - latent_mean) / latent_std."""
    latent_std: float = 0.2
    """See ``latent_mean``; 0.2 for T5-small (the paper's)."""
    task: str = "unconditional"
    """'unconditional' or 'conditional' (source -> target)."""
    max_input_length: int = 0
    """Conditional tasks: source tokens kept (the target gets max_length - max_input_length)."""
    pad_with_eos: bool = False
    """True when the task pads with EOS (seq2seq)."""
    packed: bool = False
    """True when trained on packed rows (several texts a row: ``data.packing``); projected
    sampling, which re-encodes one text per row, does not apply."""
    noise_scale: float = 2.0
    """s: the path's noise scale."""
    t_eps: float = 0.05
    """Velocity denominators are max(1 - t, t_eps)."""
    length_histogram: tuple[int, ...] = ()
    """How many training texts had 0, 1, 2, ... tokens (special tokens not counted): the lengths
    ``length_range=data`` draws from; empty for models trained before it was recorded."""
    tokens_per_word: float = 0.0
    """Mean tokens per word of the training texts (``length_range=A:Bw``; 0: not recorded)."""
    origin: str = ""
    """Free-text provenance (e.g. the imported checkpoint)."""
    data: str = ""
    """The training data as the run named it (``data.path``: a Hub dataset or a local path); a
    training checkpoint's is read from its run config; empty: not recorded."""
    license: str = ""
    """The weights' licence as the Hub names it (e.g. ``apache-2.0``); empty: not stated."""

    def __post_init__(self) -> None:
        check_task(self.task, self.max_input_length, self.model.max_length)
        if not (math.isfinite(self.latent_std) and self.latent_std > 0):
            raise ELFError(f"latent_std must be a positive number, got {self.latent_std}")
        if not math.isfinite(self.latent_mean):
            raise ELFError(f"latent_mean must be a finite number, got {self.latent_mean}")
        if not self.conditional and self.max_input_length != 0:
            raise ELFError(
                f"max_input_length {self.max_input_length} applies to conditional models; "
                "an unconditional model has 0"
            )
        if not (math.isfinite(self.noise_scale) and self.noise_scale > 0):
            raise ELFError(f"noise_scale must be positive, got {self.noise_scale}")
        if not 0 < self.t_eps <= 1:
            raise ELFError(f"t_eps must be in (0, 1], got {self.t_eps}")
        if self.encoder_layer < 0:
            raise ELFError(f"encoder_layer must be >= 0 (0: the output), got {self.encoder_layer}")

    @property
    def conditional(self) -> bool:
        return self.task == "conditional"

    def check_sampler(self, sampler: SamplerConfig) -> None:
        """One-line errors for sampler settings this model cannot honour: guidance and
        projection on the wrong kind of model, a length it cannot give, and an SDE whose gamma
        left at an ODE model's gamma 0 is caught where the settings are given
        (:func:`elflow.cli.common.sampler_from_args`)."""
        check_guidance(self.task, sampler)
        if sampler.length and self.conditional:
            raise ELFError(
                "sampler.length applies to unconditional models; a conditional model writes its "
                "max_length - max_input_length target tokens"
            )
        if sampler.length > self.model.max_length:
            raise ELFError(
                f"sampler.length {sampler.length} exceeds the model's max_length "
                f"{self.model.max_length}"
            )
        if sampler.project_from < 1.0:
            self.check_projectable(f"sampler.project_from {sampler.project_from}")
        if sampler.length_range == "data" and not self.length_histogram:
            raise ELFError(
                "sampler.length_range data draws lengths from the histogram a model records of "
                "its training texts, and this one has none (trained before it was recorded); "
                "give a range, e.g. 10:30"
            )
        if sampler.length_range and self.model.max_length < 3:
            raise ELFError("sampler.length_range needs rows of at least 3 tokens")

    def check_projectable(self, what: str) -> None:
        """Projected sampling re-encodes one unconditional text per row: not for a conditional
        model, nor for one trained on packed rows (``what`` names the setting asking for it)."""
        if self.conditional or self.packed:
            why = "is conditional" if self.conditional else "was trained on packed rows"
            raise ELFError(
                f"{what} (projected sampling) re-encodes one unconditional text per row, but "
                f"this model {why}; turn it off (sampler.project_from 1)"
            )

    def sample_length(self, sampler: SamplerConfig) -> int:
        """The rows' length L a sample is drawn at (a conditional model: its max_length)."""
        return sampler.length or self.model.max_length

    def to_json(self) -> dict[str, Any]:
        data = to_dict(self)
        omitted = (
            "encoder_layer",
            "packed",
            "length_histogram",
            "tokens_per_word",
            "data",
            "license",
        )
        for key in omitted:
            # the defaults: configs earlier elflow loads
            if not data[key]:
                del data[key]
        for key, default in SAMPLER_KEYS_SINCE_0_2.items():
            if data["sampler"][key] == default:
                del data["sampler"][key]
        return {"format": FORMAT, "format_version": FORMAT_VERSION, **data}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> ArtifactConfig:
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            raise ELFError(
                "config.json is not an elflow model config (no 'format': 'elflow-model')"
            )
        data = dict(data)
        del data["format"]
        if "format_version" not in data:
            raise ELFError("config.json has no 'format_version'; it was not written by elflow")
        version = data.pop("format_version")
        if version != FORMAT_VERSION:
            raise ELFError(f"unsupported elflow model format_version {version}; upgrade elflow")
        run = data.pop("run", None)  # a training checkpoint's full run config (checkpoint.py)
        if "packed" not in data and isinstance(run, dict):  # saved before configs recorded it
            data["packed"] = bool(run.get("data", {}).get("packing", False))
        if "data" not in data and isinstance(run, dict):  # a training checkpoint's run config
            data["data"] = str(run.get("data", {}).get("path", ""))
        if data.get("task", "unconditional") == "unconditional":
            data["max_input_length"] = 0  # saved by earlier versions from an ignored setting
        counts = data.get("length_histogram", ())
        if not isinstance(counts, list | tuple) or not all(
            isinstance(c, int) and c >= 0 for c in counts
        ):
            raise ELFError("config.json's length_histogram must be a list of counts (ints >= 0)")
        data["length_histogram"] = tuple(counts)
        data["model"] = from_dict(ModelConfig, data.get("model", {}), "model")
        data["sampler"] = from_dict(SamplerConfig, data.get("sampler", {}), "sampler")
        return from_dict(cls, data)


def official_artifact_config(state: dict, task: str, origin: str = "") -> ArtifactConfig:
    """Config for an authors' checkpoint: dims from shapes, the rest from the paper preset."""
    if task not in PAPER_TASKS:
        raise ELFError(f"unknown paper task {task!r}; choose one of {sorted(PAPER_TASKS)}")
    preset = PAPER_TASKS[task]
    model = infer_model_config(state, max_length=preset["max_length"])
    if preset["task"] == "conditional":
        sampler = SamplerConfig(steps=64, sampler="ode", gamma=0.0, w=1.0, cfg=2.0)
    elif model.depth > 12:  # ELF-M / ELF-L
        sampler = SamplerConfig(steps=64, sampler="sde", gamma=1.0, w=3.0)
    else:
        sampler = SamplerConfig(steps=32, sampler="sde", gamma=1.5, w=3.0)
    return ArtifactConfig(
        model=model,
        sampler=sampler,
        task=preset["task"],
        max_input_length=preset["max_input_length"],
        pad_with_eos=preset["pad_with_eos"],
        origin=origin,
    )


def _atomic_write(path: Path, write) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        write(tmp)
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()


def save_model(
    folder: str | Path,
    model: ELF,
    config: ArtifactConfig,
    ema_state: dict[str, torch.Tensor] | None = None,
    *,
    overwrite: bool = False,
    max_shard_size: int | str | None = None,
) -> Path:
    """Write ``model.safetensors`` (+ ``ema.safetensors``) and ``config.json``, each atomically.

    ``model`` may be wrapped (``torch.compile``, DDP): its :class:`ELF` is saved. Everything is
    checked before the first file is written. A folder that already holds any of
    :data:`MODEL_FILES` is refused unless ``overwrite``, which replaces the model: the files of
    the earlier one that this save does not write (``ema.safetensors``, ``tokenizer/``,
    ``README.md``) are removed, so that loading never reads them with these weights.
    With ``max_shard_size`` (bytes, or e.g. ``"15MiB"``), weights larger than that are written
    as Hugging Face-style shards (``model-00001-of-0000N.safetensors`` and
    ``model.safetensors.index.json``) instead of one ``model.safetensors``; the EMA weights are
    then not saved beside them (save them as the model's weights).
    """
    folder = Path(folder)
    model = unwrap(model)
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
    written = _write_weights(folder, weights(state), meta, limit)
    _remove_weights(folder, keep=written)  # an earlier save's in the other layout
    if ema_state is not None:
        _atomic_write(folder / EMA_WEIGHTS, lambda p: save_safetensors(weights(ema_state), p, meta))
    stale = [EMA_WEIGHTS] if ema_state is None else []
    for name in [*stale, TOKENIZER_DIR, CARD]:
        path = folder / name
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        elif path.exists() or path.is_symlink():
            path.unlink()
    text = json.dumps(config.to_json(), indent=2) + "\n"
    _atomic_write(folder / CONFIG, lambda p: Path(p).write_text(text))
    return folder


_SHARD_RE = re.compile(r"^model-\d{5}-of-\d{5}\.safetensors$")
_SIZE_RE = re.compile(r"^(\d+(?:\.\d+)?)\s*(|B|KB|MB|GB|KiB|MiB|GiB)$", re.IGNORECASE)
_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9}
_UNITS |= {"kib": 2**10, "mib": 2**20, "gib": 2**30}


def shard_bytes(size: int | str) -> int:
    """``max_shard_size`` in bytes: an int, or a string such as ``"15MiB"`` or ``"16MB"``
    (Hugging Face's units: MB = 10**6 bytes, MiB = 2**20)."""
    if isinstance(size, int) and not isinstance(size, bool) and size > 0:
        return size
    match = _SIZE_RE.match(size.strip()) if isinstance(size, str) else None
    value = float(match.group(1)) * _UNITS[match.group(2).lower()] if match else 0
    if value < 1:
        raise ELFError(
            f"max_shard_size must be a positive number of bytes or a size such as '15MiB', "
            f"got {size!r}"
        )
    return int(value)


def _split_rows(name: str, value: torch.Tensor, limit: int) -> dict[str, torch.Tensor]:
    """``value`` as blocks of whole rows (its first dimension) of at most ``limit`` bytes each
    (one row may be more), keyed ``name:0``, ``name:1``, ...; itself when it fits."""
    size = value.numel() * value.element_size()
    if size <= limit or value.dim() == 0 or value.shape[0] < 2:
        return {name: value}
    rows = max(1, limit // (size // value.shape[0]))
    return {f"{name}:{i}": block for i, block in enumerate(value.split(rows))}


def _write_weights(
    folder: Path, state: dict[str, torch.Tensor], meta: dict, limit: int | None
) -> list[str]:
    """``state`` as one ``model.safetensors``, or, when larger than ``limit`` bytes, as shards
    of at most ``limit`` bytes each (first fit, largest tensors first), written before their
    index; a tensor larger than a shard
    is split into blocks of rows (the index's ``metadata.split`` lists them, in order, and
    loading joins them). Returns the names written."""
    sizes = {k: v.numel() * v.element_size() for k, v in state.items()}
    if limit is None or sum(sizes.values()) <= limit:
        _atomic_write(folder / WEIGHTS, lambda p: save_safetensors(state, p, meta))
        return [WEIGHTS]
    pieces, split = {}, {}
    for key, value in state.items():
        blocks = _split_rows(key, value, limit)
        pieces |= blocks
        if len(blocks) > 1:
            split[key] = list(blocks)
    # First fit, largest first: few shards, each at most ``limit`` bytes.
    parts: list[dict[str, torch.Tensor]] = []
    used: list[int] = []
    for key, value in sorted(pieces.items(), key=lambda kv: -kv[1].numel() * kv[1].element_size()):
        size = value.numel() * value.element_size()
        i = next((i for i, u in enumerate(used) if u + size <= limit), len(parts))
        if i == len(parts):
            parts.append({})
            used.append(0)
        parts[i][key] = value
        used[i] += size
    names = [f"model-{i + 1:05d}-of-{len(parts):05d}.safetensors" for i in range(len(parts))]
    for name, part in zip(names, parts, strict=True):
        part = {k: v.contiguous() for k, v in part.items()}
        _atomic_write(folder / name, lambda p, part=part: save_safetensors(part, p, meta))
    metadata = {"total_size": sum(sizes.values()), "format": FORMAT}
    index = {
        "metadata": metadata | ({"split": split} if split else {}),
        "weight_map": {k: name for name, part in zip(names, parts, strict=True) for k in part},
    }
    text = json.dumps(index, indent=2) + "\n"
    _atomic_write(folder / WEIGHTS_INDEX, lambda p: Path(p).write_text(text))
    return [*names, WEIGHTS_INDEX]


def weight_files(folder: Path) -> list[str]:
    """The weight files of a model folder saved in shards: its index and the shards in it."""
    return [WEIGHTS_INDEX, *sorted(p.name for p in folder.iterdir() if _SHARD_RE.match(p.name))]


def _remove_weights(folder: Path, keep: list[str]) -> None:
    """Remove the model weights of ``folder`` (one file, or an index and shards) but ``keep``."""
    for path in folder.iterdir():
        if path.name in keep:
            continue
        if path.name in (WEIGHTS, WEIGHTS_INDEX) or _SHARD_RE.match(path.name):
            path.unlink()


def _read_safetensors(path: Path) -> dict[str, torch.Tensor]:
    try:
        return load_file(str(path))
    except OSError:
        raise  # missing or unreadable: the CLI says which file
    except Exception as e:  # safetensors raises its own error types
        raise ELFError(
            f"cannot read {path}: {first_line(e)}; the file is truncated or corrupt"
        ) from None


def read_sharded(folder: Path) -> dict[str, torch.Tensor]:
    """The weights of a model saved in shards: every shard its index names, each weight from
    the shard the index places it in (one-line errors for a damaged index, a missing shard, or
    a shard that does not hold what the index says)."""
    path = folder / WEIGHTS_INDEX
    try:
        index = json.loads(path.read_text())
        weight_map = index["weight_map"]
        split = index.get("metadata", {}).get("split", {})
        if not isinstance(weight_map, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()
        ):
            raise TypeError("its weight_map is not a mapping of names to files")
        if not isinstance(split, dict) or not all(
            isinstance(v, list) and v and all(isinstance(p, str) for p in v) for v in split.values()
        ):
            raise TypeError("its metadata.split is not a mapping of names to lists of parts")
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise ELFError(f"cannot read {path} ({first_line(e)}); the index is damaged") from None
    state: dict[str, torch.Tensor] = {}
    for name in sorted(set(weight_map.values())):
        shard = folder / name
        if Path(name).name != name or not shard.is_file():
            raise ELFError(f"{path} names the shard {name!r}, which is not a file in {folder}")
        part = _read_safetensors(shard)
        foreign = sorted(k for k in part if weight_map.get(k) != name)
        if foreign:
            raise ELFError(f"{shard} holds {foreign[0]}, which {WEIGHTS_INDEX} does not put there")
        state |= part
    missing = sorted(set(weight_map) - set(state))
    if missing:
        raise ELFError(
            f"{path} places {len(missing)} weights ({missing[0]}, ...) in shards that lack them"
        )
    for name, pieces in split.items():
        absent = [p for p in pieces if p not in state]
        if absent or name in state:
            what = f"its part {absent[0]} is in no shard" if absent else "it is also whole"
            raise ELFError(f"{path} splits {name}, but {what}; the index is damaged")
        state[name] = torch.cat([state.pop(p) for p in pieces])
    return state


def unwrap(model: Any) -> ELF:
    """The :class:`ELF` inside ``torch.compile`` and DDP wrappers (whose keys carry prefixes)."""
    while not isinstance(model, ELF):
        inner = getattr(model, "_orig_mod", None) or getattr(model, "module", None)
        if inner is None:
            raise ELFError(f"expected an elflow ELF network, got {type(model).__name__}")
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
        state = read_sharded(folder) if sharded else _read_safetensors(folder / name)
    check_finite_weights(state, resolved.path if resolved.kind == "official" else folder)
    with torch.device("meta"):
        model = ELF(config.model)
    model.to_empty(device=device)
    load_state_dict_strict(model, {k: v.to(device) for k, v in state.items()})
    return model.eval(), config


def check_finite_weights(state: dict[str, torch.Tensor], where: Path) -> None:
    """A one-line error when a weight of ``state`` is NaN or infinite (a diverged run's, or a
    damaged file's), rather than a model that samples nothing."""
    bad = [k for k, v in state.items() if v.is_floating_point() and not bool(v.isfinite().all())]
    if bad:
        more = f" and {len(bad) - 1} more" if len(bad) > 1 else ""
        raise ELFError(
            f"{where} holds NaN or infinite weights ({bad[0]}{more}); the run diverged before it "
            "was saved or the file is damaged: load an earlier checkpoint"
        )


def read_config(folder: Path) -> ArtifactConfig:
    """Read and validate a model folder's ``config.json``."""
    try:
        data = json.loads((folder / CONFIG).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ELFError(f"cannot read {folder / CONFIG}: {e}") from None
    try:
        return ArtifactConfig.from_json(data)
    except ELFError as e:
        # Named as the file spells them ('sampler.steps'), not as a command's flags: the fix
        # is in the file, not on the command line.
        message = re.sub(r"(?<![\w.'\"])((?:sampler|model)\.\w+)", r"'\1'", str(e))
        raise ELFError(f"{folder / CONFIG}: {message}") from None


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
