"""The weight files of a model folder (ELF_SPEC §10): one ``model.safetensors``, or Hugging
Face-style shards with their index, each written atomically; reading them back, and the checks on
what was read (a damaged index or shard, NaN or infinite weights), each a one-line error.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import torch
from safetensors.torch import load_file

from elflow.errors import ELFError, first_line
from elflow.io.model_sources import WEIGHTS, WEIGHTS_INDEX
from elflow.io.paths import save_safetensors


def atomic_write(path: Path, write) -> None:
    """``write(tmp)`` to a temporary file beside ``path``, then renamed onto it."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        write(tmp)
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()


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


def write_weights(
    folder: Path, state: dict[str, torch.Tensor], meta: dict, limit: int | None
) -> list[str]:
    """``state`` as one ``model.safetensors``, or, when larger than ``limit`` bytes, as shards
    of at most ``limit`` bytes each (first fit, largest tensors first), written before their
    index; a tensor larger than a shard
    is split into blocks of rows (the index's ``metadata.split`` lists them, in order, and
    loading joins them). Returns the names written."""
    sizes = {k: v.numel() * v.element_size() for k, v in state.items()}
    if limit is None or sum(sizes.values()) <= limit:
        atomic_write(folder / WEIGHTS, lambda p: save_safetensors(state, p, meta))
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
        atomic_write(folder / name, lambda p, part=part: save_safetensors(part, p, meta))
    metadata = {"total_size": sum(sizes.values()), **meta}
    index = {
        "metadata": metadata | ({"split": split} if split else {}),
        "weight_map": {k: name for name, part in zip(names, parts, strict=True) for k in part},
    }
    text = json.dumps(index, indent=2) + "\n"
    atomic_write(folder / WEIGHTS_INDEX, lambda p: Path(p).write_text(text))
    return [*names, WEIGHTS_INDEX]


def weight_files(folder: Path) -> list[str]:
    """The weight files of a model folder saved in shards: its index and the shards in it."""
    return [WEIGHTS_INDEX, *sorted(p.name for p in folder.iterdir() if _SHARD_RE.match(p.name))]


def remove_weights(folder: Path, keep: list[str]) -> None:
    """Remove the model weights of ``folder`` (one file, or an index and shards) but ``keep``."""
    for path in folder.iterdir():
        if path.name in keep:
            continue
        if path.name in (WEIGHTS, WEIGHTS_INDEX) or _SHARD_RE.match(path.name):
            path.unlink()


def read_safetensors(path: Path) -> dict[str, torch.Tensor]:
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
        part = read_safetensors(shard)
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
