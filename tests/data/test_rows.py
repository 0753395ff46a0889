"""Rows (spec §4): packing, one document per row, conditional rows and masks, truncation, and the
prepared (memory-mapped) folder reproducing the in-memory path."""

import argparse
import dataclasses
import json
from typing import ClassVar

import numpy as np
import pytest

from elflow.data import DataConfig, RowDataset, TokenTable, build_dataset
from elflow.data.preparation import prepare, prepared_latent_std
from elflow.data.rows import read_meta
from elflow.errors import ELFError
from elflow.text.tokens import build_conditional_row, build_unconditional_row, token_spec, tokenize
from tests.data.conftest import shared_rows, write_jsonl


def _table(docs):
    lengths = np.array([0] + [len(d) for d in docs])
    flat = np.array([t for d in docs for t in d], dtype=np.uint16)
    return TokenTable(flat, np.cumsum(lengths))


def test_one_document_per_row_padding_and_masks(tokenizer, tmp_path):
    verses = [r["text"] for r in shared_rows("web_bible", 20)]
    path = write_jsonl(tmp_path / "b.jsonl", [{"text": v} for v in verses])
    spec = token_spec(tokenizer)
    ds = build_dataset(DataConfig(path=str(path)), tokenizer, max_length=32)
    assert len(ds) == 20 and not ds.conditional
    # A conditional run on plain text would train a "conditional" model that never saw a source.
    with pytest.raises(ELFError, match=r"data\.path .* holds plain text .* task is conditional"):
        build_dataset(DataConfig(path=str(path)), tokenizer, 32, 8, conditional=True)
    rows = ds.get_rows(np.arange(20))
    assert all(v.dtype == np.int64 and v.shape == (20, 32) for v in rows.values())
    docs = tokenize(tokenizer, verses)
    for i, doc in enumerate(docs):
        ids, mask = build_unconditional_row(doc, 32, spec.pad_id)
        assert rows["input_ids"][i].tolist() == ids
        assert rows["attention_mask"][i].tolist() == mask
    assert not rows["cond_mask"].any()
    assert ds.num_truncated == sum(len(d) > 32 for d in docs) > 0
    # A different pad id (the seq2seq convention pads with EOS) only changes the padding.
    eos_pad = build_dataset(DataConfig(path=str(path)), tokenizer, 32, pad_id=spec.eos_id)
    other = eos_pad.get_rows(np.arange(20))
    pad = rows["attention_mask"] == 0
    assert (other["input_ids"][pad] == spec.eos_id).all()
    assert (other["input_ids"][~pad] == rows["input_ids"][~pad]).all()


def test_packing_exact_rows_with_eos_separators(tokenizer, tmp_path):
    verses = [r["text"] for r in shared_rows("web_bible", 30)]
    (tmp_path / "b.txt").write_text("\n".join(verses), encoding="utf-8")
    eos = token_spec(tokenizer).eos_id
    ds = build_dataset(DataConfig(path=str(tmp_path / "b.txt"), packing=True), tokenizer, 16)
    stream = [t for d in tokenize(tokenizer, verses) for t in d]
    assert len(ds) == len(stream) // 16 and ds.num_truncated == 0  # the partial tail is dropped
    rows = ds.get_rows(np.arange(len(ds)))
    assert rows["input_ids"].shape == (len(ds), 16)
    assert rows["input_ids"].reshape(-1).tolist() == stream[: len(ds) * 16]
    assert rows["attention_mask"].all() and not rows["cond_mask"].any()
    assert stream.count(eos) == 30  # one EOS ends every document in the stream


def test_packing_appends_missing_eos():
    # Pre-tokenised documents without a trailing EOS still get one separator each when packed.
    table = _table([[5, 6, 2], [7, 8]])
    ds = RowDataset(table, max_length=2, pad_id=0, packing=True)
    assert ds.get_rows(np.arange(len(ds)))["input_ids"].reshape(-1).tolist() == [5, 6, 2, 7]


def test_conditional_rows_match_build_conditional_row(tokenizer, tmp_path):
    pairs = shared_rows("ddtp_de_en", 40)
    path = write_jsonl(tmp_path / "p.jsonl.gz", pairs, gz=True)
    cfg = DataConfig(path=str(path), source_field="de", target_field="en")
    eos = token_spec(tokenizer).eos_id
    ds = build_dataset(cfg, tokenizer, max_length=24, max_input_length=12, pad_id=eos)
    assert ds.conditional and len(ds) == 40
    with pytest.raises(ELFError, match=r"holds source/target pairs .* task is unconditional"):
        build_dataset(cfg, tokenizer, 24, 12, eos, conditional=False)
    rows = ds.get_rows(np.arange(40))
    src = tokenize(tokenizer, [p["de"] for p in pairs])
    tgt = tokenize(tokenizer, [p["en"] for p in pairs])
    truncated = 0
    for i in range(40):
        ids, attn, cond = build_conditional_row(src[i], tgt[i], 12, 24, eos)
        assert rows["input_ids"][i].tolist() == ids
        assert rows["attention_mask"][i].tolist() == attn
        assert rows["cond_mask"][i].tolist() == cond
        truncated += len(src[i]) > 12 or min(len(src[i]), 12) + len(tgt[i]) > 24
    assert ds.num_truncated == truncated > 0
    with pytest.raises(ELFError, match="max_input_length"):
        build_dataset(cfg, tokenizer, max_length=24)
    with pytest.raises(ELFError, match="packing applies to unconditional"):
        build_dataset(
            DataConfig(path=str(path), source_field="de", target_field="en", packing=True),
            tokenizer,
            24,
            12,
        )


def test_overlong_error_names_document(tokenizer, tmp_path):
    path = tmp_path / "t.txt"
    path.write_text("short\n" + "a much longer line with many words in it\n")
    ds = build_dataset(DataConfig(path=str(path)), tokenizer, 5)
    assert ds.num_truncated == 1
    with pytest.raises(ELFError, match=r"document 1 has 11 tokens, more than max_length 5"):
        build_dataset(DataConfig(path=str(path), overlong="error"), tokenizer, 5)
    table = _table([[1, 2, 3], [4, 5, 6, 7]])
    with pytest.raises(ELFError, match="document 0 has source 3"):
        RowDataset(
            table, source=table, max_length=6, max_input_length=2, pad_id=0, overlong="error"
        )


def test_pre_chunked_ids_of_exactly_max_length_fit(tokenizer, tmp_path):
    """The EOS appended to pre-tokenised ids that lack one is a separator: dropping it loses no
    text, so a pre-chunked record of exactly max_length ids is not over-long (raw or prepared)."""
    eos = token_spec(tokenizer).eos_id
    recs = [
        {"input_ids": list(range(1000, 1006))},  # exactly L, no EOS: an EOS is appended
        {"input_ids": [*range(1000, 1006), eos]},  # L + its own EOS
        {"input_ids": list(range(1000, 1004))},  # short
    ]
    path = write_jsonl(tmp_path / "c.jsonl", recs)
    cfg = DataConfig(path=str(path), overlong="error")
    memory = build_dataset(cfg, tokenizer, 6)
    prepared = prepare(cfg, tokenizer, tmp_path / "prep", 6)
    assert read_meta(prepared)["num_truncated"] == 0
    mapped = build_dataset(DataConfig(path=str(prepared), overlong="error"), tokenizer, 6)
    for ds in (memory, mapped):
        assert ds.num_truncated == 0
        ids = ds.get_rows(np.arange(3))["input_ids"]
        assert ids[0].tolist() == ids[1].tolist() == list(range(1000, 1006))
    # One more id is real text lost, whether or not an EOS follows it.
    longer = [{"input_ids": list(range(1000, 1007))}, {"input_ids": [*range(1000, 1007), eos]}]
    path = write_jsonl(tmp_path / "d.jsonl", longer)
    assert build_dataset(DataConfig(path=str(path)), tokenizer, 6).num_truncated == 2
    with pytest.raises(ELFError, match="document 0 has 8 tokens, more than max_length 6"):
        build_dataset(DataConfig(path=str(path), overlong="error"), tokenizer, 6)


@pytest.mark.parametrize("kind", ["text", "pairs", "packed", "pretokenized"])
def test_prepare_round_trip_equals_in_memory(tokenizer, tmp_path, kind):
    if kind == "pairs":
        recs = shared_rows("ddtp_summ", 30)
        kw = dict(source_field="document", target_field="summary")
        lengths = dict(max_length=40, max_input_length=32)
    elif kind == "pretokenized":
        recs = [
            {"input_ids": [101, i, 102], "condition_input_ids": [101, 7, i, 102]}
            for i in range(1000, 1030)
        ]
        kw, lengths = {}, dict(max_length=6, max_input_length=3)
    else:
        recs = shared_rows("web_bible", 30)
        kw = dict(packing=kind == "packed")
        lengths = dict(max_length=24)
    path = write_jsonl(tmp_path / "d.jsonl", recs)
    cfg = DataConfig(path=str(path), tokenize_batch_size=7, **kw)  # several append batches
    memory = build_dataset(cfg, tokenizer, **lengths)
    out = prepare(cfg, tokenizer, tmp_path / "prep", **lengths)
    assert not any(p.name.startswith(".") for p in tmp_path.iterdir())  # temp folder renamed
    meta = read_meta(out)
    assert meta["dtype"] == "uint16" and meta["conditional"] == memory.conditional
    assert meta["num_docs"] == memory.num_docs and meta["num_truncated"] == memory.num_truncated
    mapped = build_dataset(DataConfig(path=str(out), **kw), tokenizer, **lengths)
    assert isinstance(mapped.target.tokens, np.memmap)
    assert len(mapped) == len(memory) and mapped.num_truncated == memory.num_truncated
    idx = np.arange(len(memory))[::-1]
    a, b = memory.get_rows(idx), mapped.get_rows(idx)
    for key in a:
        assert np.array_equal(a[key], b[key]), key
    with pytest.raises(ELFError, match="already exists"):
        prepare(cfg, tokenizer, out, **lengths)
    # data.max_rows reads the first documents of a prepared folder as of raw data.
    few = dict(kw, tokenize_batch_size=7, max_rows=5)
    head = build_dataset(DataConfig(path=str(path), **few), tokenizer, **lengths)
    mapped = build_dataset(DataConfig(path=str(out), **few), tokenizer, **lengths)
    assert mapped.num_docs == head.num_docs == 5 and len(mapped) == len(head)
    a, b = head.get_rows(np.arange(len(head))), mapped.get_rows(np.arange(len(head)))
    assert all(np.array_equal(a[key], b[key]) for key in a)
    # A preset names its raw format (data.format=jsonl); the prepared folder is still one.
    named = build_dataset(DataConfig(path=str(out), format="jsonl", **kw), tokenizer, **lengths)
    assert isinstance(named.target.tokens, np.memmap)


def test_damaged_prepared_folder_is_one_line(tokenizer, tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", shared_rows("web_bible", 10))
    out = prepare(DataConfig(path=str(path)), tokenizer, tmp_path / "prep", max_length=16)
    tokens = out / "tokens.bin"
    tokens.write_bytes(tokens.read_bytes()[:4])
    with pytest.raises(ELFError, match=r"is damaged \(tokens.bin has 4 bytes.*re-run elflow"):
        build_dataset(DataConfig(path=str(out)), tokenizer, 16)
    tokens.unlink()
    with pytest.raises(ELFError, match="is damaged"):
        build_dataset(DataConfig(path=str(out)), tokenizer, 16)


def test_prepare_checks_tokenizer_and_cli(tokenizer, tmp_path, capsys):
    from elflow.cli import prepare_cmd as cli

    recs = shared_rows("web_bible", 10)
    path = write_jsonl(tmp_path / "d.jsonl", recs)
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    args = parser.parse_args(
        [
            "--data",
            str(path),
            "--tokenizer",
            tokenizer.name_or_path,
            "--out",
            str(tmp_path / "p"),
            "--max-length",
            "16",
        ]
    )
    assert cli.run(args) == 0
    assert "num_docs=10" in capsys.readouterr().out
    meta = json.loads((tmp_path / "p" / "meta.json").read_text())
    assert meta["vocab_size"] == len(tokenizer) and "latent_std" not in meta

    class Other:  # a tokenizer with another vocabulary
        special_tokens_map: ClassVar[dict] = {}

        def get_vocab(self):
            return {"a": 0}

    with pytest.raises(ELFError, match="vocabulary hash differs"):
        RowDataset.from_prepared(tmp_path / "p", max_length=16, pad_id=0, tokenizer=Other())


def test_prepare_measures_latent_std(tokenizer, tmp_path, tiny_encoder):
    path = write_jsonl(tmp_path / "d.jsonl", shared_rows("web_bible", 12))
    cfg = DataConfig(path=str(path))
    out = prepare(cfg, tokenizer, tmp_path / "p", max_length=16, encoder=tiny_encoder)
    std = read_meta(out)["latent_std"]
    ds = build_dataset(DataConfig(path=str(out)), tokenizer, 16)
    batch = ds.get_batch(np.arange(len(ds)))
    h = tiny_encoder.encode_raw(batch["input_ids"], batch["attention_mask"])
    valid = batch["attention_mask"].bool()
    assert std == pytest.approx(float(h[valid].pow(2).mean().sqrt()), rel=1e-5)
    # Training reuses it only for rows of the shape it was measured on.
    name = tiny_encoder.name
    assert prepared_latent_std(str(out), name, 0, ds) == std
    longer = build_dataset(DataConfig(path=str(out)), tokenizer, 32)
    packed = build_dataset(DataConfig(path=str(out), packing=True), tokenizer, 16)
    assert prepared_latent_std(str(out), name, 0, longer) == 0.0  # measured again
    assert prepared_latent_std(str(out), name, 0, packed) == 0.0
    assert prepared_latent_std(str(out), name, 2, ds) == 0.0
    raw = tmp_path / "raw"  # raw data with a meta.json of its own: measured, not an error
    raw.mkdir()
    (raw / "meta.json").write_text('{"source": "somewhere"}')
    assert prepared_latent_std(str(raw), name, 0, ds) == 0.0


def test_packing_keeps_rows_that_are_already_chunked():
    L, eos = 8, 2
    chunks = [[5 + i] * L + [eos] for i in range(6)]  # pre-chunked rows, an EOS appended
    ds = RowDataset(_table(chunks), max_length=L, pad_id=0, packing=True, eos_id=eos)
    assert ds.prechunked and not ds.packing and len(ds) == 6 and ds.num_truncated == 0
    assert ds.get_rows(np.arange(6))["input_ids"][3].tolist() == [8] * L  # one chunk, whole
    # Documents longer than a row, or much shorter ones, are packed as asked.
    for docs in ([[5] * 20 + [eos]] * 3, [[5, 6, eos]] * 12):
        ds = RowDataset(_table(docs), max_length=L, pad_id=0, packing=True, eos_id=eos)
        assert ds.packing and not ds.prechunked and len(ds) == sum(map(len, docs)) // L


def test_start_up_reports_truncated_documents_and_warns_above_5_percent():
    from elflow.config.run_presets import preset
    from elflow.train.start_report import data_notes

    cfg = preset("owt-b")
    # fewer rows than a batch is warned about separately
    cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, global_batch=4))
    L, eos = 8, 2

    def notes(long: int, total: int, packing: bool = False) -> list[str]:
        docs = [[5] * (L + 3) + [eos]] * long + [[5, eos]] * (total - long)
        ds = RowDataset(_table(docs), max_length=L, pad_id=0, packing=packing, eos_id=eos)
        return data_notes(ds, cfg)

    assert notes(0, 40) == []
    (line,) = notes(2, 40)  # 5%: said, no warning
    assert "2 of 40 documents (5.0%) are longer than a row" in line and "warning" not in line
    (line,) = notes(3, 40)
    assert "warning" in line and "7.5%" in line and "data.packing=true" in line
    assert notes(3, 40, packing=True) == []  # packed: nothing is cut off
    chunked = RowDataset(_table([[5] * L] * 4), max_length=L, pad_id=0, packing=True, eos_id=eos)
    (line,) = data_notes(chunked, cfg)
    assert "already rows of 8 tokens" in line


def test_a_memory_mapped_table_reads_single_tokens_from_its_file(tmp_path, monkeypatch):
    """``TokenTable.at`` reads a handful of tokens with pread (no pages of the map touched) and
    gives what indexing gives, through ``head`` too; more go through the map; the over-long
    count of a memory-mapped table equals the in-memory one's."""
    from elflow.data import token_tables as tables
    from elflow.data.token_tables import TableWriter

    rng = np.random.default_rng(0)
    L, eos = 8, 2
    docs = [[*rng.integers(3, 60000, size=int(n)).tolist(), eos] for n in rng.integers(1, 12, 300)]
    docs[7] = [5] * L + [eos]  # L + 1 tokens, the last EOS: fits
    docs[9] = [5] * (L + 1)  # L + 1 tokens, no EOS: truncated
    writer = TableWriter(np.dtype(np.uint16), tmp_path, "tokens")
    writer.append(docs)
    mapped, memory = writer.finish(), _table(docs)
    assert isinstance(mapped.tokens, np.memmap) and mapped.file == tmp_path / "tokens.bin"
    where = rng.integers(0, memory.num_tokens, size=50)
    np.testing.assert_array_equal(mapped.at(where), memory.tokens[where])
    np.testing.assert_array_equal(mapped.head(10).at(where % 20), memory.tokens[where % 20])
    monkeypatch.setattr(tables, "PREAD_LIMIT", 4)  # through the map
    np.testing.assert_array_equal(mapped.at(where), memory.tokens[where])
    counts = [
        RowDataset(t, max_length=L, pad_id=0, eos_id=eos).num_truncated for t in (mapped, memory)
    ]
    fits = [len(d) <= L or (len(d) == L + 1 and d[-1] == eos) for d in docs]
    assert counts[0] == counts[1] == fits.count(False) > 1
