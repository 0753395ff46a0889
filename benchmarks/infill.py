"""Infilling quality on validation verses: one middle span of 20-40% of the words masked.

    python benchmarks/infill.py --model demo --num 256 --out infill.json
    python benchmarks/infill.py --model demo --span-model runs/demo-span --num 256

Each verse (prepared like the training rows: tokenised, truncated, decoded) loses one middle span
of 20-40% of its words (seeded); the template keeps the rest and gives the gap the span's own
token count. Rows: the training-free fill with kept latents from the placeholder encoding only
(``refresh_from 1``), the same with the boundary correction (kept latents re-encoded from the
current fill at every step, ``refresh_from 0``), the span-trained model when ``--span-model``
is given, and the model's unconditional samples as the floor. Columns: the judge's gen PPL and
entropy of the whole verses (SmolLM2, paper protocol, bootstrap 95% intervals), the share whose
kept text survives decoding whole, and the fill's BLEU and ROUGE-L against the masked span.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from dataclasses import replace

from elflow.evaluation import load_judge
from elflow.evaluation.text_metrics import bleu, rouge
from elflow.examples import web_bible_texts
from elflow.generation.infill import Gap, InfillRequest
from elflow.generation.pipeline import ELFPipeline
from quality import score


def masked_verses(pipe: ELFPipeline, num: int, seed: int) -> list[tuple[str, str, str, int]]:
    """(prefix, span, suffix, span tokens) for ``num`` random validation verses."""
    texts = web_bible_texts("valid")
    rng = random.Random(seed)
    L = pipe.config.model.max_length
    out = []
    for text in rng.sample(texts, len(texts)):
        ids = pipe.tokenizer(text, max_length=L, truncation=True)["input_ids"]
        words = pipe.tokenizer.decode(ids, skip_special_tokens=True).split()
        if len(words) < 5:
            continue
        k = max(1, round(rng.uniform(0.2, 0.4) * len(words)))
        start = rng.randint(1, len(words) - k - 1)  # a middle span: words kept on both sides
        prefix, span = " ".join(words[:start]), " ".join(words[start : start + k])
        suffix = " ".join(words[start + k :])
        n = len(pipe.tokenizer(span, add_special_tokens=False)["input_ids"])
        out.append((prefix, span, suffix, n))
        if len(out) == num:
            break
    return out


def infill_row(name, pipe, verses, sampler, judge, batch_size) -> dict:
    """One row of the table (every output kept in ``outputs``)."""
    requests = [InfillRequest(parts=[p + " ", Gap(n, n), " " + s]) for p, _, s, n in verses]
    t0 = time.perf_counter()
    out = pipe.infill(requests, sampler=sampler, seed=0, batch_size=batch_size)
    seconds = time.perf_counter() - t0
    fills = [" ".join(f) for f in out.fills]
    spans = [v[1] for v in verses]
    row = {"row": name, "seconds": round(seconds, 1), **_scores(out.texts, judge)}
    row["kept_survived"] = sum(out.survived) / len(out.survived)
    row["fill_bleu"] = bleu(fills, spans).score
    row["fill_rougeL"] = rouge(fills, spans)["rougeL"]
    row["outputs"] = [
        {"template": f"{p} [___{n}] {s}", "original": sp, "filled": t, "kept": k, "fill": f}
        for (p, sp, s, n), t, k, f in zip(verses, out.texts, out.kept, fills, strict=True)
    ]
    return row


def _scores(texts, judge) -> dict:
    m = score(texts, judge)
    return {k: m[k] for k in ("gen_ppl", "gen_ppl_ci", "entropy", "entropy_ci", "num_empty")}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="demo", help="the model to fill with (default: demo)")
    p.add_argument("--span-model", help="a model fine-tuned with objective.span_cond_prob")
    p.add_argument("--num", type=int, default=256, help="validation verses")
    p.add_argument("--steps", type=int, help="sampler steps (default: the model's)")
    p.add_argument("--seed", type=int, default=0, help="which verses and spans")
    p.add_argument("--batch-size", type=int, default=32, help="samples per forward")
    p.add_argument("--judge", default="smollm2-135m", help="judge for gen PPL and entropy")
    p.add_argument("--out", help="JSON file for the table")
    args = p.parse_args()
    if args.num < 1:
        p.error("--num must be >= 1")
    pipe = ELFPipeline.from_pretrained(args.model)
    sampler = pipe.sampler if args.steps is None else replace(pipe.sampler, steps=args.steps)
    verses = masked_verses(pipe, args.num, args.seed)
    judge = load_judge(args.judge)
    originals = [f"{p} {s} {x}".strip() for p, s, x, _ in verses]
    rows = [{"row": "original verses", **_scores(originals, judge)}]
    no_refresh = replace(sampler, refresh_from=1.0)
    rows.append(
        infill_row("(a) kept latents fixed", pipe, verses, no_refresh, judge, args.batch_size)
    )
    refresh = replace(sampler, refresh_from=0.0)
    rows.append(
        infill_row("(a) kept latents refreshed", pipe, verses, refresh, judge, args.batch_size)
    )
    if args.span_model:
        span = ELFPipeline.from_pretrained(args.span_model)
        s_sampler = replace(span.sampler, refresh_from=0.0, steps=sampler.steps)
        rows.append(infill_row("(b) span-trained", span, verses, s_sampler, judge, args.batch_size))
    free = pipe.generate(len(verses), sampler=sampler, seed=0, batch_size=args.batch_size)
    rows.append({"row": "unconditional samples (floor)", **_scores(free, judge)})
    print(f"{'row':<32} {'gen PPL [95% CI]':>26} {'entropy':>8} {'kept':>6} {'BLEU':>6} {'R-L':>6}")
    for r in rows:
        lo, hi = r["gen_ppl_ci"]
        kept = f"{100 * r['kept_survived']:.0f}%" if "kept_survived" in r else ""
        bleu_ = f"{r['fill_bleu']:.1f}" if "fill_bleu" in r else ""
        rl = f"{r['fill_rougeL']:.1f}" if "fill_rougeL" in r else ""
        ppl = f"{r['gen_ppl']:.1f} [{lo:.1f}, {hi:.1f}]"
        print(f"{r['row']:<32} {ppl:>26} {r['entropy']:>8.3f} {kept:>6} {bleu_:>6} {rl:>6}")
    if args.out:
        record = {"model": args.model, "span_model": args.span_model, "num": len(verses)}
        with open(args.out, "w", encoding="utf-8") as f:
            json.dump(record | {"steps": sampler.steps, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
