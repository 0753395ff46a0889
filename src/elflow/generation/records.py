"""Sample records: what ``elflow sample`` and every ``elflow sweep`` cell write (ELF_SPEC §5, §10).

Every sample i is drawn from generators seeded by (seed, i) (§10 "Sampling reproducibility"), so
in fp32 the records are the same whatever the batch size or the number of ``torchrun`` processes
(under bf16 autocast the blocks' rounding depends on the batch's shape): each rank generates a
contiguous share of the indices and rank 0 gathers them in index order. Each record holds ``id``,
``text`` (``source`` when conditional) and the settings that made it (:func:`settings_record`).
"""

from __future__ import annotations

import dataclasses
import sys
import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch.distributed as dist

from elflow.config import SamplerConfig, sampler_own_settings, unused_settings
from elflow.errors import ELFError, note_once
from elflow.generation.engine import infill_batch
from elflow.generation.infill import InfillRequest
from elflow.generation.pipeline import ELFPipeline
from elflow.generation.request_checks import check_batch_size
from elflow.io.jsonl import read_jsonl
from elflow.io.paths import input_file
from elflow.runtime.distributed import DistInfo
from elflow.runtime.hardware import bf16_autocast, fast_bf16


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
    path = input_file(path, "sources file")
    rows = read_jsonl(path, field, field_flag="source_field=")
    if not rows:
        raise ELFError(f"sources file {path} is empty")
    return rows


def source_fields(source: dict, field: str) -> dict[str, Any]:
    """What a conditional sample's record says of its source: the text, and the id the source
    line carried (``source_id``, which references are matched on)."""
    return {"source": source[field]} | ({"source_id": source["id"]} if "id" in source else {})


def settings_record(
    pipe: ELFPipeline,
    scfg: SamplerConfig,
    *,
    seed: int,
    bf16: bool,
    model: str,
    ema: bool,
) -> dict:
    """The settings written on every line.

    ``nfe`` counts network evaluations per sample: a Heun or pc step costs two, a step under
    classifier-free guidance two (its two evaluations share one batched forward of twice the
    rows), the final decode none. Projected sampling adds one decode pass and one encoder pass per
    projected step, not counted in ``nfe``.
    """
    cfg = pipe.config
    guided = cfg.conditional and scfg.cfg != 1.0
    # The target's length (a conditional model's rows also hold the source).
    L = cfg.model.max_length - cfg.max_input_length if cfg.conditional else scfg.length
    unused = unused_settings(scfg.sampler)  # other samplers' own settings: null
    return {
        "sampler": scfg.sampler,
        "steps": scfg.steps,
        "nfe": 2 * scfg.nfe if guided else scfg.nfe,
        # gamma, gamma_schedule, pc_snr, and any a registered sampler names
        **{f: None if f in unused else getattr(scfg, f) for f in sorted(sampler_own_settings())},
        "w": scfg.w,
        "cfg": scfg.cfg if pipe.config.conditional else None,
        "time_grid": scfg.time_grid,
        "time_mean": scfg.time_mean if scfg.time_grid == "logit_normal" else None,
        "time_std": scfg.time_std if scfg.time_grid == "logit_normal" else None,
        "project_from": recorded_project_from(scfg),
        "seed": seed,
        "length": L or pipe.config.model.max_length,
        "length_range": scfg.length_range or None,
        "refresh_from": scfg.refresh_from,  # infilling and length control
        "dtype": "bf16" if bf16 else "fp32",
        "model": model,
        "ema": ema,
    }


def sampler_from_record(record: dict) -> SamplerConfig:
    """The sampler settings a record (:func:`settings_record`) was made with; a setting the
    record leaves out (None: not used by its sampler) takes its default."""
    names = {f.name for f in dataclasses.fields(SamplerConfig)}
    given = {k: v for k, v in record.items() if k in names and v is not None}
    if given.get("length_range"):  # the recorded length is then the rows', not a setting
        given.pop("length", None)
    return SamplerConfig(**given)


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


def sample_records(
    pipe: ELFPipeline,
    scfg: SamplerConfig,
    *,
    n: int | None = None,
    sources: Sequence[dict] | None = None,
    source_field: str = "text",
    seed: int = 0,
    batch_size: int = 32,
    bf16: bool = False,
    trajectory: bool = False,
    save_tokens: bool = False,
    model: str = "",
    ema: bool = True,
    info: DistInfo | None = None,
    progress: bool = False,
    infill: Sequence[InfillRequest] | None = None,
    skip: Collection[int] = (),
    sink: Callable[[list[dict]], None] | None = None,
    cuda_graphs: bool | None = None,
) -> SampleResult:
    """Generate samples ``0..n-1`` (or one per source) across the ranks; records on rank 0.
    With ``infill``, one per request: the filled text, its ``fills``, ``kept`` text and whether
    that kept text survived whole (``kept_survived``). Samples whose ids are in ``skip`` (made
    earlier) are not drawn; ``sink`` gets each batch's records as the batch finishes, on every
    rank (resumable output, :mod:`elflow.generation.partial`). ``cuda_graphs``: as
    :meth:`ELFPipeline.generate_full`."""
    info = info or DistInfo(0, 1, 0, pipe.device)
    check_batch_size(batch_size)
    texts = None if sources is None else [s[source_field] for s in sources]
    if infill is not None:
        if scfg.length_range:
            raise ELFError(
                "sampler.length_range sets a whole text's length; an infill's gaps set theirs"
            )
        n = len(infill)
    if trajectory and skip:
        raise ELFError(
            "a trajectory shows every sample's steps: it cannot skip samples made earlier"
        )
    scfg, total, projection = pipe.prepare(scfg, n, texts)
    if infill is not None:
        pipe.frozen_encoder("infilling")
    if bf16 and pipe.device.type == "cpu" and not fast_bf16(pipe.device) and info.is_main:
        note_once(  # once: a sweep samples once per cell
            "elflow: warning: --dtype bf16 on a CPU that emulates bf16 (no AVX-512 BF16/AMX/Arm "
            "BF16) is many times slower than fp32 here; use --dtype fp32 (a CPU's default)"
        )
    settings = settings_record(pipe, scfg, seed=seed, bf16=bf16, model=model, ema=ema)
    todo = [i for i in shard(total, info) if i not in set(skip)]
    mine: list[tuple[dict, list[str]]] = []
    bar = _progress(total, progress and info.is_main, initial=total - len(todo) * info.world_size)
    t0 = time.perf_counter()
    for run in _runs(todo, batch_size):
        with bf16_autocast(bf16, pipe.device):
            gen, extras = _batch(
                pipe, scfg, run, texts, infill, seed, trajectory, projection, cuda_graphs
            )
        batch = []
        for j, i in enumerate(run):
            rec: dict[str, Any] = {"id": i, "text": gen.texts[j], **extras[j]}
            if sources is not None:
                rec.update(source_fields(sources[i], source_field))
            rec.update(settings)
            if save_tokens:
                rec["tokens"] = gen.tokens[j].tolist()
            steps = [frame[j] for frame in gen.trajectory] if trajectory else []
            batch.append((rec, steps))
        if sink is not None:
            sink([rec for rec, _ in batch])
        mine.extend(batch)
        # Other ranks progress at the same rate; scale so the bar shows the whole run.
        bar.update(len(run) * info.world_size)
    seconds = time.perf_counter() - t0
    bar.close()
    gathered = [row for part in _gather(mine, info) for row in part]
    if not info.is_main:
        return SampleResult([], None, seconds)
    gathered.sort(key=lambda r: r[0]["id"])
    records = [rec for rec, _ in gathered]
    frames = None
    if trajectory:
        frames = [[steps[k] for _, steps in gathered] for k in range(scfg.steps)]
        frames.append([rec["text"] for rec in records])
    return SampleResult(records, frames, seconds)


def _runs(ids: Sequence[int], size: int) -> list[range]:
    """``ids`` (ascending) as ranges of consecutive ids, each at most ``size`` long: batches."""
    runs: list[range] = []
    for i in ids:
        last = runs[-1] if runs else None
        if last is not None and i == last.stop and len(last) < size:
            runs[-1] = range(last.start, i + 1)
        else:
            runs.append(range(i, i + 1))
    return runs


def _batch(
    pipe: ELFPipeline,
    scfg: SamplerConfig,
    indices: range,
    texts: list[str] | None,
    infill: Sequence[InfillRequest] | None,
    seed: int,
    trajectory: bool,
    projection: Any,
    cuda_graphs: bool | None = None,
) -> tuple[Any, list[dict]]:
    """One batch of samples, and what each record adds (an infill's fills and kept text)."""
    if infill is None:
        sources = None if texts is None else texts[indices.start : indices.stop]
        gen = pipe.sample_batch(
            indices,
            scfg,
            sources=sources,
            seed=seed,
            trajectory=trajectory,
            projection=projection,
            cuda_graphs=cuda_graphs,
        )
        return gen, [{} for _ in indices]
    gen = infill_batch(
        pipe,
        infill[indices.start : indices.stop],
        scfg,
        seed=seed,
        indices=indices,
        trajectory=trajectory,
        cuda_graphs=cuda_graphs,
    )
    extras = [
        {"fills": f, "kept": k, "kept_survived": ok}
        for f, k, ok in zip(gen.fills, gen.kept, gen.survived, strict=True)
    ]
    return gen, extras


def sample_seeds(seeds: Sequence[int], draw: Callable[[int], SampleResult]) -> SampleResult:
    """``draw(seed)`` (a :func:`sample_records` call) for each seed in turn, the records
    concatenated in seed order: each carries its ``seed``, ids count from 0 within a seed. Frames
    come back for one seed only."""
    results = [draw(seed) for seed in seeds]
    return SampleResult(
        [r for res in results for r in res.records],
        results[0].frames if len(results) == 1 else None,
        sum(res.seconds for res in results),
    )


def _progress(total: int, enabled: bool, initial: int = 0):
    from tqdm.auto import tqdm

    # A bar only on an interactive stderr: in logs and tests it would be noise.
    live = enabled and sys.stderr.isatty()
    return tqdm(
        total=total,
        initial=max(0, initial),
        unit="sample",
        disable=not live,
        file=sys.stderr,
        leave=False,
    )


def token_agreement(a: Sequence[dict], b: Sequence[dict]) -> float:
    """Share of identical token ids between two runs saved with ``--save-tokens``."""
    same = total = 0
    for ra, rb in zip(a, b, strict=True):
        ta, tb = ra["tokens"], rb["tokens"]
        same += sum(x == y for x, y in zip(ta, tb, strict=True))
        total += len(ta)
    return same / max(total, 1)


def write_trajectory(
    target: str, frames: list[list[str]], settings: dict, kept: list[list[str]] | None = None
) -> None:
    """``-``: animate in the terminal (stdout); else write the HTML page to ``target``, its
    settings table in plain words from a record's ``settings`` (an infill's ``kept`` text runs,
    per sample, shown distinctly)."""
    from elflow.generation.trajectory import animate_terminal, page_settings, render_html

    labels = [f"step {k + 1}/{len(frames) - 1}" for k in range(len(frames) - 1)] + ["final"]
    if target == "-":
        animate_terminal(frames, sys.stdout, delay=0.15, labels=labels)
        return
    out = Path(target)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(render_html(frames, page_settings(settings), labels, kept), encoding="utf-8")
