"""Example data: what ships inside the package, and where the data that does not ship lives.

`web_bible/` holds the World English Bible (public domain; Debian's `sword-text-web` read with
`pysword`, footnotes removed) as gzip JSON lines with `book`, `chapter`, `verse` and `text`:
35,804 train and 729 valid verses, split by book and chapter. The `bible-tiny` preset and the
benchmarks read it from here, wherever the package is installed. The Debian description pair sets
of `de-en-tiny` and `summ-tiny` are not shipped: those presets leave `data.path` empty and the
error says where the project keeps them (:func:`missing_data_hint`).
"""

from __future__ import annotations

from pathlib import Path

from elflow.errors import ELFError

EXAMPLES = Path(__file__).resolve().parent

# (source field, target field) of a pair preset -> (preset, the data set it was tuned on).
DEBIAN_PAIRS = {
    ("de", "en"): ("de-en-tiny", "ddtp_de_en"),
    ("document", "summary"): ("summ-tiny", "ddtp_summ"),
}


def web_bible(split: str = "train") -> str:
    """The packaged World English Bible split (``train`` or ``valid``), as a path string."""
    if split not in ("train", "valid"):
        raise ELFError(f"the World English Bible has splits 'train' and 'valid', not {split!r}")
    return str(EXAMPLES / "web_bible" / f"{split}.jsonl.gz")


def web_bible_texts(split: str = "train") -> list[str]:
    """The verses of a packaged World English Bible split, in file order."""
    from elflow.io.jsonl import read_jsonl

    return [row["text"] for row in read_jsonl(web_bible(split))]


def missing_data_hint(source_field: str, target_field: str) -> str:
    """Where a preset's unshipped example data lives ('' for fields no preset uses)."""
    found = DEBIAN_PAIRS.get((source_field, target_field))
    if found is None:
        return ""
    name, folder = found
    return (
        f'; {name} reads JSONL pairs, one {{"{source_field}": ..., "{target_field}": ...}} '
        f"a line (it was tuned on Debian package descriptions, {folder}, which elflow does "
        "not ship)"
    )
