"""``elflow sweep``: sample and score a grid of sampler settings (sampler x steps x w x gamma).

Each cell is an ``elflow sample`` run followed by an ``elflow score`` run (the same functions,
the same seeds), so a cell can be reproduced on its own; the folder's layout and tables are
:mod:`elflow.evaluation.sweep_plan`'s. With ``--seeds`` every cell is sampled once per seed; with
``--reference`` the real text is prepared like the model's training rows, gets its own row and
point, and each cell's MAUVE is measured against it. Generation is shared across ``torchrun``
ranks, scoring runs on rank 0; ``--resume`` finishes an interrupted sweep with the same shared
options (a cell interrupted between seeds keeps the seeds it finished).
"""

from __future__ import annotations

import argparse
import json

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
    sampler_from_args,
    sampling_bf16,
    seeds_from_args,
    sources_from_args,
)
from elflow.cli.score_cmd import add_judge_arguments, check_counts
from elflow.errors import ELFError
from elflow.evaluation.sweep_grid import AXES as GRID_AXES
from elflow.io.paths import output_dir

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
    from elflow.evaluation.sweep_grid import grid

    return grid(
        [name.strip() for name in samplers.split(",") if name.strip()],
        {a.field: comma_list(lists.get(a.field), a.kind, a.flag) for a in GRID_AXES},
    )


def run(args: argparse.Namespace) -> int:
    """``elflow sweep``; generation is shared across ``torchrun`` ranks, scoring is on rank 0.
    Everything a cell needs is checked before an earlier sweep in ``--out`` is touched."""
    from elflow.evaluation import load_judge
    from elflow.evaluation import sweep_plan as sw
    from elflow.evaluation.scoring import align_refs, read_refs
    from elflow.evaluation.sweep_run import SweepOptions, sweep
    from elflow.generation.request_checks import check_batch_size
    from elflow.io.jsonl import read_jsonl
    from elflow.runtime.distributed import resolve_device, teardown

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
        options = SweepOptions(
            batch_size=args.batch_size,
            bf16=args.bf16,
            ema=not args.no_ema,
            source_field=args.source_field,
            protocol=args.protocol,
            score_batch_size=args.score_batch_size,
            bootstrap=args.bootstrap,
            bootstrap_seed=args.bootstrap_seed,
            resume=args.resume,
            reference_name=str(args.reference),
        )
        sweep(
            pipe,
            cells,
            out,
            samplers=samplers,
            num_samples=n,
            sources=sources,
            seeds=seeds,
            judge=judge,
            refs=refs,
            reference=None if reference is None else [r["text"] for r in reference],
            model=model,
            options=options,
            info=info,
        )
    finally:
        if info.distributed:
            teardown()
    return 0


def _texts(sources: list[dict] | None, args: argparse.Namespace) -> list[str] | None:
    return None if sources is None else [s[args.source_field] for s in sources]
