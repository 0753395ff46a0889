"""Checksums of a checkpoint's files, written with it and checked before it is used.

``checkpoint-<step>/manifest.json`` lists every file of the checkpoint (its path in the folder,
its size and its SHA-256). A flipped bit, a truncated copy or an edited ``state.json`` is found
before a resume or a load starts from it; see :func:`damage`. Writing the manifest also flushes
each file to the disk (``fsync``), so a checkpoint that is in place survives a power loss.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterable
from pathlib import Path

from elflow.errors import ELFError, note_once
from elflow.io.model_sources import run_checkpoints

MANIFEST = "manifest.json"


def sha256(path: Path) -> str:
    """The SHA-256 of a file's bytes, in hex."""
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def fsync_dir(folder: Path) -> None:
    """Flush ``folder``'s entries (new names, renames) to the disk."""
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    except OSError:  # some file systems refuse fsync on folders; their entries are durable
        pass
    finally:
        os.close(fd)


def write_manifest(folder: Path) -> None:
    """Hash and ``fsync`` every file under ``folder``, then write and ``fsync`` its manifest."""
    entries = {}
    for path in sorted(p for p in folder.rglob("*") if p.is_file() and p.name != MANIFEST):
        with open(path, "rb") as f:
            digest = hashlib.file_digest(f, "sha256").hexdigest()
            os.fsync(f.fileno())
        rel = path.relative_to(folder).as_posix()
        entries[rel] = {"bytes": path.stat().st_size, "sha256": digest}
    with open(folder / MANIFEST, "w") as f:
        f.write(json.dumps({"algorithm": "sha256", "files": entries}, indent=1) + "\n")
        f.flush()
        os.fsync(f.fileno())
    for sub in sorted({p.parent for p in folder.rglob("*")} | {folder}):
        fsync_dir(sub)


def damage(folder: Path, only: Iterable[str] | None = None) -> str | None:
    """What is wrong with ``folder`` by its manifest (e.g. ``model.safetensors does not match its
    checksum``), or None when it is intact; ``only``: check these files alone. A folder without a
    manifest (written by elflow < 0.3, or an exported model) passes: there is nothing to check."""
    path = folder / MANIFEST
    if not path.is_file():
        return None
    try:
        files = json.loads(path.read_text())["files"]
        wanted = set(files) if only is None else set(only) & set(files)
        items = [(name, int(files[name]["bytes"]), str(files[name]["sha256"])) for name in wanted]
    except (OSError, ValueError, KeyError, TypeError):
        return f"its {MANIFEST} is unreadable"
    for name, size, digest in sorted(items):
        file = folder / name
        if not file.is_file():
            return f"{name} is missing"
        if file.stat().st_size != size:
            return f"{name} has {file.stat().st_size} bytes, its manifest says {size}"
        if sha256(file) != digest:
            return f"{name} does not match its checksum"
    return None


def intact(ckpt: Path, *, fallback: bool, doing: str, only: Iterable[str] | None = None) -> Path:
    """``ckpt`` when :func:`damage` finds nothing wrong; else, with ``fallback``, the newest
    earlier intact ``checkpoint-<s>`` of the same run folder (said in one line: ``doing`` names
    what happens, e.g. "resuming from"), or a one-line error naming the damage (and that earlier
    checkpoint, to be named instead)."""
    problem = damage(ckpt, only)
    if problem is None:
        return ckpt
    step = _step(ckpt)
    earlier = None
    if step is not None:
        for s, path in reversed(run_checkpoints(ckpt.parent)):
            if s < step and damage(path, only) is None:
                earlier = path
                break
    if fallback and earlier is not None:
        note_once(
            f"elflow: warning: {ckpt} is damaged ({problem}); {doing} {earlier}, the newest "
            "intact checkpoint before it"
        )
        return earlier
    hint = (
        f"name the newest intact checkpoint before it, {earlier}, instead"
        if earlier is not None
        else "no earlier checkpoint of its run is intact; restore the file from a copy (after a "
        f"deliberate edit, delete {MANIFEST})"
    )
    raise ELFError(f"{ckpt} is damaged ({problem}); {hint}")


def _step(ckpt: Path) -> int | None:
    name = ckpt.name.removeprefix("checkpoint-")
    return int(name) if name != ckpt.name and name.isdigit() else None
