"""Readers: every format from a real small file, and the bad inputs of issue 3."""

import gzip

import pytest

from elflow.data import DataConfig, iter_examples, resolve_source
from elflow.errors import ELFError
from tests.data.conftest import SHARED_DATA, shared_rows, write_jsonl


def _read(path, **kw):
    cfg = DataConfig(path=str(path), **kw)
    src = resolve_source(cfg, str(path))
    return src, list(iter_examples(src, cfg))


def test_text_lines_gz_and_folder(tmp_path):
    verses = [r["text"] for r in shared_rows("web_bible", 6)]
    (tmp_path / "a.txt").write_text("\n".join(verses[:3]) + "\n\n", encoding="utf-8")
    with gzip.open(tmp_path / "b.txt.gz", "wt", encoding="utf-8") as f:
        f.write("\ufeff" + "\r\n".join(verses[3:]))
    src, ex = _read(tmp_path / "a.txt")
    assert (src.container, src.kind, src.conditional) == ("text", "text", False)
    assert ex == [(None, v) for v in verses[:3]]
    _, ex = _read(tmp_path / "b.txt.gz")
    assert ex == [(None, v) for v in verses[3:]]
    _, ex = _read(tmp_path)  # a folder: all its *.txt(.gz) files, sorted
    assert ex == [(None, v) for v in verses]
    _, ex = _read(tmp_path, doc_per="file")
    assert ex == [(None, "\n".join(verses[:3])), (None, "\r\n".join(verses[3:]))]
    _, ex = _read(tmp_path, max_rows=2)
    assert len(ex) == 2


def test_jsonl_text_field(tmp_path):
    rows = shared_rows("web_bible", 4)
    path = write_jsonl(tmp_path / "bible.jsonl.gz", rows, gz=True)
    src, ex = _read(path)
    assert (src.container, src.kind) == ("jsonl", "text")
    assert ex == [(None, r["text"]) for r in rows]
    _, ex = _read(path, text_field="book")
    assert ex[0] == (None, rows[0]["book"])


def test_jsonl_pairs(tmp_path):
    rows = shared_rows("ddtp_de_en", 5)
    path = write_jsonl(tmp_path / "de_en.jsonl", rows)
    src, ex = _read(path, source_field="de", target_field="en")
    assert (src.kind, src.conditional) == ("pairs", True)
    assert ex == [(r["de"], r["en"]) for r in rows]


def test_real_shared_file_directly():
    path = SHARED_DATA / "ddtp_summ" / "valid.jsonl.gz"
    if not path.is_file():
        pytest.skip(f"offline data set {path} is absent")
    src, ex = _read(path, source_field="document", target_field="summary", max_rows=3)
    assert src.conditional and len(ex) == 3 and all(isinstance(s, str) for s, _ in ex)


def test_pretokenized_jsonl(tmp_path):
    recs = [{"input_ids": [101, 7, 102], "condition_input_ids": [101, 9, 9, 102]}] * 2
    src, ex = _read(write_jsonl(tmp_path / "p.jsonl", recs))
    assert (src.kind, src.conditional) == ("pretokenized", True)
    assert ex == [([101, 9, 9, 102], [101, 7, 102])] * 2
    src, ex = _read(write_jsonl(tmp_path / "u.jsonl", [{"input_ids": [1, 2]}]))
    assert not src.conditional and ex == [(None, [1, 2])]
    # The first record sets the kind; a later one of the other kind is an error, not dropped.
    mixed = [{"input_ids": [1, 2]}, {"input_ids": [3], "condition_input_ids": [4]}]
    with pytest.raises(ELFError, match=r"m\.jsonl:2: has condition_input_ids but the first"):
        _read(write_jsonl(tmp_path / "m.jsonl", mixed))
    with pytest.raises(ELFError, match=r"r\.jsonl:2: has no condition_input_ids but the first"):
        _read(write_jsonl(tmp_path / "r.jsonl", mixed[::-1]))


def test_folders_skip_hidden_and_prepared_subfolders(tmp_path):
    (tmp_path / "a.txt").write_text("alpha\nbeta\n")
    (tmp_path / ".ipynb_checkpoints").mkdir()
    (tmp_path / ".ipynb_checkpoints" / "a-checkpoint.txt").write_text("alpha\nbeta\n")
    (tmp_path / ".hidden.txt").write_text("gamma\n")
    (tmp_path / "prep").mkdir()  # elflow prepare's output inside the data folder
    (tmp_path / "prep" / "meta.json").write_text('{"elflow_prepared": 1}')
    (tmp_path / "prep" / "notes.txt").write_text("delta\n")
    _, ex = _read(tmp_path)
    assert ex == [(None, "alpha"), (None, "beta")]
    (tmp_path / "meta.json").write_text("{bad")  # someone else's meta.json: not a prepared folder
    _, ex = _read(tmp_path, format="text")
    assert ex == [(None, "alpha"), (None, "beta")]


def test_hf_dataset_folder(tmp_path):
    datasets = pytest.importorskip("datasets")
    rows = shared_rows("ddtp_de_en", 4)
    dd = datasets.DatasetDict(
        train=datasets.Dataset.from_list(rows), validation=datasets.Dataset.from_list(rows[:1])
    )
    dd.save_to_disk(str(tmp_path / "dd"))
    src, ex = _read(tmp_path / "dd", source_field="de", target_field="en")
    assert (src.container, src.kind) == ("hf", "pairs")
    assert ex == [(r["de"], r["en"]) for r in rows]
    _, ex = _read(tmp_path / "dd", source_field="de", target_field="en", hf_split="validation")
    assert len(ex) == 1
    datasets.Dataset.from_list([{"input_ids": [5, 6]}]).save_to_disk(str(tmp_path / "pt"))
    src, ex = _read(tmp_path / "pt")
    assert src.kind == "pretokenized" and ex == [(None, [5, 6])]
    with pytest.raises(ELFError, match=r"no split 'test'.*data.hf_split .data.hf_valid_split"):
        _read(tmp_path / "dd", hf_split="test", source_field="de", target_field="en")


def test_hf_hub_name_offline_is_one_line(monkeypatch):
    pytest.importorskip("datasets")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    with pytest.raises(ELFError, match="cannot load Hugging Face dataset 'nobody/nothing'") as e:
        _read("nobody/nothing")
    assert "\n" not in str(e.value)


# --- bad inputs ----------------------------------------------------------------------------------


def _one_line_error(match, path, **kw):
    with pytest.raises(ELFError, match=match) as e:
        _read(path, **kw)
    assert "\n" not in str(e.value)
    return str(e.value)


def test_missing_and_empty(tmp_path):
    _one_line_error("does not exist", tmp_path / "nope.txt")
    (tmp_path / "empty.txt").write_text("")
    _one_line_error("is empty", tmp_path / "empty.txt")
    (tmp_path / "blank.txt").write_text("\n  \n")
    _one_line_error("no documents", tmp_path / "blank.txt")
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "notes.csv").write_text("a,b\n")
    _one_line_error("has no text", tmp_path / "d")
    _one_line_error("no data path", "")


def test_malformed_json_names_file_and_line(tmp_path):
    path = tmp_path / "x.jsonl"
    path.write_text('{"text": "a"}\n\n{"text": "b"\n')
    msg = _one_line_error("malformed JSON", path)
    assert f"{path}:3:" in msg


def test_plain_text_under_a_named_jsonl_format_says_which_setting(tmp_path):
    """A preset that names its format meets a user's .txt file: one line naming data.format."""
    from elflow.config.run_presets import preset

    path = tmp_path / "mine.txt"
    path.write_text("in the beginning\nthere was text\n")
    for fmt in ("jsonl", "pairs"):
        with pytest.raises(ELFError, match=r"data.format is '\w+' .* is plain text; set data.fo"):
            _read(path, format=fmt)
    (tmp_path / "records.txt").write_text('{"text": "a"}\n')  # JSON lines in a .txt: as named
    assert _read(tmp_path / "records.txt", format="jsonl")[1] == [(None, "a")]
    # bible-tiny detects the format, so a user's plain text works with --set data.path alone.
    data = preset("bible-tiny").data
    src = resolve_source(DataConfig(**{**data.__dict__, "path": str(path)}), str(path))
    assert (src.container, src.kind) == ("text", "text")
    # Under auto, an unknown suffix holding JSON objects is JSONL, not raw text.
    (tmp_path / "records.ndjson").write_text('{"text": "a"}\n{"text": "b"}\n')
    src, ex = _read(tmp_path / "records.ndjson")
    assert src.container == "jsonl" and ex == [(None, "a"), (None, "b")]


def test_missing_field_lists_keys(tmp_path):
    path = write_jsonl(tmp_path / "x.jsonl", [{"text": "a"}, {"body": "b", "id": 1}])
    msg = _one_line_error("no field 'text'", path)
    assert f"{path}:2:" in msg and "body, id" in msg
    msg = _one_line_error("no 'txt' field", path, text_field="txt")  # auto-detect fails
    path = write_jsonl(tmp_path / "p.jsonl", [{"de": "a", "en": "b"}, {"de": "c"}])
    msg = _one_line_error("no field 'en'", path, source_field="de", target_field="en")
    assert f"{path}:2:" in msg


def test_non_utf8_names_file_and_line(tmp_path):
    path = tmp_path / "latin1.txt"
    path.write_bytes("first line\nsecond\ncaf\u00e9 au lait\n".encode("latin-1"))
    msg = _one_line_error("invalid UTF-8", path)
    assert f"{path}:3:" in msg and "0xe9" in msg
    msg = _one_line_error("invalid UTF-8", path, doc_per="file")
    assert f"{path}:3:" in msg
    gz = tmp_path / "bad.jsonl.gz"
    with gzip.open(gz, "wb") as f:
        f.write(b'{"text": "ok"}\n{"text": "\xff"}\n')
    assert f"{gz}:2:" in _one_line_error("invalid UTF-8", gz)


def test_config_validation():
    with pytest.raises(ELFError, match=r"data\.format"):
        DataConfig(format="csv")
    with pytest.raises(ELFError, match=r"data\.overlong"):
        DataConfig(overlong="drop")
    with pytest.raises(ELFError, match="max_rows"):
        DataConfig(max_rows=-1)


def test_hf_without_datasets_package_says_pip_install(tmp_path, monkeypatch):
    import sys

    (tmp_path / "state.json").write_text("{}")
    monkeypatch.setitem(sys.modules, "datasets", None)  # import datasets -> ImportError
    assert "pip install datasets" in _one_line_error("needs the datasets package", tmp_path)
