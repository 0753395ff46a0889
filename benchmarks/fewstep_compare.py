"""Progressive (pd) against consistency (cd) distillation of one teacher at an equal budget.

Usage:
    python benchmarks/fewstep_compare.py --teacher demo --out runs/fewstep-compare \
        --budget 4e6 --steps 1,2,4,8 --seeds 0,1,2 --num 256
    python benchmarks/fewstep_compare.py --quick --out /tmp/fewstep-quick   # minutes: a check

Both methods distil the same teacher with ``elflow distill`` (Python API) under the same run
settings (the preset scaled to each run's length as ``elflow train --steps N`` scales it: warm-up
over 5% of the steps, the lr decaying over the last 30%; then ``--set``) and the same budget in
teacher-equivalent forward passes (:func:`row_cost`: a trained pass counts 3, forward and backward;
every teacher or no-grad pass 1). pd's rounds are ``N/K`` for each student step count N with N x K =
``--teacher-steps``, each round as many steps (the budget over their summed cost); cd trains one
student. Both distil the teacher's 16-step Euler ODE by default (pd: N x K = 16 in every round; cd:
K = 16 sub-steps over each span). Each student samples at its step count with its own saved sampler
(pd's: the paper's few-step SDE; cd's: renoise), the teacher at the same counts and at 32 steps with
its own; every cell is scored with the offline judge (paper protocol, fp32, bootstrap 95%
intervals), one cell per sampling seed. The report pairs pd and cd at each step count: "cd beats pd"
when cd's whole gen-PPL interval lies below pd's in every seed and their entropies are within
``--entropy-tol``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

from fewstep import ppl_entropy
from quality import score, timed_generate

QUICK = {
    "budget": 800.0,
    "steps": "1,2",
    "seeds": "0",
    "num": 8,
    "teacher_steps": 8,
    "cd_substeps": 8,
    "batch": 8,
    "set": ["data.latent_cache=false", "train.precision=fp32"],
}
"""``--quick``: a few training steps a method and 16 samples a cell (the pipeline, not a result)."""


def row_cost(method: str, k: int, decoder_prob: float, bootstrap: float = 0.0) -> float:
    """Teacher-equivalent forward passes one training example costs: the trained pass (3), and on
    the student-step rows (1 - decoder_prob) the teacher's self-conditioning pass (probability
    0.5), its K sub-steps and, for cd, the student's no-grad pass on the ``bootstrap`` share."""
    extra = bootstrap if method == "cd" else 0.0
    return 3.0 + (1.0 - decoder_prob) * (0.5 + k + extra)


def bootstrap_share(spans: str, grid_steps: str) -> float:
    """The share of cd rows whose span ends before t = 1 (their target is the student's)."""
    from elflow.config import ObjectiveConfig
    from elflow.distill.consistency import ConsistencyConfig, ConsistencySettings
    from elflow.distill.consistency import sample_consistency_draws_keyed as draws

    cfg = ConsistencyConfig.of(
        ConsistencySettings(spans=spans, grid_steps=grid_steps), ObjectiveConfig()
    )
    d = draws(range(20000), 1, 1, cfg, seed=0)
    return float(((d.t + d.span) < 1.0).float().mean())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--teacher", default="demo")
    p.add_argument("--out", required=True, help="folder for the students and the report")
    p.add_argument("--preset", default="bible-tiny")
    p.add_argument("--set", action="append", default=[], help="run config KEY=VALUE (repeatable)")
    p.add_argument("--budget", type=float, default=4e6, help="teacher-equivalent forward passes")
    p.add_argument("--batch", type=int, default=32, help="train.global_batch of every run")
    p.add_argument("--steps", default="1,2,4,8", help="student step counts")
    p.add_argument("--teacher-steps", type=int, default=16, help="pd: N x K of every round")
    p.add_argument("--cd-substeps", type=int, default=16, help="cd: teacher_substeps")
    p.add_argument("--cd-spans", default="1", help="cd: spans")
    p.add_argument("--seeds", default="0,1,2", help="sampling seeds, one scored cell each")
    p.add_argument("--num", type=int, default=256, help="samples per cell")
    p.add_argument("--judge", default="smollm2-135m")
    p.add_argument("--entropy-tol", type=float, default=0.05)
    p.add_argument("--batch-size", type=int, default=64, help="sampling batch size")
    p.add_argument("--quick", action="store_true", help="a few minutes: checks the pipeline")
    p.add_argument(
        "--add-cell",
        action="append",
        default=[],
        metavar="MODEL:STEPS:KEY=VALUE,...",
        help="with --report-only: score a model at a step count with its sampler changed, "
        "e.g. cd:4:w=4.5 (repeatable; entropy-matched pairs then cover more of the frontier)",
    )
    p.add_argument(
        "--report-only",
        action="store_true",
        help="no training or sampling: add the real-verse rows to --out's results.json if it "
        "lacks them, and rewrite results.md from it",
    )
    args = p.parse_args()
    if args.quick:
        for key, value in QUICK.items():
            setattr(args, key, [*value, *args.set] if key == "set" else value)
    out = Path(args.out)
    if not out.parent.is_dir():
        p.error(f"--out {out}: its folder does not exist")
    steps = step_counts(args.steps)
    if any(args.teacher_steps % n for n in steps):
        p.error(f"--teacher-steps {args.teacher_steps} must be a multiple of every step count")

    from elflow.config.run_presets import short_run
    from elflow.evaluation import load_judge
    from elflow.generation.pipeline import ELFPipeline
    from elflow.train import apply_overrides, distill, preset

    judge = load_judge(args.judge)  # before hours of training, not after
    seeds = [int(s) for s in args.seeds.split(",")]
    if args.report_only:
        results = json.loads((out / "results.json").read_text())
        rows = results["rows"]
        num = results["args"]["num"]
        if not any(r["model"] == "real" for r in rows):
            teacher = ELFPipeline.from_pretrained(results["args"]["teacher"])
            rows += real_rows(teacher, judge, seeds, num)
        for model, n, changes in map(parse_cell, args.add_cell):
            path = next(r["path"] for r in rows if (r["model"], r["steps"]) == (model, n))
            pipe = ELFPipeline.from_pretrained(path)
            rows += score_cell(model, path, n, pipe, judge, seeds, num, args.batch_size, **changes)
        write_results(out, results, args.entropy_tol)
        return
    sets = [f"train.global_batch={args.batch}", "train.sample_every=0", "train.eval_every=0"]
    keep = {s.split("=", 1)[0] for s in args.set}

    def run_of(steps: int):
        """The preset scaled to ``steps`` (warm-up 5%, lr decay over the last 30%: as
        ``elflow train --steps N``), then the script's and the user's settings."""
        scaled = short_run(preset(args.preset), steps, keep)
        return apply_overrides(scaled, None, [*sets, *args.set])

    cfg = run_of(1)
    p_dec = cfg.objective.decoder_prob
    rounds = [(n, args.teacher_steps // n) for n in steps]
    # One train.max_steps for every pd round (as elflow distill runs them): the budget over
    # the rounds' summed cost.
    pd_cost = sum(row_cost("pd", k, p_dec) for _, k in rounds)
    pd_steps = max(1, round(args.budget / (args.batch * pd_cost)))
    share = bootstrap_share(args.cd_spans, ",".join(map(str, sorted(steps))))
    cd_cost = row_cost("cd", args.cd_substeps, p_dec, share)
    cd_steps = max(1, round(args.budget / (args.batch * cd_cost)))
    plan = {
        "pd": {"rounds": [f"{n}/{k}" for n, k in rounds], "max_steps": pd_steps},
        "cd": {"max_steps": cd_steps, "row_cost": cd_cost, "bootstrap_share": share},
    }
    print(json.dumps({"budget": args.budget, "plan": plan}), flush=True)

    students: dict[tuple[str, int], str] = {}
    run = run_of(pd_steps)
    spec = ",".join(f"{n}/{k}" for n, k in rounds)
    distill(args.teacher, run, out / "pd", spec, args.teacher_steps)
    for r, (n, k) in enumerate(rounds, start=1):
        students[("pd", n)] = str(out / "pd" / f"round-{r}-{n}x{k}")
    run = run_of(cd_steps)
    settings = {
        "teacher_substeps": args.cd_substeps,
        "spans": args.cd_spans,
        "grid_steps": ",".join(map(str, sorted(steps))),
        "steps": min(steps),
    }
    distill(args.teacher, run, out / "cd", method="cd", settings=settings)
    for n in steps:
        students[("cd", n)] = str(out / "cd" / "round-1-cd")

    rows: list[dict] = []

    def cell(name: str, path: str, n: int, pipe) -> None:
        rows.extend(score_cell(name, path, n, pipe, judge, seeds, args.num, args.batch_size))

    teacher = ELFPipeline.from_pretrained(args.teacher)
    for n in [*steps, 32]:
        cell("teacher", args.teacher, n, teacher)
    for (name, n), path in students.items():
        cell(name, path, n, ELFPipeline.from_pretrained(path))
    rows += real_rows(teacher, judge, seeds, args.num)
    write_results(out, {"args": vars(args), "plan": plan, "rows": rows}, args.entropy_tol)


def step_counts(text: str) -> list[int]:
    """``--steps`` (e.g. ``1,2,4,8``) as distinct step counts, largest first."""
    return sorted({int(s) for s in text.split(",")}, reverse=True)


def write_results(out: Path, results: dict, tol: float) -> None:
    """``results.json`` and the table made from it, ``results.md``; the table printed too."""
    report = verdicts(results["rows"], step_counts(results["args"]["steps"]), tol)
    (out / "results.json").write_text(json.dumps(results, indent=2) + "\n")
    (out / "results.md").write_text(report + "\n")
    print(report)
    print(f"wrote {out / 'results.json'} and {out / 'results.md'}")


def score_cell(
    name: str,
    path: str,
    n: int,
    pipe,
    judge,
    seeds: list[int],
    num: int,
    batch_size: int,
    **changes: float,
) -> list[dict]:
    """``num`` samples of ``pipe`` at ``n`` steps (its sampler with ``changes``) per seed, scored:
    one row each."""
    rows = []
    for seed in seeds:
        texts, seconds = timed_generate(
            pipe, num, seed=seed, steps=n, batch_size=batch_size, **changes
        )
        rows.append({"model": name, "path": path, "steps": n, "seed": seed, **score(texts, judge),
                     "sampler": pipe.sampler.sampler, "changes": changes, "seconds": seconds,
                     "examples": texts[:3]})  # fmt: skip
        shown = "".join(f" {k} {v}" for k, v in changes.items())
        print(f"{name:<8} {n:>2} steps{shown} seed {seed}: {ppl_entropy(rows[-1])}", flush=True)
    return rows


def parse_cell(spec: str) -> tuple[str, int, dict[str, float]]:
    """``MODEL:STEPS[:KEY=VALUE,...]`` (``--add-cell``): a model of the comparison at a step
    count with its sampler's settings changed, e.g. ``cd:4:w=4.5``."""
    model, steps, *rest = spec.split(":")
    changes = dict(kv.split("=", 1) for kv in rest[0].split(",")) if rest and rest[0] else {}
    return model, int(steps), {k: float(v) for k, v in changes.items()}


def real_rows(pipe, judge, seeds: list[int], num: int) -> list[dict]:
    """Per seed, ``num`` random validation verses prepared as the training rows are (tokenised,
    truncated and decoded back: benchmarks/demo_quality.py), scored as the samples are."""
    import numpy as np

    from demo_quality import prepared_like_rows, read_texts
    from elflow.examples import web_bible

    valid = read_texts(web_bible("valid"))
    rows = []
    for seed in seeds:
        pick = np.random.default_rng(seed).choice(len(valid), size=num, replace=False)
        texts = prepared_like_rows(pipe, [valid[i] for i in pick])
        rows.append({"model": "real", "steps": 0, "seed": seed, **score(texts, judge)})
        print(f"real verses seed {seed}: {ppl_entropy(rows[-1])}", flush=True)
    return rows


def verdicts(rows: list[dict], steps: list[int], tol: float) -> str:
    """Markdown: per step count, each model's gen PPL (CI) and entropy per seed with its own
    sampler, and cd against pd by the evaluator's matched-entropy rule
    (:func:`elflow.evaluation.comparison.compare`) over every pair of their cells (all seeds and
    all ``--add-cell`` settings) whose entropies are within ``tol``: wins, ties and losses of
    cd, where a win lies below the other's whole 95% interval. "cd beats pd" when cd wins some
    pairs and loses none; then the cells ``--add-cell`` scored."""
    from elflow.evaluation.comparison import Scored, compare

    def scored(r: dict) -> Scored:
        lo, hi = r["gen_ppl_ci"]
        shown = ",".join(f"{k}={v}" for k, v in (r.get("changes") or {}).items())
        cell = f"{r['model']} {r['steps']} seed {r['seed']} {shown}".strip()
        return Scored(r["model"], cell, r["gen_ppl"], lo, hi, r["entropy"])

    lines = ["| steps | teacher | pd | cd | cd vs pd: W–T–L of matched pairs |"]
    lines.append("|---|---|---|---|---|")
    own: dict[tuple[str, int], list[dict]] = {}
    every: dict[tuple[str, int], list[dict]] = {}
    for r in rows:
        every.setdefault((r["model"], r["steps"]), []).append(r)
        if not r.get("changes"):
            own.setdefault((r["model"], r["steps"]), []).append(r)
    for n in [*sorted(steps), 32]:
        cells = [
            "; ".join(ppl_entropy(r) for r in own.get((m, n), [])) or "–"
            for m in ("teacher", "pd", "cd")
        ]
        pd, cd = every.get(("pd", n), []), every.get(("cd", n), [])
        verdict = "–"
        if pd and cd:
            (c,) = compare([[scored(r) for r in cd], [scored(r) for r in pd]], tol)
            wins, ties, losses = c.counts
            total = len(pd) * len(cd)
            if not c.pairs:
                word = "no pair within the entropy tolerance"
            elif wins and not losses:
                word = "cd beats pd"
            elif losses and not wins:
                word = "pd beats cd"
            else:
                word = "mixed" if wins else "ties"
            gap = statistics.mean(b["entropy"] for b in cd) - statistics.mean(
                a["entropy"] for a in pd
            )
            verdict = (
                f"{word}: {wins}–{ties}–{losses} of {len(c.pairs)} of {total} pairs "
                f"(mean entropy cd − pd {gap:+.2f})"
            )
        lines.append(f"| {n} | " + " | ".join(cells) + f" | {verdict} |")
    real = [r for r in rows if r["model"] == "real"]
    if real:
        lines.append("| real verses | " + "; ".join(ppl_entropy(r) for r in real) + " | | | |")
    extra = [r for r in rows if r.get("changes")]
    if extra:
        lines += ["", "| model | steps | sampler change | per seed |", "|---|---|---|---|"]
        groups: dict[tuple, list[dict]] = {}
        for r in extra:
            key = (r["model"], r["steps"], tuple(sorted(r["changes"].items())))
            groups.setdefault(key, []).append(r)
        for (model, n, changes), group in groups.items():
            shown = ", ".join(f"{k} {v:g}" for k, v in changes)
            seeds = "; ".join(ppl_entropy(r) for r in group)
            lines.append(f"| {model} | {n} | {shown} | {seeds} |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
