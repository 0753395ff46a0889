"""Readers: every input format streamed as (source, target) examples (ELF_SPEC §4 custom data).

Plain text (one document per line or per file; a folder means all its *.txt files, sorted), JSONL
with a text field, JSONL pairs (source/target fields), Hugging Face datasets (`load_from_disk`
folders or Hub names) and the authors' pre-tokenised records (`input_ids`, optional
`condition_input_ids`). Everything is a generator: a 9B-token corpus is never held in memory.
Each yielded example is ``(source, target)``: strings, or id lists for pre-tokenised data;
``source`` is None for unconditional data. User errors are one line naming the file and line.
"""

from __future__ import annotations

import gzip
import json
import os
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from elflow.config.data_config import DataConfig
from elflow.data.hf_datasets import hf_kind as _hf_kind
from elflow.data.hf_datasets import is_saved_dataset
from elflow.data.hf_datasets import load_hf as _load_hf
from elflow.errors import ELFError, note_once
from elflow.io.jsonl import iter_json_objects, iter_lines, open_binary

Example = tuple[Any, Any]  # (source or None, target): str, or list[int] when pre-tokenised
TEXT_SUFFIXES = (".txt", ".txt.gz")
JSONL_SUFFIXES = (".jsonl", ".jsonl.gz", ".json", ".json.gz")
PREPARED_MARKER = "elflow_prepared"


@dataclass(frozen=True)
class Source:
    """A resolved data source."""

    location: str
    """The path or Hub name as given."""
    container: str
    """text | jsonl | hf | prepared."""
    kind: str
    """What a record holds: text | pairs | pretokenized (prepared: from its meta.json)."""
    files: tuple[Path, ...] = ()
    """The files to read, in order (text / jsonl)."""
    hf_split: str = "train"
    """Split to read from a Hugging Face dataset."""
    streaming: bool = False
    """A Hugging Face dataset that is not a saved folder is streamed, not downloaded whole
    (``elflow prepare``)."""

    @property
    def conditional(self) -> bool:
        if self.container == "prepared":
            meta = json.loads((Path(self.location) / "meta.json").read_text())
            return bool(meta["conditional"])
        if self.kind == "pretokenized":
            return _first_pretokenized_is_conditional(self)
        return self.kind == "pairs"


def _has_suffix(path: Path, suffixes: tuple[str, ...]) -> bool:
    return path.name.lower().endswith(suffixes)


def _looks_like_hub_name(location: str) -> bool:
    # "name" or "org/name" without a file extension; anything else was meant as a local path.
    return (
        not os.path.isabs(location)
        and not location.startswith((".", "~"))
        and location.count("/") <= 1
        and not _has_suffix(Path(location), (*TEXT_SUFFIXES, *JSONL_SUFFIXES, ".gz"))
    )


def resolve_source(
    cfg: DataConfig,
    location: str,
    hf_split: str | None = None,
    key: str = "data.path",
    streaming: bool = False,
) -> Source:
    """Find out what `location` is (per ``cfg.format``) without reading more than one record.

    `key` is the setting `location` came from, named in the errors (e.g. ``data.valid_path``).
    `streaming`: read a Hugging Face dataset other than a saved folder as a stream.
    """
    if not location:
        raise ELFError(f"no data path given; set {key} to a file, folder or dataset")
    split = hf_split or cfg.hf_split
    fmt = cfg.format
    path = Path(os.path.expanduser(location))
    if not path.exists():
        if fmt in ("auto", "hf") and _looks_like_hub_name(location):
            kind = _hf_kind(cfg, location, split, streaming)
            return Source(location, "hf", kind, (), split, streaming)
        raise ELFError(f"{key} '{location}' does not exist; fix the path")
    if path.is_dir():
        if is_prepared(path):  # whatever data.format says (the presets name their raw format)
            return Source(location, "prepared", "pretokenized")
        if fmt == "prepared":
            raise ELFError(f"'{location}' is not a folder written by elflow prepare (no meta.json)")
        if fmt == "hf" or (fmt in ("auto", "pairs", "pretokenized") and is_saved_dataset(path)):
            kind = _hf_kind(cfg, location, split, streaming)
            return Source(location, "hf", kind, (), split, streaming)
        files = _data_files(path)
        texts = tuple(p for p in files if _has_suffix(p, TEXT_SUFFIXES))
        jsonls = tuple(p for p in files if _has_suffix(p, JSONL_SUFFIXES))
        if fmt == "text" or (fmt == "auto" and texts and not jsonls):
            if not texts:
                raise ELFError(f"folder '{location}' has no *.txt or *.txt.gz files; add text")
            _check_text(texts[0], fmt)  # the first file tells
            return Source(location, "text", "text", texts)
        if fmt == "auto" and texts and jsonls:
            raise ELFError(
                f"folder '{location}' holds both *.txt and *.jsonl files; set data.format "
                "to 'text' or 'jsonl'"
            )
        if not jsonls:
            raise ELFError(
                f"folder '{location}' has no text (*.txt, *.jsonl, optionally .gz) and is not a "
                f"Hugging Face dataset; point {key} at your data"
            )
        return Source(location, "jsonl", _jsonl_kind(cfg, jsonls, key), jsonls)
    if fmt in ("hf", "prepared"):
        raise ELFError(f"data.format is {fmt!r} but '{location}' is a file; pass its folder")
    if path.stat().st_size == 0:
        raise ELFError(f"data file '{location}' is empty; point {key} at a file with text")
    if fmt == "text" or (
        fmt == "auto"
        and not _has_suffix(path, JSONL_SUFFIXES)
        # an unknown suffix (.ndjson, none) holding JSON objects is JSONL
        and (_has_suffix(path, TEXT_SUFFIXES) or not _first_line_is_json(path))
    ):
        _check_text(path, fmt)
        return Source(location, "text", "text", (path,))
    if _has_suffix(path, TEXT_SUFFIXES) and not _first_line_is_json(path):
        raise ELFError(
            f"data.format is {fmt!r} (presets name their own format) but '{location}' is plain "
            "text; set data.format=text (or auto)"
        )
    return Source(location, "jsonl", _jsonl_kind(cfg, (path,), key), (path,))


def _check_text(path: Path, fmt: str) -> None:
    """What plain text read line by line would silently get wrong, found in the first 64 KB of
    ``path``: NUL bytes (a binary or UTF-16 file) are an error; a CSV file, or JSON lines in a
    file named .txt (when the format was not given), get a warning."""
    with open_binary(path) as f:
        head = f.read(1 << 16)
    if b"\x00" in head:
        raise ELFError(
            f"{path} holds NUL bytes: a binary (or UTF-16) file, not UTF-8 text; give text, "
            "JSONL or a folder written by elflow prepare"
        )
    if path.name.lower().endswith((".csv", ".tsv", ".csv.gz", ".tsv.gz")):
        note_once(
            f"elflow: warning: {path} is read as plain text, one document a line, its header "
            "line and separators included; give the text column as plain text or JSONL "
            '({"text": ...} a line)'
        )
    elif fmt == "auto" and _first_line_is_json(path):
        note_once(
            f"elflow: warning: {path} holds JSON lines but its name says plain text, so each "
            "line, braces and all, is one document; rename it .jsonl or set data.format=jsonl"
        )


def _first_line_is_json(path: Path) -> bool:
    for _, line in iter_lines(path):
        if line.strip():
            try:
                return isinstance(json.loads(line), dict)
            except json.JSONDecodeError:
                return False
    return False


def is_prepared(folder: Path) -> bool:
    """Whether ``folder`` was written by ``elflow prepare`` (its meta.json has the marker)."""
    try:
        meta = json.loads((folder / "meta.json").read_text())
    except (OSError, ValueError):  # no meta.json, or someone else's that is not JSON
        return False
    return isinstance(meta, dict) and PREPARED_MARKER in meta


def _data_files(folder: Path) -> list[Path]:
    """The files under ``folder``, skipping hidden folders (``.ipynb_checkpoints`` copies, a
    prepare's temporary output) and prepared folders (their meta.json is not data)."""
    found = []
    for root, dirs, names in os.walk(folder):
        here = Path(root)
        dirs[:] = sorted(d for d in dirs if not d.startswith(".") and not is_prepared(here / d))
        found += [here / n for n in names if not n.startswith(".") and (here / n).is_file()]
    return sorted(found)


def _jsonl_kind(cfg: DataConfig, files: tuple[Path, ...], key: str) -> str:
    explicit = {"jsonl": "text", "pairs": "pairs", "pretokenized": "pretokenized"}
    if cfg.format in explicit:
        return explicit[cfg.format]
    for path in files:
        for lineno, record in iter_json_objects(path):
            return _record_kind(cfg, record, f"{path}:{lineno}")
    raise ELFError(f"no JSON records in {', '.join(map(str, files))}; add data or fix {key}")


def _record_kind(cfg: DataConfig, record: dict, where: str) -> str:
    if "input_ids" in record:
        return "pretokenized"
    if cfg.source_field in record and cfg.target_field in record:
        return "pairs"
    if cfg.text_field in record:
        return "text"
    raise ELFError(
        f"{where}: no '{cfg.text_field}' field, no '{cfg.source_field}'/'{cfg.target_field}' pair "
        f"and no 'input_ids' (keys: {', '.join(sorted(record)) or 'none'}); set data.text_field "
        "or data.source_field and data.target_field"
    )


def _first_pretokenized_is_conditional(src: Source) -> bool:
    for _, record in _iter_records(src):
        return "condition_input_ids" in record
    return False


# --- line and record readers --------------------------------------------------------------------


def _field(record: dict, name: str, where: str, kind: type, key: str = "") -> Any:
    """``record[name]`` checked to be a string or an id list; `key` is the setting naming it."""
    if name not in record:
        raise ELFError(
            f"{where}: record has no field '{name}' (keys: {', '.join(sorted(record)) or 'none'}); "
            + (f"fix the record or set {key}" if key else "fix the record")
        )
    value = record[name]
    if kind is str and not isinstance(value, str):
        raise ELFError(f"{where}: field '{name}' must be a string, got {type(value).__name__}")
    if kind is list and not (isinstance(value, list) and all(type(v) is int for v in value)):
        raise ELFError(f"{where}: field '{name}' must be a list of integer token ids")
    return value


def _iter_records(src: Source) -> Iterator[tuple[str, dict]]:
    """(location for messages, record) of a JSONL or HF source."""
    if src.container == "jsonl":
        for path in src.files:
            for lineno, record in iter_json_objects(path):
                yield f"{path}:{lineno}", record
    else:
        for i, record in enumerate(_load_hf(src.location, src.hf_split, src.streaming)):
            yield f"{src.location}[{src.hf_split}] row {i}", record


def _iter_text(src: Source, doc_per: str) -> Iterator[str]:
    for path in src.files:
        if doc_per == "line":
            for _, line in iter_lines(path):
                if line.strip():
                    yield line.strip()
            continue
        with open_binary(path) as f:
            try:
                data = f.read()
            except (gzip.BadGzipFile, EOFError, zlib.error) as e:
                raise ELFError(f"{path}: corrupt gzip file ({e}); re-compress it") from None
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError as e:
            lineno = data.count(b"\n", 0, e.start) + 1
            col = e.start - (data.rfind(b"\n", 0, e.start) + 1) + 1
            raise ELFError(
                f"{path}:{lineno}: invalid UTF-8 (byte 0x{data[e.start]:02x} at column {col}); "
                "re-encode the file as UTF-8"
            ) from None
        if text.lstrip("\ufeff").strip():
            yield text.lstrip("\ufeff").strip()


def iter_examples(src: Source, cfg: DataConfig) -> Iterator[Example]:
    """Stream (source, target) examples from `src` (at most ``cfg.max_rows``; 0 = all)."""
    if src.container == "prepared":
        raise ELFError(f"'{src.location}' is already prepared; open it with build_dataset")
    if src.kind == "text" and src.container == "text":
        gen: Iterator[Example] = ((None, doc) for doc in _iter_text(src, cfg.doc_per))
    else:
        gen = _iter_record_examples(src, cfg)
    count = 0
    for example in gen:
        yield example
        count += 1
        if count == cfg.max_rows:
            return
    if count == 0:
        raise ELFError(f"no documents in '{src.location}'; it holds only blank lines or records")


def _iter_record_examples(src: Source, cfg: DataConfig) -> Iterator[Example]:
    conditional = None
    for where, record in _iter_records(src):
        if src.kind == "text":
            if cfg.text_field not in record and {cfg.source_field, cfg.target_field} <= set(record):
                raise ELFError(
                    f"{where}: a source/target pair, but data.format {cfg.format} reads plain "
                    f"text ('{cfg.text_field}'); set data.format=auto (or pairs) for pairs"
                )
            yield None, _field(record, cfg.text_field, where, str, "data.text_field")
        elif src.kind == "pairs":
            yield (
                _field(record, cfg.source_field, where, str, "data.source_field"),
                _field(record, cfg.target_field, where, str, "data.target_field"),
            )
        else:
            has_source = "condition_input_ids" in record
            if conditional is None:
                conditional = has_source
            elif has_source != conditional:  # the first record set the kind of the whole data
                first = "has" if conditional else "has no"
                raise ELFError(
                    f"{where}: {'has' if has_source else 'has no'} condition_input_ids but the "
                    f"first record {first}; give every record a source, or none"
                )
            source = _field(record, "condition_input_ids", where, list) if conditional else None
            yield source, _field(record, "input_ids", where, list)
