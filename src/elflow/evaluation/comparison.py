"""Matched-entropy comparison of scored results: what ``elflow compare`` prints (spec §6).

Generative perplexity falls as entropy falls (repetitive text is "likely"), so two settings are
compared only where their unigram entropies lie within a tolerance. For each such pair the side
lower in gen PPL *beyond both 95% intervals* wins; pairs whose intervals overlap are ties. A
result is an ``elflow sweep`` folder (or its ``table.csv``; every cell but the real-text row) or
an ``elflow score`` metrics file (one cell). Two or more results: every cell of each result is
paired with every cell of each later result; one result: its cells with each other. Pure Python
(no torch), so the command answers at once.
"""

from __future__ import annotations

import csv
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from elflow.errors import ELFError
from elflow.evaluation.sweep_grid import row_settings


@dataclass(frozen=True)
class Scored:
    """One scored cell: its gen PPL and entropy with their 95% intervals."""

    result: str
    cell: str
    gen_ppl: float
    gen_ppl_lo: float
    gen_ppl_hi: float
    entropy: float
    settings: dict[str, str] = field(default_factory=dict, compare=False)
    num_samples: str = ""


def _num(value: Any) -> float:
    try:
        return float(value)
    except (TypeError, ValueError):
        return math.nan


def _from_metrics(result: str, cell: str, m: dict, settings: dict) -> Scored:
    if "gen_ppl" not in m or "entropy" not in m:
        raise ELFError(f"{result}: no gen_ppl and entropy (scored without a judge?)")
    lo, hi = (m.get("gen_ppl_ci") or [None, None])[:2]
    shown = {k: "" if settings.get(k) is None else str(settings[k]) for k in row_settings()}
    return Scored(
        result,
        cell,
        _num(m["gen_ppl"]),
        _num(lo),
        _num(hi),
        _num(m["entropy"]),
        shown,
        str(m.get("num_samples", "")),
    )


def load_result(path: str | Path) -> list[Scored]:
    """The scored cells of a sweep folder, a sweep's ``table.csv`` or a score ``metrics.json``."""
    p = Path(path).expanduser()
    label = str(path)
    if p.is_dir():
        p = p / "table.csv"
        if not p.is_file():
            raise ELFError(f"{path} holds no table.csv; give a finished sweep or a metrics file")
    if not p.is_file():
        raise ELFError(f"{path} does not exist; give a sweep folder or a metrics.json")
    if p.suffix == ".csv":
        with p.open(newline="", encoding="utf-8") as f:
            rows = [r for r in csv.DictReader(f) if r.get("cell") != "reference"]
        if not rows or "gen_ppl" not in rows[0]:
            raise ELFError(f"{p} is not a sweep table (no gen_ppl column)")
        return [
            Scored(
                label,
                r["cell"],
                _num(r["gen_ppl"]),
                _num(r.get("gen_ppl_lo")),
                _num(r.get("gen_ppl_hi")),
                _num(r.get("entropy")),
                {k: r.get(k, "") for k in row_settings()},
                r.get("num_samples", ""),
            )
            for r in rows
        ]
    try:
        m = json.loads(p.read_text(encoding="utf-8"))
    except ValueError:
        raise ELFError(
            f"{p} is not JSON; give a sweep folder or an elflow score metrics.json"
        ) from None
    if not isinstance(m, dict):
        raise ELFError(f"{p} is not an elflow score metrics file")
    settings = m.get("sweep") or {}
    return [_from_metrics(label, settings.get("cell", p.stem), m, settings)]


def separation(a: Scored, b: Scored) -> int:
    """1 when ``a`` is lower in gen PPL beyond both intervals, -1 when ``b`` is, else 0."""
    if a.gen_ppl_hi < b.gen_ppl_lo:
        return 1
    if b.gen_ppl_hi < a.gen_ppl_lo:
        return -1
    return 0  # overlapping, or an interval missing (NaN compares false)


@dataclass(frozen=True)
class Comparison:
    """The pairs of two results (or of one result's cells) with entropies within tolerance."""

    a: str
    b: str
    pairs: list[tuple[Scored, Scored, int]]

    @property
    def counts(self) -> tuple[int, int, int]:
        """(wins, ties, losses) of side A."""
        verdicts = [v for _, _, v in self.pairs]
        return verdicts.count(1), verdicts.count(0), verdicts.count(-1)


def _pairs(
    cells_a: Sequence[Scored],
    cells_b: Sequence[Scored],
    tolerance: float,
    same: Sequence[str],
    within: bool,
) -> list[tuple[Scored, Scored, int]]:
    out = []
    for i, a in enumerate(cells_a):
        for b in cells_b[i + 1 :] if within else cells_b:
            if not abs(a.entropy - b.entropy) <= tolerance:  # NaN entropy: never paired
                continue
            if any(a.settings.get(k) != b.settings.get(k) for k in same):
                continue
            out.append((a, b, separation(a, b)))
    return out


def compare(
    results: Sequence[Sequence[Scored]], tolerance: float = 0.05, same: Sequence[str] = ()
) -> list[Comparison]:
    """Every result against every later one (one result: its cells against each other)."""
    if tolerance < 0 or not math.isfinite(tolerance):
        raise ELFError(f"tolerance= must be a finite number >= 0, got {tolerance}")
    settings = row_settings()  # what a cell records, and so may be required to agree
    unknown = [k for k in same if k not in settings]
    if unknown:
        raise ELFError(f"{unknown[0]!r} in same= is not a cell setting; use {', '.join(settings)}")
    if len(results) == 1:
        cells = results[0]
        name = cells[0].result if cells else ""
        return [Comparison(name, name, _pairs(cells, cells, tolerance, same, within=True))]
    return [
        Comparison(ra[0].result, rb[0].result, _pairs(ra, rb, tolerance, same, within=False))
        for i, ra in enumerate(results)
        for rb in results[i + 1 :]
        if ra and rb
    ]


def _ppl(c: Scored) -> str:
    return f"{c.gen_ppl:.2f} [{c.gen_ppl_lo:.2f}, {c.gen_ppl_hi:.2f}]"


def markdown(comparisons: Sequence[Comparison], tolerance: float) -> str:
    """One table per comparison and its summary line: the output of ``elflow compare``."""
    blocks = []
    for comp in comparisons:
        title = (
            f"A = B = {comp.a} (its cells against each other)"
            if comp.a == comp.b
            else f"A = {comp.a}, B = {comp.b}"
        )
        lines = [f"{title}; entropy within {tolerance:g} nats", ""]
        if comp.pairs:
            lines += [
                "| A cell | A entropy | A gen PPL [95% CI] | B cell | B entropy "
                "| B gen PPL [95% CI] | lower gen PPL |",
                "|---|---|---|---|---|---|---|",
            ]
            word = {1: "A", 0: "overlap", -1: "B"}
            for a, b, v in comp.pairs:
                lines.append(
                    f"| {a.cell} | {a.entropy:.3f} | {_ppl(a)} | {b.cell} | {b.entropy:.3f} "
                    f"| {_ppl(b)} | {word[v]} |"
                )
            lines.append("")
        wins, ties, losses = comp.counts
        lines.append(
            f"A vs B: {wins} wins, {ties} overlaps, {losses} losses for A in {len(comp.pairs)} "
            "pairs (a win: lower gen PPL beyond both 95% intervals)"
            if comp.pairs
            else f"no pair of cells has entropies within {tolerance:g} nats; raise the tolerance"
        )
        blocks.append("\n".join(lines))
    return "\n\n".join(blocks) + "\n"


def as_json(comparisons: Sequence[Comparison], tolerance: float) -> dict[str, Any]:
    """The comparisons as JSON-able data (``elflow compare --out``)."""

    def cell(c: Scored) -> dict[str, Any]:
        return {
            "cell": c.cell,
            "entropy": c.entropy,
            "gen_ppl": c.gen_ppl,
            "gen_ppl_ci": [c.gen_ppl_lo, c.gen_ppl_hi],
            **c.settings,
        }

    return {
        "entropy_tolerance": tolerance,
        "comparisons": [
            {
                "a": comp.a,
                "b": comp.b,
                "wins": comp.counts[0],
                "overlaps": comp.counts[1],
                "losses": comp.counts[2],
                "pairs": [
                    {"a": cell(a), "b": cell(b), "lower": {1: "a", 0: None, -1: "b"}[v]}
                    for a, b, v in comp.pairs
                ],
            }
            for comp in comparisons
        ],
    }
