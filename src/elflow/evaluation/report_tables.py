"""A sweep's tables and frontier plot: ``table.csv``, ``table.md`` and ``frontier.png`` (spec §6).

One row per cell (and one for the real text of ``--reference``). Each metric is the value over
all the cell's samples with its 95% bootstrap interval; a sweep of several seeds adds the mean
and the between-seed standard deviation (:mod:`elflow.evaluation.seeds`), which ``table.md``
shows as ``mean ± sd [pooled interval]`` (MAUVE: the pooled value, then the seeds', as it
depends on how many texts it sees). ``table.md`` ends with notes: the protocol, the seeds, how
the real text was prepared, that set statistics need equal sizes, and how many pairs of cells
the intervals separate (none: the sweep has too few samples to rank its cells).
``frontier.png`` draws every point with its intervals as error bars.
"""

from __future__ import annotations

import csv
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from elflow.evaluation.comparison import Scored, separation
from elflow.evaluation.metric_table import METRICS, Metric
from elflow.evaluation.sweep_grid import row_settings

COUNT_COLUMNS = ("num_seeds", "num_samples", "num_empty", "seconds")


def _own_columns(metrics: Sequence[Metric]) -> list[str]:
    return [c for m in metrics for c in (m.name, *(f"{m.name}_lo", f"{m.name}_hi") * m.table_ci)]


def metric_columns() -> tuple[str, ...]:
    """The metric columns of ``table.csv`` (:data:`METRICS` with ``table``): the judge's metrics
    (with ``_lo``/``_hi`` where ``table_ci``), the seed spreads (``table_seeds``), the
    judge-free metrics, the counts, then the metrics against references."""
    shown = [m for m in METRICS.values() if m.table]
    spreads = [f"{m.name}_seed_{s}" for m in shown if m.table_seeds for s in ("mean", "sd")]
    return (
        *_own_columns([m for m in shown if m.needs in ("judge", "reference")]),
        *spreads,
        *_own_columns([m for m in shown if not m.needs]),
        *COUNT_COLUMNS,
        *_own_columns([m for m in shown if m.needs == "refs"]),
    )


def optional_columns() -> set[str]:
    """Columns left empty (not NaN) when a sweep does not compute them: the metrics needing real
    text or references, and the seed spreads."""
    shown = [m for m in METRICS.values() if m.table]
    optional = set(_own_columns([m for m in shown if m.needs in ("reference", "refs")]))
    return optional | {c for c in metric_columns() if "_seed_" in c}


def table_columns() -> tuple[str, ...]:
    """The columns of ``table.csv``: the cell, its settings, its metrics."""
    return ("cell", *row_settings(), *metric_columns())


COLUMNS = table_columns()
"""The columns of ``table.csv`` with the built-in samplers and metrics (:func:`table_columns`
reads the registries when called)."""


def table_row(name: str, settings: dict, metrics: dict, seconds: float | None) -> dict:
    """One row of ``table.csv`` (NaN where a metric was not computed, empty where it does not
    apply: no ``--reference``, no ``--refs``, one seed)."""
    optional = optional_columns()
    row: dict[str, Any] = {"cell": name}
    row |= {k: "" if settings.get(k) is None else settings[k] for k in row_settings()}
    row |= {k: metrics.get(k, "" if k in optional else math.nan) for k in metric_columns()}
    for m in (m for m in METRICS.values() if m.table and m.table_ci):
        missing = "" if f"{m.name}_lo" in optional else math.nan
        row[f"{m.name}_lo"], row[f"{m.name}_hi"] = metrics.get(f"{m.name}_ci", [missing] * 2)
    row["num_seeds"] = len(metrics.get("seeds") or [0])
    row["num_samples"] = metrics.get("num_samples", "")
    row["num_empty"] = metrics.get("num_empty", "")
    row["seconds"] = "" if seconds is None else round(seconds, 3)
    return row


def fmt(value: Any, digits: int = 2) -> str:
    if isinstance(value, float):
        return "nan" if not math.isfinite(value) else f"{value:.{digits}f}"
    return str(value)


def _g(value: Any) -> str:
    return f"{value:g}" if isinstance(value, float) else str(value)


def _with_spread(r: dict, key: str, digits: int, seeds: bool) -> str:
    if seeds and r.get(f"{key}_seed_mean", "") != "":
        return f"{fmt(r[f'{key}_seed_mean'], digits)} ± {fmt(r[f'{key}_seed_sd'], digits)}"
    return fmt(r[key], digits)


def _mauve(r: dict, seeds: bool) -> str:
    """All samples' MAUVE, then (several seeds) each seed's: fewer samples, fewer clusters, a
    different number, so the two are shown apart rather than as one mean."""
    if r["mauve"] == "":
        return ""
    pooled = fmt(r["mauve"], 3)
    if seeds and r.get("mauve_seed_mean", "") != "":
        return f"{pooled} ({_with_spread(r, 'mauve', 3, seeds)})"
    return pooled


def _scored(r: dict) -> Scored:
    num = {k: float(r[k]) if r[k] != "" else math.nan for k in ("gen_ppl_lo", "gen_ppl_hi")}
    return Scored("", r["cell"], r["gen_ppl"], num["gen_ppl_lo"], num["gen_ppl_hi"], r["entropy"])


def separability(rows: Sequence[dict]) -> str | None:
    """How many pairs of cells the gen PPL intervals separate, and a warning when none are."""
    cells = [_scored(r) for r in rows if r["cell"] != "reference"]
    pairs = [(a, b) for i, a in enumerate(cells) for b in cells[i + 1 :]]
    if not pairs:
        return None
    apart = sum(separation(a, b) != 0 for a, b in pairs)
    line = f"{apart} of {len(pairs)} pairs of cells differ in gen PPL beyond their 95% intervals"
    if apart == 0:
        line += (
            "; too few samples to tell these cells apart: draw more samples or add seeds before "
            "reading an order into them"
        )
    return line


def write_tables(folder: Path, rows: list[dict], protocol: str, notes: Sequence[str] = ()) -> None:
    """``table.csv`` (every column) and ``table.md`` (the columns a reader compares, then the
    protocol, ``notes`` and the separability line)."""
    with (folder / "table.csv").open("w", newline="", encoding="utf-8") as f:
        writer = csv.DictWriter(f, fieldnames=table_columns())
        writer.writeheader()
        writer.writerows(rows)
    refs = any(r["bleu"] != "" for r in rows)  # scored against --refs: BLEU and ROUGE-L too
    projected = any(r.get("project_from", "") != "" for r in rows)  # a "project from" column
    mauve = any(r["mauve"] != "" for r in rows)
    seeds = any(r["num_seeds"] > 1 for r in rows)
    ppl_head = "gen PPL mean ± sd [pooled 95% CI]" if seeds else "gen PPL [95% CI]"
    schedules = any(r.get("gamma_schedule", "") not in ("", "constant") for r in rows)
    heads = ["sampler", "steps", "nfe", "gamma"] + ["γ schedule"] * schedules + ["w"]
    heads += ["project from"] * projected
    heads += [ppl_head, "entropy" + " mean ± sd" * seeds]
    heads += ["MAUVE" + " (per seed: mean ± sd)" * seeds] * mauve
    heads += ["distinct-2", "rep-4", "self-BLEU", "empty", "dup", "seconds"]
    heads += ["BLEU", "ROUGE-L"] * refs
    lines = ["| " + " | ".join(heads) + " |", "|" + "---|" * len(heads)]
    # Grouped by cost: rows of one NFE (network evaluations per sample) compare fairly.
    for r in sorted(rows, key=_by_nfe):
        ppl = f"{_with_spread(r, 'gen_ppl', 2, seeds)} [{fmt(r['gen_ppl_lo'])}, "
        ppl += f"{fmt(r['gen_ppl_hi'])}]"
        cols = [str(r[k]) for k in ("sampler", "steps", "nfe", "gamma")]
        cols += [str(r.get("gamma_schedule", ""))] * schedules + [str(r["w"])]
        cols += [str(r.get("project_from", ""))] * projected
        cols += [ppl, _with_spread(r, "entropy", 3, seeds)]
        cols += [_mauve(r, seeds)] * mauve
        cols += [fmt(r["distinct_2"], 3), fmt(r["rep_4"], 3), fmt(r["self_bleu"])]
        cols += [str(r["num_empty"]), fmt(r["duplicate_share"]), str(r["seconds"])]
        cols += [fmt(r["bleu"]), fmt(r["rougeL"])] * refs
        lines.append("| " + " | ".join(cols) + " |")
    lines.append(f"\nScored with protocol: {protocol}")
    lines += [f"\n{note}" for note in notes]
    sizes = sorted({r["num_samples"] for r in rows if r["num_samples"] != ""})
    if len(sizes) > 1 or seeds:
        lines.append(
            f"\nMAUVE, distinct-2 and self-BLEU depend on how many texts they see (here "
            f"{', '.join(map(str, sizes))}; per seed, fewer): compare them between rows of one "
            "size."
        )
    apart = separability(rows)
    if apart:
        lines.append(f"\n{apart}.")
    (folder / "table.md").write_text("\n".join(lines) + "\n", encoding="utf-8")


def _by_nfe(row: dict) -> tuple[float, int]:
    """Sort key: by NFE (the reference row, which has none, last), stable within one NFE."""
    nfe = row.get("nfe", "")
    return (math.inf if nfe in ("", None) else float(nfe), 0)


def _bars(rows: Sequence[dict], key: str) -> list[list[float]]:
    """(2, N) distances from each value down to its interval's low end and up to its high end
    (0 where there is no interval), as ``errorbar`` takes them."""
    low, high = [], []
    for r in rows:
        lo, hi, v = r[f"{key}_lo"], r[f"{key}_hi"], r[key]
        ok = all(isinstance(x, (int, float)) and math.isfinite(x) for x in (lo, hi, v))
        low.append(max(v - lo, 0.0) if ok else 0.0)
        high.append(max(hi - v, 0.0) if ok else 0.0)
    return [low, high]


def plot_frontier(
    path: Path, rows: list[dict], reference: dict | None = None, caption: str = ""
) -> Path:
    """Save :func:`frontier_figure` as a PNG at ``path``."""
    frontier_figure(rows, reference, caption).savefig(path, dpi=100)
    return path


def frontier_figure(rows: list[dict], reference: dict | None = None, caption: str = ""):
    """Generative perplexity vs entropy, one curve per sampler, points labelled ``n<steps> w<w>``,
    each with its 95% intervals as error bars in both directions; the real text as a star.

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
        ppls += ys + [r["gen_ppl_hi"] for r in pts if isinstance(r["gen_ppl_hi"], float)]
        ax.errorbar(
            xs,
            ys,
            xerr=_bars(pts, "entropy"),
            yerr=_bars(pts, "gen_ppl"),
            marker="o",
            capsize=3,
            label=sampler,
        )
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
        ref = table_row("reference", {}, reference, None)
        ax.errorbar(
            [ref["entropy"]],
            [ref["gen_ppl"]],
            xerr=_bars([ref], "entropy"),
            yerr=_bars([ref], "gen_ppl"),
            fmt="k*",
            markersize=14,
            capsize=3,
            label="real text",
        )
        ppls.append(reference["gen_ppl"])
    finite = [p for p in ppls if math.isfinite(p) and p > 0]
    if finite and max(finite) / min(finite) > 10:
        ax.set_yscale("log")
    ax.set_xlabel("unigram entropy (higher = more diverse)")
    ax.set_ylabel("generative perplexity (lower = better)")
    ax.set_title("quality-diversity frontier" + (f"\n{caption}" if caption else ""), fontsize=10)
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend()
    fig.tight_layout()
    return fig
