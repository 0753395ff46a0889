"""Infilling's maths (an elflow addition): kept tokens held at clean latents, over callables.

A template row has kept positions, whose tokens are known, and fill positions. Kept positions are
a condition exactly as a seq2seq model's source is (ELF_SPEC §5): their latents are held clean at
every step and the sampler moves only the fill. Their contextual latents depend on the fill, which
is unknown: they start as the encoder's latents of the row with a placeholder token at the fill
and, as the training-free boundary correction, are recomputed from the row with the current fill
decoded in (:func:`refresh_denoiser`). Decoding forces the kept tokens and constrains the fill
(:func:`constrained_tokens`): no special tokens, so a fill has exactly its length, and no
word-continuation piece right after a kept word, which would change that word. Everything here
takes callables (``logits(z)``, ``encode(ids, mask, source)``): the generation engine builds them
from a model, and :mod:`elflow.generation.infill` turns texts with gaps into :class:`Template` rows.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

import torch
from torch import Tensor

from elflow.flow import velocity
from elflow.sampling.step_context import Condition, Denoiser

Logits = Callable[[Tensor], Tensor]
"""``logits(z) -> (B, L, V)``: decode-mode logits of latents at t = 1."""
EncodeRows = Callable[[Tensor, Tensor, "Tensor | None"], Tensor]
"""``encode(ids, attention, source) -> (B, L, E)``: normalised latents of token rows (``source``,
a conditional model's source positions, or None)."""


@dataclass
class Template:
    """Rows to fill: their tokens, which positions are kept, and the rows' layout."""

    ids: Tensor
    """(B, L) token ids; fill positions hold a placeholder id."""
    keep: Tensor
    """(B, L) bool: kept positions (their tokens are the output's)."""
    attention: Tensor
    """(B, L) the rows' valid positions, as the model's training rows mark them."""
    after_word: Tensor
    """(B, L) bool: fill positions right after a kept word, where a word-continuation piece
    would glue onto that word."""
    source: Tensor | None = None
    """(B, L) bool: a conditional model's source positions (kept too), or None."""

    def rows(self, select: Tensor) -> Template:
        """The template of the rows ``select`` ((B,) bool)."""
        source = None if self.source is None else self.source[select]
        return replace(
            self,
            ids=self.ids[select],
            keep=self.keep[select],
            attention=self.attention[select],
            after_word=self.after_word[select],
            source=source,
        )


@dataclass
class FillVocabulary:
    """What a fill may not hold."""

    special: Tensor
    """(V,) bool: special tokens (start, end, padding, mask, unknown)."""
    continues: Tensor
    """(V,) bool: pieces that continue the previous word (WordPiece ``##x``, SentencePiece
    pieces without the word-start mark that start with a letter or digit)."""


def constrained_tokens(logits: Tensor, template: Template, vocab: FillVocabulary) -> Tensor:
    """The argmax of ``logits`` (B, L, V) at fill positions, special tokens and (right after a
    kept word) continuation pieces excluded; the template's tokens at kept positions."""
    scores = logits.float().clone()
    fill = ~template.keep
    banned = vocab.special.to(scores.device)
    scores[fill] = scores[fill].masked_fill(banned, float("-inf"))
    glued = template.after_word & fill
    if bool(glued.any()):
        banned = banned | vocab.continues.to(scores.device)
        scores[glued] = scores[glued].masked_fill(banned, float("-inf"))
    return torch.where(template.keep, template.ids, scores.argmax(-1))


def initial_condition(template: Template, encode: EncodeRows) -> Condition:
    """The kept positions' clean latents before any fill is known: the encoder's latents of the
    rows with the placeholder at the fill (a source, when given, is part of the condition;
    classifier-free guidance drops the source only)."""
    latents = encode(template.ids, template.attention, template.source)
    mask = template.keep if template.source is None else template.keep | template.source
    return Condition(latents, mask.long(), guided=template.source)


def refresh_denoiser(
    denoise: Denoiser,
    logits: Logits,
    encode: EncodeRows,
    template: Template,
    vocab: FillVocabulary,
    cond: Condition,
    refresh_from: float,
    t_eps: float,
    project_from: float = 1.0,
) -> Denoiser:
    """Wrap ``denoise`` with the boundary correction: for rows at t >= ``refresh_from`` the kept
    positions' latents become the encoder's latents of the row with the current fill (x_hat
    decoded under the constraints) and are written into ``cond`` (the sampler holds z there);
    rows at t >= ``project_from`` also take those latents as their x_hat (projected sampling).
    One decode and one encoder pass per step that refreshes."""
    keep3 = template.keep[..., None]
    first = min(refresh_from, project_from)

    def denoise_refreshed(z: Tensor, x_prev: Tensor, t: Tensor) -> tuple[Tensor, Tensor]:
        x_hat, v = denoise(z, x_prev, t)
        tb = t.expand(z.shape[0]) if t.dim() == 0 else t
        rows = tb >= first
        if not bool(rows.any()):
            return x_hat, v
        part = template.rows(rows)
        tokens = constrained_tokens(logits(x_hat[rows]), part, vocab)
        latents = encode(tokens, part.attention, part.source).to(x_hat.dtype)
        row_latents = torch.zeros_like(x_hat)
        row_latents[rows] = latents
        refresh = (tb >= refresh_from)[:, None, None] & keep3
        cond.latents = torch.where(refresh, row_latents, cond.latents)
        x_hat = torch.where(refresh, row_latents, x_hat)
        project = (tb >= project_from)[:, None, None] & ~cond.mask.bool()[..., None]
        x_hat = torch.where(project, row_latents, x_hat)
        v = velocity(x_hat, z, t, t_eps).masked_fill(cond.mask.bool()[..., None], 0.0)
        return x_hat, v

    return denoise_refreshed
