"""``elflow sweep``: sample and score a grid of sampler settings (sampler x steps x w x gamma).

Each cell is an ``elflow sample`` run followed by an ``elflow score`` run (the same functions,
the same seeds), so a cell can be reproduced on its own; the folder's layout and tables are
:mod:`elflow.evaluation.sweep`'s. With ``--seeds`` every cell is sampled once per seed; with
``--reference`` the real text is prepared like the model's training rows, gets its own row and
point, and each cell's MAUVE is measured against it. Generation is shared across ``torchrun``
ranks, scoring runs on rank 0; ``--resume`` finishes an interrupted sweep with the same shared
options (a cell interrupted between seeds keeps the seeds it finished).
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from elflow.cli.common import (
    add_device_argument,
    add_dtype_argument,
    add_model_argument,
    add_num_samples,
    add_sampler_arguments,
    add_seed_arguments,
    add_sources_arguments,
    add_task_argument,
    comma_list,
    load_pipeline,
    model_from_args,
    num_samples,
    sampler_flag_names,
    sampler_from_args,
    sampling_bf16,
    seeds_from_args,
    sources_from_args,
)
from elflow.cli.score import add_judge_arguments, check_counts
from elflow.errors import ELFError
from elflow.evaluation.grid import AXES as GRID_AXES
from elflow.paths import output_dir

AXES = ("sampler", *(axis.field for axis in GRID_AXES))
"""The sampler fields a sweep takes as comma lists (its grid); the others are one value."""


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_model_argument(p, "the model to sweep", old_flags=("--checkpoint",))
    add_task_argument(p)
    add_num_samples(p)
    add_sources_arguments(p, inline=False)
    p.add_argument("--out", required=True, help="output folder")
    add_seed_arguments(p)
    p.add_argument("--batch-size", type=int, default=32, help="samples per forward (per process)")
    add_device_argument(p)
    add_dtype_argument(p)
    p.add_argument("--no-ema", action="store_true", help="sample with the training weights")
    p.add_argument(
        "--reference",
        help="JSONL(.gz) of real text ('text'), prepared like the model's training rows: its "
        "row and point on the frontier, and each cell's MAUVE against it",
    )
    p.add_argument("--refs", help="conditional: JSONL references; adds BLEU and ROUGE per cell")
    add_judge_arguments(p, "--score-batch-size", "--bootstrap-seed")
    p.add_argument(
        "--resume",
        action="store_true",
        help="finish an interrupted sweep in --out: keep its scored cells, score sampled ones",
    )
    p.add_argument("--overwrite", action="store_true", help="replace an earlier sweep in --out")
    add_sampler_arguments(p, lists=AXES, defaults={"sampler": "ode,sde"}, preset=False)


def parse_grid(samplers: str, lists: dict[str, str | None]):
    """The grid's cells from the comma lists of ``--sampler`` and of each axis flag (``lists``:
    field -> text; None: the model's value)."""
    from elflow.evaluation.grid import grid

    return grid(
        [name.strip() for name in samplers.split(",") if name.strip()],
        {a.field: comma_list(lists.get(a.field), a.kind, a.flag) for a in GRID_AXES},
    )


def run(args: argparse.Namespace) -> int:
    """``elflow sweep``; generation is shared across ``torchrun`` ranks, scoring is on rank 0.
    Everything a cell needs is checked before an earlier sweep in ``--out`` is touched."""
    from elflow.distributed import resolve_device, teardown
    from elflow.evaluation import load_judge
    from elflow.evaluation import sweep as sw
    from elflow.evaluation.score import align_refs, read_refs
    from elflow.generation.pipeline import check_batch_size
    from elflow.jsonl import read_jsonl

    model = model_from_args(args)
    cells = parse_grid(args.sampler, {a.field: getattr(args, a.field) for a in GRID_AXES})
    seeds = seeds_from_args(args)
    check_counts(args.score_batch_size, args.bootstrap, "--score-batch-size")
    check_batch_size(args.batch_size)
    out = output_dir(args.out, "--out")
    n = num_samples(args, with_sources=args.sources is not None)
    shared = {key: getattr(args, key, None) for key in sw.RESUME_KEYS}
    shared |= {"checkpoint": model, "num_samples": n, "seeds": seeds}
    settings = sw.sweep_settings(shared, cells)
    previous = sw.check_previous(out, args.overwrite, args.resume, settings)
    info = resolve_device(args.device)
    args.bf16 = sampling_bf16(args, info.device)  # --dtype, resolved once
    try:
        sources = sources_from_args(args)
        reference = read_jsonl(args.reference, "text") if args.reference else None
        refs = read_refs(args.refs, args.ref_field) if args.refs else None
        if reference is not None and not reference:
            raise ELFError(f"--reference {args.reference} holds no texts")
        pipe = load_pipeline(model, info.device, use_ema=not args.no_ema, task=args.task)
        base = sampler_from_args(args, pipe.sampler, skip=AXES)
        samplers = []
        for c in cells:
            scfg = sampler_from_args(argparse.Namespace(**c.settings), base)
            with sampler_flag_names():
                pipe.prepare(scfg, None if sources is not None else n, _texts(sources, args))
            samplers.append(scfg)
        if refs is not None and sources is not None:  # references that cannot align: now
            align_refs(sw.stub_records(sources, args.source_field), refs)
        judge = None
        if info.is_main:
            judge = None if args.judge.lower() == "none" else load_judge(args.judge)
            if previous:  # only now that the new sweep has everything it needs to start
                sw.clear_previous(out)
            (out / "samples").mkdir(parents=True, exist_ok=True)
            (out / "metrics").mkdir(parents=True, exist_ok=True)
            (out / sw.SETTINGS).write_text(json.dumps(settings, indent=2) + "\n")
        sweep = _Sweep(args, pipe, model, n, sources, refs, judge, info, out, seeds)
        if info.is_main and reference is not None:
            sweep.prepare_reference([r["text"] for r in reference], samplers[0])
        rows = [
            row
            for i, (cell, scfg) in enumerate(zip(cells, samplers, strict=True))
            if (row := sweep.cell(f"[{i + 1}/{len(cells)}]", cell, scfg)) is not None
        ]
        if info.is_main:
            sweep.finish(rows)
    finally:
        if info.distributed:
            teardown()
    return 0


@dataclass
class _Sweep:
    """One sweep's shared state: each cell is sampled (on every rank) and scored (on rank 0)."""

    args: argparse.Namespace
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
        from elflow.evaluation import sweep as sw
        from elflow.evaluation.score import reference_features
        from elflow.generation.records import settings_record
        from elflow.jsonl import write_jsonl

        record = settings_record(self.pipe, scfg, seed=0, bf16=False, model=self.model, ema=True)
        length = record["length"]  # a sample's tokens: what the training rows are cut to
        prepared = sw.prepare_reference(self.pipe.tokenizer, texts, length)
        self.reference = [{"id": i, "text": t} for i, t in enumerate(prepared)]
        write_jsonl(self.out / sw.REFERENCE, self.reference)
        self.reference_note = (
            f"Real text: {len(texts)} texts of {self.args.reference}, prepared like the model's "
            f"training rows (tokenised with its tokenizer, cut to {length} tokens, decoded "
            f"back; saved as {sw.REFERENCE})"
        )
        print(self.reference_note, file=sys.stderr)
        if self.judge is not None:
            a = self.args
            self.reference_features = reference_features(
                prepared, self.judge, a.protocol, a.score_batch_size
            )

    @property
    def score(self) -> dict[str, Any]:
        a = self.args
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
        from elflow.distributed import broadcast_object
        from elflow.evaluation import score_samples
        from elflow.evaluation import sweep as sw
        from elflow.evaluation.diversity import degenerate
        from elflow.evaluation.score import write_metrics
        from elflow.evaluation.tables import SETTING_COLUMNS
        from elflow.generation.records import recorded_project_from, sample_records
        from elflow.jsonl import write_jsonl

        args, info = self.args, self.info
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
                ema=not args.no_ema,
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
        settings = {k: records[0].get(k) for k in SETTING_COLUMNS}  # older files lack some
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
        from elflow.evaluation import sweep as sw
        from elflow.evaluation.score import write_metrics

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
        sw.write_tables(self.out, rows, self.args.protocol, notes)
        if self.judge is not None:
            cells_only = [r for r in rows if r["cell"] != "reference"]
            caption = f"bars: 95% bootstrap intervals; {per_cell} samples x seeds {seeds}"
            sw.plot_frontier(self.out / "frontier.png", cells_only, ref_metrics, caption)
        print((self.out / "table.md").read_text(), end="")
        print(f"wrote {self.out}", file=sys.stderr)


def _texts(sources: list[dict] | None, args: argparse.Namespace) -> list[str] | None:
    return None if sources is None else [s[args.source_field] for s in sources]
