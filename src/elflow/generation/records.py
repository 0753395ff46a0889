"""``elflow sample``: generate a JSONL file of samples, on one process or many (ELF_SPEC §5, §10).

Every sample i is drawn from generators seeded by (seed, i) (§10 "Sampling reproducibility"), so
in fp32 the file is the same whatever the batch size or the number of ``torchrun`` processes (under
``--bf16`` the blocks' rounding depends on the batch's shape): each rank
generates a contiguous share of the indices, rank 0 gathers them and writes one file in index
order. Each line holds ``id``, ``text`` (``source`` when conditional) and the settings that made
it. ``--trajectory`` renders every step's decoded x_hat (§10 "Trajectories") as a self-contained
HTML page or a terminal animation. Also runnable as ``python -m elflow.generation.records``.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from elflow.config import SamplerConfig
from elflow.distributed import DistInfo, setup, teardown
from elflow.errors import ELFError, note_once
from elflow.generation.pipeline import ELFPipeline, check_sde_gamma
from elflow.hardware import bf16_autocast, fast_bf16
from elflow.io.artifact import OFFICIAL_TASKS
from elflow.jsonl import read_jsonl, write_jsonl
from elflow.paths import input_file, output_file
from elflow.sampling import nfe

# Few-step students (spec §5, "Distilled few-step"): (gamma, w) by number of steps. The paper
# gives 1-8 and 16-32 steps; 9-15 take the 16-32 values.
FEWSTEP = ((8, 1.5, 2.5), (10**9, 2.0, 2.0))


@dataclass
class SampleResult:
    records: list[dict]
    """One JSON-able dict per sample in index order (rank 0; empty on the other ranks)."""
    frames: list[list[str]] | None = None
    """frames[k][i]: sample i's text after step k, then the final texts (rank 0, when asked)."""
    seconds: float = 0.0
    """Wall time of the generation on this rank."""


def read_sources(path: str | Path, field: str = "text") -> list[dict]:
    """Read a JSONL file of source objects, each with a string ``field``; one-line errors."""
    path = input_file(path, "--sources")
    rows = read_jsonl(path, field, field_flag="--source-field")
    if not rows:
        raise ELFError(f"sources file {path} is empty")
    return rows


def sources_from_args(args: argparse.Namespace) -> list[dict] | None:
    """``--sources`` (the first ``--num-samples`` of them when given), or None."""
    if args.num_samples is not None and args.num_samples < 1:
        raise ELFError(f"--num-samples must be >= 1, got {args.num_samples}")
    if not args.sources:
        return None
    sources = read_sources(args.sources, args.source_field)
    return sources if args.num_samples is None else sources[: args.num_samples]


def check_request(
    pipe: ELFPipeline, total: int | None, sources: Sequence[dict] | None, batch_size: int
) -> None:
    """One-line errors for a sampling request the model cannot serve (before any work starts)."""
    if batch_size < 1:
        raise ELFError(f"--batch-size must be >= 1, got {batch_size}")
    if total is None or total < 1:
        raise ELFError("pass --num-samples >= 1 (unconditional) or a non-empty --sources file")
    if pipe.config.conditional and sources is None:
        raise ELFError("this model is conditional: pass --sources FILE.jsonl")
    if not pipe.config.conditional and sources is not None:
        raise ELFError("this model is unconditional: drop --sources")


def check_sample_args(
    pipe: ELFPipeline, args: argparse.Namespace, sources: Sequence[dict] | None
) -> None:
    """Everything :func:`sample_from_args` checks, so ``sweep`` can check it before it clears."""
    if args.length is not None and args.length < 1:
        raise ELFError(f"--length must be >= 1, got {args.length}")
    longest = pipe.config.model.max_length
    if args.length is not None and args.length > longest:
        raise ELFError(f"--length {args.length} exceeds the model's max_length {longest}")
    if args.length is not None and pipe.config.conditional:
        raise ELFError(
            "--length applies to unconditional models; a conditional model writes its "
            "max_length - max_input_length target tokens"
        )
    total = len(sources) if sources is not None else requested_samples(args)
    check_request(pipe, total, sources, args.batch_size)


def source_fields(source: dict, field: str) -> dict[str, Any]:
    """What a conditional sample's record says of its source: the text, and the id the source
    line carried (``source_id``, which references are matched on)."""
    return {"source": source[field]} | ({"source_id": source["id"]} if "id" in source else {})


def requested_samples(args: argparse.Namespace) -> int:
    return 16 if args.num_samples is None else args.num_samples


def resolve_sampler(
    pipe: ELFPipeline,
    *,
    preset: str | None = None,
    steps: int | None = None,
    sampler: str | None = None,
    gamma: float | None = None,
    w: float | None = None,
    cfg: float | None = None,
    time_grid: str | None = None,
    time_mean: float | None = None,
    time_std: float | None = None,
    project_from: float | None = None,
) -> SamplerConfig:
    """The model's sampler defaults, then the preset, then the explicit (non-None) options."""
    if steps is not None and steps < 1:
        raise ELFError(f"--steps must be >= 1, got {steps}")
    base = pipe.config.sampler
    if preset == "fewstep":
        n = steps or 8
        _, g, ww = next(row for row in FEWSTEP if n <= row[0])
        base = replace(base, steps=n, sampler="sde", gamma=g, w=ww)
    elif preset not in (None, "model"):
        raise ELFError(f"unknown preset {preset!r}; use 'model' or 'fewstep'")
    if cfg is not None and cfg != 1.0 and not pipe.config.conditional:
        raise ELFError("--cfg (classifier-free guidance) applies to conditional models only")
    check_sde_gamma(base, sampler, gamma)
    given = {
        "steps": steps,
        "sampler": sampler,
        "gamma": gamma,
        "w": w,
        "cfg": cfg,
        "time_grid": time_grid,
        "time_mean": time_mean,
        "time_std": time_std,
        "project_from": project_from,
    }
    explicit = {k: v for k, v in given.items() if v is not None}
    try:
        return replace(base, **explicit)
    except ELFError as e:  # name the option, not the config key: "--w must be ..."
        message = str(e)
        for k in explicit:
            message = message.replace(f"sampler.{k} ", f"--{k.replace('_', '-')} ")
        raise ELFError(message) from None


def settings_record(
    pipe: ELFPipeline,
    scfg: SamplerConfig,
    *,
    seed: int,
    length: int | None,
    bf16: bool,
    model: str,
    ema: bool,
) -> dict:
    """The settings written on every line.

    ``nfe`` counts network evaluations per sample (a Heun step costs two, the final decode is not
    counted); classifier-free guidance batches its two evaluations into the same forward, so it
    does not change ``nfe`` but doubles the rows: ``nfe_rows`` = nfe x 2 under CFG. Projected
    sampling adds one decode pass and one encoder pass per projected step, not counted in ``nfe``.
    """
    guided = pipe.config.conditional and scfg.cfg != 1.0
    n = nfe(scfg.sampler, scfg.steps)
    cfg = pipe.config
    L = cfg.model.max_length - cfg.max_input_length if cfg.conditional else length  # the target's
    return {
        "sampler": scfg.sampler,
        "steps": scfg.steps,
        "nfe": n,
        "nfe_rows": 2 * n if guided else n,
        "gamma": scfg.gamma if scfg.sampler == "sde" else None,
        "w": scfg.w,
        "cfg": scfg.cfg if pipe.config.conditional else None,
        "time_grid": scfg.time_grid,
        "time_mean": scfg.time_mean if scfg.time_grid == "logit_normal" else None,
        "time_std": scfg.time_std if scfg.time_grid == "logit_normal" else None,
        "project_from": recorded_project_from(scfg),
        "seed": seed,
        "length": L or pipe.config.model.max_length,
        "dtype": "bf16" if bf16 else "fp32",
        "model": model,
        "ema": ema,
    }


def recorded_project_from(scfg: SamplerConfig) -> float | None:
    """Projected sampling's start as sample records and sweep tables show it: None when off."""
    return scfg.project_from if scfg.project_from < 1.0 else None


def shard(n: int, info: DistInfo) -> range:
    """This rank's contiguous share of ``range(n)`` (sizes differ by at most one)."""
    return range(info.rank * n // info.world_size, (info.rank + 1) * n // info.world_size)


def _gather(obj: Any, info: DistInfo) -> list[Any]:
    """Every rank's ``obj`` on rank 0 (in rank order), ``[]`` elsewhere; one process: ``[obj]``."""
    if not (info.distributed and dist.is_initialized()):
        return [obj]
    box = [None] * info.world_size if info.is_main else None
    dist.gather_object(obj, box, dst=0)
    return box if info.is_main else []


def sample_from_args(
    pipe: ELFPipeline,
    scfg: SamplerConfig,
    args: argparse.Namespace,
    sources: Sequence[dict] | None,
    info: DistInfo,
    **extra,
) -> SampleResult:
    """:func:`sample_records` with the options shared by ``elflow sample`` and ``elflow sweep``."""
    check_sample_args(pipe, args, sources)
    if args.bf16 and pipe.device.type == "cpu" and not fast_bf16(pipe.device) and info.is_main:
        note_once(  # once: a sweep samples once per cell
            "elflow: warning: --bf16 on a CPU that emulates bf16 (no AVX-512 BF16/AMX/Arm "
            "BF16) is many times slower than fp32 here; drop --bf16"
        )
    return sample_records(
        pipe,
        scfg,
        n=requested_samples(args),
        sources=sources,
        source_field=args.source_field,
        seed=args.seed,
        batch_size=args.batch_size,
        length=args.length,
        bf16=args.bf16,
        model=str(args.checkpoint),
        ema=not args.no_ema,
        info=info,
        **extra,
    )


def sample_records(
    pipe: ELFPipeline,
    scfg: SamplerConfig,
    *,
    n: int | None = None,
    sources: Sequence[dict] | None = None,
    source_field: str = "text",
    seed: int = 0,
    batch_size: int = 32,
    length: int | None = None,
    bf16: bool = False,
    trajectory: bool = False,
    save_tokens: bool = False,
    model: str = "",
    ema: bool = True,
    info: DistInfo | None = None,
    progress: bool = False,
) -> SampleResult:
    """Generate samples ``0..n-1`` (or one per source) across the ranks; records on rank 0.

    The same function backs ``elflow sample`` and every ``elflow sweep`` cell, so a sweep cell is
    a ``sample`` run by construction.
    """
    info = info or DistInfo(0, 1, 0, pipe.device)
    total = len(sources) if sources is not None else n
    check_request(pipe, total, sources, batch_size)
    settings = settings_record(
        pipe, scfg, seed=seed, length=length, bf16=bf16, model=model, ema=ema
    )
    overrides = {f.name: getattr(scfg, f.name) for f in fields(scfg)}  # the whole sampler config
    mine = shard(total, info)
    rows: list[tuple[int, str, list[int], list[str]]] = []
    bar = _progress(total, progress and info.is_main)
    t0 = time.perf_counter()
    for start in range(mine.start, mine.stop, batch_size):
        stop = min(mine.stop, start + batch_size)
        batch_sources = None
        if sources is not None:
            batch_sources = [s[source_field] for s in sources[start:stop]]
        with bf16_autocast(bf16, pipe.device):
            gen = pipe.generate_full(
                stop - start,
                sources=batch_sources,
                seed=seed,
                batch_size=stop - start,
                length=length,
                trajectory=trajectory,
                first_index=start,
                **overrides,
            )
        for j, i in enumerate(range(start, stop)):
            steps = [frame[j] for frame in gen.trajectory] if trajectory else []
            rows.append((i, gen.texts[j], gen.tokens[j].tolist(), steps))
        # Other ranks progress at the same rate; scale so the bar shows the whole run.
        bar.update((stop - start) * info.world_size)
    seconds = time.perf_counter() - t0
    bar.close()
    gathered = [row for part in _gather(rows, info) for row in part]
    if not info.is_main:
        return SampleResult([], None, seconds)
    gathered.sort(key=lambda r: r[0])
    records = []
    for i, text, tokens, _ in gathered:
        rec: dict[str, Any] = {"id": i, "text": text}
        if sources is not None:
            rec.update(source_fields(sources[i], source_field))
        rec.update(settings)
        if save_tokens:
            rec["tokens"] = tokens
        records.append(rec)
    frames = None
    if trajectory:
        frames = [[r[3][k] for r in gathered] for k in range(scfg.steps)]
        frames.append([r[1] for r in gathered])
    return SampleResult(records, frames, seconds)


def _progress(total: int, enabled: bool):
    from tqdm.auto import tqdm

    # A bar only on an interactive stderr: in logs and tests it would be noise.
    live = enabled and sys.stderr.isatty()
    return tqdm(total=total, unit="sample", disable=not live, file=sys.stderr, leave=False)


def token_agreement(a: Sequence[dict], b: Sequence[dict]) -> float:
    """Share of identical token ids between two runs saved with ``--save-tokens``."""
    same = total = 0
    for ra, rb in zip(a, b, strict=True):
        ta, tb = ra["tokens"], rb["tokens"]
        same += sum(x == y for x, y in zip(ta, tb, strict=True))
        total += len(ta)
    return same / max(total, 1)


def write_trajectory(target: str, frames: list[list[str]], meta: dict) -> None:
    """``-``: animate in the terminal (stdout); else write the HTML page to ``target``."""
    from elflow.generation.trajectory import animate_terminal, render_html

    labels = [f"step {k + 1}/{len(frames) - 1}" for k in range(len(frames) - 1)] + ["final"]
    if target == "-":
        animate_terminal(frames, sys.stdout, delay=0.15, labels=labels)
        return
    out = Path(target)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(render_html(frames, meta, labels), encoding="utf-8")


def resolve_device(name: str) -> DistInfo:
    """The process's device for a ``--device`` value: auto, cpu, cuda, or cuda:K (one process)."""
    if name not in ("auto", "cpu", "cuda") and not (name[:5] == "cuda:" and name[5:].isdigit()):
        raise ELFError(f"--device is {name!r}; use auto, cpu, cuda or cuda:K")
    info = setup("cuda" if name.startswith("cuda") else name, "--device")
    if name.startswith("cuda:") and not info.distributed:
        info = replace(info, device=torch.device(name))
    return info


def add_task_argument(p: argparse.ArgumentParser) -> None:
    """``--task`` for an authors' checkpoint, which records none (elflow models refuse it)."""
    p.add_argument(
        "--task",
        choices=list(OFFICIAL_TASKS),
        help="authors' checkpoints: the paper task (default: guessed from the name)",
    )


def add_project_argument(p: argparse.ArgumentParser) -> None:
    """``--project-from T``: projected sampling (an elflow addition)."""
    p.add_argument(
        "--project-from",
        type=float,
        metavar="T",
        help="re-encode the decoded text of every clean estimate made at t >= T (unconditional "
        "models; 1 = off; default: the model's)",
    )


def add_sampling_arguments(p: argparse.ArgumentParser) -> None:
    """Options shared by ``sample`` and ``sweep``."""
    p.add_argument("--checkpoint", required=True, help="any model source (folder, run, Hub id)")
    add_task_argument(p)
    p.add_argument("--num-samples", type=int, help="unconditional: how many (default 16)")
    p.add_argument("--seed", type=int, default=0, help="sample i depends on (seed, i) only")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--length", type=int, help="sequence length (default: the model's)")
    p.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:K")
    p.add_argument("--bf16", action="store_true", help="bf16 autocast around sampling")
    p.add_argument("--no-ema", action="store_true", help="sample with the training weights")
    p.add_argument("--sources", help="conditional: JSONL(.gz) file, one sample per line")
    p.add_argument("--source-field", default="text", help="field of --sources holding the text")
    p.add_argument("--overwrite", action="store_true", help="replace an existing --out")


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Arguments of ``elflow sample``."""
    add_sampling_arguments(p)
    p.add_argument("--out", required=True, help="samples JSONL file (written by rank 0)")
    p.add_argument("--steps", type=int, help="integration steps (default: the model's)")
    p.add_argument("--sampler", choices=["ode", "sde", "heun"])
    p.add_argument("--gamma", type=float, help="SDE noise re-injection rate")
    p.add_argument("--w", type=float, help="self-conditioning CFG scale")
    p.add_argument("--cfg", type=float, help="classifier-free guidance (conditional models)")
    p.add_argument("--time-grid", choices=["logit_normal", "uniform"], help="sampling time grid")
    p.add_argument(
        "--time-mean", type=float, help="logit-normal time grid location (default: the model's)"
    )
    p.add_argument(
        "--time-std", type=float, help="logit-normal time grid scale (default: the model's)"
    )
    add_project_argument(p)
    p.add_argument(
        "--preset",
        choices=["model", "fewstep"],
        help="'model': the model's defaults; 'fewstep': the paper's distilled SDE settings",
    )
    p.add_argument(
        "--trajectory", metavar="OUT.html|-", help="HTML page of every step, or '-' to animate"
    )
    p.add_argument("--save-tokens", action="store_true", help="add token ids to every line")


def load_pipeline(args: argparse.Namespace, info: DistInfo) -> ELFPipeline:
    """The model of ``--checkpoint`` (without transformers' weight-loading bars on stderr)."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    return ELFPipeline.from_pretrained(
        args.checkpoint, device=info.device, use_ema=not args.no_ema, task=args.task
    )


def run(args: argparse.Namespace) -> int:
    """``elflow sample``; one process or under ``torchrun``."""
    if args.steps is not None and args.steps < 1:
        raise ELFError(f"--steps must be >= 1, got {args.steps}")
    if args.out == "-":
        raise ELFError("--out - : give a JSONL file name (elflow generate prints texts instead)")
    output_file(args.out, "--out", overwrite=args.overwrite)
    if args.trajectory not in (None, "-"):
        if Path(args.trajectory).expanduser().resolve() == Path(args.out).expanduser().resolve():
            raise ELFError("--trajectory and --out name the same file; give the page its own")
        output_file(args.trajectory, "--trajectory", overwrite=args.overwrite)
    info = resolve_device(args.device)
    try:
        sources = sources_from_args(args)
        pipe = load_pipeline(args, info)
        scfg = resolve_sampler(
            pipe,
            preset=args.preset,
            steps=args.steps,
            sampler=args.sampler,
            gamma=args.gamma,
            w=args.w,
            cfg=args.cfg,
            time_grid=args.time_grid,
            time_mean=args.time_mean,
            time_std=args.time_std,
            project_from=args.project_from,
        )
        result = sample_from_args(
            pipe,
            scfg,
            args,
            sources,
            info,
            trajectory=args.trajectory is not None,
            save_tokens=args.save_tokens,
            progress=True,
        )
        if info.is_main:
            write_jsonl(args.out, result.records)
            if result.frames is not None:
                meta = {k: v for k, v in result.records[0].items() if k not in ("id", "text")}
                for per_sample in ("source", "source_id", "tokens"):  # record 0's, not all's
                    meta.pop(per_sample, None)
                write_trajectory(args.trajectory, result.frames, meta)
            rate = len(result.records) / max(result.seconds, 1e-9)
            print(
                f"wrote {len(result.records)} samples to {args.out} "
                f"({result.seconds:.1f} s, {rate:.2f} samples/s per rank)",
                file=sys.stderr,
            )
    finally:
        if info.distributed:
            teardown()
    return 0
