"""Line-oriented text files: JSONL samples, sources and references, and training corpora.

Readers take plain or gzip files (any ``.gz`` suffix case), strip a UTF-8 byte-order mark, end
lines at ``\\n`` (a ``\\r\\n`` is stripped; U+2028 stays text) and raise one-line errors that name
the file and line: invalid UTF-8, a corrupt gzip stream, malformed JSON, a missing field.
Writing is atomic (a temporary name, then a rename), so an interrupted run never leaves half a
samples file where a whole one was.
"""

from __future__ import annotations

import gzip
import json
import math
import os
import zlib
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, BinaryIO

from elflow.errors import ELFError


def is_gzip(path: Path) -> bool:
    """Whether elflow reads ``path`` through gzip (its name ends in .gz)."""
    return path.name.lower().endswith(".gz")


def open_binary(path: Path) -> BinaryIO:
    """``path`` opened for reading bytes, through gzip when its name ends in .gz."""
    return gzip.open(path, "rb") if is_gzip(path) else open(path, "rb")


def _decode(raw: bytes, path: Path, lineno: int) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ELFError(
            f"{path}:{lineno}: invalid UTF-8 (byte 0x{raw[e.start]:02x} at column {e.start + 1}); "
            "re-encode the file as UTF-8"
        ) from None


def iter_lines(path: Path) -> Iterator[tuple[int, str]]:
    """(line number, decoded line without its newline); a gzip or UTF-8 problem is an ELFError."""
    try:
        with open_binary(path) as f:
            for lineno, raw in enumerate(f, 1):
                line = _decode(raw, path, lineno).rstrip("\r\n")
                yield lineno, (line.lstrip("\ufeff") if lineno == 1 else line)
    except (gzip.BadGzipFile, EOFError, zlib.error) as e:
        raise ELFError(f"{path}: corrupt gzip file ({e}); re-compress or decompress it") from None


def iter_json_objects(path: Path) -> Iterator[tuple[int, dict]]:
    """(line number, object) for every non-blank line of a JSONL file."""
    for lineno, line in iter_lines(path):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise ELFError(
                f"{path}:{lineno}: malformed JSON ({e.msg} at column {e.colno}); fix or remove "
                "the line (JSONL: one JSON object a line)"
            ) from None
        if not isinstance(record, dict):
            raise ELFError(f"{path}:{lineno}: expected a JSON object per line, got {line[:40]!r}")
        if "\\ud" in line.lower():  # only an escape can make a lone surrogate: check those lines
            check_unicode(record, f"{path}:{lineno}")
        yield lineno, record


def check_unicode(value: Any, where: str) -> None:
    """One line naming ``where`` when a string in ``value`` (a record, a text) holds an unpaired
    surrogate (JSON's ``\\ud800`` escapes decode to one), which no file or tokenizer takes."""
    try:
        json.dumps(value, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        raise ELFError(
            f"{where}: a string holds an unpaired surrogate escape (\\ud800-\\udfff); "
            "fix the text (it is not valid Unicode)"
        ) from None


def read_jsonl(
    path: str | Path, field: str = "text", *, field_flag: str | None = None
) -> list[dict[str, Any]]:
    """The objects of a JSONL file (samples, sources, references), each with a string ``field``.

    Raises :class:`ELFError` naming ``file:line`` for a line that is not such an object (and
    ``field_flag``, the argument or option that names another field, when given).
    """
    path = Path(path)
    if path.is_dir():
        raise ELFError(f"{path} is a folder; give a JSONL file")
    hint = ""
    if field_flag:  # an argument (``source_field=``) or a command's flag
        hint = f"; pass {field_flag}{'' if field_flag.endswith('=') else ' '}NAME for another field"
    rows = []
    for lineno, row in iter_json_objects(path):
        if not isinstance(row.get(field), str):
            raise ELFError(f"{path}:{lineno}: expected a JSON object with a string {field!r}{hint}")
        rows.append(row)
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


def finite_or_null(value: Any) -> Any:
    """NaN/inf (gen PPL when every sample is empty) become null, so metrics.json is strict JSON."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: finite_or_null(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [finite_or_null(v) for v in value]
    return value
