"""Infilling and length control: templates to rows, constrained decoding, kept text that
survives whole, exact fill lengths, the span-conditioning training rows, and the command line."""

from __future__ import annotations

import json
import tracemalloc
from dataclasses import replace

import numpy as np
import pytest
import torch

from elflow import ELFPipeline
from elflow.__main__ import main
from elflow.errors import ELFError
from elflow.generation.infill import (
    MAX_GAP,
    Gap,
    InfillRequest,
    _target,
    build_template,
    length_requests,
    parse_template,
    placeholder_id,
)
from elflow.generation.infill_texts import fill_vocabulary, kept_texts, survives
from elflow.sampling.infill_maths import Template, constrained_tokens
from tests.builders import MINILM, VOCAB, make_cond, make_infill_model

L = 16


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return make_infill_model(tmp_path_factory.mktemp("infill"), histogram=(5, 0, 1, 3))


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(MINILM)


def test_templates_parse_gaps_and_refuse_bad_ones():
    assert parse_template("a [___2-4] b [___]") == ["a ", Gap(2, 4), " b ", Gap(8, 8)]
    assert parse_template("[___3]x") == [Gap(3, 3), "x"]
    for bad, match in (
        ("no gap", "has no gap"),
        ("a [___0] b", "1 <= A <= B"),
        ("[___5-2]", "1 <= A <= B"),
    ):
        with pytest.raises(ELFError, match=match):
            parse_template(bad)


@pytest.mark.parametrize(
    ("text", "marker"),
    [
        ("in the [___] beginning [___", "[___"),  # no closing bracket
        ("in the [__3] beginning [___2]", "[__3]"),  # two underscores
        ("in the [____] beginning [___2]", "[____]"),  # four
        ("in the [___ 5] beginning [___2]", "[___ 5]"),
        ("in the [___3-] beginning [___2]", "[___3-]"),
        ("in the [___three] beginning", "[___three]"),
    ],
)
def test_a_malformed_gap_beside_a_valid_one_is_refused_not_kept_as_text(text, marker):
    with pytest.raises(ELFError) as e:
        parse_template(text)
    assert str(e.value) == (
        f"malformed gap {marker!r} in {text!r}: write [___], [___N] or [___A-B] (three "
        "underscores, then digits)"
    )
    # Brackets and underscores that are not gap markers stay text.
    assert parse_template("a [_] b [x] c__d [___2]") == ["a [_] b [x] c__d ", Gap(2, 2)]


def test_a_template_row_keeps_everything_but_the_gap(tokenizer):
    request = InfillRequest(parts=parse_template("in the beginning [___3] the earth."))
    t = build_template(tokenizer, [request], length=L, pad_id=102, eos_id=102)
    tokens = tokenizer.convert_ids_to_tokens(t.ids[0].tolist())
    assert tokens[:4] == ["[CLS]", "in", "the", "beginning"]
    assert tokens[4:7] == ["[MASK]"] * 3 and tokens[7:11] == ["the", "earth", ".", "[SEP]"]
    assert t.keep[0].tolist() == [True] * 4 + [False] * 3 + [True] * (L - 7)
    assert t.attention[0].tolist() == [1] * 11 + [0] * (L - 11)  # valid through [SEP]
    assert t.after_word[0].tolist() == [False] * 4 + [True] + [False] * (L - 5)
    assert kept_texts(tokenizer, t, 0) == ["in the beginning", "the earth."]
    with pytest.raises(ELFError, match="needs 21 tokens, more than the model's 16"):
        build_template(
            tokenizer, [InfillRequest(parts=[Gap(19, 19)])], length=L, pad_id=0, eos_id=102
        )


TOO_LONG = (
    "infill request {i} needs {n} tokens, more than the model's 16; shorten its text or its gaps"
)


def _peak_bytes(call) -> int:
    """The most Python memory ``call()`` held at once (it is to raise ELFError)."""
    tracemalloc.start()
    try:
        with pytest.raises(ELFError):
            call()
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_gap_counts_parse_as_numbers_and_absurd_ones_are_one_line():
    assert parse_template("[___1000000000000]") == [Gap(10**12, 10**12)]  # a number, no list
    assert parse_template("a [___0005-0007]") == ["a ", Gap(5, 7)]
    assert parse_template(f"[___{MAX_GAP}]") == [Gap(MAX_GAP, MAX_GAP)]
    digits = "9" * 5000  # int() alone refuses over 4300 digits, with a ValueError of its own
    with pytest.raises(ELFError, match="a gap of 5000 digits in ") as e:
        parse_template(f"in the beginning [___{digits}] the earth.")
    assert "\n" not in str(e.value) and len(str(e.value)) < 300  # the template shown shortened
    with pytest.raises(ELFError, match=f"a gap holds at most {MAX_GAP} tokens"):
        parse_template(f"[___1-{MAX_GAP + 1}]")
    with pytest.raises(ELFError, match="1 <= A <= B"):
        parse_template("[___" + "0" * 40 + "]")  # leading zeros are not digits that count


def test_a_huge_gap_is_counted_not_laid_out(tokenizer):
    """A gap of 10**9 tokens is refused with the message of a gap one token too long, its
    length counted (kept tokens, gaps and a conditional model's source head) before anything
    the size of a gap is made."""

    def rows(text, source=None, max_input_length=0):
        request = InfillRequest(parts=parse_template(text), source=source)
        return build_template(
            tokenizer,
            [request],
            length=L,
            pad_id=0,
            eos_id=102,
            indices=[7],
            max_input_length=max_input_length,
        )

    for text, n in (("a [___14]", 17), ("a [___1000000000]", 10**9 + 3)):  # [CLS] a ... [SEP]
        with pytest.raises(ELFError) as e:
            rows(text)
        assert str(e.value) == TOO_LONG.format(i=7, n=n)
    assert _peak_bytes(lambda: rows("a [___1000000000]")) < 4 * 2**20  # a list would be GBs
    assert _peak_bytes(lambda: rows("[___1000000000-1000000009] b [___2]")) < 4 * 2**20
    assert len(tokenizer("ein werkzeug")["input_ids"]) > 4  # a source head of 4 tokens
    rows("a [___9]", "ein werkzeug", max_input_length=4)  # 4 + 12 tokens: fits exactly
    for text, n in (("a [___10]", 4 + 13), ("a [___1000000000]", 4 + 10**9 + 3)):
        with pytest.raises(ELFError) as e:
            rows(text, "ein werkzeug", max_input_length=4)
        assert str(e.value) == TOO_LONG.format(i=7, n=n)
    request = InfillRequest(parts=parse_template("a [___1000000000] b [___3-5]"))
    target = _target(tokenizer, request, hole=placeholder_id(tokenizer), seed=0, index=0)
    assert len(target.ids) == 6 and 10**9 + 4 + 3 <= len(target) <= 10**9 + 4 + 5
    for parts, match in (
        (["a [MASK] ", Gap(2, 2)], r"its text holds the placeholder token '\[MASK\]' itself"),
        ([Gap(10**30, 10**30)], f"a gap of {10**30} to {10**30} tokens is over {MAX_GAP}"),
    ):  # a bare StopIteration and torch's overflow before
        with pytest.raises(ELFError, match=match):
            build_template(tokenizer, [InfillRequest(parts=parts)], length=L, pad_id=0, eos_id=102)


def test_a_huge_gap_is_one_line_from_the_pipeline_and_the_command_line(model, tmp_path, capsys):
    pipe = ELFPipeline.from_pretrained(model)
    with pytest.raises(ELFError) as e:  # one token over, and every lazy load made now
        pipe.infill(["a [___2]", "a [___14]"])
    assert str(e.value) == TOO_LONG.format(i=1, n=17)
    with pytest.raises(ELFError) as e:
        pipe.infill(["a [___2]", "a [___1000000000]"])
    assert str(e.value) == TOO_LONG.format(i=1, n=10**9 + 3)
    assert _peak_bytes(lambda: pipe.infill(["a [___1000000000]"])) < 4 * 2**20
    requests = tmp_path / "huge.jsonl"
    requests.write_text(json.dumps({"text": "a [___1000000000]"}) + "\n")
    capsys.readouterr()
    assert main(["sample", "--model", model, "--infill", str(requests), "--device", "cpu"]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    # The last line, and the only one of elflow's (a library's log lines may come before it).
    (error,) = [x for x in captured.err.splitlines() if x.startswith("elflow:")]
    assert captured.err.endswith(error + "\n")
    assert error == "elflow: error: " + TOO_LONG.format(i=0, n=10**9 + 3)


def test_gap_lengths_are_drawn_per_sample_and_seed(tokenizer):
    request = InfillRequest(parts=[Gap(1, 9)])
    fills = [
        int(
            (
                ~build_template(tokenizer, [request], length=L, pad_id=0, eos_id=102, seed=s).keep
            ).sum()
        )
        for s in range(20)
    ]
    assert set(fills) <= set(range(1, 10)) and len(set(fills)) > 3
    again = build_template(tokenizer, [request] * 3, length=L, pad_id=0, eos_id=102, seed=4)
    alone = build_template(
        tokenizer, [request], length=L, pad_id=0, eos_id=102, seed=4, indices=[2]
    )
    assert torch.equal(again.keep[2], alone.keep[0])  # (seed, index), not the batch


def test_constrained_decoding_forces_kept_and_bans_specials_and_glue(tokenizer):
    vocab = fill_vocabulary(tokenizer)
    ids = tokenizer.convert_tokens_to_ids(["[CLS]", "in", "[MASK]", "[MASK]", "[SEP]"])
    keep = torch.tensor([[1, 1, 0, 0, 1]], dtype=torch.bool)
    after = torch.tensor([[0, 0, 1, 0, 0]], dtype=torch.bool)
    t = Template(torch.tensor([ids]), keep, torch.ones(1, 5, dtype=torch.long), after)
    logits = torch.zeros(1, 5, VOCAB)
    sep, glue, word = (tokenizer.convert_tokens_to_ids(x) for x in ("[SEP]", "##ing", "god"))
    logits[0, :, sep] = 10.0  # the model would end the text inside the gap
    logits[0, :, glue] = 9.0  # or glue "##ing" onto "in"
    logits[0, :, word] = 1.0
    out = constrained_tokens(logits, t, vocab)[0].tolist()
    assert out[:2] == ids[:2] and out[4] == ids[4]  # kept, whatever the logits say
    assert out[2] == word and out[3] == glue  # no glue after a kept word; inside the gap, fine
    assert bool(vocab.continues[glue]) and not bool(vocab.continues[word])
    assert bool(vocab.special[sep])


def test_survival_is_whole_words_in_order():
    assert survives("in the beginning god made the earth.", ["in the beginning", "the earth."])
    assert not survives("in the beginnings made the earth.", ["in the beginning", "the earth."])
    assert not survives("the earth. in the beginning", ["in the beginning", "the earth."])
    assert survives("in its.... the ephod.", ["in its", "the ephod."])  # punctuation after it
    assert not survives("in itself the ephod.", ["in its", "the ephod."])  # a longer word


def test_infill_keeps_the_kept_text_and_fills_exact_lengths(model):
    pipe = ELFPipeline.from_pretrained(model)
    templates = ["the lord [___3] the earth.", "[___2] said.", "god [___2] and [___1] light"]
    out = pipe.infill(templates, seed=1)
    assert out.survived == [True] * 3
    assert [len(f) for f in out.fills] == [1, 1, 2]
    row = pipe.tokenizer.convert_ids_to_tokens(out.tokens[0, :10].tolist())
    assert row[:3] == ["[CLS]", "the", "lord"] and row[6:] == ["the", "earth", ".", "[SEP]"]
    assert not set(row[3:6]) & {"[CLS]", "[SEP]", "[PAD]", "[MASK]"}  # a 3-token fill, exactly
    assert out.kept[0] == ["the lord", "the earth."]
    for text, kept in zip(out.texts, out.kept, strict=True):
        assert survives(text, kept)
    again = pipe.infill(templates, seed=1, batch_size=1)
    assert again.texts == out.texts  # sample i depends on (seed, i) only
    calls = []
    encode = pipe.encoder.forward
    pipe.encoder.forward = lambda *a, **k: calls.append(1) or encode(*a, **k)
    frozen = pipe.infill(templates, seed=1, sampler=replace(pipe.sampler, refresh_from=1.0))
    assert frozen.survived == [True] * 3 and len(calls) == 1  # the placeholder encoding only
    pipe.infill(templates, seed=1)
    assert len(calls) == 1 + 1 + 3  # and then one refresh per step (3 steps)


def test_a_conditional_model_infills_its_target(tmp_path):
    pipe = ELFPipeline.from_pretrained(make_cond(tmp_path / "cond"))
    out = pipe.infill([{"text": "a [___2] tool", "source": "ein werkzeug"}], seed=0)
    assert out.survived == [True] and out.tokens.shape == (1, 16 - 8)
    with pytest.raises(ELFError, match="give each infill request a 'source'"):
        pipe.infill(["a [___2] tool"])


def test_length_control_gives_exact_token_counts(model):
    pipe = ELFPipeline.from_pretrained(model)
    texts = pipe.generate(4, sampler=replace(pipe.sampler, length_range="5"), seed=0)
    for text in texts:
        n = len(pipe.tokenizer(text, add_special_tokens=False)["input_ids"])
        assert n >= 1  # decoding may merge pieces into fewer words, never more tokens
    out = pipe.generate_full(6, sampler=replace(pipe.sampler, length_range="3:6"), seed=0)
    ends = (out.tokens == pipe.tokens.eos_id).int().argmax(1).tolist()
    assert all(4 <= e <= 7 for e in ends)  # [CLS] + 3..6 tokens, then [SEP]
    data = pipe.generate_full(20, sampler=replace(pipe.sampler, length_range="data"), seed=0)
    ends = set((data.tokens == pipe.tokens.eos_id).int().argmax(1).tolist())
    assert ends <= {3, 4}  # the histogram has texts of 2 and 3 tokens only
    requests = length_requests("4:6w", range(3), seed=0, tokens_per_word=2.0)
    assert all(r.parts[0].lo == r.parts[0].hi in (8, 10, 12) for r in requests)


def test_length_control_needs_what_it_draws_from(tmp_path):
    pipe = ELFPipeline.from_pretrained(make_infill_model(tmp_path))  # no histogram recorded
    with pytest.raises(ELFError, match=r"has none .*give a range"):
        pipe.generate(1, sampler=replace(pipe.sampler, length_range="data"))
    with pytest.raises(ELFError, match=r"sampler\.length_range must be N, A:B"):
        replace(pipe.sampler, length_range="ten")
    # A range past the rows is refused before any row is drawn, in its own terms.
    L = pipe.config.model.max_length
    for text in (f"2:{L - 1}", f"{L}", f"1:{L}w"):
        with pytest.raises(ELFError, match=rf"reaches \d+ tokens of text; .* at most {L - 2} "):
            pipe.generate(1, sampler=replace(pipe.sampler, length_range=text))
    assert len(pipe.generate(2, sampler=replace(pipe.sampler, length_range=f"{L - 2}"))) == 2


def test_cli_infill_writes_fills_and_a_page_with_kept_text(model, tmp_path, capsys):
    lines = [{"text": "the lord [___2] the earth."}, {"text": "[___3] light."}]
    requests = tmp_path / "in.jsonl"
    requests.write_text("".join(json.dumps(x) + "\n" for x in lines))
    out, page = tmp_path / "out.jsonl", tmp_path / "page.html"
    argv = ["sample", "--model", model, "--infill", str(requests), "--out", str(out)]
    assert main([*argv, "--trajectory", str(page), "--steps", "2"]) == 0
    records = [json.loads(x) for x in out.read_text().splitlines()]
    assert [r["template"] for r in records] == [x["text"] for x in lines]
    assert all(r["kept_survived"] for r in records) and records[1]["kept"] == ["light."]
    html = page.read_text()
    assert "kept text" in html and '"kept":' in html
    assert main(["sample", "--model", model, "--length-range", "3", "-n", "2"]) == 0
    assert len(capsys.readouterr().out.splitlines()) == 2


def test_span_condition_keeps_all_but_one_span():
    from elflow.config.train_config import RunConfig
    from elflow.train.batches import span_condition

    cfg = RunConfig()
    cfg = replace(cfg, objective=replace(cfg.objective, span_cond_prob=1.0))
    attention = np.zeros((64, 20), dtype=np.int64)
    attention[:, :12] = 1  # 12 valid tokens: [CLS] + 10 + [SEP]
    spans = span_condition(attention, np.arange(64), cfg)
    filled = 1 - spans
    assert (filled[:, 0] == 0).all() and (filled[:, 11:] == 0).all()  # ends and padding kept
    sizes = filled.sum(1)
    assert sizes.min() >= 1 and sizes.max() <= 6  # 10-60% of the 10 text tokens
    for row in filled:  # one contiguous span
        on = np.flatnonzero(row)
        assert on[-1] - on[0] + 1 == len(on)
    again = span_condition(attention[10:20], np.arange(10, 20), cfg)
    assert (again == spans[10:20]).all()  # keyed by stream position, not by batch
    half = replace(cfg, objective=replace(cfg.objective, span_cond_prob=0.5))
    share = span_condition(attention, np.arange(64), half).any(1).mean()
    assert 0.25 < share < 0.75


@pytest.mark.parametrize(
    ("flags", "given"),
    [
        (
            "--sampler sde --steps 2 --gamma 0.7 --w 1.5 --time-mean -1.0 --time-std 0.6 "
            "--project-from 0.9 --length 10",
            {
                "steps": 2,
                "gamma": 0.7,
                "w": 1.5,
                "time_mean": -1.0,
                "time_std": 0.6,
                "project_from": 0.9,
                "length": 10,
            },
        ),
        (
            "--sampler pc --pc-snr 0.2 --time-grid uniform --length-range 8 --refresh-from 0.5",
            {
                "sampler": "pc",
                "pc_snr": 0.2,
                "time_grid": "uniform",
                "length_range": "8",
                "refresh_from": 0.5,
                "gamma": 1.5,  # not used by pc: recorded as None, read back as the default
            },
        ),
    ],
)
def test_every_sampler_setting_round_trips_through_a_record(model, tmp_path, flags, given):
    """A sample record holds every sampler setting (a key per SamplerConfig field) and gives back
    the settings that made it (``length`` as resolved: 0 is the model's max_length, 16; under
    ``length_range`` the rows' length is the model's)."""
    import dataclasses
    import json

    from elflow.config import SamplerConfig
    from elflow.generation.records import sampler_from_record

    out = tmp_path / "s.jsonl"
    argv = ["sample", "--model", model, "--out", str(out), "-n", "1", "--device", "cpu"]
    assert main(argv + flags.split()) == 0
    (record,) = [json.loads(x) for x in out.read_text().splitlines()]
    assert {f.name for f in dataclasses.fields(SamplerConfig)} <= set(record)
    made_with = SamplerConfig(steps=3, sampler="sde", gamma=1.0, w=2.0)  # make_infill_model's
    assert sampler_from_record(record) == dataclasses.replace(made_with, **given)


def test_infilled_texts_keep_the_users_text_exactly(model):
    """Only the gaps are decoded text: the kept text comes back as given, case and punctuation
    included (a WordPiece decode would give "yahweh ' s" and "stiff - necked")."""
    from elflow.generation.infill import InfillRequest
    from elflow.generation.infill_texts import verbatim_text

    pipe = ELFPipeline.from_pretrained(model)
    template = "Yahweh's stiff-necked [___2] Ok!"
    out = pipe.infill([template], seed=2)
    (text,), (fills,) = out.texts, out.fills
    assert text == f"Yahweh's stiff-necked {fills[0]} Ok!".replace("  ", " ")
    assert out.survived == [True]  # checked on the model's own tokens, as before
    request = InfillRequest(parts=parse_template("A [___2] b [___1]."))
    assert verbatim_text(request, ["x y", ""], "decoded") == "A x y b ."
    assert verbatim_text(request, ["only one span"], "decoded") == "decoded"  # fills merged
    assert verbatim_text(InfillRequest(ids=[1], keep=[1]), [], "decoded") == "decoded"


def test_per_sample_seeds_reach_infilling_and_length_control(model):
    pipe = ELFPipeline.from_pretrained(model)
    templates = ["the lord [___2-3] the earth.", "[___1-2] said."]
    both = pipe.infill(templates, seed=[4, 6])
    assert both.texts[0] == pipe.infill(templates, seed=4).texts[0]
    assert both.texts[1] == pipe.infill(templates, seed=6).texts[1]
    lengths = replace(pipe.sampler, length_range="2:4")
    mixed = pipe(2, seed=[4, 6], sampler=lengths)
    assert torch.equal(mixed.tokens[1], pipe(2, seed=6, sampler=lengths).tokens[1])


def _cli_error(argv, capsys) -> str:
    """The one line ``elflow`` writes for a refused command (exit 2, nothing on stdout)."""
    capsys.readouterr()
    assert main(argv) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    (error,) = [x for x in captured.err.splitlines() if x.startswith("elflow:")]
    assert captured.err.endswith(error + "\n")  # the last line: no traceback after it
    return error.removeprefix("elflow: error: ")


def test_cli_infills_explicit_ids_and_keep_as_the_library_does(infill_model, tmp_path, capsys):
    """A line of ``ids`` and ``keep`` (as the docs offer) is sampled, not refused for lacking
    'text'; its text is the library's for the same request and seed."""
    explicit = {"ids": [101, 1996, 2935, 103, 103, 1996, 3011, 102]}
    explicit["keep"] = [True, True, True, False, False, True, True, True]
    lines = [explicit, {"text": "the lord [___2] the earth."}]
    requests = tmp_path / "ids.jsonl"
    requests.write_text(json.dumps(lines[0]) + "\n\n" + json.dumps(lines[1]) + "\n")
    capsys.readouterr()
    argv = ["sample", "--model", infill_model, "--infill", str(requests), "--device", "cpu"]
    assert main([*argv, "--seed", "3"]) == 0
    printed = capsys.readouterr().out.splitlines()
    pipe = ELFPipeline.from_pretrained(infill_model)
    assert printed == pipe.infill(lines, seed=3).texts
    out = tmp_path / "out.jsonl"
    assert main([*argv, "--seed", "3", "--out", str(out), "-n", "1"]) == 0
    (record,) = [json.loads(x) for x in out.read_text().splitlines()]
    assert record["text"] == printed[0] and record["template"] is None
    assert record["kept_survived"] and len(record["fills"]) == 1


@pytest.mark.parametrize(
    ("line", "error"),
    [
        ({"ids": [101, 2000.5, 102], "keep": [1, 0, 1]}, "'ids'[1] is 2000.5, not a token id"),
        ({"ids": [101, "x", 102], "keep": [1, 0, 1]}, "'ids'[1] is \"x\", not a token id"),
        ({"ids": [True, 5, 102], "keep": [1, 0, 1]}, "'ids'[0] is true, not a token id"),
        ({"ids": [101, 5, 102], "keep": [1, "yes", 1]}, "'keep'[1] is \"yes\"; give true or"),
        ({"ids": [101, 5, 102], "keep": [1, 0, 2]}, "'keep'[2] is 2; give true or false"),
        ({"ids": "101 5", "keep": [1, 0]}, "'ids' is \"101 5\"; give a list"),
        ({"ids": [101, 5], "keep": [1, 0, 1]}, "'ids' and 'keep' of one length, not 2 and 3"),
        ({"ids": [101, 5, 102]}, "needs both 'ids' and 'keep'"),
        ({"txt": "a [___2]"}, "give a template in 'text' (text with [___] gaps) or 'ids' and"),
        ({"text": "a [___2]", "ids": [101], "keep": [1]}, "or 'ids' and 'keep', not both"),
        ({"text": "a [___2] b [___"}, "malformed gap '[___' in 'a [___2] b [___': write [___]"),
        ({"text": "a [__3] b [___2]"}, "malformed gap '[__3]' in"),
    ],
)
def test_cli_refuses_a_bad_infill_line_in_one_line(infill_model, tmp_path, capsys, line, error):
    requests = tmp_path / "bad.jsonl"
    requests.write_text(json.dumps({"text": "a [___2]"}) + "\n" + json.dumps(line) + "\n")
    argv = ["sample", "--model", infill_model, "--infill", str(requests), "--device", "cpu"]
    message = _cli_error(argv, capsys)
    assert message.startswith(f"{requests}:2: ") and error in message
    assert "--" not in message.split(": ", 1)[1]  # keys, not flags


def test_ids_outside_the_vocabulary_are_one_line(infill_model, tokenizer, tmp_path, capsys):
    """An id past the vocabulary (or negative) is refused where the row is built, not an
    IndexError deep in the model."""
    assert len(tokenizer) == VOCAB
    for bad in (999999, -5, VOCAB):
        request = InfillRequest(ids=[101, bad, 102], keep=[True, False, True])
        with pytest.raises(ELFError) as e:
            build_template(tokenizer, [request], length=L, pad_id=0, eos_id=102, indices=[4])
        assert str(e.value) == f"infill request 4: id {bad} is outside the vocabulary (0..30521)"
    edge = InfillRequest(ids=torch.tensor([0, VOCAB - 1, 102]), keep=[True, False, True])
    t = build_template(tokenizer, [edge], length=L, pad_id=0, eos_id=102)
    assert t.ids[0, :3].tolist() == [0, VOCAB - 1, 102]  # both ends of it, a tensor's ids too
    with pytest.raises(ELFError, match=r"^infill request 1: 'keep'\[0\] is \"y\"; give true"):
        ELFPipeline.from_pretrained(infill_model).infill(
            ["a [___2]", {"ids": [101, 5], "keep": ["y", 0]}]
        )
    requests = tmp_path / "far.jsonl"
    requests.write_text(json.dumps({"ids": [101, 999999, 102], "keep": [1, 0, 1]}) + "\n")
    argv = ["sample", "--model", infill_model, "--infill", str(requests), "--device", "cpu"]
    message = _cli_error(argv, capsys)
    assert message == "infill request 0: id 999999 is outside the vocabulary (0..30521)"
