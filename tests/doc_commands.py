"""What the README and the docs pages show, read back for tests: fenced code blocks, the
``elflow ...`` commands in them, and a check that one such command parses as written.

Shared by ``test_readme.py``, ``test_docs.py`` and ``test_benchmarks.py``; not a test module.
"""

from __future__ import annotations

import contextlib
import io
import re
import shlex
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"


def doc_pages() -> list[Path]:
    """Every Markdown page of the docs site, results pages included."""
    return sorted(DOCS.rglob("*.md"))


def split_fenced(text: str) -> tuple[list[tuple[str, str]], str]:
    """The (language, body) of every fenced code block, indented ones in list items included,
    and the prose around them."""
    blocks: list[tuple[str, str]] = []
    prose: list[str] = []
    lang, body = None, []
    for line in text.splitlines():
        fence = line.strip().startswith("```")
        if fence and lang is None:
            lang, body = line.strip()[3:], []
        elif fence:
            blocks.append((lang, "\n".join(body)))
            lang = None
        elif lang is None:
            prose.append(line)
        else:
            body.append(line)
    assert lang is None, "an unclosed code block"
    return blocks, "\n".join(prose)


def fenced_elflow_commands(text: str) -> list[str]:
    """Every ``elflow ...`` command in ``text``'s shell blocks (continuations joined), without
    the leading ``elflow``; blocks tagged with a language (Python examples) are skipped."""
    blocks, _ = split_fenced(text)
    commands = []
    for lang, block in blocks:
        if lang:
            continue
        for line in block.replace("\\\n", " ").splitlines():
            line = line.split("  #")[0].strip()
            found = re.search(r"(?:^|&& |-m )elflow ([^&|]*)", line)
            if found:
                commands.append(found.group(1).strip())
    return commands


def parse_error(command: str) -> str | None:
    """Why ``elflow COMMAND`` would not start as written (flags, and for train/distill the
    preset, ``--steps`` and every ``--set`` key), or None when it would."""
    from elflow.__main__ import build_parser
    from elflow.config.run_presets import preset, short_run
    from elflow.config.train_config import apply_overrides, override_keys
    from elflow.errors import ELFError

    stderr = io.StringIO()
    with contextlib.redirect_stderr(stderr):
        try:
            args = build_parser().parse_args(shlex.split(command))
        except SystemExit:
            return stderr.getvalue().strip() or "does not parse"
    if args.command in ("train", "distill"):
        try:
            base = preset(args.preset)
            if getattr(args, "steps", None) is not None:
                base = short_run(base, args.steps, keep=override_keys(None, args.set))
            apply_overrides(base, None, args.set)
        except ELFError as e:
            return str(e)
    return None
