"""``elflow.score``: the scoring API under the name used in the docs (see ``elflow.evaluation``).

``elflow.score.gen_ppl(texts, judge)``, ``unigram_entropy``, ``bleu``, ``rouge``, ``bootstrap_ci``,
``score_samples`` and ``load_judge`` are the functions of :mod:`elflow.evaluation` (ELF_SPEC §6).
"""

from elflow.evaluation import (
    bleu,
    bootstrap_ci,
    gen_ppl,
    load_judge,
    rouge,
    score_samples,
    unigram_entropy,
)

__all__ = [
    "bleu",
    "bootstrap_ci",
    "gen_ppl",
    "load_judge",
    "rouge",
    "score_samples",
    "unigram_entropy",
]
