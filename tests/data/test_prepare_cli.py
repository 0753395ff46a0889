"""`elflow prepare` on the command line: what --overwrite may replace, the `minilm` alias, and
errors that name the command's flags rather than the config keys train uses."""

import json

import pytest

from elflow.__main__ import main
from elflow.data import DataConfig, build_dataset
from elflow.errors import ELFError
from elflow.text.tokenizer import load_tokenizer
from tests.data.conftest import write_jsonl


def _prepare(tokenizer, data, out, *extra) -> int:
    argv = ["prepare", "--data", str(data), "--tokenizer", tokenizer.name_or_path]
    return main([*argv, "--max-length", "16", "--out", str(out), *extra])


def _error(capsys) -> str:
    """The one error line (stderr also carries the progress bar)."""
    err = capsys.readouterr().err.replace("\r", "\n").splitlines()
    lines = [x for x in err if "error" in x]
    assert len(lines) == 1 and lines[0].startswith("elflow: error: "), err
    return lines[0]


def test_overwrite_replaces_only_a_prepared_folder(tokenizer, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    work = tmp_path / "mywork"
    work.mkdir()
    (work / "data.txt").write_text("in the beginning\nthe earth was formless\n")
    (work / "notes.md").write_text("my notes\n")
    # The folder holding the input, and the input file itself, are never replaced.
    assert _prepare(tokenizer, "mywork/data.txt", "mywork", "--overwrite") == 2
    msg = _error(capsys)
    assert "holds the input data 'mywork/data.txt'" in msg and "another --out" in msg
    assert _prepare(tokenizer, "mywork/data.txt", "mywork/data.txt", "--overwrite") == 2
    assert "is the input data" in _error(capsys)
    assert sorted(p.name for p in work.iterdir()) == ["data.txt", "notes.md"]
    assert (work / "data.txt").read_text().startswith("in the beginning")
    # Nor is any folder or file that elflow prepare did not write.
    assert _prepare(tokenizer, "mywork/data.txt", "mywork/notes.md", "--overwrite") == 2
    msg = _error(capsys)
    assert "not a folder written by elflow prepare" in msg and "--overwrite" in msg
    assert "overwrite=True" not in msg and "out_dir" not in msg
    assert (work / "notes.md").read_text() == "my notes\n"
    # An earlier prepared folder is replaced.
    assert _prepare(tokenizer, "mywork/data.txt", "prep") == 0
    (work / "more.txt").write_text("one\ntwo\nthree\n")
    assert _prepare(tokenizer, "mywork/more.txt", "prep", "--overwrite") == 0
    assert json.loads((tmp_path / "prep" / "meta.json").read_text())["num_docs"] == 3
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


def test_failed_overwrite_keeps_the_old_folder(tokenizer, tmp_path, capsys):
    assert (
        _prepare(tokenizer, write_jsonl(tmp_path / "a.jsonl", [{"text": "a b"}]), tmp_path / "p")
        == 0
    )
    before = {p.name: p.read_bytes() for p in (tmp_path / "p").iterdir()}
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "fine"}\n{"text": "broken"\n')
    assert _prepare(tokenizer, bad, tmp_path / "p", "--overwrite", "--batch-size", "1") == 2
    assert f"{bad}:2: malformed JSON" in _error(capsys)
    assert {p.name: p.read_bytes() for p in (tmp_path / "p").iterdir()} == before
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


def test_minilm_alias_resolves_offline(tokenizer, tmp_path, capsys):
    assert load_tokenizer("minilm").get_vocab() == tokenizer.get_vocab()
    (tmp_path / "d.txt").write_text("in the beginning\n")
    argv = ["prepare", "--data", str(tmp_path / "d.txt"), "--tokenizer", "minilm"]
    assert main([*argv, "--max-length", "8", "--out", str(tmp_path / "p")]) == 0
    assert "num_docs=1" in capsys.readouterr().out


def test_errors_name_the_flags(tokenizer, tmp_path, capsys):
    (tmp_path / "d.txt").write_text("in the beginning\n")
    assert _prepare(tokenizer, tmp_path / "none.txt", tmp_path / "p") == 2
    assert "--data" in (msg := _error(capsys)) and "data.path" not in msg
    assert _prepare(tokenizer, tmp_path / "d.txt", tmp_path / "p", "--batch-size", "0") == 2
    assert "--batch-size must be positive, got 0" in _error(capsys)
    assert _prepare(tokenizer, tmp_path / "d.txt", tmp_path / "p") == 0
    capsys.readouterr()
    assert _prepare(tokenizer, tmp_path / "d.txt", tmp_path / "p") == 2
    assert "choose another --out, or pass --overwrite" in _error(capsys)
    for extra in (["--max-length", "0"], ["--max-length", "16", "--workers", "99999"]):
        data = ["--data", str(tmp_path / "d.txt")]  # a tokenizer that does not exist: not read
        argv = ["prepare", "--tokenizer", "/nonexistent", *data, *extra, "--out", "p2"]
        assert main(argv) == 2
        assert f"{extra[-2]} must be" in _error(capsys)
    (tmp_path / "f").write_text("x")  # --out under a file: refused before anything loads
    assert _prepare(tokenizer, tmp_path / "d.txt", tmp_path / "f" / "p") == 2
    assert f"--out {tmp_path / 'f' / 'p'}: {tmp_path / 'f'} is a file, not a folder" in _error(
        capsys
    )
    recs = [{"document": "a", "summary": "b"}]
    pairs = write_jsonl(tmp_path / "pairs.jsonl", recs)
    assert _prepare(tokenizer, pairs, tmp_path / "q") == 2
    msg = _error(capsys)
    assert "set --text-field or --source-field and --target-field" in msg
    # Train's messages keep naming its config keys, validation data included.
    with pytest.raises(ELFError, match=r"data\.path '.*none\.txt' does not exist"):
        build_dataset(DataConfig(path=str(tmp_path / "none.txt")), tokenizer, 8)
    cfg = DataConfig(path=str(tmp_path / "d.txt"), valid_path=str(tmp_path / "none.txt"))
    with pytest.raises(ELFError, match=r"data\.valid_path '.*none\.txt' does not exist"):
        build_dataset(cfg, tokenizer, 8, split="valid")
    # A key is translated only where it stands alone, not inside a path or a quoted value.
    from elflow.cli.flags import flag_names

    assert flag_names("'/x/data.path' and data.path.gz: set data.path", "prepare") == (
        "'/x/data.path' and data.path.gz: set --data"
    )
    assert flag_names("max_length:1: bad; set data.path", "prepare", keep=("max_length",)) == (
        "max_length:1: bad; set --data"
    )
    assert flag_names("set model.max_length (and max_input_length) to at most 512", "prepare") == (
        "set --max-length (and --max-input-length) to at most 512"  # the encoder's limit
    )
    # A short user value (--out data, --data a) does not stop a setting around it being named,
    # nor does a path that spells the setting itself.
    assert flag_names("data.path 'x' and out_dir", "prepare", keep=("data", "out", "a")) == (
        "--data 'x' and --out"
    )
    message = "data file 'data.path' is empty; point data.path at a file with text"
    assert flag_names(message, "prepare", keep=("data.path",)) == (
        "data file 'data.path' is empty; point --data at a file with text"
    )


def test_a_data_file_named_like_a_key_keeps_its_name(tokenizer, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "data.path").write_text("not json\n")
    argv = ["prepare", "--data", "data.path", "--format", "jsonl", "--tokenizer"]
    assert main([*argv, tokenizer.name_or_path, "--max-length", "8", "--out", "p"]) == 2
    assert "data.path:1: malformed JSON" in _error(capsys)


def test_tokenizer_of_an_elflow_model_folder(tokenizer, tmp_path, capsys):
    from elflow.io.model_sources import DEMO_MODEL as DEMO_DIR
    from tests.builders import make_uncond

    assert load_tokenizer(str(DEMO_DIR)).get_vocab() == tokenizer.get_vocab()  # its tokenizer/
    model = make_uncond(tmp_path / "model")  # no tokenizer/: the one its config names (minilm)
    assert not (model / "tokenizer").exists()
    assert load_tokenizer(model).get_vocab() == tokenizer.get_vocab()
    # A folder with neither tokenizer files nor a model (an encoder saved without its
    # tokenizer) would load as an empty tokenizer and turn every word into [UNK]: refused.
    (tmp_path / "encoder").mkdir()
    (tmp_path / "encoder" / "config.json").write_text('{"model_type": "bert"}')
    (tmp_path / "d.txt").write_text("in the beginning\n")
    argv = ["prepare", "--data", str(tmp_path / "d.txt"), "--max-length", "8"]
    assert (
        main([*argv, "--tokenizer", str(tmp_path / "encoder"), "--out", str(tmp_path / "p")]) == 2
    )
    assert "holds no tokenizer files" in _error(capsys) and not (tmp_path / "p").exists()


def test_ctrl_c_exits_130_with_one_line_saying_how_to_go_on(
    tokenizer, tmp_path, capsys, monkeypatch
):
    from elflow.data import preparation

    data = write_jsonl(tmp_path / "a.jsonl", [{"text": "in the beginning"}, {"text": "and so"}])
    real = preparation.tokenize_to_folder

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(preparation, "tokenize_to_folder", interrupted)
    capsys.readouterr()
    assert _prepare(tokenizer, data, tmp_path / "p") == 130  # as the other commands exit
    err = capsys.readouterr().err.replace("\r", "\n").splitlines()
    assert [x for x in err if x.startswith("elflow")] == [
        f"elflow prepare: interrupted; the finished shards are kept in {tmp_path / '.p.partial'}: "
        "run the same command to go on from them"
    ]
    assert not (tmp_path / "p").exists() and (tmp_path / ".p.partial").is_dir()
    monkeypatch.setattr(preparation, "tokenize_to_folder", real)
    assert _prepare(tokenizer, data, tmp_path / "p") == 0  # the same command goes on
    assert json.loads((tmp_path / "p" / "meta.json").read_text())["num_docs"] == 2
    # Ctrl-C before the preparation starts (the tokenizer loading): 130 too.
    monkeypatch.setattr("elflow.text.tokenizer.load_tokenizer", interrupted)
    assert _prepare(tokenizer, data, tmp_path / "q") == 130
    assert "elflow: interrupted" in capsys.readouterr().err
