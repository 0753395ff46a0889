"""User-facing errors.

Everything a user can cause (a bad path, a bad config value, a checkpoint/tokenizer mismatch, a
sequence that is too long) raises :class:`ELFError` with a one-line message that says what is wrong
and how to fix it. The CLI prints these messages without a traceback.
"""

from __future__ import annotations

import os
import re
import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the command line imports this module: no torch at import time
    from torch import Tensor


class ELFError(ValueError):
    """A problem the user can fix; the message is one line and says how."""


class Interrupted(ELFError):
    """A run stopped by SIGINT/SIGTERM after saving; ``exit_code`` is 128 + the signal number."""

    def __init__(self, message: str, exit_code: int) -> None:
        super().__init__(message)
        self.exit_code = exit_code


def require(cond: bool, message: str) -> None:
    """Raise :class:`ELFError` with ``message`` unless ``cond`` (config validation)."""
    if not cond:
        raise ELFError(message)


def check_finite(tensor: Tensor, what: str) -> None:
    """Raise :class:`ELFError` if ``tensor`` holds NaN or inf (one host sync: use at API edges)."""
    if not bool(tensor.isfinite().all()):
        raise ELFError(f"{what} contains NaN or inf values; check the inputs that produced it")


_ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")
_UNPICKLER_GLOBAL = re.compile(r"GLOBAL ([\w.]+)")


def first_line(e: BaseException, limit: int = 200) -> str:
    """The first line of ``e``'s message for a one-line error: terminal escape codes removed,
    and a refused pickle said plainly, without the loader's advice to allow it."""
    text = _ANSI.sub("", str(e)).strip()
    if "Weights only load failed" in text or "WeightsUnpickler" in text:
        found = _UNPICKLER_GLOBAL.search(text)
        what = f" ({found.group(1)})" if found else ""
        return (
            f"a pickle holding objects other than tensors{what}, which elflow never unpickles "
            "(it could run code); use a safetensors copy from a source you trust"
        )
    line = text.splitlines()[0] if text else type(e).__name__
    if isinstance(e, KeyError):  # its message is the key alone
        line = f"no {line} entry"
    return line if len(line) <= limit else line[: limit - 3] + "..."


_NOTED: set[str] = set()


def say(line: str) -> None:
    """Write ``line`` and its newline to stderr in one call, so that the lines of several
    processes sharing the stream (torchrun) do not run into each other."""
    sys.stderr.write(line + "\n")
    sys.stderr.flush()


def note_once(message: str) -> None:
    """Print ``message`` to stderr once per process, and on rank 0 only under ``torchrun``."""
    if message not in _NOTED and os.environ.get("RANK", "0") == "0":
        _NOTED.add(message)
        say(message)
