"""The ``elflow`` command line: a thin table of subcommand -> function in :mod:`elflow.cli`.

Each subcommand is ``(add_arguments, run)``; ``run`` returns an exit code. User errors
(:class:`ELFError`) print one line and exit with status 2; nothing here is imported by the library.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from elflow import __version__
from elflow.errors import ELFError, first_line, say

_DEFAULT = ("add_arguments", "run")
COMMANDS: dict[str, tuple[str, str, tuple[str, str]]] = {
    # name: (help, module in elflow.cli, (its add-arguments function, its run function))
    "demo": ("watch the shipped CPU model write verses out of noise", "demo_cmd", _DEFAULT),
    "sample": ("draw samples: print them or write a JSONL file", "sample_cmd", _DEFAULT),
    "score": ("score samples: generative perplexity, entropy, BLEU, ROUGE", "score_cmd", _DEFAULT),
    "serve": ("serve a model: OpenAI-compatible API and a live playground", "serve_cmd", _DEFAULT),
    "sweep": ("sample and score a grid of sampler settings", "sweep_cmd", _DEFAULT),
    "compare": ("pair cells of equal entropy: which is lower in gen PPL", "compare_cmd", _DEFAULT),
    "prepare": ("tokenise a corpus once into a memory-mapped token file", "prepare_cmd", _DEFAULT),
    "likelihood": ("bits per token of texts under a model (a bound)", "likelihood_cmd", _DEFAULT),
    "train": ("train, resume or fine-tune an ELF model", "train_cmd", _DEFAULT),
    "distill": ("progressive distillation into few-step students", "distill_cmd", _DEFAULT),
    "import": (
        "convert an authors' checkpoint to an elflow model",
        "model_cmd",
        ("add_import_arguments", "run_import"),
    ),
    "info": ("print a model's config and size", "model_cmd", ("add_info_arguments", "run_info")),
    "check-fixture": (
        "compare elflow to a reference fixture",
        "model_cmd",
        ("add_check_fixture_arguments", "run_check_fixture"),
    ),
    "generate": (
        "old name of 'sample' (prints the texts)",
        "sample_cmd",
        ("add_generate_arguments", "run_generate"),
    ),
}


def _command(name: str) -> tuple[Callable, Callable]:
    """(add_arguments, run) of command ``name`` (its module imports torch only inside run)."""
    _, module, (add, run) = COMMANDS[name]
    mod = importlib.import_module(f"elflow.cli.{module}")
    return getattr(mod, add), getattr(mod, run)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="elflow", description="ELF: Embedded Language Flows")
    parser.add_argument("--version", action="version", version=f"elflow {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (help_text, *_) in COMMANDS.items():
        command = sub.add_parser(name, help=help_text, description=help_text)
        _command(name)[0](command)
        # What the command's errors may name (elflow.cli.flags maps library keys to these).
        options = frozenset(s for action in command._actions for s in action.option_strings)
        command.set_defaults(command_options=options)
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
        return _command(args.command)[1](args)
    except ELFError as e:
        # Library errors name config keys and Python arguments; here, the command's flags.
        from elflow.cli.flags import flag_names, user_values

        options = getattr(args, "command_options", None)
        message = flag_names(str(e), args.command, options, keep=user_values(args))
        say(f"elflow: error: {message}")
        return getattr(e, "exit_code", 2)
    except BrokenPipeError:  # e.g. `elflow generate ... | head -1`: the reader has what it wants
        # So that Python's flush at exit does not fail on the closed pipe too (a captured
        # stdout has no file descriptor: nothing to do).
        with contextlib.suppress(OSError, ValueError):
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141
    except FileNotFoundError as e:
        if e.filename is None:
            say(f"elflow: error: {e}")
        else:
            say(f"elflow: error: {Path(e.filename)} does not exist")
        return 2
    except OSError as e:
        # A path the commands' own checks did not foresee (a full disk, a read-only file
        # system, a folder where a file was expected); still one line.
        where = f"{e.filename}: " if e.filename else ""
        if e.filename2:  # a rename: name where it was going
            where = f"{e.filename} -> {e.filename2}: "
        say(f"elflow: error: {where}{e.strerror or e}")
        return 2
    except (MemoryError, RuntimeError) as e:
        if not _out_of_memory(e):
            raise
        first = first_line(e)
        say(
            f"elflow: error: out of memory ({first}); lower train.micro_batch (accumulation keeps "
            "the batch) or set train.activation_checkpointing=blocks to train, lower --batch-size "
            "to sample or score (a sweep's judge: --score-batch-size; --resume keeps its scored "
            "cells); checkpoints already saved are kept"
        )
        return 2
    except KeyboardInterrupt:  # e.g. during a start-up encoding pass, or a second Ctrl-C
        say("elflow: interrupted; files written before (checkpoints, caches) are kept")
        return 130


if __name__ == "__main__":
    sys.exit(main())
