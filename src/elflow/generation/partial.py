"""Samples written as their batches finish, so that an interrupted ``elflow sample --out`` loses at
most the batches in flight and the same command resumes (ELF_SPEC §10: a sample depends on its
seed and id alone, so a resumed file equals an uninterrupted run's).

Each process appends its finished records to ``.OUT.partial-<rank>`` beside ``OUT``, after a
header holding the fingerprint of the command that made them. A re-run reads every partial
file (another command's is refused in one line, nothing deleted), skips the (seed, id) pairs
they hold, and at the end rank 0 writes ``OUT`` in seed and id order and removes them.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from elflow.errors import ELFError

HEADER = "elflow-partial-samples"


def fingerprint(settings: dict[str, Any]) -> str:
    """A short hash of what makes a command's records (the ``settings`` that must match)."""
    text = json.dumps(settings, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


class PartialSamples:
    """The partial files of ``out`` for the command with fingerprint ``key``."""

    def __init__(self, out: str | Path, key: str, rank: int = 0) -> None:
        self.out, self.key, self.rank = Path(out), key, rank
        self._file = None

    def files(self) -> list[Path]:
        return sorted(self.out.parent.glob(f".{self.out.name}.partial-*"))

    def load(self) -> list[dict]:
        """Every record the partial files hold (each (seed, id) once); a file of another
        command is a one-line error; a line cut short by a crash is dropped (and cut off the
        file before anything is appended to it); any other damage is a one-line error naming
        the line."""
        found: dict[tuple, dict] = {}
        for path in self.files():
            try:
                lines = path.read_text(encoding="utf-8").splitlines(keepends=True)
            except UnicodeDecodeError:
                raise ELFError(_damaged(path, "is not text")) from None
            if not lines or not lines[0].endswith("\n"):
                continue  # empty, or killed while its header was written
            try:
                head = json.loads(lines[0])
            except json.JSONDecodeError:
                head = {}
            if not isinstance(head, dict) or head.get(HEADER) != self.key:
                raise ELFError(
                    f"{path} holds samples of another command (other settings, model, seeds or "
                    "n=); re-run that command to finish it, or pass overwrite=True to start over"
                )
            for number, line in enumerate(lines[1:], start=2):
                if not line.endswith("\n"):
                    break  # the last line of a killed writer
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError as e:
                    raise ELFError(_damaged(path, f"line {number} is not JSON ({e.msg})")) from None
                if not isinstance(rec, dict) or "id" not in rec:
                    raise ELFError(_damaged(path, f"line {number} is not a sample record"))
                found.setdefault((rec.get("seed"), rec["id"]), rec)
        return list(found.values())

    def write(self, records: Sequence[dict]) -> None:
        """Append finished records to this process's file (flushed to disk at once)."""
        if self._file is None:
            path = self.out.parent / f".{self.out.name}.partial-{self.rank}"
            _cut_unfinished_line(path)
            new = not path.exists() or path.stat().st_size == 0
            self._file = path.open("a", encoding="utf-8")
            if new:
                self._file.write(json.dumps({HEADER: self.key}) + "\n")
        for rec in records:
            self._file.write(json.dumps(rec, ensure_ascii=False) + "\n")
        self._file.flush()
        os.fsync(self._file.fileno())

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

    def remove(self) -> None:
        """Delete every partial file (once ``OUT`` holds their records)."""
        self.close()
        for path in self.files():
            path.unlink(missing_ok=True)


def _damaged(path: Path, what: str) -> str:
    return (
        f"{path} {what}: it is damaged; delete it to sample its records again (the other "
        "partial files are kept), or pass overwrite=True to start over"
    )


def _cut_unfinished_line(path: Path) -> None:
    """Cut a line a killed writer left unfinished off the end of ``path``, so that appended
    records start on a line of their own."""
    if not path.exists():
        return
    with path.open("rb+") as f:
        size = end = f.seek(0, os.SEEK_END)
        while end > 0:  # back from the end, a block at a time, to the last newline
            start = max(0, end - 65536)
            f.seek(start)
            newline = f.read(end - start).rfind(b"\n")
            if newline >= 0:
                end = start + newline + 1
                break
            end = start
        if end < size:
            f.truncate(end)
