"""Infilling templates and target lengths: texts with gaps to token rows (an elflow addition).

A template is text with gaps, ``In the beginning [___] the earth.``: ``[___]`` is a fill of the
default length, ``[___5]`` one of 5 tokens, ``[___3-8]`` one of 3 to 8 tokens (drawn per sample,
keyed by (seed, index)). Or explicit tokens and a keep mask. Each becomes a row laid out as the
model's training rows are (its special tokens, its padding): every position but the fill is kept.
A target length is the template ``[___n]`` (:func:`length_template`).
:mod:`elflow.sampling.infill_maths` holds the sampling side, :mod:`elflow.generation.infill_texts`
reads the filled rows back, and :func:`elflow.generation.engine.infill_batch` runs them.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from numbers import Integral

import torch

from elflow.config import length_bounds
from elflow.errors import ELFError
from elflow.sampling import Seeds, seed_of
from elflow.sampling.infill_maths import Template

GAP = re.compile(r"\[___(?:(\d+)(?:-(\d+))?)?\]")
"""A gap in a template: ``[___]``, ``[___N]`` or ``[___A-B]`` (tokens)."""
NEAR_GAP = re.compile(r"\[\s*_{2,}[^\[\]\n]{0,12}\]?")
"""What starts like a gap but is not one (``[___`` without ``]``, ``[__3]``, ``[___ 5]``,
``[___3-]``): refused, so a mistyped gap is never kept as text."""
DEFAULT_FILL = 8
"""Tokens in a ``[___]`` gap without a length."""


@dataclass(frozen=True)
class Gap:
    """A fill of ``lo`` to ``hi`` tokens (drawn per sample)."""

    lo: int
    hi: int


@dataclass
class InfillRequest:
    """One text to fill: ``parts`` (kept text and gaps, in order), or explicit ``ids`` (with the
    tokenizer's special tokens) and ``keep`` (1 = kept); a conditional model's ``source``."""

    parts: list[str | Gap] | None = None
    ids: list[int] | None = None
    keep: list[int] | None = None
    source: str | None = None


MAX_GAP = 10**18 - 1
"""The most tokens a gap may name (18 digits): far over any model's length, and a gap's length
is drawn as a 64-bit integer."""


def _gap_count(digits: str, text: str) -> int:
    """A gap's token count, refused in one line when it has more digits than :data:`MAX_GAP`
    (before ``int``, which would refuse thousands of digits with a ValueError of its own)."""
    significant = digits.lstrip("0")
    if len(significant) > len(str(MAX_GAP)):
        raise ELFError(
            f"a gap of {len(significant)} digits in {_clip(text, 60, 16)!r}: a gap holds at most "
            f"{MAX_GAP} tokens ([___N]), and a model far fewer"
        )
    return int(significant or "0")


def parse_template(text: str, default: int = DEFAULT_FILL) -> list[str | Gap]:
    """``"a [___2-4] b"`` -> ``["a ", Gap(2, 4), " b"]``; one-line errors for bad gaps."""
    parts: list[str | Gap] = []
    at = 0
    for m in GAP.finditer(text):
        parts.append(text[at : m.start()])
        lo = _gap_count(m.group(1), text) if m.group(1) else default
        hi = _gap_count(m.group(2), text) if m.group(2) else lo
        if not 1 <= lo <= hi:
            raise ELFError(f"gap {m.group(0)!r} in {text!r}: give 1 <= A <= B tokens ([___A-B])")
        parts.append(Gap(lo, hi))
        at = m.end()
    parts.append(text[at:])
    for part in parts:
        bad = NEAR_GAP.search(part) if isinstance(part, str) else None
        if bad:
            raise ELFError(
                f"malformed gap {bad.group(0)!r} in {_clip(text, 60, 16)!r}: write [___], [___N] "
                "or [___A-B] (three underscores, then digits)"
            )
    if not any(isinstance(p, Gap) for p in parts):
        raise ELFError(f"template {text!r} has no gap; mark what to fill with [___] or [___N]")
    return [p for p in parts if p != ""]


def length_template(lo: int, hi: int) -> list[str | Gap]:
    """A whole text of ``lo`` to ``hi`` tokens: one gap and nothing kept but the row's layout."""
    return [Gap(lo, hi)]


def placeholder_id(tokenizer) -> int:
    """The id a gap holds before it is filled: the mask token, else the first extra special
    token (T5's ``<extra_id_0>``), else the unknown token."""
    extra = getattr(tokenizer, "additional_special_tokens", None) or []
    extra_ids = tokenizer.convert_tokens_to_ids(extra[:1]) if extra else []
    for candidate in (tokenizer.mask_token_id, *extra_ids):
        if candidate is not None:
            return int(candidate)
    if tokenizer.unk_token_id is None:
        raise ELFError("this tokenizer has no mask, extra or unknown token to hold a gap")
    return int(tokenizer.unk_token_id)


def length_generator(*, seed: int, index: int) -> torch.Generator:
    """The generator of sample ``index``'s gap lengths (independent of its sampling noise)."""
    digest = hashlib.sha256(f"elflow-length:{seed}:{index}".encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") >> 1)


@dataclass(frozen=True)
class _Target:
    """One target before it is laid out: its tokens (each gap's placeholder once), whether each
    is kept, and how many tokens each stands for (a gap: its drawn length; else 1). Its length
    is known, and checked, before anything the size of a gap is made."""

    ids: list[int]
    keep: list[int]
    counts: list[int] | None = None
    """None: one token each (an explicit request)."""

    def __len__(self) -> int:
        return len(self.ids) if self.counts is None else sum(self.counts)

    def expand(self) -> tuple[list[int], list[int]]:
        """(ids, keep) with each gap expanded to its drawn length."""
        if self.counts is None:
            return self.ids, self.keep
        out_ids: list[int] = []
        keep: list[int] = []
        for token, kept, n in zip(self.ids, self.keep, self.counts, strict=True):
            out_ids += [token] * n
            keep += [kept] * n
        return out_ids, keep


def _shown(value) -> str:
    """A value as a JSON file spells it (``true``, ``"x"``), shortened, for a message."""
    try:
        text = json.dumps(value, ensure_ascii=False)
    except (TypeError, ValueError):
        text = repr(value)
    return _clip(text, 30, 6)


def _clip(text: str, head: int, tail: int) -> str:
    """``text`` for a one-line message: whole, or its first ``head`` and last ``tail``
    characters around '...' when it is longer than ``head + tail + 4``."""
    return text if len(text) <= head + tail + 4 else f"{text[:head]}...{text[-tail:]}"


def _listed(values, name: str) -> list:
    """``values`` (a list, tuple, tensor or array) as a list; a one-line error otherwise."""
    if values is None:
        raise ELFError("an explicit infill request needs both 'ids' and 'keep'")
    if hasattr(values, "tolist") and not isinstance(values, str | bytes):
        values = values.tolist()  # a tensor or an array
    if not isinstance(values, list | tuple):
        raise ELFError(f"'{name}' is {_shown(values)}; give a list, one value per token")
    return list(values)


def explicit_tokens(ids, keep) -> tuple[list[int], list[int]]:
    """An explicit request's ``ids`` (integers) and ``keep`` (true/false, or 1/0), checked and
    as lists of ints (keep: 1 = kept); a one-line :class:`ELFError` that names neither the
    request nor the file (callers add where). The vocabulary's bounds are checked later, with
    the tokenizer (:func:`_target`)."""
    ids, keep = _listed(ids, "ids"), _listed(keep, "keep")
    for i, x in enumerate(ids):
        if isinstance(x, bool) or not isinstance(x, Integral):
            raise ELFError(f"'ids'[{i}] is {_shown(x)}, not a token id; give integers")
    for i, k in enumerate(keep):
        if not isinstance(k, bool) and not (isinstance(k, Integral) and k in (0, 1)):
            raise ELFError(f"'keep'[{i}] is {_shown(k)}; give true or false (or 1 or 0)")
    if len(ids) != len(keep):
        raise ELFError(
            f"an explicit infill request needs 'ids' and 'keep' of one length, not "
            f"{len(ids)} and {len(keep)}"
        )
    return [int(x) for x in ids], [int(bool(k)) for k in keep]


def _target(tokenizer, request: InfillRequest, *, hole: int, seed: int, index: int) -> _Target:
    """One target, unexpanded: the template tokenised with ``hole`` at each gap, each hole's
    length drawn (:meth:`_Target.expand` lays it out)."""
    if request.parts is None:
        try:
            ids, keep = explicit_tokens(request.ids, request.keep)
        except ELFError as e:
            raise ELFError(f"infill request {index}: {e}") from None
        V = len(tokenizer)  # the model's decoder head: its size is checked against it on loading
        bad = next((i for i in ids if not 0 <= i < V), None)
        if bad is not None:
            raise ELFError(
                f"infill request {index}: id {bad} is outside the vocabulary (0..{V - 1})"
            )
        return _Target(ids, keep)
    marker = tokenizer.convert_ids_to_tokens(hole)
    text = "".join(f" {marker} " if isinstance(p, Gap) else p for p in request.parts)
    ids = tokenizer(text, add_special_tokens=True)["input_ids"]
    gaps = iter([p for p in request.parts if isinstance(p, Gap)])
    gen = length_generator(seed=seed, index=index)  # this sample's
    keep, counts = [], []
    for token in ids:
        if token != hole:
            keep.append(1)
            counts.append(1)
            continue
        gap = next(gaps, None)
        if gap is None:
            raise ELFError(
                f"infill request {index}: its text holds the placeholder token {marker!r} "
                "itself; mark what to fill with [___] or [___N] only"
            )
        if gap.hi > MAX_GAP:
            raise ELFError(
                f"infill request {index}: a gap of {gap.lo} to {gap.hi} tokens is over "
                f"{MAX_GAP}; shorten its gaps"
            )
        keep.append(0)
        counts.append(int(torch.randint(gap.lo, gap.hi + 1, (1,), generator=gen)))
    return _Target(ids, keep, counts)


def build_template(
    tokenizer,
    requests: Sequence[InfillRequest],
    *,
    length: int,
    pad_id: int,
    eos_id: int,
    indices: Sequence[int] | None = None,
    seed: Seeds = 0,
    max_input_length: int = 0,
) -> Template:
    """The rows of ``requests`` (request b's gap lengths drawn from (its seed, ``indices[b]``),
    default b; ``seed`` one for all or one per request),
    padded to ``length`` as training rows; a conditional model's source (its first
    ``max_input_length`` tokens) comes first and is kept."""
    hole = placeholder_id(tokenizer)
    B = len(requests)
    ids = torch.full((B, length), pad_id, dtype=torch.long)
    keep = torch.ones(B, length, dtype=torch.bool)
    attention = torch.zeros(B, length, dtype=torch.long)
    source = torch.zeros(B, length, dtype=torch.bool) if max_input_length else None
    indices = range(B) if indices is None else indices
    for b, request in enumerate(requests):
        planned = _target(tokenizer, request, hole=hole, seed=seed_of(seed, b), index=indices[b])
        head: list[int] = []
        if source is not None:
            if request.source is None:
                raise ELFError("this model is conditional: give each infill request a 'source'")
            head = tokenizer(request.source, add_special_tokens=True)["input_ids"]
            head = head[:max_input_length]
        elif request.source is not None:
            raise ELFError("this model is unconditional: drop the infill requests' 'source'")
        needed = len(head) + len(planned)  # counted: a gap is expanded only once it fits
        if needed > length:
            raise ELFError(
                f"infill request {indices[b]} needs {needed} tokens, more than the "
                f"model's {length}; shorten its text or its gaps"
            )
        target, kept = planned.expand()
        row = head + target
        n = len(row)
        ids[b, :n] = torch.tensor(row)
        keep[b, len(head) : n] = torch.tensor(kept, dtype=torch.bool)
        # Valid up to and including the first EOS of the target, as training rows are.
        eos = [i for i, t in enumerate(target) if t == eos_id and kept[i]]
        attention[b, : len(head) + (eos[0] + 1 if eos else len(target))] = 1
        if source is not None:
            source[b, : len(head)] = True
    special = torch.zeros(max(len(tokenizer), 1), dtype=torch.bool)
    special[[i for i in tokenizer.all_special_ids if i < len(tokenizer)]] = True
    before = torch.cat([torch.ones(B, 1, dtype=torch.bool), keep[:, :-1]], dim=1)
    word_before = before & ~special[torch.cat([ids[:, :1], ids[:, :-1]], dim=1)]
    after_word = ~keep & word_before
    if source is not None:
        after_word &= ~torch.cat([source[:, :1], source[:, :-1]], dim=1)
    return Template(ids, keep, attention, after_word, source)


def request_from_record(row: dict, field: str = "text") -> InfillRequest:
    """One infill request from a JSONL record: a template in ``field``, or ``ids`` and ``keep``
    (checked: :func:`explicit_tokens`); an optional ``source``. A one-line :class:`ELFError`
    that names neither the record nor the file (callers add where)."""
    source = row.get("source")
    if source is not None and not isinstance(source, str):
        raise ELFError(f"'source' is {_shown(source)}; give a string")
    if "ids" in row or "keep" in row:
        if row.get(field) is not None:
            raise ELFError(f"give a template in '{field}' or 'ids' and 'keep', not both")
        ids, keep = explicit_tokens(row.get("ids"), row.get("keep"))
        return InfillRequest(ids=ids, keep=keep, source=source)
    if isinstance(row.get(field), str):
        return InfillRequest(parts=parse_template(row[field]), source=source)
    raise ELFError(f"give a template in '{field}' (text with [___] gaps) or 'ids' and 'keep'")


def as_requests(items: Sequence[str | InfillRequest | dict]) -> list[InfillRequest]:
    """Templates, :class:`InfillRequest` objects or JSONL-style dicts, as requests."""
    out = []
    for item in items:
        if isinstance(item, str):
            item = InfillRequest(parts=parse_template(item))
        elif isinstance(item, dict):
            try:
                item = request_from_record(item)
            except ELFError as e:
                raise ELFError(f"infill request {len(out)}: {e}") from None
        elif not isinstance(item, InfillRequest):
            kind = type(item).__name__
            raise ELFError(f"an infill request is a template, a dict or an InfillRequest: {kind}")
        out.append(item)
    return out


def words_to_tokens(words: int, tokens_per_word: float = 0.0) -> int:
    """The tokens a text of ``words`` words is given: times the model's tokens per word (1.3
    when it records none), at least one."""
    return max(1, round(words * (tokens_per_word or 1.3)))


def length_requests(
    length_range: str,
    indices: Sequence[int],
    *,
    seed: Seeds,
    histogram: Sequence[int] = (),
    tokens_per_word: float = 0.0,
) -> list[InfillRequest]:
    """One whole-text gap per sample for ``length_range`` (:class:`SamplerConfig`): N or A:B
    tokens; A:Bw words (A to B words times the model's tokens per word, 1.3 when it records
    none); ``data``: a length drawn from the training texts' ``histogram``."""
    out = []
    for k, i in enumerate(indices):
        gen = length_generator(seed=seed_of(seed, k), index=i)
        if length_range == "data":
            weights = torch.tensor([float(c) for c in histogram])
            weights[0] = 0.0  # an empty text has no gap to fill
            n = int(torch.multinomial(weights, 1, generator=gen))
            out.append(InfillRequest(parts=length_template(n, n)))
            continue
        lo, hi, words = length_bounds(length_range)
        if words:
            k = int(torch.randint(lo, hi + 1, (1,), generator=gen))
            lo = hi = words_to_tokens(k, tokens_per_word)
        out.append(InfillRequest(parts=length_template(lo, hi)))
    return out
