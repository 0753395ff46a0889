"""``elflow sample``: draw samples, print them or write a JSONL file, on one process or under
``torchrun`` (ELF_SPEC §5, §10).

Sample i depends on (seed, i) only, so the file is the same for any batch size or number of
processes (in fp32). Each line holds ``id``, ``text`` (``source`` when conditional) and the
settings that made it. ``--seeds 0,1,2`` draws a set per seed into the one file, each record
carrying its ``seed`` (ids count from 0 within a seed); a set that is all empty or all one text
gets a one-line warning. ``--trajectory`` renders every step's decoded x_hat as a self-contained
HTML page (or ``-``: a terminal animation). ``elflow generate`` is the old name of this command.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from elflow.cli.common import (
    add_device_argument,
    add_dtype_argument,
    add_model_argument,
    add_num_samples,
    add_sampler_arguments,
    add_seed_arguments,
    add_sources_arguments,
    add_task_argument,
    checked_sampler,
    deprecated,
    load_pipeline,
    model_from_args,
    num_samples,
    sampling_bf16,
    seeds_from_args,
    sources_from_args,
)
from elflow.errors import ELFError
from elflow.io.paths import make_parents, output_file


def add_arguments(p: argparse.ArgumentParser, old_positional: bool = False) -> None:
    add_model_argument(
        p, "the model to sample", old_flags=("--checkpoint",), old_positional=old_positional
    )
    add_task_argument(p)
    add_num_samples(p)
    add_sources_arguments(p)
    p.add_argument(
        "--infill",
        metavar="FILE",
        help="JSONL of texts to fill: a template in 'text' ('In the beginning [___] the earth.'; "
        "gaps [___], [___N], [___A-B] tokens) or 'ids' and 'keep'; 'source' for a conditional "
        "model; -n takes the first N",
    )
    p.add_argument("--out", metavar="FILE", help="JSONL file to write (default: print the texts)")
    add_seed_arguments(p)
    p.add_argument("--batch-size", type=int, default=32, help="samples per forward (per process)")
    add_device_argument(p)
    add_dtype_argument(p)
    p.add_argument("--no-ema", action="store_true", help="sample with the training weights")
    p.add_argument(
        "--trajectory", metavar="OUT.html|-", help="HTML page of every step, or '-' to animate"
    )
    p.add_argument("--save-tokens", action="store_true", help="add token ids to every line")
    p.add_argument("--overwrite", action="store_true", help="replace an existing --out")
    add_cuda_graphs_argument(p)
    add_sampler_arguments(p)


def add_cuda_graphs_argument(p: argparse.ArgumentParser) -> None:
    """``--no-cuda-graphs``: sample every step eagerly on CUDA (``cuda_graphs=False``)."""
    p.add_argument(
        "--no-cuda-graphs",
        action="store_true",
        help="on CUDA, run each sampling step eagerly instead of replaying a captured CUDA graph",
    )


def cuda_graphs_from_args(args: argparse.Namespace) -> bool | None:
    """``cuda_graphs=`` of the library: False with ``--no-cuda-graphs``, else None (on CUDA)."""
    return False if getattr(args, "no_cuda_graphs", False) else None


def add_generate_arguments(p: argparse.ArgumentParser) -> None:
    add_arguments(p, old_positional=True)


def run_generate(args: argparse.Namespace) -> int:
    """``elflow generate``: the old name of ``elflow sample`` (which prints without --out)."""
    deprecated(
        "'elflow generate MODEL'",
        "'elflow sample --model MODEL' (it prints the texts when --out is not given)",
    )
    return run(args)


def _check_outputs(args: argparse.Namespace) -> None:
    """``--out`` and ``--trajectory``, before the model loads: both checked, then their missing
    parent folders made (the partial files of ``--out`` go beside it as soon as sampling
    starts)."""
    if args.out == "-":
        raise ELFError("--out - : leave --out out to print the texts, or give a JSONL file name")
    outputs = {}
    if args.out is not None:
        outputs["--out"] = output_file(
            args.out, "--out", overwrite=args.overwrite, make_parent=False
        )
    if args.trajectory not in (None, "-"):
        outputs["--trajectory"] = output_file(
            args.trajectory, "--trajectory", overwrite=args.overwrite, make_parent=False
        )
        page = Path(args.trajectory).expanduser().resolve()
        if args.out is not None and page == Path(args.out).expanduser().resolve():
            raise ELFError("--trajectory and --out name the same file; give the page its own")
    for flag, path in outputs.items():
        make_parents(path, flag)


def _infill_requests(args: argparse.Namespace, sources: list[dict] | None):
    """``--infill``'s requests (the first ``-n``) and their template texts, or (None, None)."""
    if args.infill is None:
        return None, None
    from elflow.generation.infill import request_from_record
    from elflow.io.jsonl import iter_json_objects
    from elflow.io.paths import input_file

    if sources is not None:
        raise ELFError("--infill lines carry their own 'source'; drop --source/--sources")
    path = input_file(args.infill, "--infill")
    requests, templates = [], []
    for lineno, row in iter_json_objects(path):  # a template in 'text', or 'ids' and 'keep'
        try:
            request = request_from_record(row)
        except ELFError as e:
            raise ELFError(f"{path}:{lineno}: {e}") from None
        requests.append(request)
        templates.append(row["text"] if request.parts is not None else None)
    if not requests:
        raise ELFError(f"--infill {args.infill} holds no texts")
    if args.num_samples is not None:
        n = num_samples(args, with_sources=True)
        requests, templates = requests[:n], templates[:n]
    return requests, templates


def _partial(args, info, sampler, n, seeds, sources, infill):
    """The partial files of ``--out`` and the records they hold, or (None, []) without
    ``--out`` or with ``--trajectory`` (a page needs every sample's steps in one run)."""
    from dataclasses import asdict

    from elflow import __version__
    from elflow.generation.partial import PartialSamples, fingerprint
    from elflow.runtime.distributed import barrier

    if args.out is None or args.trajectory is not None:
        return None, []
    key = fingerprint(
        {
            "elflow": __version__,
            "model": model_from_args(args),
            "task": args.task,
            "ema": not args.no_ema,
            "n": n,
            "seeds": seeds,
            "sampler": asdict(sampler),
            "sources": sources,
            "infill": [asdict(r) for r in infill] if infill is not None else None,
            "dtype": "bf16" if args.bf16 else "fp32",
            # bf16's rounding depends on the batch's shape; fp32's does not
            "batch_size": args.batch_size if args.bf16 else None,
            "save_tokens": args.save_tokens,
            "source_field": args.source_field,
        }
    )
    partial = PartialSamples(args.out, key, info.rank)
    if args.overwrite and info.is_main:
        partial.remove()
    barrier()
    earlier = partial.load()
    if earlier and info.is_main:
        print(f"elflow sample: resuming: {len(earlier)} samples made earlier", file=sys.stderr)
    return partial, earlier


def _in_order(records: list[dict], seeds: list[int]) -> list[dict]:
    """``records`` in seed then id order, each (seed, id) once."""
    seen: dict[tuple, dict] = {}
    for rec in records:
        seen.setdefault((rec["seed"], rec["id"]), rec)
    order = {seed: k for k, seed in enumerate(seeds)}
    return sorted(seen.values(), key=lambda r: (order[r["seed"]], r["id"]))


def run(args: argparse.Namespace) -> int:
    """``elflow sample``; one process or under ``torchrun``."""
    from elflow.evaluation.diversity import degenerate
    from elflow.generation.records import sample_records, sample_seeds, write_trajectory
    from elflow.io.jsonl import write_jsonl
    from elflow.runtime.distributed import resolve_device, teardown

    model = model_from_args(args)
    _check_outputs(args)
    info = resolve_device(args.device)
    args.bf16 = sampling_bf16(args, info.device)  # --dtype, resolved once
    try:
        sources = sources_from_args(args)
        n = num_samples(args, with_sources=sources is not None)
        infill, templates = _infill_requests(args, sources)
        seeds = seeds_from_args(args)
        if len(seeds) > 1 and args.trajectory is not None:
            raise ELFError("--trajectory shows one run: give one --seed, not --seeds")
        pipe = load_pipeline(model, info.device, use_ema=not args.no_ema, task=args.task)
        sampler = checked_sampler(args, pipe)

        def with_template(record: dict) -> dict:
            if templates is not None:
                record["template"] = templates[record["id"]]
            return record

        partial, earlier = _partial(args, info, sampler, n, seeds, sources, infill)
        done = {seed: {r["id"] for r in earlier if r["seed"] == seed} for seed in seeds}

        written = [len(earlier)]

        def sink(records: list[dict]) -> None:
            partial.write([with_template(r) for r in records])
            written[0] += len(records)

        try:
            result = sample_seeds(
                seeds,
                lambda seed: sample_records(
                    pipe,
                    sampler,
                    n=None if sources is not None or infill is not None else n,
                    sources=sources,
                    source_field="text" if args.source else args.source_field,
                    seed=seed,
                    batch_size=args.batch_size,
                    bf16=args.bf16,
                    trajectory=args.trajectory is not None,
                    save_tokens=args.save_tokens,
                    model=model,
                    ema=not args.no_ema,
                    info=info,
                    progress=args.out is not None,
                    infill=infill,
                    skip=done[seed],
                    sink=None if partial is None else sink,
                    cuda_graphs=cuda_graphs_from_args(args),
                ),
            )
        except KeyboardInterrupt:
            if partial is None:
                raise
            partial.close()
            if info.is_main:
                kept = f"{written[0]} samples are" if info.world_size == 1 else "finished batches"
                print(
                    f"elflow sample: interrupted; {kept} kept beside {args.out} (its .partial "
                    "files): run the same command again to resume",
                    file=sys.stderr,
                )
            return 130
        if not info.is_main:
            if partial is not None:
                partial.close()
            return 0
        records = _in_order([*earlier, *map(with_template, result.records)], seeds)
        warning = degenerate([r["text"] for r in records])
        if warning:  # one line: the file is still written, as asked
            print(f"elflow: warning: {warning}", file=sys.stderr)
        if args.out is None:
            for record in records:
                print(record["text"])
        else:
            write_jsonl(args.out, records)
            if partial is not None:
                partial.remove()
        if result.frames is not None:
            kept = [r["kept"] for r in records] if infill is not None else None
            write_trajectory(args.trajectory, result.frames, records[0], kept)
        if args.out is not None:
            rate = len(result.records) / max(result.seconds, 1e-9)
            resumed = f"; {len(earlier)} made earlier" if earlier else ""
            print(
                f"wrote {len(records)} samples to {args.out} ({result.seconds:.1f} s, "
                f"{rate:.2f} samples/s per rank{resumed})",
                file=sys.stderr,
            )
    finally:
        if info.distributed:
            teardown()
    return 0
