"""The metrics of ``elflow score``, one :class:`Metric` each: the one place a metric is added.

Each entry says how the metric is computed over any subset of samples (and what its bootstrap
interval resamples), what it needs (a judge, real text for MAUVE, references), which way is
better, its help line, and which columns the sweep tables give it. :func:`score_samples`
(:mod:`elflow.evaluation.scoring`), the sweep tables (:mod:`elflow.evaluation.report_tables`) and
``elflow score``'s ``--metrics`` and summary read :data:`METRICS`, in its order, when they run.
Light: nothing heavy is imported until a metric is computed, so the command line lists them.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import numpy as np

    from elflow.evaluation.sample_stats import SampleStats

NEEDS = ("", "judge", "reference", "refs")
"""What a metric may need: nothing (the texts), the judge, the judge and real text (MAUVE's
features), or references aligned to the samples."""


@dataclass(frozen=True)
class Metric:
    """One metric of ``elflow score`` and how the tables show it."""

    name: str
    """Its key in metrics.json and its column in table.csv."""
    help: str
    """One line for ``elflow score --help`` and the docs."""
    better: str
    """``lower``, ``higher``, or empty (neither: compare with real text)."""
    value: Callable[[SampleStats, np.ndarray, int], float]
    """``value(stats, idx, seed)``: the metric over samples ``idx`` (``seed``: any randomness)."""
    needs: str = ""
    """One of :data:`NEEDS`; without it the metric is left out."""
    resample: Callable[[SampleStats], tuple[np.ndarray, Callable[[np.ndarray], float]]] | None = (
        None
    )
    """(per-item rows, statistic of resampled rows) for the ``<name>_ci`` bootstrap; None: no
    interval."""
    summary: bool = True
    """Printed by ``elflow score``."""
    table: bool = True
    """A column of a sweep's table.csv."""
    table_ci: bool = False
    """Its interval as ``<name>_lo`` / ``<name>_hi`` columns of table.csv."""
    table_seeds: bool = False
    """Its between-seed ``<name>_seed_mean`` / ``<name>_seed_sd`` columns in table.csv."""

    def __post_init__(self) -> None:
        if self.needs not in NEEDS:
            raise ValueError(f"metric {self.name!r}: needs must be one of {NEEDS}")
        if self.better not in ("lower", "higher", ""):
            raise ValueError(f"metric {self.name!r}: better must be lower, higher or empty")

    @property
    def keys(self) -> tuple[str, ...]:
        """Its keys in metrics.json: the value, the interval, the spread over seeds."""
        ci = (f"{self.name}_ci",) * (self.resample is not None)
        return (self.name, *ci, f"{self.name}_seed_mean", f"{self.name}_seed_sd")

    @property
    def line(self) -> str:
        """Its help with which way is better and what it needs."""
        better = f"{self.better} is better" if self.better else "compare with real text"
        needs = {"": "", "judge": "; judge", "reference": "; judge, reference texts"}
        return f"{self.help} ({better}{needs.get(self.needs, '; reference set')})"


def _mean(values: np.ndarray) -> float:
    return float(values.mean()) if len(values) else math.nan


# The judge's metrics (over the non-empty samples' judged rows).


def _gen_ppl(s: SampleStats, idx: np.ndarray, seed: int) -> float:
    from elflow.evaluation.text_metrics import ppl_from_sums

    rows = s.judged(idx)
    return ppl_from_sums(s.ppl.nll[rows], s.ppl.counts[rows], s.aggregate)


def _gen_ppl_pairs(s: SampleStats) -> tuple[np.ndarray, Callable[[np.ndarray], float]]:
    import numpy as np

    from elflow.evaluation.text_metrics import ppl_from_sums

    pairs = np.stack([s.ppl.nll, s.ppl.counts.astype(np.float64)], axis=1)  # (K, 2)
    return pairs, lambda p: ppl_from_sums(p[:, 0], p[:, 1], s.aggregate)


def _mauve(s: SampleStats, idx: np.ndarray, seed: int) -> float:
    from elflow.evaluation.mauve import mauve

    rows = s.judged(idx)
    return mauve(s.features[rows], s.reference, seed=seed).mauve if len(rows) > 1 else math.nan


# Repetition and diversity (judge-free; :mod:`elflow.evaluation.diversity`).


def _distinct(n: int) -> Callable[[SampleStats, np.ndarray, int], float]:
    def value(s: SampleStats, idx: np.ndarray, seed: int) -> float:
        from elflow.evaluation.diversity import distinct_n

        return distinct_n(_texts(s, idx), n)

    return value


def _texts(s: SampleStats, idx: np.ndarray, non_empty: bool = True) -> list[str]:
    texts = s.texts_of(idx)
    return [t for t in texts if t.strip()] if non_empty else texts


def _self_bleu(s: SampleStats, idx: np.ndarray, seed: int) -> float:
    from elflow.evaluation.diversity import self_bleu

    return self_bleu(_texts(s, idx))


def _empty_share(s: SampleStats, idx: np.ndarray, seed: int) -> float:
    from elflow.evaluation.diversity import empty_share

    return empty_share(_texts(s, idx, non_empty=False))


def _duplicate_share(s: SampleStats, idx: np.ndarray, seed: int) -> float:
    from elflow.evaluation.diversity import duplicate_share

    return duplicate_share(_texts(s, idx, non_empty=False))


def _rep4(s: SampleStats, idx: np.ndarray, seed: int) -> float:
    from elflow.evaluation.diversity import repeated_ngrams

    return _mean(repeated_ngrams(_texts(s, idx), 4))


# Against references (:mod:`elflow.evaluation.refs`).


def _bleu_metric(name: str, help: str, lowercase: bool, table: bool) -> Metric:
    def stat(stats: np.ndarray) -> float:
        from elflow.evaluation.text_metrics import bleu_from_stats

        return bleu_from_stats(stats, lowercase=lowercase)

    def value(s: SampleStats, idx: np.ndarray, seed: int) -> float:
        return stat(s.bleu(lowercase).stats[idx])

    resample = lambda s: (s.bleu(lowercase).stats, stat)
    return Metric(name, help, "higher", value, "refs", resample, table=table)


def _rouge(kind: str) -> tuple[Callable, Callable]:
    def value(s: SampleStats, idx: np.ndarray, seed: int) -> float:
        return float(s.rouge()[kind][idx].mean())

    return value, lambda s: (s.rouge()[kind], lambda v: float(v.mean()))


def _rouge_metric(kind: str, what: str, table: bool = False) -> Metric:
    value, resample = _rouge(kind)
    help = f"ROUGE-{what} F-measure x100 (stemmed), mean over examples"
    return Metric(kind, help, "higher", value, "refs", resample, table=table)


METRICS: dict[str, Metric] = {
    m.name: m
    for m in (
        Metric(
            "gen_ppl",
            "generative perplexity of the samples under the judge (its protocol)",
            "lower",
            _gen_ppl,
            "judge",
            _gen_ppl_pairs,
            table_ci=True,
            table_seeds=True,
        ),
        Metric(
            "entropy",
            "mean unigram entropy of each sample's judge tokens, nats (higher: more diverse)",
            "",
            lambda s, idx, seed: _mean(s.entropy[s.judged(idx)]),
            "judge",
            lambda s: (s.entropy, lambda v: float(v.mean())),
            table_ci=True,
            table_seeds=True,
        ),
        Metric(
            "mean_length",
            "mean judge tokens per sample, an empty sample counting 0",
            "",
            # Per sample: a model that writes empties is not "longer".
            lambda s, idx, seed: float(s.ppl.lengths[s.judged(idx)].sum()) / len(idx),
            "judge",
            table=False,
        ),
        Metric(
            "mauve",
            "MAUVE of the samples against the real text in the judge's feature space",
            "higher",
            _mauve,
            "reference",
            table_seeds=True,
        ),
        *(
            Metric(
                f"distinct_{n}",
                f"unique / all {n}-grams over all samples",
                "higher",
                _distinct(n),
                summary=n == 2,  # the summary shows one order
            )
            for n in (1, 2, 3)
        ),
        Metric("rep_4", "share of a sample's 4-grams that repeat, mean", "lower", _rep4),
        Metric(
            "self_bleu",
            "mean BLEU of each sample against the others (high: alike)",
            "lower",
            _self_bleu,
        ),
        Metric("empty_share", "share of empty samples", "lower", _empty_share),
        Metric(
            "duplicate_share",
            "share of non-empty samples repeating an earlier one",
            "lower",
            _duplicate_share,
        ),
        _bleu_metric("bleu", "corpus BLEU, lowercased (sacrebleu; the paper's)", True, True),
        _bleu_metric("bleu_cased", "corpus BLEU, cased (sacrebleu's default)", False, False),
        _rouge_metric("rouge1", "1"),
        _rouge_metric("rouge2", "2"),
        _rouge_metric("rougeL", "L (the paper's)", table=True),
        _rouge_metric("rougeLsum", "Lsum (newlines as sentence breaks)"),
    )
}
"""The metrics by name, in the order metrics.json, the tables and the summary list them (a live
mapping: an entry added here is computed, written, tabled and offered by ``--metrics``)."""
