"""``elflow compare``: pair scored cells of equal entropy and say which is lower in gen PPL.

Results are sweep folders (or their ``table.csv``) or ``elflow score`` metrics files; the pairing
and the verdicts are :mod:`elflow.evaluation.comparison`'s. Prints one markdown table per pair of
results with its wins / overlaps / losses; ``--out`` also writes them as JSON.
"""

from __future__ import annotations

import argparse

from elflow.io.paths import output_file


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "results",
        nargs="+",
        metavar="RESULT",
        help="sweep folders, table.csv or metrics.json files (one: its cells with each other)",
    )
    p.add_argument(
        "--entropy-tol",
        type=float,
        default=0.05,
        metavar="NATS",
        help="pair cells whose unigram entropies differ by at most this much (default 0.05)",
    )
    p.add_argument(
        "--same",
        metavar="KEY,...",
        help="pair only cells that also agree on these settings (e.g. steps or sampler,nfe)",
    )
    p.add_argument("--out", metavar="FILE.json", help="also write the comparison as JSON")
    p.add_argument("--overwrite", action="store_true", help="replace an existing --out")


def run(args: argparse.Namespace) -> int:
    import json

    from elflow.evaluation.comparison import as_json, compare, load_result, markdown

    out = output_file(args.out, "--out", overwrite=args.overwrite) if args.out else None
    same = [k.strip() for k in (args.same or "").split(",") if k.strip()]
    results = [load_result(path) for path in args.results]
    comparisons = compare(results, args.entropy_tol, same)
    print(markdown(comparisons, args.entropy_tol), end="")
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(as_json(comparisons, args.entropy_tol), indent=2) + "\n")
    return 0
