"""What each sample contributes to the metrics of ``elflow score``, computed once (spec §6).

:class:`SampleStats` holds a samples file's texts and the per-sample numbers the metrics of
:data:`elflow.evaluation.metric_table.METRICS` summarise: the judge's per-sample NLL, token
counts, lengths, entropies and MAUVE features, and, against references, sacrebleu's sentence
statistics and ROUGE F-measures. Any subset of samples (one seed's) is then scored again
without running the judge, and the bootstrap resamples these rows.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from elflow.evaluation.text_metrics import BLEUResult, PPLResult, bleu, is_empty, rouge_per_example


class SampleStats:
    """Per-sample inputs of the metrics; ``ppl``, ``entropy``, ``features`` and ``reference`` are
    set by the judge pass, ``ref_texts`` by aligned references."""

    def __init__(self, texts: list[str], ref_texts: list[str] | None = None):
        self.texts = texts
        self.ref_texts = ref_texts
        self.empty = np.array([is_empty(t) for t in texts], dtype=bool)
        self.kept = np.flatnonzero(~self.empty)  # sample index of each judged row
        self.ppl: PPLResult | None = None  # over the kept samples
        self.entropy: np.ndarray | None = None  # (K,) over the kept samples
        self.aggregate = "corpus"
        self.features: np.ndarray | None = None  # (K, D)
        self.reference: np.ndarray | None = None  # (M, D) real text's features
        self._bleu: dict[bool, BLEUResult] = {}
        self._rouge: dict[str, np.ndarray] | None = None

    def has(self, needs: str) -> bool:
        """Whether the metrics that need ``needs`` (``judge``, ``reference``, ``refs`` or
        nothing) can be computed."""
        given = {
            "": True,
            "judge": self.ppl is not None,
            "reference": self.reference is not None,
            "refs": self.ref_texts is not None,
        }
        return given[needs]

    def judged(self, idx: np.ndarray) -> np.ndarray:
        """The judged rows (indices into ``ppl``, ``entropy``, ``features``) of samples ``idx``."""
        return np.flatnonzero(np.isin(self.kept, idx))

    def texts_of(self, idx: np.ndarray) -> list[str]:
        return [self.texts[i] for i in idx]

    def bleu(self, lowercase: bool) -> BLEUResult:
        """Corpus BLEU against the references, with its (N, 10) sentence statistics (cached)."""
        if lowercase not in self._bleu:
            self._bleu[lowercase] = bleu(self.texts, self.ref_texts, lowercase=lowercase)
        return self._bleu[lowercase]

    @property
    def bleu_signatures(self) -> dict[bool, str]:
        """sacrebleu's signature of each BLEU computed so far (lowercased: True)."""
        return {lc: b.signature for lc, b in self._bleu.items()}

    @property
    def rouge_computed(self) -> bool:
        return self._rouge is not None

    def rouge(self) -> dict[str, Any]:
        """(N,) ROUGE F-measures x100 per type (cached)."""
        if self._rouge is None:
            self._rouge = rouge_per_example(self.texts, self.ref_texts)
        return self._rouge
