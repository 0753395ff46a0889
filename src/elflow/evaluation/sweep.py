"""A sweep's grid, files and tables: the quality-diversity frontier of sampler settings.

Grid = sampler x steps x w x gamma (gamma only for the SDE; spec §5). Each cell is exactly an
``elflow sample`` run (:func:`elflow.generation.records.sample_records`, the same seed) followed
by an ``elflow score`` run (:func:`elflow.evaluation.score_samples`, spec §6), so a cell can be
reproduced on its own. A sweep folder holds ``samples/<cell>.jsonl``, ``metrics/<cell>.json``,
``table.csv``, ``table.md``, ``frontier.png`` (generative perplexity vs unigram entropy, one curve
per sampler, real text marked) and ``sweep.json`` (what a ``--resume`` must repeat). The command
is :mod:`elflow.cli.sweep`.
"""

from __future__ import annotations

import csv
import json
import math
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from elflow.config import SAMPLERS
from elflow.errors import ELFError
from elflow.generation.records import source_fields
from elflow.jsonl import read_jsonl

COLUMNS = (
    "cell",
    "sampler",
    "steps",
    "nfe",
    "gamma",
    "w",
    "project_from",
    "gen_ppl",
    "gen_ppl_lo",
    "gen_ppl_hi",
    "entropy",
    "entropy_lo",
    "entropy_hi",
    "num_samples",
    "num_empty",
    "seconds",
    "bleu",
    "rougeL",
)


@dataclass(frozen=True)
class Cell:
    sampler: str
    steps: int | None
    w: float | None
    gamma: float | None

    @property
    def name(self) -> str:
        """A file-name-safe id, e.g. ``sde-n16-w3-g1.5`` (``default`` for a model default)."""
        n = "default" if self.steps is None else str(self.steps)
        w = "default" if self.w is None else f"{self.w:g}"
        g = (
            ""
            if self.sampler != "sde"
            else "-g" + ("default" if self.gamma is None else f"{self.gamma:g}")
        )
        return f"{self.sampler}-n{n}-w{w}{g}"


def grid(
    samplers: list[str],
    steps: list[int | None],
    ws: list[float | None],
    gammas: list[float | None],
) -> list[Cell]:
    """Every cell in a fixed order; ``None`` values mean "the model's default"."""
    if not samplers:
        raise ELFError("--sampler names no sampler; give ode, sde and/or heun")
    for name in samplers:
        if name not in SAMPLERS:
            raise ELFError(f"unknown sampler {name!r} in --sampler; use {', '.join(SAMPLERS)}")
    cells = []
    for sampler in samplers:
        for n in steps:
            for w in ws:
                for g in gammas if sampler == "sde" else [None]:
                    cell = Cell(sampler, n, w, g)
                    if cell not in cells:  # a value listed twice is one cell
                        cells.append(cell)
    names_seen: dict[str, Cell] = {}
    for cell in cells:
        other = names_seen.setdefault(cell.name, cell)
        if other is not cell:  # e.g. --w 1,1.0000001: two cells, one file name
            raise ELFError(
                f"sweep cells {other} and {cell} share the name {cell.name!r}; "
                "give values that differ in their first 6 significant digits"
            )
    return cells


def table_row(name: str, settings: dict, metrics: dict, seconds: float | None) -> dict:
    """One row of ``table.csv`` (NaN where a metric was not computed)."""
    nan = math.nan
    lo, hi = metrics.get("gen_ppl_ci", [nan, nan])
    elo, ehi = metrics.get("entropy_ci", [nan, nan])
    return {
        "cell": name,
        "sampler": settings.get("sampler", ""),
        "steps": settings.get("steps", ""),
        "nfe": settings.get("nfe", ""),
        "gamma": "" if settings.get("gamma") is None else settings["gamma"],
        "w": settings.get("w", ""),
        # Projected sampling's start (one value per sweep; empty: off).
        "project_from": "" if settings.get("project_from") is None else settings["project_from"],
        "gen_ppl": metrics.get("gen_ppl", nan),
        "gen_ppl_lo": lo,
        "gen_ppl_hi": hi,
        "entropy": metrics.get("entropy", nan),
        "entropy_lo": elo,
        "entropy_hi": ehi,
        "num_samples": metrics.get("num_samples", ""),
        "num_empty": metrics.get("num_empty", ""),
        "seconds": "" if seconds is None else round(seconds, 3),
        "bleu": metrics.get("bleu", ""),  # with --refs
        "rougeL": metrics.get("rougeL", ""),
    }


def fmt(value: Any, digits: int = 2) -> str:
    if isinstance(value, float):
        return "nan" if not math.isfinite(value) else f"{value:.{digits}f}"
    return str(value)


def _g(value: Any) -> str:
    return f"{value:g}" if isinstance(value, float) else str(value)


def write_tables(folder: Path, rows: list[dict], protocol: str) -> None:
    with (folder / "table.csv").open("w", newline="", encoding="utf-8") as f:
        writer = csv.DictWriter(f, fieldnames=COLUMNS)
        writer.writeheader()
        writer.writerows(rows)
    refs = any(r["bleu"] != "" for r in rows)  # scored against --refs: BLEU and ROUGE-L too
    projected = any(r.get("project_from", "") != "" for r in rows)  # a "project from" column
    head = "| sampler | steps | nfe | gamma | w |" + (" project from |" if projected else "")
    head += " gen PPL [95% CI] | entropy | empty | seconds |"
    head += " BLEU | ROUGE-L |" if refs else ""
    lines = [head, "|" + "---|" * (9 + 2 * refs + projected)]
    for r in rows:
        ppl = f"{fmt(r['gen_ppl'])} [{fmt(r['gen_ppl_lo'])}, {fmt(r['gen_ppl_hi'])}]"
        line = f"| {r['sampler']} | {r['steps']} | {r['nfe']} | {r['gamma']} | {r['w']} |"
        line += f" {r.get('project_from', '')} |" if projected else ""
        line += f" {ppl} | {fmt(r['entropy'], 3)} | {r['num_empty']} | {r['seconds']} |"
        if refs:
            line += f" {fmt(r['bleu'])} | {fmt(r['rougeL'])} |"
        lines.append(line)
    lines.append(f"\nScored with protocol: {protocol}")
    (folder / "table.md").write_text("\n".join(lines) + "\n", encoding="utf-8")


def plot_frontier(path: Path, rows: list[dict], reference: dict | None = None) -> Path:
    """Generative perplexity vs entropy, one curve per sampler, points labelled ``n<steps> w<w>``.

    Uses the Agg canvas directly (no pyplot): no global backend state, no display needed.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7, 5))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    ppls = []
    for sampler in dict.fromkeys(r["sampler"] for r in rows):
        pts = [
            r
            for r in rows
            if r["sampler"] == sampler
            and math.isfinite(r["gen_ppl"])
            and math.isfinite(r["entropy"])
        ]
        pts.sort(key=lambda r: r["entropy"])
        if not pts:
            continue
        xs, ys = [r["entropy"] for r in pts], [r["gen_ppl"] for r in pts]
        ppls += ys
        ax.plot(xs, ys, marker="o", label=sampler)
        for r in pts:
            label = f"n{r['steps']} w{_g(r['w'])}" + (
                f" g{_g(r['gamma'])}" if r["gamma"] != "" else ""
            )
            ax.annotate(
                label,
                (r["entropy"], r["gen_ppl"]),
                fontsize=7,
                xytext=(3, 3),
                textcoords="offset points",
            )
    if reference is not None and math.isfinite(reference.get("gen_ppl", math.nan)):
        ref_xy = ([reference["entropy"]], [reference["gen_ppl"]])
        ax.plot(*ref_xy, "k*", markersize=14, label="real text")
        ppls.append(reference["gen_ppl"])
    if ppls and min(ppls) > 0 and max(ppls) / min(ppls) > 10:
        ax.set_yscale("log")
    ax.set_xlabel("unigram entropy (higher = more diverse)")
    ax.set_ylabel("generative perplexity (lower = better)")
    ax.set_title("quality-diversity frontier")
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return path


SETTINGS = "sweep.json"
OUTPUTS = ("samples", "metrics", "table.csv", "table.md", "frontier.png", SETTINGS)
MARKERS = ("table.csv", "table.md", "metrics", SETTINGS)
"""What only a sweep writes (a training run has ``samples/`` too, and ``metrics.jsonl``)."""
RESUME_KEYS = (
    "checkpoint",
    "task",
    "num_samples",
    "seed",
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
)
"""The options every cell of one sweep shares (``sweep.json``): a ``--resume`` must repeat them."""
RESUME_DEFAULTS = {
    "refs": None,
    "ref_field": "text",
    "project_from": 1.0,
    "time_grid": None,
    "time_mean": None,
    "time_std": None,
}
"""Their values in a ``sweep.json`` written before they were recorded."""


def sweep_settings(shared: dict[str, Any], cells: list[Cell]) -> dict[str, Any]:
    """What ``sweep.json`` records: the shared options (:data:`RESUME_KEYS`), with the model as
    the checkpoint it resolves to (a run folder's latest checkpoint then, which a resume must
    sample too) and local paths absolute; and the grid's cells."""
    from elflow.io.artifact import read_config
    from elflow.io.sources import resolve_source

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
    """Whether ``out`` holds an earlier sweep to clear: it is replaced only with ``--overwrite``,
    or finished with ``--resume`` (same shared options); a training run's folder is refused."""
    if overwrite and resume:
        raise ELFError("--overwrite replaces the sweep, --resume finishes it: give one")
    if (out / "metrics.jsonl").exists() or any(out.glob("checkpoint-*")):
        raise ELFError(f"--out {out} is a training run's folder; give the sweep its own folder")
    found = [name for name in MARKERS if (out / name).exists()]
    if found and not (overwrite or resume):
        raise ELFError(
            f"--out {out} already holds a sweep ({', '.join(found)}); pass --resume to finish "
            "it, --overwrite to replace it, or a new folder"
        )
    if found and resume:
        try:
            saved = json.loads((out / SETTINGS).read_text())
        except (OSError, ValueError):
            raise ELFError(
                f"--resume: {out} has no readable {SETTINGS} (a sweep of an older elflow); "
                "pass --overwrite to sample it again"
            ) from None
        for key in RESUME_KEYS:
            was = saved.get(key, RESUME_DEFAULTS.get(key))  # keys added since (sweep.json)
            if key == "num_samples" and was is None and settings["sources"] is None:
                was = 16  # an unconditional sweep recorded without -n: the default then
            if was != settings[key]:
                raise ELFError(
                    f"--resume: the sweep in {out} was run with --{key.replace('_', '-')} "
                    f"{was!r}, now {settings[key]!r}; give the same options, or --overwrite"
                )
        dropped = [c for c in saved.get("cells", []) if c not in settings["cells"]]
        if dropped:
            raise ELFError(
                f"--resume: the sweep in {out} also has cells {', '.join(dropped)}, which this "
                "grid lacks (its table would leave them out); give the same grid or a larger "
                "one, or --overwrite"
            )
    return bool(found) and not resume


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


def read_samples(path: Path, expected: int) -> list[dict] | None:
    """A cell's saved samples when the file holds all ``expected`` of them, else None."""
    try:
        records = read_jsonl(path)
    except (OSError, ELFError):
        return None
    return records if len(records) == expected else None


def clear_previous(out: Path) -> None:
    """Remove an earlier sweep's outputs, so the tables and folders list this sweep's cells only."""
    for name in OUTPUTS:
        path = out / name
        if path.is_dir():
            shutil.rmtree(path)
        elif path.exists():
            path.unlink()
