"""``elflow train``: train or resume an ELF model from a preset and overrides (ELF_SPEC §3).

``--model MODEL`` fine-tunes: the run starts from that model's weights, in its architecture and
latent space (the same as ``--set train.init=MODEL``; ``--init`` is its old spelling).
``--steps N`` makes a short run sensible without extra keys
(:func:`elflow.config.run_presets.short_run`).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import replace

from elflow.cli.common import MODEL_SOURCES, deprecated
from elflow.errors import ELFError, first_line


def add_run_config_arguments(p: argparse.ArgumentParser, preset_default: str | None) -> None:
    """``--preset``, ``--config`` and ``--set``: a run's config (``train`` and ``distill``)."""
    p.add_argument(
        "--preset",
        required=preset_default is None,
        default=preset_default,
        help="the run's starting point: owt-b, owt-m, owt-l, de-en-b, xsum-b (the paper's), "
        "bible-tiny, de-en-tiny, summ-tiny (CPU-sized)"
        + (f"; default {preset_default}" if preset_default else ""),
    )
    p.add_argument("--config", help="YAML or JSON file of config sections to override")
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override one dotted config key, e.g. train.max_steps=100 (repeatable)",
    )


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_run_config_arguments(p, None)
    p.add_argument(
        "--out", help="run folder (checkpoints, metrics, samples); default runs/<preset>"
    )
    p.add_argument(
        "--resume",
        default="auto",
        help="'auto' (latest checkpoint in --out, if any), 'never', or a checkpoint/run folder",
    )
    p.add_argument(
        "--model",
        metavar="MODEL",
        help=f"fine-tune: start from this model's weights ({MODEL_SOURCES}), in its "
        "architecture and latent space (= --set train.init=MODEL)",
    )
    p.add_argument("--init", metavar="MODEL", help=argparse.SUPPRESS)  # the old --model
    p.add_argument(
        "--steps",
        type=int,
        metavar="N",
        help="a run of N steps with everything scaled to it: warm-up 5%% of N, the lr decaying "
        "over the last 30%%, a checkpoint and held-out loss every N/5 steps, samples at the end, "
        "EMA warm-up on (a --set of any of these keys wins; not with --set train.max_steps)",
    )
    p.add_argument("--print-config", action="store_true", help="print the resolved config, exit")


def _with_model_dims(cfg):
    """``cfg`` with the network's E and V that training will take from the encoder's config and
    the tokenizer (a preset's own values are placeholders); unchanged, with a note, when they
    cannot be read here."""
    from transformers import AutoConfig

    from elflow.text.encoder import resolve_pretrained
    from elflow.text.tokenizer import load_tokenizer

    try:
        width = AutoConfig.from_pretrained(resolve_pretrained(cfg.encoder.name)).hidden_size
        vocab = len(load_tokenizer(cfg.encoder.tokenizer_name))
    except (OSError, ValueError, ELFError) as e:  # offline, a missing folder: training says so
        print(
            "elflow: note: model.encoder_dim and model.vocab_size are set from the encoder and "
            f"tokenizer when training starts (not readable here: {first_line(e, 120)})",
            file=sys.stderr,
        )
        return cfg
    return replace(cfg, model=replace(cfg.model, encoder_dim=int(width), vocab_size=vocab))


def init_from_args(args: argparse.Namespace) -> str | None:
    """The model to fine-tune from, by ``--model`` or its old spelling ``--init``."""
    if args.init is not None:
        deprecated("--init MODEL", "--model MODEL")
        if args.model is not None and args.model != args.init:
            raise ELFError("--model and --init name two models; give one, as --model")
    return args.model or args.init


def run(args: argparse.Namespace) -> int:
    from elflow.config.run_presets import preset, short_run
    from elflow.config.train_config import apply_overrides, override_keys, run_config_to_dict

    base = preset(args.preset)
    if args.steps is not None:  # scaled first, so that the user's own keys win
        base = short_run(base, args.steps, keep=override_keys(args.config, args.set))
    cfg = apply_overrides(base, args.config, args.set)
    init = init_from_args(args)
    if init:
        if cfg.train.init and cfg.train.init != init:
            raise ELFError(f"--model {init} and train.init={cfg.train.init} differ; give one")
        cfg = replace(cfg, train=replace(cfg.train, init=init))
    from elflow.train.resume import apply_init, check_no_architecture

    if cfg.train.init:
        check_no_architecture(cfg, base)
    if args.print_config:
        shown = _with_model_dims(apply_init(cfg)[0] if cfg.train.init else cfg)
        print(json.dumps(run_config_to_dict(shown), indent=2))
        return 0
    from elflow.runtime.distributed import teardown
    from elflow.train.loop import train

    out = args.out or os.path.join("runs", args.preset)
    if not args.out and os.environ.get("RANK", "0") == "0":
        print(f"elflow train: writing to {out} (--out names another folder)", file=sys.stderr)
    try:
        last = train(cfg, out, resume=args.resume)
    finally:
        teardown()
    if os.environ.get("RANK", "0") == "0":  # once under torchrun
        print(f"done: {last}")
    return 0
