"""``elflow demo``: text condensing out of noise, offline, on a CPU, in seconds.

Samples the shipped demo model (or any unconditional ``--model``) with its own sampler (for the
shipped model: a 32-step projected SDE, which needs its MiniLM encoder; ``--project-from 1``
samples without it) while animating the trajectory in the terminal, and writes the
self-contained HTML trajectory page. ``--score`` also scores the samples with the offline SmolLM2
judge (paper protocol) beside the model card's figures for real held-out verses.

The page (``--html``, default ``elflow-demo.html``) replaces an earlier elflow trajectory page, so
the demo can be run again as it is documented; any other existing file is refused in one line,
before sampling, unless ``--overwrite``.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

from elflow.cli.common import (
    add_device_argument,
    add_model_argument,
    add_num_samples,
    add_sampler_arguments,
    checked_sampler,
    load_pipeline,
    model_from_args,
    num_samples,
)
from elflow.cli.sample_cmd import add_cuda_graphs_argument, cuda_graphs_from_args
from elflow.errors import ELFError
from elflow.io.paths import output_file


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_model_argument(p, "an unconditional model to show", default="demo")
    add_num_samples(p, conditional_too=False)
    p.add_argument("--seed", type=int, default=0, help="sample i depends on (seed, i) only")
    p.add_argument(
        "--html",
        default="elflow-demo.html",
        help="trajectory page to write (an earlier elflow page there is replaced)",
    )
    p.add_argument(
        "--overwrite", action="store_true", help="replace an existing --html that is another file"
    )
    p.add_argument("--no-animate", action="store_true", help="print only the final samples")
    p.add_argument("--delay", type=float, default=0.08, help="seconds per animation frame")
    p.add_argument("--score", action="store_true", help="score with the offline SmolLM2 judge")
    add_device_argument(p)
    add_cuda_graphs_argument(p)
    add_sampler_arguments(p)


def run(args: argparse.Namespace) -> int:
    from elflow.generation.records import settings_record
    from elflow.generation.trajectory import animate_terminal, page_settings, render_html
    from elflow.runtime.distributed import resolve_device

    t0 = time.perf_counter()
    model = model_from_args(args)
    html = _check_html(args.html, args.overwrite)
    n = num_samples(args, with_sources=False)
    if not (math.isfinite(args.delay) and args.delay >= 0):
        raise ELFError(f"--delay must be a number of seconds >= 0, got {args.delay}")
    pipe = load_pipeline(model, resolve_device(args.device).device)
    if pipe.config.conditional:
        raise ELFError(f"{model} is a conditional model; elflow demo samples unconditionally")
    scfg = checked_sampler(args, pipe)
    out = pipe.generate_full(
        n, sampler=scfg, seed=args.seed, trajectory=True, cuda_graphs=cuda_graphs_from_args(args)
    )
    frames = [*out.trajectory, out.texts]
    labels = [f"step {k + 1}/{scfg.steps}" for k in range(len(out.trajectory))] + ["final"]
    if not args.no_animate:
        animate_terminal(frames, sys.stdout, args.delay, labels=labels)
    else:
        for i, text in enumerate(out.texts):
            print(f"{i}: {text}")
    settings = settings_record(pipe, scfg, seed=args.seed, bf16=False, model=model, ema=True)
    meta = page_settings(settings)
    html.write_text(render_html(frames, meta, labels=labels), encoding="utf-8")
    print(f"\n{n} samples in {time.perf_counter() - t0:.1f} s; trajectory page: {args.html}")
    if args.score:
        _score(out.texts, model)
    return 0


# How every page render_html writes begins; a file that does not is not an earlier page.
_PAGE_START = (
    '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8"><title>elflow trajectory'
)


def _check_html(path: str, overwrite: bool) -> Path:
    """``--html`` as a file to write: a new name, an earlier elflow trajectory page (the demo
    rewrites its own page each run), or anything else only with ``overwrite``."""
    html = output_file(path, "--html")
    if html.is_file() and not overwrite and not _earlier_page(html):
        raise ELFError(
            f"--html {html} already exists and is not an elflow trajectory page; pass "
            "--overwrite to replace it, or a new name"
        )
    return html


def _earlier_page(path: Path) -> bool:
    try:
        with open(path, "rb") as f:
            start = f.read(len(_PAGE_START.encode()))
    except OSError:
        return False
    return start == _PAGE_START.encode()


def _score(texts: list[str], model: str) -> None:
    from elflow.evaluation import score_samples
    from elflow.generation.demo_loader import CARD, read_card
    from elflow.io.model_sources import resolve_source

    metrics = score_samples([{"text": t} for t in texts], judge="smollm2-135m", bootstrap=200)
    card = read_card(resolve_source(model).path / CARD)
    print(f"\n{'':<24} {'gen PPL':>9} {'entropy':>8}")
    print(f"{'these samples':<24} {metrics['gen_ppl']:>9.2f} {metrics['entropy']:>8.3f}")
    for key, label in (("real_text", "real held-out verses"), ("shipped", "shipped model (card)")):
        row = card.get(key)
        figures = [row.get(k) for k in ("gen_ppl", "entropy")] if isinstance(row, dict) else []
        if figures and all(isinstance(x, (int, float)) for x in figures):
            print(f"{label:<24} {figures[0]:>9.2f} {figures[1]:>8.3f}")
    protocol = metrics["protocol"]
    print(
        f"protocol: {protocol['name']} — judge {protocol.get('judge')}, dtype "
        f"{protocol.get('dtype')}, end-of-text id {protocol.get('eos_id')}, "
        f"{metrics['num_samples']} samples ({metrics['num_empty']} empty)"
    )
