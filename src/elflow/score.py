"""Deprecated: ``elflow.score`` is :mod:`elflow.evaluation` under an older name.

``gen_ppl``, ``unigram_entropy``, ``bleu``, ``rouge``, ``bootstrap_ci``, ``score_samples`` and
``load_judge`` import from :mod:`elflow.evaluation` (ELF_SPEC §6); this module still gives them,
with a ``DeprecationWarning``, and goes in a later version.
"""

import warnings

from elflow.evaluation import (
    bleu,
    bootstrap_ci,
    gen_ppl,
    load_judge,
    rouge,
    score_samples,
    unigram_entropy,
)

warnings.warn(
    "elflow.score is elflow.evaluation under an older name; import from elflow.evaluation "
    "(elflow.score goes in a later version)",
    DeprecationWarning,
    stacklevel=2,
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
