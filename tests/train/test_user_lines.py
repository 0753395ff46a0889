"""What a user sees on odd data and re-runs: one line each for NUL bytes, a CSV file, JSON lines
in a .txt file, too few rows for the batch, a re-run with changed settings, a run already at its
end; and a progress bar that moves from the first step."""

from __future__ import annotations

import io
import json

import pytest

from tests.train_helpers import error_lines, run_config, train_cli


def _lines(err: str, what: str) -> list[str]:
    return [x for x in err.replace("\r", "\n").splitlines() if what in x]


def test_a_file_of_nul_bytes_is_refused(tmp_path, assets, capsys):
    data = tmp_path / "blob.txt"
    data.write_bytes(b"\x00" * 4096)
    cfg = run_config(assets, data={"path": str(data), "format": "auto"})
    assert train_cli(tmp_path, tmp_path / "run", cfg) == 2
    assert error_lines(capsys.readouterr().err) == [
        f"elflow: error: {data} holds NUL bytes: a binary (or UTF-16) file, not UTF-8 text; give "
        "text, JSONL or a folder written by elflow prepare"
    ]


def test_csv_and_json_lines_read_as_text_are_named(tmp_path, assets, capsys):
    verses = [json.loads(x)["text"] for x in (assets / "train.jsonl").read_text().splitlines()]
    csv = tmp_path / "data.csv"
    csv.write_text("id,text\n" + "".join(f"{i},{v}\n" for i, v in enumerate(verses)))
    jsonl_txt = tmp_path / "data.txt"
    jsonl_txt.write_text((assets / "train.jsonl").read_text())
    train = {"max_steps": 1, "save_every": 1}
    for data, what in (
        (csv, "is read as plain text, one document a line, its header line and separators"),
        (jsonl_txt, "holds JSON lines but its name says plain text"),
    ):
        cfg = run_config(assets, data={"path": str(data), "format": "auto"}, train=train)
        assert train_cli(tmp_path, tmp_path / f"run-{data.suffix[1:]}", cfg) == 0
        (line,) = _lines(capsys.readouterr().err, "elflow: warning:")
        assert line.startswith(f"elflow: warning: {data} ") and what in line


def test_too_few_rows_for_the_batch_are_named(tmp_path, assets, capsys):
    few = tmp_path / "few.jsonl"
    few.write_text("".join(json.dumps({"text": f"verse {i}"}) + "\n" for i in range(5)))
    cfg = run_config(assets, data={"path": str(few)}, train={"max_steps": 1})
    assert train_cli(tmp_path, tmp_path / "run", cfg) == 0
    (line,) = _lines(capsys.readouterr().err, "elflow train: warning:")
    assert line == (
        "elflow train: warning: only 5 rows for train.global_batch 8: every step sees each row "
        "about 2 times; give more data or lower train.global_batch"
    )


@pytest.mark.e2e
def test_a_rerun_says_what_changed_and_that_nothing_is_left(tmp_path, assets, capsys):
    cfg = run_config(assets, train={"max_steps": 3})
    assert train_cli(tmp_path, tmp_path / "run", cfg) == 0
    capsys.readouterr()
    cfg["optim"]["lr"] = 1e-4
    assert train_cli(tmp_path, tmp_path / "run", cfg) == 0
    err = capsys.readouterr().err
    (changed,) = _lines(err, "settings changed")
    assert changed == (
        f"elflow train: resuming {tmp_path / 'run' / 'checkpoint-3'} with settings changed since "
        "it was saved: optim.lr 0.003 -> 0.0001"
    )
    (done,) = _lines(err, "nothing to train")
    assert "is already at step 3 of 3: nothing to train; raise train.max_steps" in done
    cfg["train"]["max_steps"] = 4
    assert train_cli(tmp_path, tmp_path / "run", cfg) == 0
    assert "train.max_steps 3 -> 4" in _lines(capsys.readouterr().err, "settings changed")[0]
    assert (tmp_path / "run" / "checkpoint-4").is_dir()


def test_the_progress_bar_moves_every_step():
    from tqdm import tqdm

    from elflow.train.reporting import Progress

    out = io.StringIO()
    progress = Progress(tqdm(total=4, file=out, mininterval=0, desc="train"))
    for done in (1, 2):
        progress.tick(done)
        assert progress.bar.n == done
    assert "2/4" in out.getvalue()


@pytest.mark.e2e
def test_train_without_out_writes_to_runs_preset(tmp_path, assets, capsys, monkeypatch):
    from elflow.__main__ import main

    monkeypatch.chdir(tmp_path)
    (tmp_path / "cfg.json").write_text(json.dumps(run_config(assets, train={"max_steps": 1})))
    assert main(["train", "--preset", "bible-tiny", "--config", "cfg.json"]) == 0
    assert "elflow train: writing to runs/bible-tiny" in capsys.readouterr().err
    assert (tmp_path / "runs" / "bible-tiny" / "checkpoint-1").is_dir()
