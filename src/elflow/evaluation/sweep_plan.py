"""A sweep's files: what it records, how it resumes, and its real-text reference (spec §5, §6).

The grid (sampler x steps x w x gamma, axes as data) is :mod:`elflow.evaluation.sweep_grid`; the
tables and plot are :mod:`elflow.evaluation.report_tables`. Each cell is exactly an
``elflow sample`` run (:func:`elflow.generation.records.sample_records`, the same seeds) followed
by an ``elflow score`` run (:func:`elflow.evaluation.score_samples`, spec §6), so a cell can be
reproduced on its own.
A sweep folder holds ``samples/<cell>.jsonl`` (every seed's records, in seed order),
``metrics/<cell>.json``, ``reference.jsonl`` (the real text as scored), ``table.csv``,
``table.md``, ``frontier.png`` and ``sweep.json`` (what a ``--resume`` must repeat, seeds
included). The command is :mod:`elflow.cli.sweep_cmd`.
"""

from __future__ import annotations

import dataclasses
import json
import math
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from elflow.config import SamplerConfig
from elflow.errors import ELFError
from elflow.evaluation.report_tables import COLUMNS, fmt, plot_frontier, table_row, write_tables
from elflow.evaluation.sweep_grid import AXES, Cell, grid
from elflow.generation.records import source_fields
from elflow.io.jsonl import read_jsonl

__all__ = [
    "AXES",
    "COLUMNS",
    "Cell",
    "fmt",
    "grid",
    "plot_frontier",
    "prepare_reference",
    "table_row",
    "write_tables",
]

SETTINGS = "sweep.json"
REFERENCE = "reference.jsonl"
OUTPUTS = ("samples", "metrics", "table.csv", "table.md", "frontier.png", REFERENCE, SETTINGS)
MARKERS = ("table.csv", "table.md", "metrics", SETTINGS)
"""What only a sweep writes (a training run has ``samples/`` too, and ``metrics.jsonl``)."""
RESUME_KEYS = (
    "checkpoint",
    "task",
    "num_samples",
    "seeds",
    "length",
    "no_ema",
    "bf16",
    "sources",
    "source_field",
    "cfg",
    "judge",
    "protocol",
    "bootstrap",
    "bootstrap_seed",
    "refs",
    "ref_field",
    "project_from",
    "time_grid",
    "time_mean",
    "time_std",
    "pc_snr",
    "length_range",
    "refresh_from",
)
"""The options every cell of one sweep shares (``sweep.json``): a resume must repeat them."""
RESUME_DEFAULTS = {
    "refs": None,
    "ref_field": "text",
    "project_from": 1.0,
    "time_grid": None,
    "time_mean": None,
    "time_std": None,
    "pc_snr": None,
    "length_range": None,
    "refresh_from": None,
}
"""Their values in a ``sweep.json`` written before they were recorded."""


def sweep_settings(shared: dict[str, Any], cells: list[Cell]) -> dict[str, Any]:
    """What ``sweep.json`` records: the shared options (:data:`RESUME_KEYS`), with the model as
    the checkpoint it resolves to (a run folder's latest checkpoint then, which a resume must
    sample too) and local paths absolute; and the grid's cells."""
    from elflow.io.artifact import read_config
    from elflow.io.model_sources import resolve_source

    settings = {key: shared[key] for key in RESUME_KEYS}
    resolved = resolve_source(shared["checkpoint"])
    settings["checkpoint"] = str(resolved.path.resolve())
    if shared["project_from"] is None:  # the model's own, so that a changed default is caught too
        model = None if resolved.kind == "official" else read_config(resolved.path)
        settings["project_from"] = 1.0 if model is None else model.sampler.project_from
    for key in ("sources", "refs"):
        if shared[key]:
            settings[key] = str(Path(shared[key]).expanduser().resolve())
    return {**settings, "cells": [c.name for c in cells]}


def check_previous(out: Path, overwrite: bool, resume: bool, settings: dict) -> bool:
    """Whether ``out`` holds an earlier sweep to clear: it is replaced only with ``overwrite``,
    or finished with ``resume`` (same shared options); a training run's folder is refused."""
    if overwrite and resume:
        raise ELFError("overwrite=True replaces the sweep, resume=True finishes it: give one")
    if (out / "metrics.jsonl").exists() or any(out.glob("checkpoint-*")):
        raise ELFError(f"out={out} is a training run's folder; give the sweep its own folder")
    found = [name for name in MARKERS if (out / name).exists()]
    if found and not (overwrite or resume):
        raise ELFError(
            f"out={out} already holds a sweep ({', '.join(found)}); pass resume=True to finish "
            "it, overwrite=True to replace it, or a new folder"
        )
    if found and resume:
        try:
            saved = json.loads((out / SETTINGS).read_text())
        except (OSError, ValueError):
            raise ELFError(
                f"resume=True: {out} has no readable {SETTINGS} (a sweep of an older elflow); "
                "pass overwrite=True to sample it again"
            ) from None
        for key in RESUME_KEYS:
            was = saved.get(key, RESUME_DEFAULTS.get(key))  # keys added since (sweep.json)
            if key == "num_samples" and was is None and settings["sources"] is None:
                was = 16  # an unconditional sweep recorded without -n: the default then
            if key == "seeds" and "seeds" not in saved:
                was = [saved.get("seed", 0)]  # one seed, recorded before seeds were
            if was != settings[key]:
                name, was, now = _shown(key, was, settings[key])
                raise ELFError(
                    f"resume=True: the sweep in {out} was run with {name}{was}, now {now}; give "
                    "the same options, or overwrite=True"
                )
        dropped = [c for c in saved.get("cells", []) if c not in settings["cells"]]
        if dropped:
            raise ELFError(
                f"resume=True: the sweep in {out} also has cells {', '.join(dropped)}, which this "
                "grid lacks (its table would leave them out); give the same grid or a larger "
                "one, or overwrite=True"
            )
    return bool(found) and not resume


SAMPLER_FIELDS = frozenset(f.name for f in dataclasses.fields(SamplerConfig))


def _shown(key: str, was: Any, now: Any) -> tuple[str, str, str]:
    """The setting (``seeds=``, ``sampler.time_mean=``) and the two values as a user would
    type them."""
    if key == "seeds":
        if len(was) == 1 and len(now) == 1:
            return "seed=", str(was[0]), str(now[0])
        return "seeds=", ",".join(map(str, was)), ",".join(map(str, now))
    name = f"sampler.{key}=" if key in SAMPLER_FIELDS else f"{key}="
    return name, repr(was), repr(now)


def stub_records(sources: list[dict], field: str) -> list[dict]:
    """What ``elflow sample`` writes for ``sources``, short of the text: enough to align refs."""
    return [
        {"id": i} | source_fields(s, field) | {"sampler": "", "nfe": 0}
        for i, s in enumerate(sources)
    ]


def read_metrics(path: Path) -> dict | None:
    """A cell's saved metrics, with the nulls of metrics.json (NaN there) as NaN again; None
    when the file is missing or unreadable (the cell is then scored again)."""

    def nan(v: Any) -> Any:
        return [nan(x) for x in v] if isinstance(v, list) else math.nan if v is None else v

    try:
        saved = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(saved, dict) or not isinstance(saved.get("sweep"), dict):
        return None
    return {k: nan(v) for k, v in saved.items()}


def read_samples(path: Path, expected: int, seeds: Sequence[int]) -> dict[int, list[dict]]:
    """A cell's saved samples of each seed that has all ``expected`` of them (a sweep
    interrupted between seeds keeps the finished ones); records without a ``seed`` count as
    the first seed's (a file written before seeds were recorded)."""
    try:
        records = read_jsonl(path)
    except (OSError, ELFError):
        return {}
    by_seed: dict[int, list[dict]] = {}
    for r in records:
        by_seed.setdefault(r.get("seed", seeds[0]), []).append(r)
    return {s: by_seed[s] for s in seeds if len(by_seed.get(s, [])) == expected}


def prepare_reference(tokenizer: Any, texts: Sequence[str], length: int) -> list[str]:
    """Real ``texts`` as the model's training rows hold them: tokenised with its tokenizer (with
    its special tokens), truncated to ``length`` tokens, decoded back without special tokens
    (MiniLM: lower-case WordPiece text), so that the real-text row is not flattered or handicapped
    by what the model can write."""
    from elflow.text.tokens import tokenize

    ids = tokenize(tokenizer, list(texts), max_length=length)
    return tokenizer.batch_decode(ids, skip_special_tokens=True)


def clear_previous(out: Path) -> None:
    """Remove an earlier sweep's outputs, so the tables and folders list this sweep's cells only."""
    for name in OUTPUTS:
        path = out / name
        if path.is_dir():
            shutil.rmtree(path)
        elif path.exists():
            path.unlink()
