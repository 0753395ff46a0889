"""References for BLEU and ROUGE: reading them (``refs=``), aligning them with samples (spec §6).

References align by ``id`` when every sample and reference has one, by order when none has; a
conditional sample of ``elflow sample`` matches on its ``source_id``, or, when its sources had no
ids, takes the reference on its source's line.
"""

from __future__ import annotations

from typing import Any

from elflow.errors import ELFError
from elflow.io.jsonl import read_jsonl


def align_refs(samples: list[dict[str, Any]], refs: list[dict[str, Any]]) -> list[str]:
    """Reference texts in sample order: by id when every row on both sides has one, else order.

    A conditional sample's own `id` is its row number; the id of the source line it came from is
    `source_id` (written by `elflow sample`), which is what references are matched on. Without
    source ids, a conditional record of `elflow sample` (with `source` and its settings) takes the
    reference on its row's line.
    """
    key = "source_id" if samples and all("source_id" in s for s in samples) else "id"
    written = ("source", "sampler", "nfe")  # a conditional record of `elflow sample`
    positional = key == "id" and samples and all(all(k in s for k in written) for s in samples)
    if positional and all(isinstance(s.get("id"), int) for s in samples):
        # elflow sample's conditional records whose sources had no ids: `id` is the source's
        # line number, so the reference is the same line of --refs (whatever ids it carries).
        bad = [s["id"] for s in samples if not 0 <= s["id"] < len(refs)]
        if bad:
            raise ELFError(
                f"sample id {bad[0]} (its source's line) is past the {len(refs)} references; "
                "give the references of the sources file, line for line"
            )
        return [refs[s["id"]]["text"] for s in samples]
    for rows, k, what in ((samples, key, "sample"), (refs, "id", "reference")):
        have = [k in r for r in rows]
        if any(have) and not all(have):  # order alignment would then be silently wrong
            raise ELFError(
                f"{what} {have.index(False)} has no {k!r} while others do; give every {what} "
                "one, or none (then samples and references align by order)"
            )
    if all(key in r for r in samples) and all("id" in r for r in refs):
        by_id: dict[Any, str] = {}
        for r in refs:
            if r["id"] in by_id:
                raise ELFError(f"reference id {r['id']!r} appears twice; ids must be unique")
            by_id[r["id"]] = r["text"]
        missing = [s[key] for s in samples if s[key] not in by_id]
        if missing:
            raise ELFError(
                f"{len(missing)} sample ids have no reference (first: {missing[0]!r}); "
                "check that the references (refs=) match the samples"
            )
        return [by_id[s[key]] for s in samples]
    if len(samples) != len(refs):
        raise ELFError(
            f"{len(samples)} samples but {len(refs)} references; without ids on both sides they "
            "align by order and must have the same length"
        )
    return [r["text"] for r in refs]


def read_refs(path: str, field: str) -> list[dict]:
    """The rows of references file ``path`` with the reference (in ``field``) as their ``text``."""
    rows = read_jsonl(path, field, field_flag="ref_field=")
    if not rows:
        raise ELFError(f"refs={path} holds no references")
    return [{**r, "text": r[field]} for r in rows]
