"""`elflow prepare --workers N`: the same folder whatever N, a killed run resumed without
tokenising its finished shards again, Hugging Face datasets streamed, progress with docs/s."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from elflow.__main__ import main
from elflow.data import DataConfig
from elflow.data.preparation import prepare
from elflow.examples import web_bible_texts
from tests.data.conftest import write_jsonl

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.e2e  # whole `elflow prepare` runs


def _tables(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.glob("*.bin"))}


def _meta(folder: Path) -> dict:
    import json

    return json.loads((folder / "meta.json").read_text())


def test_any_number_of_workers_writes_the_same_folder(tokenizer, tmp_path):
    verses = web_bible_texts("train")[:600]
    (tmp_path / "text.txt").write_text("\n".join(verses) + "\n")
    pairs = [{"source": a, "target": b} for a, b in zip(verses[::2], verses[1::2], strict=True)]
    write_jsonl(tmp_path / "pairs.jsonl", pairs)
    for data in ("text.txt", "pairs.jsonl"):
        cfg = DataConfig(path=str(tmp_path / data), tokenize_batch_size=7)
        made = {}
        for workers in (1, 2):
            out = tmp_path / f"{data}-{workers}"
            prepare(cfg, tokenizer, out, 64, 32 * data.startswith("pairs"), workers=workers,
                    shard_bytes=4096)  # fmt: skip
            made[workers] = _tables(out)
            meta = _meta(out)
            assert meta["workers"] == workers and meta["shards"] > 5
            assert not list(tmp_path.glob(".*"))  # no partial folder left
        assert made[1] == made[2] and made[1]
    # And the same as tokenising in one piece (what the rows of a raw file would be).
    from elflow.data import build_dataset

    rows = build_dataset(DataConfig(path=str(tmp_path / "text.txt")), tokenizer, 64)
    prepared = build_dataset(DataConfig(path=str(tmp_path / "text.txt-2")), tokenizer, 64)
    assert (rows.target.tokens == prepared.target.tokens).all()
    assert (rows.target.offsets == prepared.target.offsets).all()


@pytest.mark.slow  # a preparation subprocess killed, resumed, and a straight one
def test_a_killed_preparation_resumes_without_redoing_finished_shards(tokenizer, tmp_path, capsys):
    verses = web_bible_texts("train")
    (tmp_path / "text.txt").write_text("\n".join(verses) + "\n")  # ~1.6 MB: ~80 shards
    argv = ["prepare", "--data", str(tmp_path / "text.txt"), "--tokenizer", "minilm"]
    argv += ["--max-length", "64", "--workers", "1", "--shard-mb", "0.02"]
    out, partial = tmp_path / "prep", tmp_path / ".prep.partial"
    cmd = [sys.executable, "-m", "elflow", *argv, "--out", str(out)]
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while len(list((partial / "shards").glob("shard-*"))) < 5:  # then kill it mid-run
        assert proc.poll() is None and time.monotonic() < deadline, "finished before the kill"
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    finished = {p.name: p.stat().st_mtime_ns for p in (partial / "shards").glob("shard-*")}
    assert len(finished) >= 5 and not out.exists()
    assert main([*argv, "--out", str(out)]) == 0
    meta = _meta(out)
    assert meta["shards_kept"] >= len(finished) and meta["shards_made"] >= 1
    assert "shards_kept=" in capsys.readouterr().out
    assert not partial.exists()
    # The same bytes as a preparation never killed.
    assert main([*argv, "--out", str(tmp_path / "straight"), "--workers", "2"]) == 0
    assert _tables(out) == _tables(tmp_path / "straight")
    assert _meta(tmp_path / "straight")["shards_kept"] == 0


def test_a_data_error_leaves_nothing_and_other_input_starts_over(tokenizer, tmp_path, capsys):
    path = tmp_path / "data.jsonl"
    path.write_text('{"text": "one"}\n{"text": "two"}\n')
    partial = tmp_path / ".prep.partial"
    (partial / "shards" / "shard-000000").mkdir(parents=True)  # from a run on other input
    (partial / "plan.json").write_text('{"source": "elsewhere"}')
    cfg = DataConfig(path=str(path))
    prepare(cfg, tokenizer, tmp_path / "prep", 16)
    assert _meta(tmp_path / "prep")["shards_kept"] == 0 and not partial.exists()
    assert "starting over" in capsys.readouterr().err
    path.write_text('{"text": "one"}\n{"text": \n')
    import pytest

    from elflow.errors import ELFError

    with pytest.raises(ELFError, match="malformed JSON"):
        prepare(cfg, tokenizer, tmp_path / "other", 16)
    assert not partial.exists() and not (tmp_path / ".other.partial").exists()


def test_hugging_face_datasets_are_streamed(tokenizer, tmp_path):
    """A folder of data files read as a Hugging Face dataset (format hf): through
    ``datasets.load_dataset(..., streaming=True)``, the same rows as the JSONL read directly."""
    folder = tmp_path / "ds"
    folder.mkdir()
    write_jsonl(folder / "train.jsonl", [{"text": v} for v in web_bible_texts("train")[:50]])
    from elflow.data.text_sources import iter_examples, resolve_source

    hf = DataConfig(path=str(folder), format="hf")
    src = resolve_source(hf, hf.path, streaming=True)
    assert src.container == "hf" and src.streaming and src.kind == "text"
    import datasets

    from elflow.data.hf_datasets import load_hf

    assert isinstance(load_hf(str(folder), "train", True), datasets.IterableDataset)
    assert len(list(iter_examples(src, hf))) == 50
    prepare(hf, tokenizer, tmp_path / "a", 32)
    prepare(DataConfig(path=str(folder / "train.jsonl")), tokenizer, tmp_path / "b", 32)
    assert _tables(tmp_path / "a") == _tables(tmp_path / "b")


def test_progress_shows_documents_per_second_and_an_eta(tokenizer, tmp_path, capsys):
    (tmp_path / "text.txt").write_text("\n".join(web_bible_texts("train")[:400]) + "\n")
    argv = ["prepare", "--data", str(tmp_path / "text.txt"), "--tokenizer", "minilm"]
    assert (
        main([*argv, "--max-length", "64", "--out", str(tmp_path / "p"), "--shard-mb", "0.01"]) == 0
    )
    bar = capsys.readouterr().err.replace("\r", "\n").splitlines()
    last = [x for x in bar if x.startswith("prepare:")][-1]
    assert "docs/s" in last and "100%" in last and "<00:00" in last  # elapsed<remaining
