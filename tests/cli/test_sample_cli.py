"""``elflow sample`` (elflow.cli.sample_cmd) on tiny models with the offline MiniLM tokenizer."""

from __future__ import annotations

import json
import time
from dataclasses import replace
from pathlib import Path

import pytest

from elflow import ArtifactConfig, build_model, save_model
from elflow.__main__ import main as elflow_main
from elflow.config import elf_tiny
from elflow.generation.records import token_agreement
from tests.builders import MINILM, read
from tests.dist.launch import run_elflow


def main(argv: list[str]) -> int:
    """`elflow sample ARGV` in-process."""
    return elflow_main(["sample", *argv])


SETTINGS = {"sampler", "steps", "nfe", "gamma", "w", "cfg", "seed", "model", "dtype"}


def sample(model: Path, out: Path, *extra: str) -> list[dict]:
    argv = ["--model", str(model), "--out", str(out), "--device", "cpu", *extra]
    assert main(argv) == 0
    return read(out)


def test_batch_size_does_not_change_samples(uncond_model, tmp_path):
    args = ["--num-samples", "5", "--steps", "3", "--save-tokens"]
    one = sample(uncond_model, tmp_path / "b1.jsonl", *args, "--seed", "7", "--batch-size", "1")
    four = sample(uncond_model, tmp_path / "b4.jsonl", *args, "--seed", "7", "--batch-size", "4")
    assert [r["id"] for r in one] == list(range(5))
    assert one == four
    other = sample(uncond_model, tmp_path / "s8.jsonl", *args, "--seed", "8")
    assert [r["tokens"] for r in other] != [r["tokens"] for r in one]


def test_settings_on_every_line(uncond_model, tmp_path):
    recs = sample(uncond_model, tmp_path / "s.jsonl", "--num-samples", "3", "--sampler", "heun")
    assert len(recs) == 3
    for rec in recs:
        assert SETTINGS <= rec.keys() and isinstance(rec["text"], str)
        # model defaults for the unset options, nfe of Heun = 2N - 1, no CFG on this model
        assert (rec["sampler"], rec["steps"], rec["w"], rec["seed"]) == ("heun", 4, 2.0, 0)
        assert rec["nfe"] == 7 and rec["gamma"] is None and rec["cfg"] is None
        assert rec["model"] == str(uncond_model) and rec["ema"] is True and rec["dtype"] == "fp32"
        assert (rec["time_grid"], rec["time_mean"], rec["time_std"]) == ("logit_normal", -1.5, 0.8)
    few = sample(uncond_model, tmp_path / "f.jsonl", "--num-samples", "1", "--preset", "fewstep")
    assert (few[0]["sampler"], few[0]["steps"], few[0]["gamma"], few[0]["w"]) == (
        "sde",
        8,
        1.5,
        2.5,
    )


def test_time_grid_options(uncond_model, tmp_path, monkeypatch):
    import elflow.sampling.sample_loop

    seen = []
    real = elflow.sampling.sample_loop.logit_normal_grid

    def spy(normal, mean, std):
        seen.append((mean, std))
        return real(normal, mean, std)

    monkeypatch.setattr(elflow.sampling.sample_loop, "logit_normal_grid", spy)
    args = ["--num-samples", "4", "--save-tokens"]
    late = sample(uncond_model, tmp_path / "late.jsonl", *args, "--time-mean", "0.5")
    assert (late[0]["time_mean"], late[0]["time_std"]) == (0.5, 0.8)
    assert seen == [(0.5, 0.8)]
    uni = sample(uncond_model, tmp_path / "uni.jsonl", *args, "--time-grid", "uniform")
    assert (uni[0]["time_grid"], uni[0]["time_mean"], uni[0]["time_std"]) == ("uniform", None, None)
    assert seen == [(0.5, 0.8)]  # the uniform grid draws no logit-normal times
    # the Python API takes the same options and gives the same samples
    from elflow.generation.pipeline import ELFPipeline

    pipe = ELFPipeline.from_pretrained(uncond_model)
    grid = replace(pipe.sampler, time_mean=0.5, time_std=0.3)
    assert pipe.generate(4, sampler=grid) == pipe.generate_full(4, sampler=grid).texts
    assert seen[-1] == (0.5, 0.3)


class CallCounter:
    """Rows of every forward of the network (a forward hook)."""

    def __init__(self, model):
        self.rows: list[int] = []
        model.register_forward_hook(lambda m, args, out: self.rows.append(args[0].shape[0]))


def test_conditional_source_and_one_batched_cfg_call(cond_model, tmp_path, monkeypatch):
    import elflow.cli.sample_cmd as gen

    sources = tmp_path / "src.jsonl"
    lines = [{"text": "the package provides a library", "id": "a"}, {"text": "a tool for text"}]
    sources.write_text("".join(json.dumps(x) + "\n" for x in lines))
    counters = []
    load = gen.load_pipeline

    def counted(*args, **kwargs):
        pipe = load(*args, **kwargs)
        counters.append(CallCounter(pipe.model))
        return pipe

    monkeypatch.setattr(gen, "load_pipeline", counted)
    recs = sample(cond_model, tmp_path / "c.jsonl", "--sources", str(sources), "--batch-size", "2")
    assert [r["source"] for r in recs] == [x["text"] for x in lines]
    assert recs[0]["source_id"] == "a" and "source_id" not in recs[1]
    assert (recs[0]["cfg"], recs[0]["steps"], recs[0]["nfe"]) == (2.0, 3, 6)  # CFG counts twice
    assert recs[0]["length"] == 16 - 8  # the target's tokens: max_length - max_input_length
    # 3 ODE steps: ONE forward per step over 2B rows (conditional + unconditional), then the
    # (unguided) decode over B rows.
    assert counters[0].rows == [4, 4, 4, 2]
    counters.clear()
    sample(cond_model, tmp_path / "c1.jsonl", "--sources", str(sources), "--cfg", "1")
    assert counters[0].rows == [2, 2, 2, 2]


def test_bf16_runs_and_agreement_is_reported(uncond_model, tmp_path, monkeypatch, capsys):
    from elflow import errors
    from elflow.runtime import hardware

    args = ["--num-samples", "4", "--steps", "3", "--save-tokens"]
    fp32 = sample(uncond_model, tmp_path / "fp32.jsonl", *args)
    monkeypatch.setenv(hardware.ENV, "0")  # a CPU that emulates bf16: warned, still correct
    monkeypatch.setattr(errors, "_NOTED", set())
    hardware.cpu_has_native_bf16.cache_clear()
    capsys.readouterr()
    bf16 = sample(uncond_model, tmp_path / "bf16.jsonl", *args, "--dtype", "bf16")
    hardware.cpu_has_native_bf16.cache_clear()
    assert "--dtype bf16 on a CPU that emulates bf16" in capsys.readouterr().err
    assert all(r["dtype"] == "bf16" for r in bf16)
    # The old spelling still works, with a note; the default on a CPU is fp32.
    old = sample(uncond_model, tmp_path / "old.jsonl", *args, "--bf16")
    assert "--bf16 is now --dtype bf16" in capsys.readouterr().err
    assert old == bf16 and all(r["dtype"] == "fp32" for r in fp32)
    agree = token_agreement(fp32, bf16)
    print(f"bf16 vs fp32 token agreement (tiny random model): {100 * agree:.1f}%")
    assert 0.0 <= agree <= 1.0


def test_trajectory_html_and_terminal(uncond_model, tmp_path, capsys):
    page = tmp_path / "t.html"
    args = ["--num-samples", "2", "--steps", "3"]
    recs = sample(uncond_model, tmp_path / "t.jsonl", *args, "--trajectory", str(page))
    text = page.read_text()
    start = text.index('id="elflow-data">') + len('id="elflow-data">')
    data = json.loads(text[start : text.index("</script>", start)])
    assert data["labels"] == ["step 1/3", "step 2/3", "step 3/3", "final"]
    assert all(len(frame) == 2 for frame in data["words"])  # every step of every sample
    assert [" ".join(w) for w in data["words"][-1]] == [" ".join(r["text"].split()) for r in recs]
    capsys.readouterr()
    sample(uncond_model, tmp_path / "t2.jsonl", *args, "--trajectory", "-")
    out = capsys.readouterr().out
    assert "[final]" in out and all(" ".join(r["text"].split()) in out for r in recs)


def _one_line_error(capsys, argv) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("elflow: error:") and err.count("\n") == 1, err
    return err


def test_bad_input_is_one_line(uncond_model, cond_model, tmp_path, capsys):
    out = ["--out", str(tmp_path / "x.jsonl"), "--device", "cpu"]
    bad = tmp_path / "bad.jsonl"
    bad.write_text("not json\n")
    err = _one_line_error(capsys, ["--model", str(cond_model), *out, "--sources", str(bad)])
    assert "bad.jsonl:1: malformed JSON" in err and "JSONL" in err
    nofield = tmp_path / "nofield.jsonl"
    nofield.write_text('{"src": "x"}\n')
    err = _one_line_error(capsys, ["--model", str(cond_model), *out, "--sources", str(nofield)])
    assert "'text'" in err and "--source-field" in err
    good = tmp_path / "good.jsonl"
    good.write_text('{"text": "x"}\n')
    argv = ["--model", str(cond_model), *out, "--sources", str(good), "--length", "4"]
    assert "--length applies to unconditional models" in _one_line_error(capsys, argv)
    argv = ["--model", str(cond_model), *out, "--sources", str(good), "--num-samples", "-1"]
    assert "--num-samples must be >= 1, got -1" in _one_line_error(capsys, argv)
    assert "steps" in _one_line_error(capsys, ["--model", str(uncond_model), *out, "--steps", "0"])
    assert "conditional" in _one_line_error(
        capsys, ["--model", str(uncond_model), *out, "--cfg", "2"]
    )
    assert "--time-std must be positive" in _one_line_error(
        capsys, ["--model", str(uncond_model), *out, "--time-std", "0"]
    )
    cfg = elf_tiny(encoder_dim=8, vocab_size=100, max_length=8)
    model = tmp_path / "small_vocab"
    save_model(model, build_model(cfg), ArtifactConfig(model=cfg, encoder=MINILM, tokenizer=MINILM))
    assert "decoder head has 100" in _one_line_error(capsys, ["--model", str(model), *out])
    assert "does not exist" in _one_line_error(capsys, ["--model", str(tmp_path / "missing"), *out])
    assert not (tmp_path / "x.jsonl").exists()


@pytest.mark.dist
def test_two_processes_write_the_one_process_file(uncond_model, tmp_path):
    args = ["--model", str(uncond_model), "--num-samples", "5", "--steps", "3", "--seed", "3"]
    args += ["--batch-size", "2", "--device", "cpu", "--save-tokens"]
    one = sample(uncond_model, tmp_path / "one.jsonl", *args[2:])
    t0 = time.perf_counter()
    run_elflow(["sample", *args, "--out", str(tmp_path / "two.jsonl")])
    assert time.perf_counter() - t0 < 60
    assert read(tmp_path / "two.jsonl") == one


def test_an_interrupted_out_resumes_to_the_uninterrupted_file(
    uncond_model, tmp_path, monkeypatch, capsys
):
    from elflow.generation import records as records_mod

    args = ["--model", str(uncond_model), "--num-samples", "7", "--steps", "3", "--batch-size", "2"]
    args += ["--seeds", "0,1"]
    assert main([*args, "--out", str(tmp_path / "straight.jsonl")]) == 0
    out = tmp_path / "resumed.jsonl"
    real, calls = records_mod._batch, {"n": 0}

    def killed(*a, **k):
        calls["n"] += 1
        if calls["n"] == 3:  # the third batch: two are on disk
            raise KeyboardInterrupt
        return real(*a, **k)

    monkeypatch.setattr(records_mod, "_batch", killed)
    capsys.readouterr()
    assert main([*args, "--out", str(out)]) == 130
    said = capsys.readouterr().err.strip().splitlines()[-1]
    assert said.startswith("elflow sample: interrupted; 4 samples are kept beside")
    assert said.endswith("run the same command again to resume")
    partials = list(tmp_path.glob(".resumed.jsonl.partial-*"))
    assert not out.exists() and len(partials) == 1
    assert len(partials[0].read_text().splitlines()) == 1 + 4  # the header, two batches of 2
    # Another command's samples are never mixed in: refused in one line, the file kept.
    assert main([*args, "--steps", "4", "--out", str(out)]) == 2
    assert partials[0].exists() and not out.exists()
    monkeypatch.setattr(records_mod, "_batch", real)
    calls["n"] = 0
    with partials[0].open("a") as f:  # a writer killed in the middle of a line
        f.write('{"seed": 1, "id": 2, "text": "cut sh')
    assert main([*args, "--out", str(out)]) == 0
    assert out.read_bytes() == (tmp_path / "straight.jsonl").read_bytes()
    assert not list(tmp_path.glob(".resumed.jsonl.partial-*"))
