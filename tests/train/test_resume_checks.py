"""A resume must continue the same run: every other config is refused in one line
(elflow/train/resume.py), checked here against the session's tiny run (``tiny_run``) instead of a
training run per refusal; then once through the command line, which says it as flags."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from elflow.errors import ELFError
from elflow.text.tokenizer import load_tokenizer
from elflow.train.resume import (
    check_resumable,
    check_same_rows,
    check_vocabulary,
    resolve_resume,
    resumed_settings,
    saved_run_config,
)
from tests.train.conftest import TINY_RUN, resolved
from tests.train_helpers import error_lines, run_config, train_cli


def refusal(tiny_run, tmp: Path, **sections) -> str:
    """The message resuming the tiny run's last checkpoint with ``sections`` changed gives (the
    checks ``prepare_run`` makes before it loads anything)."""
    train = {**TINY_RUN, **sections.pop("train", {})}
    cfg = resolved(run_config(tiny_run.assets, train=train, **sections), tmp)
    saved = saved_run_config(tiny_run.last)
    with pytest.raises(ELFError) as e:
        check_resumable(resumed_settings(cfg, saved), saved, tiny_run.last)
    return str(e.value)


def test_the_same_config_resumes(tiny_run, tmp_path):
    saved = saved_run_config(tiny_run.last)
    check_resumable(resumed_settings(tiny_run.cfg, saved), saved, tiny_run.last)
    assert resolve_resume(tiny_run.out, "auto") == tiny_run.last
    assert resolve_resume(tiny_run.out, str(tiny_run.checkpoint(3))) == tiny_run.checkpoint(3)
    assert resolve_resume(tiny_run.out, "never") is None


def test_another_architecture_is_named_by_its_changed_keys(tiny_run, tmp_path):
    err = refusal(tiny_run, tmp_path, model={"hidden_size": 48})
    assert "another architecture, model.hidden_size " in err
    assert "(now 48)" in err and "ModelConfig(" not in err
    with pytest.raises(ELFError, match="no checkpoint"):
        resolve_resume(tiny_run.out, str(tmp_path / "nothing-here"))


@pytest.mark.parametrize(
    ("sections", "message"),
    [
        ({"train": {"parallel": "fsdp2"}}, "saved with train.parallel=ddp, this run uses fsdp2"),
        ({"optim": {"optimizer": "adamw"}}, "optim.optimizer=muon, now adamw"),
        ({"train": {"global_batch": 16}}, "train.global_batch was 8, now 16"),
        ({"train": {"seed": 1}}, "train.seed was 0, now 1"),
        ({"encoder": {"layer": 1}}, "layer 0, now"),
        ({"encoder": {"latent_std": 0.7}}, "trained with encoder.latent_std 0.5, now 0.7"),
        ({"encoder": {"latent_mean": 0.1}}, "trained with encoder.latent_mean 0.0, now 0.1"),
        ({"train": {"init": "some-model"}}, "it was started from train.init 'none'"),
    ],
)
def test_another_setting_the_run_depends_on_is_refused(tiny_run, tmp_path, sections, message):
    assert message in refusal(tiny_run, tmp_path, **sections)


def test_another_vocabulary_is_refused(tiny_run, tmp_path):
    # A tokenizer of the same size with two ids swapped would remap the data silently.
    swapped = tmp_path / "swapped"
    load_tokenizer("minilm").save_pretrained(swapped)
    spec = json.loads((swapped / "tokenizer.json").read_text())
    vocab = spec["model"]["vocab"]
    vocab["the"], vocab["god"] = vocab["god"], vocab["the"]
    (swapped / "tokenizer.json").write_text(json.dumps(spec))
    tokenizer = load_tokenizer(str(swapped))
    assert tokenizer("the")["input_ids"] != load_tokenizer("minilm")("the")["input_ids"]
    check_vocabulary(load_tokenizer("minilm"), tiny_run.cfg, None, tiny_run.last)  # the same
    with pytest.raises(ELFError) as e:
        check_vocabulary(tokenizer, tiny_run.cfg, None, tiny_run.last)
    assert "checkpoint-6 was trained with another vocabulary" in str(e.value)
    assert "encoder.tokenizer" in str(e.value)


@pytest.mark.parametrize("old_checkpoint", [False, True], ids=["rows", "pre-rows-state"])
def test_other_data_is_refused(tiny_run, old_checkpoint):
    state = json.loads((tiny_run.last / "state.json").read_text())
    rows = state["rows"]
    if old_checkpoint:  # written before "rows" was: the count follows from epoch and examples
        state = {k: v for k, v in state.items() if k != "rows"}
    check_same_rows(tiny_run.last, state, rows)
    with pytest.raises(ELFError) as e:
        check_same_rows(tiny_run.last, state, rows - 1)
    assert f"trained on {rows} rows, the data now gives {rows - 1}" in str(e.value)


def test_a_new_run_into_a_folder_with_checkpoints_is_refused(tiny_run, tmp_path):
    from elflow.train.setup import prepare_run

    run = tmp_path / "run"
    shutil.copytree(tiny_run.out, run)
    with pytest.raises(ELFError) as e:
        prepare_run(tiny_run.cfg, run, "never")
    assert "already holds checkpoints (checkpoint-6)" in str(e.value)
    assert "a new run (resume=never) needs a new out=" in str(e.value)


def test_the_command_line_refuses_each_in_one_line_and_trains_nothing(tiny_run, tmp_path, capsys):
    run = tmp_path / "run"
    shutil.copytree(tiny_run.out, run)
    before = sorted(p.name for p in run.iterdir()), (run / "metrics.jsonl").read_text()
    assets = tiny_run.assets
    swapped = tmp_path / "swapped"  # same size, two ids swapped
    load_tokenizer("minilm").save_pretrained(swapped)
    spec = json.loads((swapped / "tokenizer.json").read_text())
    spec["model"]["vocab"]["the"], spec["model"]["vocab"]["god"] = (
        spec["model"]["vocab"]["god"],
        spec["model"]["vocab"]["the"],
    )
    (swapped / "tokenizer.json").write_text(json.dumps(spec))
    fewer = tmp_path / "fewer.jsonl"
    fewer.write_text("".join((assets / "train.jsonl").read_text().splitlines(True)[:-1]))
    cases = [
        (
            {"model": {"hidden_size": 48}},
            (),
            ["another architecture, model.hidden_size ", "(now 48)"],
        ),
        (
            {"train": {"parallel": "fsdp2"}},
            (),
            ["saved with train.parallel=ddp, this run uses fsdp2"],
        ),
        ({"optim": {"optimizer": "adamw"}}, (), ["optim.optimizer=muon, now adamw"]),
        (
            {"encoder": {"tokenizer": str(swapped)}},
            (),
            ["checkpoint-6 was trained with another vocabulary", "encoder.tokenizer"],
        ),
        (
            {},
            ("--resume", "never"),
            [
                "already holds checkpoints (checkpoint-6)",
                "a new run (--resume never) needs a new --out",
            ],
        ),
        ({"train": {"global_batch": 16}}, (), ["train.global_batch was 8, now 16"]),
        ({"data": {"path": str(fewer)}}, (), ["trained on 40 rows, the data now gives 39"]),
        ({"encoder": {"layer": 1}}, (), ["layer 0, now"]),
    ]
    capsys.readouterr()
    for sections, extra, messages in cases:
        train = {**TINY_RUN, **sections.pop("train", {})}
        cfg = run_config(assets, train=train, **sections)
        assert train_cli(tmp_path, run, cfg, *extra) == 2, (sections, extra)
        errs = error_lines(capsys.readouterr().err)
        assert len(errs) == 1 and all(m in errs[0] for m in messages), (errs, messages)
        assert "ModelConfig(" not in errs[0]
    assert (sorted(p.name for p in run.iterdir()), (run / "metrics.jsonl").read_text()) == before
    # A checkpoint written before state.json had "rows": the count follows from epoch and
    # examples, and the same data change is refused.
    state_path = run / "checkpoint-6" / "state.json"
    state = json.loads(state_path.read_text())
    state_path.write_text(json.dumps({k: v for k, v in state.items() if k != "rows"}))
    (run / "checkpoint-6" / "manifest.json").unlink()  # (written before manifests were)
    assert (
        train_cli(tmp_path, run, run_config(assets, train=TINY_RUN, data={"path": str(fewer)})) == 2
    )
    errs = error_lines(capsys.readouterr().err)
    assert len(errs) == 1 and "trained on 40 rows, the data now gives 39" in errs[0]
    assert sorted(p.name for p in run.glob("checkpoint-*")) == ["checkpoint-3", "checkpoint-6"]
