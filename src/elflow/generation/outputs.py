"""What generation returns: :class:`Generation` (free samples) and :class:`Infilled` (filled
templates), each with its tokens and, when asked for, every step's texts (an elflow addition)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor


def _joined_frames(parts: Sequence[Generation | Infilled]) -> list[list[str]] | None:
    """Batches' per-step texts as one run's: frame k holds every batch's texts of step k."""
    if any(p.trajectory is None for p in parts):
        return None
    steps = len(parts[0].trajectory)
    return [[t for p in parts for t in p.trajectory[k]] for k in range(steps)]


@dataclass
class Generation:
    """Generated texts (``pipe(n)``, ``pipe.generate_full``)."""

    texts: list[str]
    """One decoded text per sample."""
    tokens: Tensor
    """(n, L_out) generated token ids (source removed for conditional models)."""
    trajectory: list[list[str]] | None = None
    """trajectory[k][i]: sample i's decoded x_hat after step k (when asked for)."""

    @classmethod
    def joined(cls, parts: Sequence[Generation | Infilled]) -> Generation:
        """Batches of one run as one result, in order."""
        texts = [t for p in parts for t in p.texts]
        return cls(texts, torch.cat([p.tokens for p in parts]), _joined_frames(parts))


@dataclass
class Infilled:
    """Filled texts and what to check them by (``pipe.infill``)."""

    texts: list[str]
    """The whole texts (a conditional model's target only)."""
    fills: list[list[str]]
    """Each sample's filled gaps, in order."""
    kept: list[list[str]]
    """Each sample's kept text runs."""
    survived: list[bool]
    """Whether every kept run is in the text, whole and in order
    (:func:`elflow.generation.infill_texts.survives`)."""
    tokens: Tensor
    """(n, L_out) token ids."""
    trajectory: list[list[str]] | None = None
    """trajectory[k][i]: sample i's text after step k (when asked for)."""

    @classmethod
    def joined(cls, parts: Sequence[Infilled]) -> Infilled:
        """Batches of one run as one result, in order."""
        return cls(
            texts=[t for p in parts for t in p.texts],
            fills=[f for p in parts for f in p.fills],
            kept=[k for p in parts for k in p.kept],
            survived=[s for p in parts for s in p.survived],
            tokens=torch.cat([p.tokens for p in parts]),
            trajectory=_joined_frames(parts),
        )
