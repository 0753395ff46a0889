"""The few-step table: a teacher and its distilled students at 1/2/4/8 sampling steps (spec §8).

Usage:
    python benchmarks/fewstep.py --teacher runs/bible-tiny \
        --student 4-step=runs/bible-tiny-pd/round-1-4x8 \
        --student 2-step=runs/bible-tiny-pd/round-2-2x16 \
        --steps 1,2,4,8 --num 256 --out fewstep.json

Every model samples with the same few-step sampler (SDE, gamma 1.5, w 2.5 by default: the students'
preset; ``--sampler ode`` for the deterministic Euler sampler) and the same seed, and is scored
with the offline SmolLM2 judge under the paper protocol
(fp32) with bootstrap 95% intervals. A student "beats" the teacher at a step count when its whole
gen-PPL interval lies below the teacher's.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from elflow.evaluation import load_judge
from elflow.pipeline import ELFPipeline
from quality import score, timed_generate


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--teacher", required=True)
    p.add_argument("--student", action="append", default=[], help="NAME=PATH (repeatable)")
    p.add_argument("--steps", default="1,2,4,8")
    p.add_argument("--num", type=int, default=256)
    p.add_argument("--sampler", default="sde", choices=["sde", "ode"])
    p.add_argument("--gamma", type=float, default=1.5, help="SDE only")
    p.add_argument("--w", type=float, default=2.5)
    p.add_argument("--judge", default="smollm2-135m")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--out", default="fewstep.json")
    args = p.parse_args()

    models = {"teacher": args.teacher}
    for spec in args.student:
        name, _, path = spec.partition("=")
        if not path or name == "teacher" or name in models:
            p.error(f"--student {spec!r}: expected NAME=PATH with a new NAME other than 'teacher'")
        models[name] = path
    steps = [int(s) for s in args.steps.split(",")]
    judge = load_judge(args.judge)
    rows = []
    for name, path in models.items():
        pipe = ELFPipeline.from_pretrained(path)
        for n in steps:
            texts, seconds = timed_generate(
                pipe,
                args.num,
                seed=args.seed,
                steps=n,
                sampler=args.sampler,
                gamma=args.gamma if args.sampler == "sde" else None,
                w=args.w,
                batch_size=args.batch_size,
            )
            m = score(texts, judge)
            rows.append(
                {
                    "model": name,
                    "path": path,
                    "steps": n,
                    "seconds": seconds,
                    **m,
                    "examples": texts[:3],
                }
            )
            print(
                f"{name:<10} {n} steps: gen PPL {m['gen_ppl']:8.2f} [{m['gen_ppl_ci'][0]:.1f}, "
                f"{m['gen_ppl_ci'][1]:.1f}]  entropy {m['entropy']:.3f}  ({seconds:.0f} s)",
                flush=True,
            )
    Path(args.out).write_text(json.dumps({"args": vars(args), "rows": rows}, indent=2) + "\n")
    print(markdown(rows, list(models), steps))
    print(f"wrote {args.out}")


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
