"""The few-step table: a teacher and its distilled students at 1/2/4/8 sampling steps (spec §8).

Usage:
    python benchmarks/fewstep.py --teacher runs/bible-tiny \
        --student 4-step=runs/bible-tiny-pd/round-1-4x8 \
        --student 2-step=runs/bible-tiny-pd/round-2-2x16 \
        --steps 1,2,4,8 --num 256 --out fewstep.json

Every model samples with the same few-step sampler (SDE, gamma 1.5, w 2.5 by default: the students'
preset; ``--sampler ode`` for the deterministic Euler sampler; no projection unless
``--project-from`` is given, for every model alike) and the same seed, and is scored
with the offline SmolLM2 judge under the paper protocol
(fp32) with bootstrap 95% intervals. A student "beats" the teacher at a step count when its whole
gen-PPL interval lies below the teacher's.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from elflow.evaluation import load_judge
from elflow.generation.pipeline import ELFPipeline
from quality import score, timed_generate


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--teacher", required=True)
    p.add_argument("--student", action="append", default=[], help="NAME=PATH (repeatable)")
    p.add_argument("--steps", default="1,2,4,8")
    p.add_argument("--num", type=int, default=256)
    p.add_argument("--sampler", default="sde", help="sde, ode or both: sde,ode")
    p.add_argument("--gamma", default="1.5", help="SDE noise level(s), comma-separated: 0.5,1.5,3")
    p.add_argument(
        "--entropy-tol",
        type=float,
        default=0.05,
        help="entropy gap under which a student and a teacher cell count as matched",
    )
    p.add_argument("--w", default="2.5", help="self-conditioning CFG scale(s), comma-separated")
    p.add_argument(
        "--project-from",
        type=float,
        default=1.0,
        help="projected sampling for every model alike (default 1: off, the paper's samplers)",
    )
    p.add_argument("--judge", default="smollm2-135m")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--out", default="fewstep.json")
    args = p.parse_args()
    if not Path(args.out).parent.is_dir():  # before the sampling and scoring, not after
        p.error(f"--out {args.out}: its folder does not exist")

    models = {"teacher": args.teacher}
    for spec in args.student:
        name, _, path = spec.partition("=")
        if not path or name == "teacher" or name in models:
            p.error(f"--student {spec!r}: expected NAME=PATH with a new NAME other than 'teacher'")
        models[name] = path
    steps = [int(s) for s in args.steps.split(",")]
    settings = []
    for w in (float(v) for v in args.w.split(",")):
        for sampler in args.sampler.split(","):
            if sampler == "ode":
                settings.append(("ode", None, w))
            elif sampler == "sde":
                settings += [("sde", float(g), w) for g in args.gamma.split(",")]
            else:
                p.error(f"--sampler {sampler!r}: expected sde, ode or sde,ode")
    judge = load_judge(args.judge)
    rows = []
    for name, path in models.items():
        pipe = ELFPipeline.from_pretrained(path)
        for n in steps:
            for sampler, gamma, w in settings:
                texts, seconds = timed_generate(
                    pipe,
                    args.num,
                    seed=args.seed,
                    steps=n,
                    sampler=sampler,
                    gamma=gamma,
                    w=w,
                    project_from=args.project_from,
                    batch_size=args.batch_size,
                )
                m = score(texts, judge)
                rows.append(
                    {
                        "model": name,
                        "path": path,
                        "steps": n,
                        "sampler": sampler,
                        "gamma": gamma,
                        "w": w,
                        "project_from": args.project_from,
                        "seconds": seconds,
                        **m,
                        "examples": texts[:3],
                    }
                )
                print(
                    f"{name:<10} {n} steps {label(rows[-1]):<14}: gen PPL {m['gen_ppl']:8.2f} "
                    f"[{m['gen_ppl_ci'][0]:.1f}, {m['gen_ppl_ci'][1]:.1f}]  "
                    f"entropy {m['entropy']:.3f}  ({seconds:.0f} s)",
                    flush=True,
                )
    Path(args.out).write_text(json.dumps({"args": vars(args), "rows": rows}, indent=2) + "\n")
    if len(settings) == 1:
        print(markdown(rows, list(models), steps))
    print(matched(rows, args.entropy_tol))
    print(f"wrote {args.out}")


def label(r: dict) -> str:
    """A row's sampler setting, e.g. 'SDE γ1.5 w2.5'."""
    return ("ODE" if r["sampler"] == "ode" else f"SDE γ{r['gamma']:g}") + f" w{r['w']:g}"


def ppl_entropy(r: dict) -> str:
    lo, hi = r["gen_ppl_ci"]
    return f"{r['gen_ppl']:.1f} ({lo:.1f}–{hi:.1f}), {r['entropy']:.2f}"


def matched(rows: list[dict], tol: float) -> str:
    """Entropy-matched comparisons: every student cell against each teacher cell at the same step
    count whose entropy is within ``tol`` (any sampler setting). "beats" when the student's whole
    gen-PPL interval lies below the teacher's, "loses" when above, else "overlaps"."""
    head = "| steps | student (setting) | PPL (CI), ent. | teacher (setting) | PPL (CI), ent. | |"
    lines = [head, "|---|---|---|---|---|---|"]
    for s in rows:
        if s["model"] == "teacher":
            continue
        for t in rows:
            if t["model"] != "teacher" or t["steps"] != s["steps"]:
                continue
            if abs(t["entropy"] - s["entropy"]) > tol:
                continue
            if s["gen_ppl_ci"][1] < t["gen_ppl_ci"][0]:
                verdict = "beats"
            elif s["gen_ppl_ci"][0] > t["gen_ppl_ci"][1]:
                verdict = "loses"
            else:
                verdict = "overlaps"
            lines.append(
                f"| {s['steps']} | {s['model']} ({label(s)}) | {ppl_entropy(s)} | "
                f"teacher ({label(t)}) | {ppl_entropy(t)} | {verdict} |"
            )
    return "\n".join(lines)


def markdown(rows: list[dict], names: list[str], steps: list[int]) -> str:
    cell = {(r["model"], r["steps"]): r for r in rows}
    head = "| steps | " + " | ".join(f"{n}: gen PPL (95% CI), entropy" for n in names) + " |"
    lines = [head, "|---" * (len(names) + 1) + "|"]
    for s in steps:
        teacher = cell[(names[0], s)]
        out = []
        for n in names:
            r = cell[(n, s)]
            lo, hi = r["gen_ppl_ci"]
            better = n != names[0] and hi < teacher["gen_ppl_ci"][0]
            mark = " **↓**" if better else ""
            out.append(f"{r['gen_ppl']:.1f} ({lo:.1f}–{hi:.1f}){mark}, {r['entropy']:.2f}")
        lines.append(f"| {s} | " + " | ".join(out) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
