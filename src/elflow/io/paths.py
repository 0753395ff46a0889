"""Checks on the files a command reads and writes, made before any work starts, and elflow's
user cache folder.

A command that samples for an hour and then cannot write its ``--out`` has lost the hour; these
checks fail first, with one line naming the setting (``out=``; the command line: ``--out``) and
what to change. An output file's missing parent folders are made by the check itself (every
command alike), so nothing written later can fail for want of them.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Any

from elflow.errors import ELFError


def cache_root() -> Path:
    """elflow's user cache folder (converted judges, latent caches): ``$ELFLOW_CACHE``, else
    ``$XDG_CACHE_HOME/elflow``, else ``~/.cache/elflow``."""
    root = os.environ.get("ELFLOW_CACHE")
    if root:
        return Path(root).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME", "")
    # The XDG spec: a relative XDG_CACHE_HOME is invalid and ignored.
    base = Path(xdg) if os.path.isabs(xdg) else Path.home() / ".cache"
    return base / "elflow"


def save_safetensors(tensors: dict[str, Any], path: str | Path, metadata: dict[str, str]) -> None:
    """``safetensors.torch.save_file`` with the permissions of any file the user writes.

    safetensors creates its files 0600; a model on a shared file system (a multi-node run, a
    team's model folder) must be readable as the user's umask allows, like its config.json.
    """
    from safetensors.torch import save_file

    save_file(tensors, str(path), metadata)
    with contextlib.suppress(OSError):  # a file system without modes (some CIFS/FUSE mounts)
        os.chmod(path, 0o666 & ~_umask())


def _umask() -> int:
    """The process's umask, read without setting it (os.umask would change it for a moment for
    every thread) where /proc says it."""
    with contextlib.suppress(OSError, ValueError):
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _named(what: str, path: str | Path) -> str:
    """How an error names ``path``: ``out=/x`` after an argument (``what`` ends in ``=``), else
    ``what /x`` (``sources file /x``; ``--out /x`` for a command's flag)."""
    return f"{what}{path}" if what.endswith("=") else f"{what} {path}"


def input_file(path: str | Path, flag: str) -> Path:
    """``path`` as an existing file (not a folder); ``flag`` names it in errors (:func:`_named`)."""
    p = Path(path)
    if p.is_dir():
        raise ELFError(f"{_named(flag, p)} is a folder; give a file")
    if not p.is_file():
        raise ELFError(f"{_named(flag, p)} does not exist")
    return p


def output_file(
    path: str | Path, flag: str, *, overwrite: bool = True, make_parent: bool = True
) -> Path:
    """``path`` as a file that can be written: not a folder, in a writable folder, and, unless
    ``overwrite``, not there yet. Its missing parent folders are made now (``make_parent``;
    a caller checking several outputs first passes False and calls :func:`make_parents` after),
    as every command makes them; a parent that is a file is a one-line error."""
    check_no_loop(path, flag)
    p = Path(path)
    if p.is_dir():
        raise ELFError(f"{_named(flag, p)} is a folder; give a file name")
    if p.exists() and not overwrite:
        raise ELFError(
            f"{_named(flag, p)} already exists; pass overwrite=True to replace it, or a new name"
        )
    _writable_parent(p, flag)
    if make_parent:
        make_parents(p, flag)
    return p


def make_parents(path: str | Path, flag: str) -> None:
    """Make the missing parent folders of the output file ``path`` (checked by
    :func:`output_file`), with a one-line error when that fails."""
    parent = Path(path).absolute().parent
    if parent.is_dir():
        return
    try:
        parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ELFError(
            f"{_named(flag, path)}: cannot make the folder {parent} ({e.strerror or e})"
        ) from None


def check_no_loop(path: str | Path, flag: str) -> None:
    """A one-line error when ``path`` goes through a symbolic link that loops."""
    try:
        Path(path).expanduser().resolve()
    except (RuntimeError, OSError) as e:  # Python < 3.13 raises RuntimeError, later OSError
        raise ELFError(
            f"{_named(flag, path)} goes through a symbolic link that loops ({e}); fix or remove "
            "the link"
        ) from None


def output_dir(path: str | Path, flag: str) -> Path:
    """``path`` as a folder that can be written: a folder already, or creatable."""
    check_no_loop(path, flag)
    p = Path(path)
    if p.exists() and not p.is_dir():
        raise ELFError(f"{_named(flag, p)} is a file; give a folder")
    if not p.exists():
        _writable_parent(p, flag)
    elif not os.access(p, os.W_OK | os.X_OK):
        raise ELFError(f"{_named(flag, p)}: cannot write in it")
    return p


def _writable_parent(p: Path, flag: str) -> None:
    """The nearest existing ancestor of ``p`` is a folder we may create entries in."""
    parent = p.absolute().parent
    while not parent.exists():
        if parent.is_symlink():  # a link to nothing: mkdir could not make it
            raise ELFError(f"{_named(flag, p)}: {parent} is a link to nothing; fix or remove it")
        parent = parent.parent
    if not parent.is_dir():
        raise ELFError(f"{_named(flag, p)}: {parent} is a file, not a folder")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise ELFError(f"{_named(flag, p)}: cannot write in {parent}")
