"""Run a sweep from Python: sample and score a grid of sampler settings into a folder.

:func:`sweep` is what ``elflow sweep`` runs once it has read its flags: each cell (a
:class:`elflow.evaluation.sweep_grid.Cell` and its :class:`elflow.SamplerConfig`) is sampled for
every seed, written to ``OUT/samples/<cell>.jsonl``, scored into ``OUT/metrics/<cell>.json``, and
the tables (``table.csv``, ``table.md``) and the frontier plot gathered at the end; with real
``reference`` text the real text gets its own row and each cell's MAUVE is measured against it.
Under ``torchrun`` every process samples and process 0 scores.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from elflow.config import SamplerConfig
from elflow.evaluation.sweep_grid import Cell


@dataclass(frozen=True)
class SweepOptions:
    """How every cell is sampled and scored (the flags ``elflow sweep`` shares across cells)."""

    batch_size: int = 32
    bf16: bool = False
    ema: bool = True
    source_field: str = "text"
    protocol: str = "paper"
    score_batch_size: int = 32
    bootstrap: int = 1000
    bootstrap_seed: int = 0
    resume: bool = False
    """Read back the cells (and seeds) an earlier run in the folder finished."""
    reference_name: str = "the reference"
    """How the tables' note names the real text."""


def cell_samplers(cells: Sequence[Cell], base: SamplerConfig) -> list[SamplerConfig]:
    """Each cell's sampler: ``base`` with the cell's values (a value of None keeps base's)."""
    return [
        dataclasses.replace(base, **{k: v for k, v in c.settings.items() if v is not None})
        for c in cells
    ]


def sweep(
    pipe: Any,
    cells: Sequence[Cell],
    out: str | Path,
    *,
    samplers: Sequence[SamplerConfig] | None = None,
    num_samples: int | None = None,
    sources: list[dict] | None = None,
    seeds: Sequence[int] = (0,),
    judge: Any = None,
    refs: list[dict] | None = None,
    reference: Sequence[str] | None = None,
    model: str = "",
    options: SweepOptions = SweepOptions(),
    info: Any = None,
) -> list[dict]:
    """Sample and score ``cells`` with ``pipe`` into ``out``; returns the table's rows.

    ``samplers`` defaults to :func:`cell_samplers` over ``pipe.sampler``; ``num_samples`` per
    cell and seed for an unconditional model, ``sources`` (records holding
    ``options.source_field``) for a conditional one; ``judge`` a loaded judge
    (:func:`elflow.evaluation.load_judge`) or None to sample only; ``refs`` reference records
    for BLEU/ROUGE; ``reference`` real texts for MAUVE and a row of their own.
    """
    from elflow.runtime.distributed import DistInfo

    out = Path(out)
    if samplers is None:
        samplers = cell_samplers(cells, pipe.sampler)
    info = info if info is not None else DistInfo(0, 1, 0, pipe.device)
    if info.is_main:
        (out / "samples").mkdir(parents=True, exist_ok=True)
        (out / "metrics").mkdir(parents=True, exist_ok=True)
    run = Sweep(options, pipe, model, num_samples, sources, refs, judge, info, out, list(seeds))
    if info.is_main and reference is not None:
        run.prepare_reference(list(reference), samplers[0])
    rows = [
        row
        for i, (cell, scfg) in enumerate(zip(cells, samplers, strict=True))
        if (row := run.cell(f"[{i + 1}/{len(cells)}]", cell, scfg)) is not None
    ]
    if info.is_main:
        run.finish(rows)
    return rows


@dataclass
class Sweep:
    """One sweep's shared state: each cell is sampled (on every rank) and scored (on rank 0)."""

    options: SweepOptions
    pipe: Any
    model: str
    n: int | None
    sources: list[dict] | None
    refs: list[dict] | None
    judge: Any
    info: Any
    out: Path
    seeds: list[int]
    reference: list[dict] | None = None
    """The real text of ``--reference`` as scored (prepared like the training rows)."""
    reference_features: Any = None
    """Its judge features, computed once for every cell's MAUVE."""
    reference_note: str = ""

    def prepare_reference(self, texts: list[str], scfg: Any) -> None:
        """The real text as the model's training rows hold it, saved, and its MAUVE features."""
        from elflow.evaluation import sweep_plan as sw
        from elflow.evaluation.scoring import reference_features
        from elflow.generation.records import settings_record
        from elflow.io.jsonl import write_jsonl

        record = settings_record(self.pipe, scfg, seed=0, bf16=False, model=self.model, ema=True)
        length = record["length"]  # a sample's tokens: what the training rows are cut to
        prepared = sw.prepare_reference(self.pipe.tokenizer, texts, length)
        self.reference = [{"id": i, "text": t} for i, t in enumerate(prepared)]
        write_jsonl(self.out / sw.REFERENCE, self.reference)
        self.reference_note = (
            f"Real text: {len(texts)} texts of {self.options.reference_name}, prepared like the "
            f"model's training rows (tokenised with its tokenizer, cut to {length} tokens, "
            f"decoded back; saved as {sw.REFERENCE})"
        )
        print(self.reference_note, file=sys.stderr)
        if self.judge is not None:
            a = self.options
            self.reference_features = reference_features(
                prepared, self.judge, a.protocol, a.score_batch_size
            )

    @property
    def score(self) -> dict[str, Any]:
        a = self.options
        return dict(
            judge=self.judge,
            protocol=a.protocol,
            batch_size=a.score_batch_size,
            bootstrap=a.bootstrap,
            seed=a.bootstrap_seed,
        )

    def cell(self, label: str, cell: Any, scfg: Any) -> dict | None:
        """Sample and score one cell (or read it back under ``--resume``); its table row on
        rank 0, None elsewhere."""
        from elflow.evaluation import score_samples
        from elflow.evaluation import sweep_plan as sw
        from elflow.evaluation.diversity import degenerate
        from elflow.evaluation.scoring import write_metrics
        from elflow.evaluation.sweep_grid import row_settings
        from elflow.generation.records import recorded_project_from, sample_records
        from elflow.io.jsonl import write_jsonl
        from elflow.runtime.distributed import broadcast_object

        args, info = self.options, self.info
        sample_file = self.out / "samples" / f"{cell.name}.jsonl"
        metrics_file = self.out / "metrics" / f"{cell.name}.json"
        expected = len(self.sources) if self.sources is not None else self.n
        # --resume: a scored cell is read back, the seeds sampled in full only scored (rank 0
        # decides, so every rank skips the same collective sampling).
        metrics, by_seed = None, {}
        if args.resume and info.is_main:
            metrics = sw.read_metrics(metrics_file)
            if metrics is None:
                by_seed = sw.read_samples(sample_file, expected, self.seeds)
        scored, earlier = broadcast_object((metrics is not None, sorted(by_seed)))
        if scored:
            if not info.is_main:
                return None
            # Cells scored before the tables showed it used the sweep's (one) value.
            done = {"project_from": recorded_project_from(scfg), **metrics["sweep"]}
            print(f"{label} {cell.name}: done earlier", file=sys.stderr)
            return sw.table_row(cell.name, done, metrics, done.get("seconds"))
        seconds = 0.0
        for seed in [s for s in self.seeds if s not in earlier]:
            result = sample_records(
                self.pipe,
                scfg,
                n=None if self.sources is not None else self.n,
                sources=self.sources,
                source_field=args.source_field,
                seed=seed,
                batch_size=args.batch_size,
                bf16=args.bf16,
                model=self.model,
                ema=args.ema,
                info=info,
            )
            seconds += result.seconds
            if info.is_main:  # after each seed, so that an interruption keeps the seeds done
                by_seed[seed] = result.records
                write_jsonl(sample_file, [r for s in self.seeds for r in by_seed.get(s, [])])
        if not info.is_main:
            return None
        records = [r for s in self.seeds for r in by_seed[s]]
        warning = degenerate([r["text"] for r in records])
        if warning:
            print(f"elflow: warning: {cell.name}: {warning}", file=sys.stderr)
        metrics = score_samples(
            records, refs=self.refs, reference=self.reference_features, **self.score
        )
        settings = {k: records[0].get(k) for k in row_settings()}  # older files lack some
        took = None if earlier else seconds  # a cell sampled in part earlier has no one time
        record = {**settings, "cell": cell.name, "seconds": took}
        write_metrics(metrics_file, {**metrics, "sweep": record})
        row = sw.table_row(cell.name, settings, metrics, took)
        when = "sampled earlier" if earlier else f"{seconds:.1f} s"
        print(
            f"{label} {cell.name}: gen_ppl {sw.fmt(row['gen_ppl'])}, "
            f"entropy {sw.fmt(row['entropy'], 3)} ({when})",
            file=sys.stderr,
        )
        return row

    def finish(self, rows: list[dict]) -> None:
        """The real-text row, the tables and the frontier plot (rank 0)."""
        from elflow.evaluation import score_samples
        from elflow.evaluation import sweep_plan as sw
        from elflow.evaluation.scoring import write_metrics

        ref_metrics = None
        if self.reference is not None:
            ref_metrics = score_samples(self.reference, **self.score)
            write_metrics(self.out / "metrics" / "reference.json", ref_metrics)
            rows.append(sw.table_row("reference", {"sampler": "reference"}, ref_metrics, None))
        per_cell = self.n if self.sources is None else len(self.sources)
        seeds = ",".join(map(str, self.seeds))
        notes = [self.reference_note] if self.reference_note else []
        if len(self.seeds) > 1:
            notes.insert(
                0,
                f"Seeds {seeds}, {per_cell} samples each: mean ± sd over the seeds; intervals: "
                "95% bootstrap over all seeds' samples pooled.",
            )
        sw.write_tables(self.out, rows, self.options.protocol, notes)
        if self.judge is not None:
            cells_only = [r for r in rows if r["cell"] != "reference"]
            caption = f"bars: 95% bootstrap intervals; {per_cell} samples x seeds {seeds}"
            sw.plot_frontier(self.out / "frontier.png", cells_only, ref_metrics, caption)
        print((self.out / "table.md").read_text(), end="")
        print(f"wrote {self.out}", file=sys.stderr)
