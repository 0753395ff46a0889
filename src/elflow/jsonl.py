"""JSONL files of texts: samples, sources and references, one JSON object a line (spec §10).

Reading gives one-line errors that name the file and line (and the option that picks the field);
``.gz`` files are read through gzip. Writing is atomic (a temporary name, then a rename), so an
interrupted run never leaves half a samples file where a whole one was.
"""

from __future__ import annotations

import gzip
import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from elflow.errors import ELFError


def read_jsonl(
    path: str | Path, field: str = "text", *, field_flag: str | None = None
) -> list[dict[str, Any]]:
    """The objects of a JSONL file, each with a string ``field``; blank lines are skipped.

    Raises :class:`ELFError` naming ``file:line`` for a line that is not such an object (and
    ``field_flag``, the option that names another field, when given).
    """
    path = Path(path)
    if path.is_dir():
        raise ELFError(f"{path} is a folder; give a JSONL file")
    opener = gzip.open if path.suffix == ".gz" else open
    hint = f"; pass {field_flag} NAME for another field" if field_flag else ""
    rows: list[dict[str, Any]] = []
    try:
        with opener(path, "rt", encoding="utf-8") as f:  # lines end at \n, not at U+2028
            for lineno, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except json.JSONDecodeError:
                    raise ELFError(
                        f"{path}:{lineno}: not JSON; expected one JSON object per line (JSONL)"
                    ) from None
                if not isinstance(row, dict) or not isinstance(row.get(field), str):
                    raise ELFError(
                        f"{path}:{lineno}: expected a JSON object with a string {field!r}{hint}"
                    )
                rows.append(row)
    except UnicodeDecodeError as e:
        raise ELFError(f"{path}: not a UTF-8 JSONL file ({e.reason} at byte {e.start})") from None
    except (gzip.BadGzipFile, EOFError):
        raise ELFError(f"{path}: not a UTF-8 JSONL file (a broken gzip stream)") from None
    return rows


def write_jsonl(path: str | Path, records: Sequence[dict]) -> Path:
    """Write records one JSON object a line, atomically (temporary name, then rename)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    with tmp.open("w", encoding="utf-8") as f:
        for rec in records:
            f.write(json.dumps(rec, ensure_ascii=False) + "\n")
    os.replace(tmp, path)
    return path
