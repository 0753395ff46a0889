"""Filled rows back to text (an elflow addition): each gap's fill, the kept text runs, the
template with its gaps filled and the user's kept text verbatim, whether the kept text survived
whole; and what a gap may hold (:func:`fill_vocabulary`). :mod:`elflow.generation.infill` lays the
rows out; :mod:`elflow.sampling.infill_maths` samples them."""

from __future__ import annotations

import re
from collections.abc import Sequence

import torch
from torch import Tensor

from elflow.generation.infill import Gap, InfillRequest
from elflow.sampling.infill_maths import FillVocabulary, Template

UNUSED = re.compile(r"\[unused\d+\]")


def fill_vocabulary(tokenizer) -> FillVocabulary:
    """The special tokens (and WordPiece's reserved ``[unusedN]``), and the pieces that continue a
    word (WordPiece ``##x``; SentencePiece pieces without the word-start mark that begin with a
    letter or digit)."""
    V = len(tokenizer)
    special = torch.zeros(V, dtype=torch.bool)
    special[[i for i in tokenizer.all_special_ids if i < V]] = True
    pieces = tokenizer.convert_ids_to_tokens(list(range(V)))
    for i, piece in enumerate(pieces):  # BERT's reserved [unusedN]: never text
        if piece and UNUSED.fullmatch(piece):
            special[i] = True
    sentencepiece = any(p.startswith("\u2581") for p in pieces if p)
    continues = torch.zeros(V, dtype=torch.bool)
    for i, piece in enumerate(pieces):
        if not piece:
            continue
        if sentencepiece:
            continues[i] = not piece.startswith("\u2581") and piece[0].isalnum()
        else:
            continues[i] = piece.startswith("##")
    return FillVocabulary(special, continues & ~special)


def kept_texts(tokenizer, template: Template, row: int) -> list[str]:
    """The kept text runs of a template row (special tokens and the source left out)."""
    keep = template.keep[row].tolist()
    source = [False] * len(keep) if template.source is None else template.source[row].tolist()
    runs, current = [], []
    for i, kept in enumerate(keep):
        if kept and not source[i]:
            current.append(int(template.ids[row, i]))
        elif current:
            runs.append(current)
            current = []
    if current:
        runs.append(current)
    texts = [tokenizer.decode(r, skip_special_tokens=True).strip() for r in runs]
    return [t for t in texts if t]


def survives(text: str, kept: Sequence[str]) -> bool:
    """Whether every kept run appears in ``text`` in order, unchanged and not merged into a
    neighbouring word: no letter or digit right before or after it (punctuation a fill puts
    there, as in "its." or "man,", leaves the kept words whole); whitespace-insensitive."""
    at = 0
    for run in kept:
        words = run.split()
        if not words:
            continue
        body = r"\s+".join(re.escape(w) for w in words)
        found = re.compile(rf"(?<![^\W_]){body}(?![^\W_])").search(text, at)
        if found is None:
            return False
        at = found.end()
    return True


def verbatim_text(request: InfillRequest, fills: Sequence[str], decoded: str) -> str:
    """A template with its gaps filled: the kept text exactly as the user gave it (case,
    punctuation and spacing; a tokenizer's decode would lower-case and respace it), each gap
    its decoded fill. ``decoded`` (the whole row decoded) for requests given as ids, and where
    fills cannot be told apart (adjacent gaps decode as one span)."""
    if request.parts is None:
        return decoded
    gaps = [p for p in request.parts if isinstance(p, Gap)]
    if len(gaps) != len(fills):
        return decoded
    out: list[str] = []
    it = iter(fills)
    for part in request.parts:
        if not isinstance(part, Gap):
            out.append(part[1:] if out and out[-1][-1:].isspace() and part[:1].isspace() else part)
            continue
        fill = next(it)
        if fill:
            out.append(fill)
    return "".join(out).strip()


def fill_texts(tokenizer, template: Template, tokens: Tensor) -> list[list[str]]:
    """Each row's filled gaps as text, in order."""
    out = []
    for b in range(tokens.shape[0]):
        fill = (~template.keep[b]).tolist()
        spans, current = [], []
        for i, is_fill in enumerate(fill):
            if is_fill:
                current.append(int(tokens[b, i]))
            elif current:
                spans.append(current)
                current = []
        if current:
            spans.append(current)
        out.append([tokenizer.decode(s, skip_special_tokens=True).strip() for s in spans])
    return out
