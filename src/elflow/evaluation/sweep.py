"""``elflow sweep``: sample and score a grid of sampler settings; the quality-diversity frontier.

Grid = sampler x steps x w x gamma (gamma only for the SDE; spec §5). Each cell is exactly an
``elflow sample`` run (the same :func:`elflow.generation.records.sample_records`, the same seed) followed by
an ``elflow score`` run (:func:`elflow.evaluation.score_samples`, spec §6), so a cell can be
reproduced on its own. Writes ``samples/<cell>.jsonl``, ``metrics/<cell>.json``, ``table.csv``,
``table.md`` and ``frontier.png`` (generative perplexity vs unigram entropy, one curve per sampler,
the real-text reference point marked when ``--reference`` is given).
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from elflow.distributed import broadcast_object, teardown
from elflow.errors import ELFError
from elflow.generation.records import (
    add_project_argument,
    add_sampling_arguments,
    check_sample_args,
    load_pipeline,
    recorded_project_from,
    requested_samples,
    resolve_device,
    resolve_sampler,
    sample_from_args,
    source_fields,
    sources_from_args,
)
from elflow.jsonl import read_jsonl, write_jsonl
from elflow.paths import output_dir

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


def _list(text: str | None, kind: type, what: str) -> list:
    if text is None:
        return [None]
    try:
        values = [kind(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise ELFError(
            f"--{what} must be a comma-separated list of numbers, got {text!r}"
        ) from None
    if not values:
        raise ELFError(f"--{what} is empty")
    return values


def grid(samplers: str, steps: str | None, ws: str | None, gammas: str | None) -> list[Cell]:
    """Every cell in a fixed order; ``None`` values mean "the model's default"."""
    names = [s.strip() for s in samplers.split(",") if s.strip()]
    if not names:
        raise ELFError(f"--sampler {samplers!r} names no sampler; give ode, sde and/or heun")
    for name in names:
        if name not in ("ode", "sde", "heun"):
            raise ELFError(f"unknown sampler {name!r} in --sampler; use ode, sde or heun")
    step_list = _list(steps, int, "steps")
    if any(n is not None and n < 1 for n in step_list):
        raise ELFError(f"--steps must be >= 1, got {steps}")
    cells = []
    for sampler in names:
        for n in step_list:
            for w in _list(ws, float, "w"):
                for g in _list(gammas, float, "gamma") if sampler == "sde" else [None]:
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


def _num(value: Any, digits: int = 2) -> str:
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
        ppl = f"{_num(r['gen_ppl'])} [{_num(r['gen_ppl_lo'])}, {_num(r['gen_ppl_hi'])}]"
        line = f"| {r['sampler']} | {r['steps']} | {r['nfe']} | {r['gamma']} | {r['w']} |"
        line += f" {r.get('project_from', '')} |" if projected else ""
        line += f" {ppl} | {_num(r['entropy'], 3)} | {r['num_empty']} | {r['seconds']} |"
        if refs:
            line += f" {_num(r['bleu'])} | {_num(r['rougeL'])} |"
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
)
"""The options every cell of one sweep shares (``sweep.json``): a ``--resume`` must repeat them."""
RESUME_DEFAULTS = {"refs": None, "ref_field": "text", "project_from": 1.0}
"""Their values in a ``sweep.json`` written before they were recorded."""


def sweep_settings(args: argparse.Namespace, cells: list[Cell]) -> dict[str, Any]:
    """What ``sweep.json`` records: the shared options, with the checkpoint as the one it
    resolves to (a run folder's latest checkpoint then, which a resume must sample too) and
    local paths absolute; and the grid's cells."""
    from elflow.io.artifact import read_config, resolve_source

    settings = {key: getattr(args, key) for key in RESUME_KEYS}
    resolved = resolve_source(args.checkpoint)
    settings["checkpoint"] = str(resolved.path.resolve())
    if args.project_from is None:  # the model's own, so that a changed default is caught too
        model = None if resolved.kind == "official" else read_config(resolved.path)
        settings["project_from"] = 1.0 if model is None else model.sampler.project_from
    for key in ("sources", "refs"):
        if getattr(args, key):
            settings[key] = str(Path(getattr(args, key)).expanduser().resolve())
    return {**settings, "cells": [c.name for c in cells]}


def _check_previous(out: Path, overwrite: bool, resume: bool, settings: dict) -> bool:
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


def _read_metrics(path: Path) -> dict | None:
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


def _read_samples(path: Path, expected: int) -> list[dict] | None:
    """A cell's saved samples when the file holds all ``expected`` of them, else None."""
    try:
        records = read_jsonl(path)
    except (OSError, ELFError):
        return None
    return records if len(records) == expected else None


def _clear_previous(out: Path) -> None:
    """Remove an earlier sweep's outputs, so the tables and folders list this sweep's cells only."""
    for name in OUTPUTS:
        path = out / name
        if path.is_dir():
            shutil.rmtree(path)
        elif path.exists():
            path.unlink()


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Arguments of ``elflow sweep``."""
    from elflow.evaluation.judge import DEFAULT_JUDGE
    from elflow.evaluation.score import PROTOCOLS

    add_sampling_arguments(p)
    p.add_argument("--out", required=True, help="output folder")
    p.add_argument("--sampler", default="ode,sde", help="comma list of ode, sde, heun")
    p.add_argument("--steps", help="comma list, e.g. 8,16,32 (default: the model's)")
    p.add_argument("--w", help="comma list of self-conditioning CFG scales (default: the model's)")
    p.add_argument("--gamma", help="comma list of SDE gammas (default: the model's)")
    p.add_argument("--cfg", type=float, help="classifier-free guidance (conditional models)")
    add_project_argument(p)
    p.add_argument("--judge", default=DEFAULT_JUDGE, help="judge LM for gen PPL (see elflow score)")
    p.add_argument("--reference", help="JSONL of real text ('text'): its point on the frontier")
    p.add_argument("--refs", help="conditional: JSONL references; adds BLEU and ROUGE per cell")
    p.add_argument("--ref-field", default="text", help="field of --refs holding the reference")
    p.add_argument("--protocol", default="paper", choices=list(PROTOCOLS))
    p.add_argument("--score-batch-size", type=int, default=16, help="samples per judge forward")
    p.add_argument("--bootstrap", type=int, default=1000, help="bootstrap resamples (0: no CIs)")
    p.add_argument("--bootstrap-seed", type=int, default=0, help="as elflow score --seed")
    p.add_argument(
        "--resume",
        action="store_true",
        help="finish an interrupted sweep in --out: keep its scored cells, score sampled ones",
    )


def run(args: argparse.Namespace) -> int:
    """``elflow sweep``; generation is shared across ``torchrun`` ranks, scoring is on rank 0."""
    from elflow.cli.score import check_counts, read_refs, write_metrics
    from elflow.evaluation import load_judge, score_samples
    from elflow.evaluation.score import align_refs

    cells = grid(args.sampler, args.steps, args.w, args.gamma)
    check_counts(args.score_batch_size, args.bootstrap, "--score-batch-size")
    out = output_dir(args.out, "--out")
    settings = sweep_settings(args, cells)
    previous = _check_previous(out, args.overwrite, args.resume, settings)
    info = resolve_device(args.device)
    try:
        sources = sources_from_args(args)
        reference = read_jsonl(args.reference) if args.reference else None
        refs = read_refs(args.refs, args.ref_field) if args.refs else None
        if reference is not None and not reference:
            raise ELFError(f"--reference {args.reference} holds no texts")
        pipe = load_pipeline(args, info)
        judge = None
        # Every cell's settings are checked before the first is sampled.
        samplers = [
            resolve_sampler(
                pipe,
                steps=c.steps,
                sampler=c.sampler,
                gamma=c.gamma,
                w=c.w,
                cfg=args.cfg,
                project_from=args.project_from,
            )
            for c in cells
        ]
        check_sample_args(pipe, args, sources)
        if any(s.project_from < 1.0 for s in samplers):
            pipe.projection()  # its encoder loads now, so that a missing one clears nothing
        if refs is not None and sources is not None:  # references that cannot align: now
            align_refs(stub_records(sources, args.source_field), refs)
        if info.is_main:
            judge = None if args.judge.lower() == "none" else load_judge(args.judge)
            if previous:  # only now that the new sweep has everything it needs to start
                _clear_previous(out)
            (out / "samples").mkdir(parents=True, exist_ok=True)
            (out / "metrics").mkdir(parents=True, exist_ok=True)
            (out / SETTINGS).write_text(json.dumps(settings, indent=2) + "\n")
        score = dict(
            judge=judge,
            protocol=args.protocol,
            batch_size=args.score_batch_size,
            bootstrap=args.bootstrap,
            seed=args.bootstrap_seed,
        )
        rows = []
        keys = ("sampler", "steps", "nfe", "gamma", "w", "project_from")
        expected = len(sources) if sources is not None else requested_samples(args)
        for i, (cell, scfg) in enumerate(zip(cells, samplers, strict=True)):
            sample_file = out / "samples" / f"{cell.name}.jsonl"
            metrics_file = out / "metrics" / f"{cell.name}.json"
            # --resume: a scored cell is read back, a sampled one only scored (rank 0 decides,
            # so every rank skips the same collective sampling).
            metrics = records = None
            if args.resume and info.is_main:
                metrics = _read_metrics(metrics_file)
                records = _read_samples(sample_file, expected) if metrics is None else None
            scored, sampled = broadcast_object((metrics is not None, records is not None))
            if scored:
                if info.is_main:
                    # Cells scored before the tables showed it used the sweep's (one) value.
                    done = {"project_from": recorded_project_from(scfg), **metrics["sweep"]}
                    rows.append(table_row(cell.name, done, metrics, done.get("seconds")))
                    print(f"[{i + 1}/{len(cells)}] {cell.name}: done earlier", file=sys.stderr)
                continue
            if sampled:
                seconds = None
            else:
                result = sample_from_args(pipe, scfg, args, sources, info)
                records, seconds = result.records, result.seconds
            if not info.is_main:
                continue
            if not sampled:
                write_jsonl(sample_file, records)
            metrics = score_samples(records, refs=refs, **score)
            cell_settings = {k: records[0].get(k) for k in keys}  # older files lack some
            write_metrics(
                metrics_file,
                {**metrics, "sweep": {**cell_settings, "cell": cell.name, "seconds": seconds}},
            )
            rows.append(table_row(cell.name, cell_settings, metrics, seconds))
            took = "sampled earlier" if seconds is None else f"{seconds:.1f} s"
            print(
                f"[{i + 1}/{len(cells)}] {cell.name}: gen_ppl {_num(rows[-1]['gen_ppl'])}, "
                f"entropy {_num(rows[-1]['entropy'], 3)} ({took})",
                file=sys.stderr,
            )
        if not info.is_main:
            return 0
        ref_metrics = None
        if reference is not None:
            ref_metrics = score_samples(reference, **score)
            write_metrics(out / "metrics" / "reference.json", ref_metrics)
            rows.append(table_row("reference", {"sampler": "reference"}, ref_metrics, None))
        write_tables(out, rows, args.protocol)
        if judge is not None:
            cells_only = [r for r in rows if r["cell"] != "reference"]
            plot_frontier(out / "frontier.png", cells_only, ref_metrics)
        print((out / "table.md").read_text(), end="")
        print(f"wrote {out}", file=sys.stderr)
    finally:
        if info.distributed:
            teardown()
    return 0
