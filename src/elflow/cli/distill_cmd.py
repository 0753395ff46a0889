"""``elflow distill``: distillation of ``--model`` (the frozen teacher) into few-step students,
round after resumable round, by a registered method (``--method``: progressive distillation,
ELF_SPEC §8, or consistency distillation; :mod:`elflow.distill.curriculum`)."""

from __future__ import annotations

import argparse
import os

from elflow.cli.common import add_model_argument, add_task_argument, model_from_args
from elflow.cli.train_cmd import add_run_config_arguments
from elflow.errors import ELFError


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_model_argument(p, "the teacher (frozen)", old_flags=("--teacher",))
    add_task_argument(p)
    p.add_argument("--out", required=True, help="folder for the rounds")
    add_run_config_arguments(p, "bible-tiny")
    p.add_argument(
        "--method",
        default="pd",
        help="distillation method: pd (progressive distillation, the paper's; default) or cd "
        "(consistency distillation: one round, students for any step count)",
    )
    p.add_argument(
        "--method-set",
        action="append",
        metavar="KEY=VALUE",
        help="a setting of the method (repeatable), e.g. --method-set teacher_substeps=8",
    )
    p.add_argument(
        "--rounds",
        default=None,
        help="pd: student steps / teacher sub-steps per round (default: the paper's "
        "16/4,8/8,4/16,2/32,1/64)",
    )
    p.add_argument(
        "--teacher-steps", type=int, default=None, help="pd: N x K of every round (0: any; 64)"
    )
    p.add_argument(
        "--teacher-project-from",
        type=float,
        default=1.0,
        metavar="T",
        help="distil the teacher's projected trajectory: its x-predictions at t >= T replaced by "
        "the encoder's latents of their text (elflow addition; default 1 = off, the paper)",
    )


def run(args: argparse.Namespace) -> int:
    from elflow.config.run_presets import preset
    from elflow.config.train_config import apply_overrides, override_keys
    from elflow.distill.curriculum import distill
    from elflow.runtime.distributed import teardown
    from elflow.train.resume import architecture_changes

    settings = method_sets(args.method_set)
    teacher = model_from_args(args)
    cfg = apply_overrides(preset(args.preset), args.config, args.set)
    if cfg.train.max_steps <= 0:
        raise ELFError("set the steps per round with --set train.max_steps=N")
    objective_keys = {
        key.removeprefix("objective.")
        for key in override_keys(args.config, args.set)
        if key.startswith("objective.")
    }
    fixed_keys = set(architecture_changes(cfg, preset(args.preset)))  # changed from the preset
    try:
        last = distill(
            teacher,
            cfg,
            args.out,
            args.rounds,
            64 if args.teacher_steps is None else args.teacher_steps or None,
            objective_keys,
            preset(args.preset).objective,
            fixed_keys,
            args.task,
            args.teacher_project_from,
            method=args.method,
            settings=settings,
        )
    finally:
        teardown()
    if os.environ.get("RANK", "0") == "0":  # once under torchrun
        print(f"done: {last}")
    return 0


def method_sets(items: list[str] | None) -> dict[str, str | int | float]:
    """``--method-set spans=0.5,1 --method-set teacher_substeps=8`` -> a dict, numbers as
    numbers."""
    out: dict[str, str | int | float] = {}
    for item in items or ():
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ELFError(f"--method-set takes KEY=VALUE, got {item!r}")
        out[key.strip()] = _number(value.strip())
    return out


def _number(value: str) -> str | int | float:
    for kind in (int, float):
        try:
            return kind(value)
        except ValueError:
            continue
    return value
