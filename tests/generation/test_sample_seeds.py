"""``elflow sample --seeds`` and its one-line warning for degenerate sample sets."""

from __future__ import annotations

import pytest

from elflow.__main__ import main
from elflow.generation import records as records_mod
from elflow.generation.records import SampleResult
from tests.builders import read


@pytest.fixture(scope="module")
def model(uncond_model):
    return uncond_model


def test_seeds_write_one_file_of_every_seeds_records(model, tmp_path, capsys):
    out = tmp_path / "s.jsonl"
    argv = ["sample", "--model", str(model), "-n", "2", "--steps", "2", "--device", "cpu"]
    assert main([*argv, "--seeds", "3,5", "--out", str(out)]) == 0
    got = read(out)
    assert [(r["seed"], r["id"]) for r in got] == [(3, 0), (3, 1), (5, 0), (5, 1)]
    assert main([*argv, "--seed", "5", "--out", str(out), "--overwrite"]) == 0
    assert read(out) == got[2:]
    capsys.readouterr()
    assert main([*argv, "--seeds", "3,5", "--trajectory", str(tmp_path / "t.html")]) == 2
    assert "--trajectory shows one run" in capsys.readouterr().err
    assert main([*argv, "--seeds", "3,3"]) == 2
    assert "lists seed 3 twice" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("texts", "expected"),
    [
        (["", " "], "elflow: warning: all 2 samples are empty"),
        (["amen", "amen"], "elflow: warning: all 2 samples are the same text ('amen')"),
        (["amen", "and"], None),
    ],
)
def test_sample_warns_in_one_line_when_all_empty_or_identical(
    model, tmp_path, capsys, monkeypatch, texts, expected
):
    def fake(pipe, scfg, *, n=None, seed=0, **rest):
        return SampleResult([{"id": i, "text": t, "seed": seed} for i, t in enumerate(texts)])

    monkeypatch.setattr(records_mod, "sample_records", fake)
    out = tmp_path / "s.jsonl"
    assert main(["sample", "--model", str(model), "-n", "2", "--out", str(out)]) == 0
    err = [line for line in capsys.readouterr().err.splitlines() if "warning" in line]
    if expected is None:
        assert err == []
    else:
        assert len(err) == 1 and err[0].startswith(expected)
    assert [r["text"] for r in read(out)] == texts  # the file is written all the same
