"""Evaluation: generative perplexity, unigram entropy, BLEU, ROUGE and bootstrap CIs (spec §6).

The Python mirror of `elflow score`: :func:`score_samples` computes everything with a protocol card;
the metric functions are pure and usable alone. Judges (spec §10) load with :func:`load_judge`.
"""

from elflow.evaluation.judge import Judge, load_judge
from elflow.evaluation.metrics import (
    BLEUResult,
    PPLResult,
    bleu,
    bleu_cased,
    bootstrap_ci,
    gen_ppl,
    rouge,
    unigram_entropy,
)
from elflow.evaluation.score import PROTOCOLS, score_samples
from elflow.jsonl import read_jsonl

__all__ = [
    "PROTOCOLS",
    "BLEUResult",
    "Judge",
    "PPLResult",
    "bleu",
    "bleu_cased",
    "bootstrap_ci",
    "gen_ppl",
    "load_judge",
    "read_jsonl",
    "rouge",
    "score_samples",
    "unigram_entropy",
]
