"""Evaluation: generative perplexity, unigram entropy, MAUVE, repetition, BLEU, ROUGE (spec §6).

The Python mirror of `elflow score`: :func:`score_samples` computes everything with a protocol card
(bootstrap intervals, and the spread over seeds for samples of several); the metric functions are
pure and usable alone. Judges (spec §10) load with :func:`load_judge`. Sweeps of sampler
settings: :mod:`elflow.evaluation.sweep`; matched-entropy comparison:
:mod:`elflow.evaluation.compare`. Names load on first use.
"""

from elflow.lazy import lazy_exports

_EXPORTS = {
    "Judge": "elflow.evaluation.judge",
    "load_judge": "elflow.evaluation.judge",
    "BLEUResult": "elflow.evaluation.metrics",
    "PPLResult": "elflow.evaluation.metrics",
    "bleu": "elflow.evaluation.metrics",
    "bleu_cased": "elflow.evaluation.metrics",
    "bootstrap_ci": "elflow.evaluation.metrics",
    "reference_features": "elflow.evaluation.score",
    "gen_ppl": "elflow.evaluation.metrics",
    "rouge": "elflow.evaluation.metrics",
    "unigram_entropy": "elflow.evaluation.metrics",
    "PROTOCOLS": "elflow.evaluation.protocol",
    "score_samples": "elflow.evaluation.score",
    "read_jsonl": "elflow.jsonl",
}
__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
