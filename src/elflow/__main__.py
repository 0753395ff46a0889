"""The ``elflow`` command line: a thin table of subcommand -> function.

Each subcommand is ``(add_arguments, run)``; ``run`` returns an exit code. User errors
(:class:`ELFError`) print one line and exit with status 2; nothing here is imported by the library.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import os
import sys
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path

from elflow import __version__
from elflow.errors import ELFError


def _add_import(p: argparse.ArgumentParser) -> None:
    from elflow.generation.records import add_task_argument

    p.add_argument("source", help="authors' checkpoint: checkpoint_<step> file, folder or Hub id")
    p.add_argument("--out", required=True, help="folder for the elflow model")
    add_task_argument(p)
    p.add_argument("--no-ema", action="store_true", help="export 'params' instead of the EMA")


def _run_import(args: argparse.Namespace) -> int:
    from elflow.io.artifact import import_official

    out = import_official(args.source, args.out, task=args.task, use_ema=not args.no_ema)
    print(f"wrote {out}")
    return 0


def _add_info(p: argparse.ArgumentParser) -> None:
    from elflow.generation.records import add_task_argument

    p.add_argument("model", help="any model source (folder, checkpoint, Hub id)")
    add_task_argument(p)


def _run_info(args: argparse.Namespace) -> int:
    from elflow.io.artifact import load_model
    from elflow.model import count_parameters

    model, config = load_model(args.model, task=args.task)
    print(json.dumps({"parameters": count_parameters(model), **config.to_json()}, indent=2))
    return 0


def _add_check_fixture(p: argparse.ArgumentParser) -> None:
    p.add_argument("fixture", help="reference fixture .safetensors (with its .json beside it)")


def _run_check_fixture(args: argparse.Namespace) -> int:
    from elflow.testing.reference import check_fixture

    report = check_fixture(args.fixture)
    worst = max(report.items(), key=lambda kv: kv[1])
    bad = {k: v for k, v in report.items() if v > 1e-4}
    for key, value in report.items():
        print(f"{value:.3e}  {key}")
    print(f"{len(report)} entries, worst {worst[1]:.3e} ({worst[0]}), {len(bad)} over 1e-4")
    return 1 if bad else 0


def _add_generate(p: argparse.ArgumentParser) -> None:
    from elflow.generation.records import add_project_argument, add_task_argument

    p.add_argument("model", help="any model source (folder, checkpoint, Hub id)")
    add_task_argument(p)
    p.add_argument("-n", "--num-samples", type=int, help="unconditional: how many (default 4)")
    p.add_argument("--source", action="append", help="source text (conditional models; repeat)")
    p.add_argument("--steps", type=int)
    p.add_argument("--sampler", choices=["ode", "sde", "heun"])
    p.add_argument("--gamma", type=float)
    p.add_argument("--w", type=float, help="self-conditioning CFG scale")
    p.add_argument("--cfg", type=float, help="classifier-free guidance (conditional models)")
    add_project_argument(p)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--device", default="cpu", help="cpu, cuda, cuda:K or auto")


def _run_generate(args: argparse.Namespace) -> int:
    from elflow.generation.pipeline import ELFPipeline
    from elflow.generation.records import resolve_device, resolve_sampler

    pipe = ELFPipeline.from_pretrained(
        args.model, device=resolve_device(args.device).device, task=args.task
    )
    options = dict(
        steps=args.steps,
        sampler=args.sampler,
        gamma=args.gamma,
        w=args.w,
        project_from=args.project_from,
    )
    resolve_sampler(pipe, cfg=args.cfg, **options)  # its errors name the options (--steps)
    n = args.num_samples if args.num_samples is not None or args.source else 4
    texts = pipe.generate(
        n, sources=args.source, cfg=args.cfg, seed=args.seed, batch_size=args.batch_size, **options
    )
    for text in texts:
        print(text)
    return 0


def _add_train(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--preset", required=True, help="owt-b, owt-m, owt-l, de-en-b, xsum-b, bible-tiny, ..."
    )
    p.add_argument("--out", required=True, help="run folder (checkpoints, metrics, samples)")
    p.add_argument("--config", help="YAML or JSON file of config sections to override")
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override one dotted config key, e.g. train.max_steps=100 (repeatable)",
    )
    p.add_argument(
        "--resume",
        default="auto",
        help="'auto' (latest checkpoint in --out, if any), 'never', or a checkpoint/run folder",
    )
    p.add_argument(
        "--init",
        metavar="MODEL",
        help="fine-tune: start from this model's weights (run, checkpoint, model folder, Hub id "
        "or authors' checkpoint), in its architecture and latent space (= --set train.init=MODEL)",
    )
    p.add_argument("--print-config", action="store_true", help="print the resolved config, exit")


def _with_model_dims(cfg):
    """``cfg`` with the network's E and V that training will take from the encoder's config and
    the tokenizer (a preset's own values are placeholders); unchanged, with a note, when they
    cannot be read here."""
    from transformers import AutoConfig

    from elflow.encoder import resolve_pretrained
    from elflow.generation.pipeline import load_tokenizer

    try:
        width = AutoConfig.from_pretrained(resolve_pretrained(cfg.encoder.name)).hidden_size
        vocab = len(load_tokenizer(cfg.encoder.tokenizer_name))
    except (OSError, ValueError, ELFError) as e:  # offline, a missing folder: training says so
        print(
            "elflow: note: model.encoder_dim and model.vocab_size are set from the encoder and "
            f"tokenizer when training starts (not readable here: {str(e).splitlines()[0][:120]})",
            file=sys.stderr,
        )
        return cfg
    return replace(cfg, model=replace(cfg.model, encoder_dim=int(width), vocab_size=vocab))


def _run_train(args: argparse.Namespace) -> int:
    from elflow.train.config import apply_overrides, run_config_to_dict
    from elflow.train.presets import preset

    base = preset(args.preset)
    cfg = apply_overrides(base, args.config, args.set)
    if args.init:
        if cfg.train.init and cfg.train.init != args.init:
            raise ELFError(f"--init {args.init} and train.init={cfg.train.init} differ; give one")
        cfg = replace(cfg, train=replace(cfg.train, init=args.init))
    from elflow.train.loop import train
    from elflow.train.resume import apply_init, check_no_architecture

    if cfg.train.init:
        check_no_architecture(cfg, base)
    if args.print_config:
        shown = _with_model_dims(apply_init(cfg)[0] if cfg.train.init else cfg)
        print(json.dumps(run_config_to_dict(shown), indent=2))
        return 0
    from elflow.distributed import teardown

    try:
        last = train(cfg, args.out, resume=args.resume)
    finally:
        teardown()
    if os.environ.get("RANK", "0") == "0":  # once under torchrun
        print(f"done: {last}")
    return 0


def _delegate(module: str) -> tuple[Callable, Callable]:
    """(add_arguments, run) of a module that owns its subcommand, imported lazily."""

    def add(p: argparse.ArgumentParser) -> None:
        importlib.import_module(module).add_arguments(p)

    def run(args: argparse.Namespace) -> int:
        return importlib.import_module(module).run(args)

    return add, run


COMMANDS: dict[str, tuple[str, Callable, Callable]] = {
    "demo": (
        "watch the shipped CPU model write verses out of noise",
        *_delegate("elflow.generation.demo"),
    ),
    "sample": ("generate samples into a JSONL file", *_delegate("elflow.generation.records")),
    "score": (
        "score samples: generative perplexity, entropy, BLEU, ROUGE",
        *_delegate("elflow.cli.score"),
    ),
    "sweep": ("sample and score a grid of sampler settings", *_delegate("elflow.evaluation.sweep")),
    "prepare": (
        "tokenise a corpus once into a memory-mapped token file",
        *_delegate("elflow.cli.prepare"),
    ),
    "train": ("train or resume an ELF model", _add_train, _run_train),
    "distill": (
        "progressive distillation into few-step students",
        *_delegate("elflow.train.curriculum"),
    ),
    "generate": ("generate text and print it", _add_generate, _run_generate),
    "import": ("convert an authors' checkpoint to an elflow model", _add_import, _run_import),
    "info": ("print a model's config and size", _add_info, _run_info),
    "check-fixture": (
        "compare elflow to a reference fixture",
        _add_check_fixture,
        _run_check_fixture,
    ),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="elflow", description="ELF: Embedded Language Flows")
    parser.add_argument("--version", action="version", version=f"elflow {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (help_text, add, _) in COMMANDS.items():
        add(sub.add_parser(name, help=help_text, description=help_text))
    return parser


def _out_of_memory(e: BaseException) -> bool:
    """torch.OutOfMemoryError (CUDA), the CPU allocator's refusal, or Python's MemoryError."""
    text = str(e).lower()
    return (
        isinstance(e, MemoryError)
        or type(e).__name__ == "OutOfMemoryError"
        or "can't allocate memory" in text
        or "out of memory" in text  # CUDA and MPS spellings
        or "cublas_status_alloc_failed" in text
    )


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return COMMANDS[args.command][2](args)
    except ELFError as e:
        print(f"elflow: error: {e}", file=sys.stderr)
        return getattr(e, "exit_code", 2)
    except BrokenPipeError:  # e.g. `elflow generate ... | head -1`: the reader has what it wants
        # So that Python's flush at exit does not fail on the closed pipe too (a captured
        # stdout has no file descriptor: nothing to do).
        with contextlib.suppress(OSError, ValueError):
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141
    except FileNotFoundError as e:
        if e.filename is None:
            print(f"elflow: error: {e}", file=sys.stderr)
        else:
            print(f"elflow: error: {Path(e.filename)} does not exist", file=sys.stderr)
        return 2
    except OSError as e:
        # A path the commands' own checks did not foresee (a full disk, a read-only file
        # system, a folder where a file was expected); still one line.
        where = f"{e.filename}: " if e.filename else ""
        if e.filename2:  # a rename: name where it was going
            where = f"{e.filename} -> {e.filename2}: "
        print(f"elflow: error: {where}{e.strerror or e}", file=sys.stderr)
        return 2
    except (MemoryError, RuntimeError) as e:
        if not _out_of_memory(e):
            raise
        first = str(e).strip().splitlines()[0][:200] if str(e).strip() else type(e).__name__
        print(
            f"elflow: error: out of memory ({first}); lower train.micro_batch (accumulation keeps "
            "the batch) or turn on train.activation_checkpointing to train, lower --batch-size "
            "to sample or score (a sweep's judge: --score-batch-size; --resume keeps its scored "
            "cells); checkpoints already saved are kept",
            file=sys.stderr,
        )
        return 2
    except KeyboardInterrupt:  # e.g. during a start-up encoding pass, or a second Ctrl-C
        print(
            "elflow: interrupted; files written before (checkpoints, caches) are kept",
            file=sys.stderr,
        )
        return 130


if __name__ == "__main__":
    sys.exit(main())
