"""Evaluation: generative perplexity, unigram entropy, MAUVE, repetition, BLEU, ROUGE (spec §6).

The Python mirror of `elflow score`: :func:`score_samples` computes everything with a protocol card
(bootstrap intervals, and the spread over seeds for samples of several); the metric functions are
pure and usable alone. Judges (spec §10) load with :func:`load_judge`. Sweeps of sampler
settings: :mod:`elflow.evaluation.sweep_plan`; matched-entropy comparison:
:mod:`elflow.evaluation.comparison`. Names load on first use.
"""

from elflow.runtime.lazy_exports import lazy_exports

_EXPORTS = {
    "Judge": "elflow.evaluation.judge",
    "load_judge": "elflow.evaluation.judge",
    "BLEUResult": "elflow.evaluation.text_metrics",
    "PPLResult": "elflow.evaluation.text_metrics",
    "bleu": "elflow.evaluation.text_metrics",
    "bleu_cased": "elflow.evaluation.text_metrics",
    "bootstrap_ci": "elflow.evaluation.text_metrics",
    "reference_features": "elflow.evaluation.scoring",
    "gen_ppl": "elflow.evaluation.text_metrics",
    "rouge": "elflow.evaluation.text_metrics",
    "unigram_entropy": "elflow.evaluation.text_metrics",
    "PROTOCOLS": "elflow.evaluation.judge_protocol",
    "score_samples": "elflow.evaluation.scoring",
    "read_jsonl": "elflow.io.jsonl",
}
__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
