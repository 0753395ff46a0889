"""Commands about a model's files: ``elflow import`` (an authors' checkpoint to an elflow model),
``elflow info`` (a model's config and size) and ``elflow check-fixture`` (parity against the
authors' reference tensors, ELF_SPEC §2-§5)."""

from __future__ import annotations

import argparse
import json

from elflow.cli.common import add_model_argument, add_task_argument, model_from_args


def add_import_arguments(p: argparse.ArgumentParser) -> None:
    add_model_argument(
        p,
        "the authors' checkpoint: a checkpoint_<step> file, folder or Hub id",
        old_positional=True,
    )
    p.add_argument("--out", required=True, help="folder for the elflow model")
    add_task_argument(p)
    p.add_argument("--no-ema", action="store_true", help="export 'params' instead of the EMA")


def run_import(args: argparse.Namespace) -> int:
    from elflow.io.artifact import import_official
    from elflow.io.paths import output_dir

    output_dir(args.out, "--out")  # before the checkpoint is read
    out = import_official(model_from_args(args), args.out, task=args.task, use_ema=not args.no_ema)
    print(f"wrote {out}")
    return 0


def add_info_arguments(p: argparse.ArgumentParser) -> None:
    add_model_argument(p, "the model to describe", old_positional=True)
    add_task_argument(p)


def run_info(args: argparse.Namespace) -> int:
    from elflow.io.artifact import load_model
    from elflow.model import count_parameters

    model, config = load_model(model_from_args(args), task=args.task)
    print(json.dumps({"parameters": count_parameters(model), **config.to_json()}, indent=2))
    return 0


def add_check_fixture_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "fixture",
        nargs="?",
        help="reference fixture .safetensors (with its .json beside it; default: the tiny "
        "fixture shipped with elflow)",
    )


def run_check_fixture(args: argparse.Namespace) -> int:
    from elflow.testing.reference import BUNDLED_FIXTURE, check_fixture

    report = check_fixture(args.fixture or BUNDLED_FIXTURE)
    worst = max(report.items(), key=lambda kv: kv[1])
    bad = {k: v for k, v in report.items() if v > 1e-4}
    for key, value in report.items():
        print(f"{value:.3e}  {key}")
    print(f"{len(report)} entries, worst {worst[1]:.3e} ({worst[0]}), {len(bad)} over 1e-4")
    return 1 if bad else 0
