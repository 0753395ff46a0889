"""User-facing errors.

Everything a user can cause (a bad path, a bad config value, a checkpoint/tokenizer mismatch, a
sequence that is too long) raises :class:`ELFError` with a one-line message that says what is wrong
and how to fix it. The CLI prints these messages without a traceback.
"""

from __future__ import annotations


class ELFError(ValueError):
    """A problem the user can fix; the message is one line and says how."""
