"""Damaged and hostile files are found and answered in one line: checkpoint manifests (a damaged
latest checkpoint gives way to the newest intact one), atomic pruning, non-finite weights, model
configs too large to build, pickled encoder weights, a tokenizer of the wrong schema, paths
through a symbolic-link loop and the loaders' own advice to unpickle."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from elflow.errors import ELFError, first_line
from elflow.io.manifest import MANIFEST, damage
from tests.train_helpers import (
    assert_same_checkpoint,
    error_lines,
    run_config,
    train_cli,
)

TRAIN = {"max_steps": 4, "save_every": 2}


@pytest.fixture(scope="module")
def trained(tmp_path_factory, assets):
    """A 4-step run (checkpoint-2, checkpoint-4) and the same run straight to step 6."""
    tmp = tmp_path_factory.mktemp("trained")
    assert train_cli(tmp, tmp / "run", run_config(assets, train=TRAIN)) == 0
    six = {**TRAIN, "max_steps": 6}
    assert train_cli(tmp, tmp / "straight", run_config(assets, train=six)) == 0
    return tmp


def _copy(trained: Path, tmp: Path) -> Path:
    run = tmp / "run"
    shutil.copytree(trained / "run", run)
    return run


def _flip_byte(path: Path, at: float = 0.7) -> None:
    data = bytearray(path.read_bytes())
    data[int(len(data) * at)] ^= 0x10
    path.write_bytes(bytes(data))


def test_every_checkpoint_lists_its_files_with_checksums(trained):
    for ckpt in ("checkpoint-2", "checkpoint-4"):
        folder = trained / "run" / ckpt
        files = json.loads((folder / MANIFEST).read_text())["files"]
        on_disk = {p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file()} - {
            MANIFEST
        }
        assert set(files) == on_disk and {"model.safetensors", "state.json"} <= on_disk
        assert any(name.startswith("train-state/") for name in files)
        assert damage(folder) is None


def test_a_damaged_latest_checkpoint_gives_way_to_the_newest_intact_one(
    trained,
    tmp_path,
    assets,
    capsys,
):
    run = _copy(trained, tmp_path)
    _flip_byte(run / "checkpoint-4" / "model.safetensors")
    assert damage(run / "checkpoint-4") == "model.safetensors does not match its checksum"
    cfg = run_config(assets, train={**TRAIN, "max_steps": 6})
    assert train_cli(tmp_path, run, cfg) == 0
    warnings = [x for x in capsys.readouterr().err.splitlines() if "is damaged" in x]
    assert warnings == [
        f"elflow: warning: {run / 'checkpoint-4'} is damaged (model.safetensors does not match "
        f"its checksum); resuming from {run / 'checkpoint-2'}, the newest intact checkpoint "
        "before it"
    ]
    # The damaged checkpoint is kept aside (nothing is deleted), and the run continues exactly
    # (bitwise: `trained` ran with the test's one thread, tests/conftest.py).
    assert (run / "abandoned-1" / "checkpoint-4").is_dir()
    assert_same_checkpoint(run / "checkpoint-6", trained / "straight" / "checkpoint-6")


def test_a_damaged_checkpoint_named_explicitly_is_refused(trained, tmp_path, assets, capsys):
    run = _copy(trained, tmp_path)
    state = run / "checkpoint-4" / "state.json"
    state.write_text(state.read_text().replace('"step": 4', '"step": 5'))
    cfg = run_config(assets, train={**TRAIN, "max_steps": 6})
    assert train_cli(tmp_path, run, cfg, "--resume", str(run / "checkpoint-4")) == 2
    assert error_lines(capsys.readouterr().err) == [
        f"elflow: error: cannot resume: {run / 'checkpoint-4'} is damaged (state.json does not "
        f"match its checksum); name the newest intact checkpoint before it, "
        f"{run / 'checkpoint-2'}, instead"
    ]
    assert not (run / "checkpoint-6").exists()


def test_loading_checks_the_weights_it_reads(trained, tmp_path, capsys):
    from elflow import load_model

    run = _copy(trained, tmp_path)
    _flip_byte(run / "checkpoint-4" / "ema.safetensors")
    model, _ = load_model(run)  # the run's latest: damaged, so the one before it
    expected, _ = load_model(trained / "run" / "checkpoint-2")
    for a, b in zip(model.state_dict().values(), expected.state_dict().values(), strict=True):
        assert torch.equal(a, b)
    assert "is damaged (ema.safetensors does not match its checksum); loading" in (
        capsys.readouterr().err
    )
    with pytest.raises(ELFError, match=r"checkpoint-4 is damaged .*checkpoint-2, instead"):
        load_model(run / "checkpoint-4")  # named: not replaced
    load_model(run / "checkpoint-4", use_ema=False)  # its training weights are intact


def test_non_finite_weights_are_refused_at_load(trained, tmp_path):
    from safetensors.torch import load_file, save_file

    from elflow import load_model

    model = tmp_path / "model"
    shutil.copytree(trained / "run" / "checkpoint-4", model)
    (model / MANIFEST).unlink()  # a hand-edited model folder: nothing to check it against
    state = load_file(model / "ema.safetensors")
    state["blocks.1.mlp.w3.weight"][0, 0] = float("inf")
    save_file(state, model / "ema.safetensors")
    with pytest.raises(ELFError) as e:
        load_model(model)
    assert str(e.value) == (
        f"{model} holds NaN or infinite weights (blocks.1.mlp.w3.weight); the run diverged "
        "before it was saved or the file is damaged: load an earlier checkpoint"
    )


def test_a_killed_prune_leaves_no_half_checkpoint(trained, tmp_path, monkeypatch):
    from elflow.io import checkpoint as ckpt_io
    from elflow.io.model_sources import latest_run_checkpoint

    run = _copy(trained, tmp_path)
    real = shutil.rmtree

    def killed(path, *args, **kwargs):  # deletes one file, then the process "dies"
        next(p for p in Path(path).rglob("*") if p.is_file()).unlink()
        raise KeyboardInterrupt

    monkeypatch.setattr(ckpt_io.shutil, "rmtree", killed)
    with pytest.raises(KeyboardInterrupt):
        ckpt_io._prune(run, keep_last=1, current=4)
    monkeypatch.setattr(ckpt_io.shutil, "rmtree", real)
    assert sorted(p.name for p in run.iterdir() if "checkpoint" in p.name) == [
        ".trash-checkpoint-2",
        "checkpoint-4",
    ]
    assert latest_run_checkpoint(run) == run / "checkpoint-4"
    ckpt_io._prune(run, keep_last=1, current=4)  # the next save's prune clears the rest
    assert sorted(p.name for p in run.iterdir() if "checkpoint" in p.name) == ["checkpoint-4"]


@pytest.mark.parametrize(
    "change", [{"hidden_size": 2**40, "num_heads": 2**34}, {"depth": 10**9}], ids=["wide", "deep"]
)
def test_a_model_config_too_large_to_build_is_refused_before_allocating(
    trained,
    tmp_path,
    change,
    assets,
):
    from elflow import load_model
    from elflow.config import ModelConfig

    model = tmp_path / "model"
    shutil.copytree(trained / "run" / "checkpoint-4", model)
    (model / MANIFEST).unlink()
    cfg = json.loads((model / "config.json").read_text())
    cfg["model"].update(change)
    (model / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ELFError, match=r"parameters, which needs about .* GB for its weights"):
        load_model(model)
    big = run_config(assets, model=change)
    assert train_cli(tmp_path, tmp_path / "big", big) == 2
    assert ModelConfig(**change).num_parameters > 10**14


def test_the_parameter_count_from_the_config_is_exact():
    from elflow.config import ModelConfig
    from elflow.model import build_model, count_parameters

    for kw in (
        {"depth": 2, "hidden_size": 64, "num_heads": 4, "encoder_dim": 16, "vocab_size": 50},
        {
            "depth": 3,
            "hidden_size": 48,
            "num_heads": 2,
            "encoder_dim": 8,
            "vocab_size": 30,
            "self_condition": False,
            "num_scale_tokens": 0,
            "mlp_ratio": 2.5,
            "bottleneck_dim": 4,
        },
    ):
        cfg = ModelConfig(**kw)
        assert cfg.num_parameters == count_parameters(build_model(cfg))


class Payload:
    """A pickle that would write a file when unpickled."""

    def __init__(self, target: Path) -> None:
        self.target = target

    def __reduce__(self):
        return (exec, (f"open({str(self.target)!r}, 'w').write('ran')",))


def test_a_pickled_encoder_is_refused_without_running_it(assets, tmp_path):
    from elflow.text.encoder import FrozenEncoder

    folder = tmp_path / "encoder"
    folder.mkdir()
    shutil.copy(assets / "encoder" / "config.json", folder / "config.json")
    torch.save({"w": Payload(tmp_path / "ran")}, folder / "pytorch_model.bin")
    with pytest.raises(ELFError) as e:
        FrozenEncoder.from_pretrained(str(folder))
    message = str(e.value)
    assert "\n" not in message and "add_safe_globals" not in message and "\x1b" not in message
    assert "a pickle holding objects other than tensors (exec), which elflow never unpickles" in (
        message
    )
    assert not (tmp_path / "ran").exists()


def test_a_tokenizer_of_the_wrong_schema_is_one_line(tmp_path):
    from elflow.text.tokenizer import load_tokenizer

    (tmp_path / "tokenizer.json").write_text(json.dumps({"model": {"type": "WordPiece"}}))
    with pytest.raises(ELFError) as e:
        load_tokenizer(tmp_path)
    assert str(e.value) == (
        f"cannot load tokenizer '{tmp_path}' (no 'added_tokens' entry); its files are damaged "
        "or not a Hugging Face tokenizer: use the files tokenizer.save_pretrained writes"
    )


def test_a_path_through_a_symlink_loop_is_one_line(tmp_path, assets, capsys):
    from elflow import load_model

    (tmp_path / "a").symlink_to(tmp_path / "b")
    (tmp_path / "b").symlink_to(tmp_path / "a")
    for out in (tmp_path / "a", tmp_path / "a" / "run"):
        assert train_cli(tmp_path, out, run_config(assets)) == 2
        (line,) = error_lines(capsys.readouterr().err)
        assert f"--out {out} goes through a symbolic link that loops" in line
    with pytest.raises(ELFError, match="goes through a symbolic link that loops"):
        load_model(tmp_path / "a")


def test_refused_pickles_and_terminal_codes_never_reach_a_message(tmp_path):
    from elflow.evaluation.judge import load_judge
    from elflow.io.official import read_official_checkpoint

    path = tmp_path / "checkpoint_100"
    torch.save({"params": {"w": Payload(tmp_path / "ran")}}, path)
    with pytest.raises(ELFError) as e:
        read_official_checkpoint(path)
    assert "add_safe_globals" not in str(e.value) and "(exec)" in str(e.value)
    judge = tmp_path / "judge"
    judge.mkdir()
    from transformers import GPT2Config

    GPT2Config(vocab_size=8, n_embd=8, n_layer=1, n_head=2, n_positions=16).save_pretrained(judge)
    torch.save({"w": Payload(tmp_path / "ran")}, judge / "pytorch_model.bin")
    with pytest.raises(ELFError) as e:
        load_judge(str(judge))
    assert "\x1b" not in str(e.value) and "add_safe_globals" not in str(e.value)
    assert not (tmp_path / "ran").exists()
    styled = RuntimeError("\x1b[1mbold\x1b[0m text\nsecond line")
    assert first_line(styled) == "bold text"


def test_the_messages_for_pairs_data_lead_to_a_conditional_run(tmp_path, assets, capsys):
    """Source/target data on an unconditional preset: each message names what the next run
    needs, none sends the user back (no 'set max_input_length' then 'leave it at 0')."""
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text(
        "".join(
            json.dumps({"source": f"hallo {i}", "target": f"hello {i}"}) + "\n" for i in range(40)
        )
    )
    base = run_config(assets, data={"path": str(pairs)}, train={"max_steps": 1})
    assert train_cli(tmp_path, tmp_path / "a", base) == 2  # the format says plain text
    (line,) = error_lines(capsys.readouterr().err)
    assert "a source/target pair, but data.format jsonl reads plain text ('text')" in line
    base["data"]["format"] = "auto"
    assert train_cli(tmp_path, tmp_path / "a", base) == 2
    (line,) = error_lines(capsys.readouterr().err)
    assert "holds source/target pairs but the run's task is unconditional" in line
    assert "set task=conditional and max_input_length" in line and "leave it at 0" not in line
    cond = {**base, "task": "conditional"}
    assert train_cli(tmp_path, tmp_path / "b", cond) == 2
    (line,) = error_lines(capsys.readouterr().err)
    assert "set max_input_length, the source's share of each row (e.g. 6)" in line
    assert train_cli(tmp_path, tmp_path / "c", {**cond, "max_input_length": 6}) == 0
    only_length = {**base, "max_input_length": 6}
    assert train_cli(tmp_path, tmp_path / "d", only_length) == 2
    (line,) = error_lines(capsys.readouterr().err)
    assert "leave it at 0, or set task=conditional for source/target data" in line
