"""``elflow demo``: text condensing out of noise, offline, on a CPU, in seconds.

Loads the small ELF model shipped inside the package (``elflow/demo_model/``: bf16 safetensors,
config, the MiniLM vocabulary files and ``card.json`` with its training and quality record), or any
model given with ``--model``; generates a few samples with the model's 32-step SDE sampler (for the
shipped model: projected sampling from t 0.3, which needs its MiniLM encoder; ``--project-from 1``
samples without it, at the model's gamma) while animating the trajectory in the terminal, and
writes the self-contained HTML trajectory page.
``--score`` also scores them with the offline SmolLM2 judge (paper protocol) and prints the numbers
beside the card's figures for real held-out verses. :func:`export_demo` builds such a folder from a
training run.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import torch

from elflow.errors import ELFError
from elflow.io.artifact import CONFIG, WEIGHTS, load_model, save_model
from elflow.paths import output_file

DEMO_DIR = Path(__file__).resolve().parents[1] / "demo_model"
CARD = "card.json"
TOKENIZER_FILES = (
    "vocab.txt",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
)


def export_demo(
    run: str | Path, out: str | Path, card: dict[str, Any], dtype: torch.dtype = torch.bfloat16
) -> Path:
    """Write a demo model folder: EMA weights in ``dtype``, config, tokenizer files and a card."""
    from elflow.encoder import resolve_pretrained

    model, config = load_model(run)
    out = Path(out)
    tmp = out.with_name(f".{out.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    save_model(tmp, model.to(dtype), config)
    tok_src = Path(resolve_pretrained(config.tokenizer))
    (tmp / "tokenizer").mkdir()
    for name in TOKENIZER_FILES:
        if (tok_src / name).is_file():
            shutil.copy(tok_src / name, tmp / "tokenizer" / name)
    (tmp / CARD).write_text(json.dumps(card, indent=2) + "\n")
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return out


def _model_dir(path: str | None) -> Path:
    if path is not None:  # any model source: ELFPipeline.from_pretrained resolves runs too
        if not Path(path).exists():
            raise ELFError(f"--model {path}: no such model folder, run or checkpoint")
        return Path(path)
    if not (DEMO_DIR / WEIGHTS).is_file() or not (DEMO_DIR / CONFIG).is_file():
        raise ELFError(
            "this installation ships no demo model; train one with "
            "`elflow train --preset bible-tiny --out runs/bible-tiny` and run "
            "`elflow demo --model runs/bible-tiny`"
        )
    return DEMO_DIR


def add_arguments(p: argparse.ArgumentParser) -> None:
    from elflow.generation.records import add_project_argument

    p.add_argument("--model", help="model folder or run (default: the shipped demo model)")
    p.add_argument("-n", "--num-samples", type=int, default=4)
    p.add_argument("--steps", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--html", default="elflow-demo.html", help="trajectory page to write")
    p.add_argument("--no-animate", action="store_true", help="print only the final samples")
    p.add_argument("--delay", type=float, default=0.08, help="seconds per animation frame")
    p.add_argument("--score", action="store_true", help="score with the offline SmolLM2 judge")
    add_project_argument(p)


def run(args: argparse.Namespace) -> int:
    from elflow.generation.pipeline import ELFPipeline
    from elflow.generation.trajectory import animate_terminal, render_html

    t0 = time.perf_counter()
    html = output_file(args.html, "--html")
    if args.num_samples < 1:
        raise ELFError(f"-n must be >= 1, got {args.num_samples}")
    if args.steps < 1:
        raise ELFError(f"--steps must be >= 1, got {args.steps}")
    if not (math.isfinite(args.delay) and args.delay >= 0):
        raise ELFError(f"--delay must be a number of seconds >= 0, got {args.delay}")
    folder = _model_dir(args.model)
    pipe = ELFPipeline.from_pretrained(folder)
    if pipe.config.conditional:
        raise ELFError(f"{folder} is a conditional model; elflow demo samples unconditionally")
    from elflow.generation.records import resolve_sampler

    scfg = resolve_sampler(pipe, steps=args.steps, sampler="sde", project_from=args.project_from)
    out = pipe.generate_full(
        args.num_samples,
        seed=args.seed,
        steps=args.steps,
        sampler="sde",
        project_from=args.project_from,
        trajectory=True,
    )
    frames = [*out.trajectory, out.texts]
    labels = [f"step {k + 1}/{args.steps}" for k in range(len(out.trajectory))] + ["final"]
    if not args.no_animate:
        animate_terminal(frames, sys.stdout, args.delay, labels=labels)
    else:
        for i, text in enumerate(out.texts):
            print(f"{i}: {text}")
    meta = {"model": str(folder), "sampler": "sde", "steps": args.steps, "gamma": scfg.gamma}
    meta |= {"w": scfg.w, "project_from": scfg.project_from, "seed": args.seed}
    html.parent.mkdir(parents=True, exist_ok=True)
    html.write_text(render_html(frames, meta, labels=labels), encoding="utf-8")
    print(
        f"\n{args.num_samples} samples in {time.perf_counter() - t0:.1f} s; "
        f"trajectory page: {args.html}"
    )
    if args.score:
        _score(out.texts, folder)
    return 0


def _read_card(path: Path) -> dict[str, Any]:
    """A model's card.json, or {} when it has none or it is not a JSON object (the figures
    beside the samples' are then left out)."""
    try:
        card = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return card if isinstance(card, dict) else {}


def _score(texts: list[str], folder: Path) -> None:
    from elflow.evaluation import score_samples

    metrics = score_samples([{"text": t} for t in texts], judge="smollm2-135m", bootstrap=200)
    card = _read_card(folder / CARD)
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
