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


def test_partial_files_survive_a_cut_line_and_name_real_damage(tmp_path):
    import json

    from elflow.errors import ELFError
    from elflow.generation.partial import PartialSamples

    out = tmp_path / "out.jsonl"
    first = PartialSamples(out, "key")
    first.write([{"seed": 0, "id": 0, "text": "a"}, {"seed": 0, "id": 1, "text": "b"}])
    first.close()
    (path,) = first.files()
    with path.open("a") as f:
        f.write('{"seed": 0, "id": 2, "te')  # killed mid-line
    again = PartialSamples(out, "key")
    assert [r["id"] for r in again.load()] == [0, 1]
    again.write([{"seed": 0, "id": 2, "text": "c"}])
    again.close()
    lines = path.read_text().splitlines()
    assert [json.loads(line).get("id") for line in lines[1:]] == [0, 1, 2]
    # A damaged line that is not the last: one line naming the file and the line, file kept.
    path.write_text("\n".join([lines[0], lines[1], "{oops", lines[2]]) + "\n")
    with pytest.raises(ELFError, match=r"partial-0 line 3 is not JSON .*delete it to sample") as e:
        PartialSamples(out, "key").load()
    assert "\n" not in str(e.value) and path.exists()
    path.write_text(lines[0] + '\n["not", "a record"]\n')
    with pytest.raises(ELFError, match="line 2 is not a sample record"):
        PartialSamples(out, "key").load()
    path.write_bytes(lines[0].encode() + b"\n\xff\xfe\x00garbage\n")
    with pytest.raises(ELFError, match="is not text: it is damaged"):
        PartialSamples(out, "key").load()
    path.write_text('{"elflow-partial')  # killed while writing its header: nothing in it
    fresh = PartialSamples(out, "key")
    assert fresh.load() == []
    fresh.write([{"seed": 0, "id": 0, "text": "a"}])
    fresh.close()
    assert json.loads(path.read_text().splitlines()[0]) == {"elflow-partial-samples": "key"}
