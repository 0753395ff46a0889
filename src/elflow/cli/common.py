"""What the commands share: the one model flag, the sampler flags (generated from
:class:`SamplerConfig`'s fields and their docstrings), counts, devices and deprecated spellings."""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable
from typing import Any

from elflow.config import (
    CHOICES,
    PAPER_TASKS,
    SamplerConfig,
    change_sampler,
    fewstep_sampler,
    field_docs,
)
from elflow.errors import ELFError, note_once

NUM_SAMPLES = 4
"""Unconditional samples when ``-n`` is not given (every command that samples)."""
MODEL_SOURCES = (
    "a model folder, training run or checkpoint, an elflow model or authors' checkpoint on the "
    "Hub, an authors' checkpoint_<step> file or folder, or 'demo' (the shipped model)"
)
_TYPES = {"int": int, "float": float, "str": str}


def deprecated(old: str, new: str) -> None:
    """One line, once, for an old spelling that still works in this version."""
    note_once(f"elflow: note: {old} is now {new}; the old spelling goes in a later version")


def add_model_argument(
    p: argparse.ArgumentParser,
    what: str,
    *,
    old_flags: tuple[str, ...] = (),
    old_positional: bool = False,
    default: str | None = None,
) -> None:
    """``--model`` (any model source) and, hidden, the spellings it replaces."""
    shown = f"; default {default}" if default else ""
    p.add_argument("--model", metavar="MODEL", default=None, help=f"{what}: {MODEL_SOURCES}{shown}")
    for flag in old_flags:
        p.add_argument(flag, dest=_old_dest(flag), metavar="MODEL", help=argparse.SUPPRESS)
    if old_positional:
        p.add_argument("old_model", nargs="?", metavar="MODEL", help=argparse.SUPPRESS)
    p.set_defaults(model_default=default, model_old_flags=old_flags)


def _old_dest(flag: str) -> str:
    return "old_" + flag.lstrip("-").replace("-", "_")


def model_from_args(args: argparse.Namespace) -> str:
    """The model the command was given, by ``--model`` or an old spelling (with its note)."""
    given = [("--model", args.model)] if args.model is not None else []
    for flag in getattr(args, "model_old_flags", ()):
        if getattr(args, _old_dest(flag)) is not None:
            deprecated(f"{flag} MODEL", "--model MODEL")
            given.append((flag, getattr(args, _old_dest(flag))))
    if getattr(args, "old_model", None) is not None:
        if args.command != "generate":  # (generate's own note says what replaces it)
            deprecated(f"'elflow {args.command} MODEL'", f"'elflow {args.command} --model MODEL'")
        given.append(("the positional MODEL", args.old_model))
    if len({value for _, value in given}) > 1:
        raise ELFError(f"{given[0][0]} and {given[1][0]} name two models; give one, as --model")
    if given:
        return str(given[0][1])
    if args.model_default is not None:
        return args.model_default
    raise ELFError("pass the model with --model MODEL (a folder, run, Hub id, or 'demo')")


def add_task_argument(p: argparse.ArgumentParser) -> None:
    """``--task`` for an authors' checkpoint, which records none (elflow models refuse it)."""
    p.add_argument(
        "--task",
        choices=list(PAPER_TASKS),
        help="authors' checkpoints: the paper task (default: guessed from the name)",
    )


def add_num_samples(p: argparse.ArgumentParser, conditional_too: bool = True) -> None:
    extra = "; with sources, the first N of them (default: all)" if conditional_too else ""
    p.add_argument(
        "-n",
        "--num-samples",
        type=int,
        metavar="N",
        help=f"unconditional samples to draw (default {NUM_SAMPLES}){extra}",
    )


def num_samples(args: argparse.Namespace, with_sources: bool) -> int | None:
    """``-n`` checked, with the default for unconditional sampling (None: every source)."""
    n = args.num_samples
    if n is not None and n < 1:
        raise ELFError(f"--num-samples must be >= 1, got {n}")
    if n is None and not with_sources:
        return NUM_SAMPLES
    return n


def add_seed_arguments(p: argparse.ArgumentParser) -> None:
    """``--seed`` (one) or ``--seeds`` (several: one sample set each, records carrying ``seed``)."""
    p.add_argument("--seed", type=int, default=None, help="sample i depends on (seed, i) only")
    p.add_argument(
        "--seeds",
        metavar="A,B,...",
        help="several seeds (e.g. 0,1,2): a sample set per seed, records carrying 'seed'; "
        "scores report each metric's mean, between-seed spread and pooled interval",
    )


def seeds_from_args(args: argparse.Namespace) -> list[int]:
    """The seeds of ``--seeds`` or ``--seed`` (default 0)."""
    if args.seeds is None:
        return [0 if args.seed is None else args.seed]
    if args.seed is not None:
        raise ELFError("give one seed with --seed or several with --seeds, not both")
    from elflow.evaluation.seeds import parse_seeds

    return parse_seeds(args.seeds)


def add_device_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--device",
        default="auto",
        help="auto (cuda:LOCAL_RANK when available, else cpu), cpu, cuda or cuda:K",
    )


def add_dtype_argument(p: argparse.ArgumentParser) -> None:
    """``--dtype`` of sampling (and, hidden, the ``--bf16`` it replaces)."""
    p.add_argument(
        "--dtype",
        choices=("auto", "fp32", "bf16"),
        default="auto",
        help="the network's compute dtype: auto (bf16 autocast on CUDA, fp32 elsewhere), fp32 "
        "or bf16",
    )
    p.add_argument("--bf16", action="store_true", help=argparse.SUPPRESS)


def sampling_bf16(args: argparse.Namespace, device) -> bool:
    """Whether to sample under bf16 autocast: ``--dtype`` on ``device`` (``--bf16``: bf16)."""
    if args.bf16:
        deprecated("--bf16", "--dtype bf16")
        return True
    return args.dtype == "bf16" or (args.dtype == "auto" and device.type == "cuda")


def add_sampler_arguments(
    p: argparse.ArgumentParser,
    *,
    lists: tuple[str, ...] = (),
    defaults: dict | None = None,
    preset: bool = True,
) -> None:
    """A flag per :class:`SamplerConfig` field (``--time-mean`` for ``time_mean``), its help the
    field's docstring; unset flags keep the model's value. Fields in ``lists`` take comma lists
    (a sweep's axes)."""
    docs = field_docs(SamplerConfig)
    defaults = defaults or {}
    group = p.add_argument_group("sampler (default: the model's own settings)")
    for f in dataclasses.fields(SamplerConfig):
        flag = "--" + f.name.replace("_", "-")
        doc = docs.get(f.name, "")
        if f.name in lists:
            default = defaults.get(f.name)
            shown = f" (default {default})" if default else ""
            group.add_argument(
                flag, metavar="A,B,...", default=default, help=f"comma list; {doc}{shown}"
            )
        else:
            group.add_argument(
                flag, type=_TYPES[str(f.type)], choices=CHOICES.get(f.name), help=doc
            )
    if not preset:  # a sweep sweeps the grid instead
        return
    group.add_argument(
        "--preset",
        choices=["model", "fewstep"],
        help="model: the model's settings; fewstep: the paper's distilled-student SDE settings "
        "for --steps (default 8)",
    )


def sampler_from_args(
    args: argparse.Namespace, base: SamplerConfig, skip: tuple[str, ...] = ()
) -> SamplerConfig:
    """``base`` (a model's defaults) with ``--preset`` and the given sampler flags applied."""
    if getattr(args, "preset", None) == "fewstep":
        steps = args.steps if isinstance(args.steps, int) else 8
        base = fewstep_sampler(base, steps)
    changes = {
        f.name: getattr(args, f.name)
        for f in dataclasses.fields(SamplerConfig)
        if f.name not in skip and getattr(args, f.name, None) is not None
    }
    return change_sampler(base, changes)


def checked_sampler(args: argparse.Namespace, pipe: Any, skip: tuple[str, ...] = ()):
    """The command's sampler (:func:`sampler_from_args` over the model's), checked against the
    model (``ArtifactConfig.check_sampler``; its errors name ``sampler.<field>``, which
    :mod:`elflow.cli.flags` writes as the flags)."""
    return pipe.check_sampler(sampler_from_args(args, pipe.sampler, skip))


def comma_list(text: str | None, kind: Callable[[str], Any], flag: str) -> list:
    """``"8,16"`` -> ``[8, 16]``; None -> ``[None]`` (the model's value)."""
    if text is None:
        return [None]
    try:
        values = [kind(v.strip()) for v in text.split(",") if v.strip()]
    except ValueError:
        raise ELFError(f"{flag} must be a comma-separated list, got {text!r}") from None
    if not values:
        raise ELFError(f"{flag} is empty")
    return values


def load_pipeline(model: str, device: Any, *, use_ema: bool = True, task: str | None = None):
    """The model as an :class:`ELFPipeline` (without transformers' weight-loading bars)."""
    from transformers.utils import logging as hf_logging

    from elflow.generation.pipeline import ELFPipeline

    hf_logging.disable_progress_bar()
    return ELFPipeline.from_pretrained(model, device=device, use_ema=use_ema, task=task)


def add_sources_arguments(p: argparse.ArgumentParser, inline: bool = True) -> None:
    """Where a conditional model's sources come from."""
    if inline:
        p.add_argument(
            "--source",
            action="append",
            metavar="TEXT",
            help="conditional models: a source text to translate or summarise (repeatable)",
        )
    p.add_argument("--sources", metavar="FILE", help="conditional: JSONL(.gz), one source a line")
    p.add_argument("--source-field", default="text", help="field of --sources holding the text")


def sources_from_args(args: argparse.Namespace) -> list[dict] | None:
    """The sources of ``--sources FILE`` or ``--source TEXT`` (each as ``{"text": ...}``), cut to
    ``-n`` when it is given; None when there are none."""
    from elflow.generation.records import read_sources

    inline = getattr(args, "source", None)
    if inline and args.sources:
        raise ELFError("give sources with --source TEXT or with --sources FILE, not both")
    if inline:
        if args.source_field != "text":
            raise ELFError("--source-field applies to --sources FILE; drop it")
        rows = [{"text": text} for text in inline]
    elif args.sources:
        rows = read_sources(args.sources, args.source_field)
    else:
        return None
    n = num_samples(args, with_sources=True)
    return rows if n is None else rows[:n]
