"""What the settings named in library errors are called on the command line: one table, applied
in one place (``elflow``'s ``main``, where an :class:`~elflow.errors.ELFError` is printed).

Library code (everything outside :mod:`elflow.cli`) names what a Python or config-file user sets:
a config key (``sampler.steps``, ``data.path``) or a Python argument, written with its ``=``
(``sources=``, ``n=``, ``batch_size=``; ``out=/tmp/x`` with a value, ``overwrite=True`` for a
switch). :func:`flag_names` rewrites those to the flags of the command that failed, from
:data:`KEY_FLAGS` (every command) and :data:`COMMAND_KEY_FLAGS` (one command's own), and only to
flags that command has: a key it has no flag for stays a key. ``train`` and ``distill`` take config
keys as they are (``--set KEY=VALUE``, ``--config``), so their config keys are not rewritten.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Collection, Mapping

from elflow.config import SamplerConfig


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


SAMPLER_FLAGS: dict[str, str] = {
    f"sampler.{f.name}": _flag(f.name) for f in dataclasses.fields(SamplerConfig)
}
"""``sampler.<field>`` -> ``--<field>`` for every :class:`SamplerConfig` field (new fields too)."""

KEY_FLAGS: dict[str, str] = {
    # Python arguments, the same flag in every command that has it ("a/b": either, where present).
    "n=": "-n",
    "num_samples=": "-n",
    "sources=": "--source/--sources",
    "source_field=": "--source-field",
    "refs=": "--refs",
    "ref_field=": "--ref-field",
    "reference=": "--reference",
    "judge=": "--judge",
    "batch_size=": "--batch-size",
    "seed=": "--seed",
    "seeds=": "--seeds",
    "out=": "--out",
    "overwrite=True": "--overwrite",
    "resume=True": "--resume",
    "resume=": "--resume",
    "device=": "--device",
    "task=": "--task",
    "use_ema=False": "--no-ema",
    "cuda_graphs=False": "--no-cuda-graphs",
    "checkpoint=": "--model",
}
"""Key -> flag(s) in every command whose parser has the flag."""

KEEP = ""
"""A command's entry that keeps a key as it is (there it spells a config key, not an argument)."""

COMMAND_KEY_FLAGS: dict[str, dict[str, str]] = {
    "sample": SAMPLER_FLAGS,
    "generate": SAMPLER_FLAGS,
    "demo": SAMPLER_FLAGS,
    "sweep": {
        **SAMPLER_FLAGS,
        "samplers=": "--sampler",
        # What sweep.json records, named when a resume differs from it.
        "no_ema=": "--no-ema",
        "protocol=": "--protocol",
        "bootstrap=": "--bootstrap",
        "bootstrap_seed=": "--bootstrap-seed",
    },
    "likelihood": {
        "steps=": "--steps",
        "samples=": "--samples",
        "probes=": "--probes",
        "t1=": "--t1",
        "truncate=True": "--truncate",
    },
    "compare": {"tolerance=": "--entropy-tol", "same=": "--same"},
    "train": {"steps=": "--steps", "sets=": "--set", "file=": "--config"},
    "distill": {
        "task=": KEEP,  # the run config's task=conditional, not the teacher's --task
        "teacher_source=": "--model",
        "rounds=": "--rounds",
        "teacher_steps=": "--teacher-steps",
        "teacher_project_from=": "--teacher-project-from",
        "method=": "--method",
        "settings=": "--method-set",
        "sets=": "--set",
        "file=": "--config",
    },
    "serve": {"max_batch=": "--max-batch", "max_queue=": "--max-queue"},
    "prepare": {
        "data.path": "--data",
        "data.format": "--format",
        "data.text_field": "--text-field",
        "data.source_field": "--source-field",
        "data.target_field": "--target-field",
        "data.hf_split": "--hf-split",
        "data.doc_per": "--doc-per",
        "data.packing": "--packing",
        "data.overlong": "--overlong",
        "data.max_rows": "--max-rows",
        "data.tokenize_batch_size": "--batch-size",
        "model.max_length": "--max-length",
        "max_length": "--max-length",
        "max_input_length": "--max-input-length",
        "out_dir": "--out",
    },
}
"""Command -> its own keys (and any that mean another flag there than in :data:`KEY_FLAGS`)."""


def key_flags(command: str, options: Collection[str] | None = None) -> dict[str, str]:
    """The keys ``command``'s errors get as flags; with ``options`` (the command's option strings)
    only the flags it has (of ``a/b``, those present; a key with none stays a key)."""
    table = {k: v for k, v in {**KEY_FLAGS, **COMMAND_KEY_FLAGS.get(command, {})}.items() if v}
    if options is None:
        return table
    out = {}
    for key, value in table.items():
        kept = [part for part in value.split("/") if part.split()[0] in options]
        if kept:
            out[key] = "/".join(kept)
    return out


# A key only where it stands alone: not inside a longer name, a path or a quoted value. A key
# ending in "=" is a Python argument; a value after it (or after "key=") becomes the flag's.
_BEFORE = r"(?<![\w.'\"/-])"
_AFTER = r"(?![\w'\"/-]|\.\w)"
_VALUE = r"(?=[^\s)\];,])"


def _pattern(keys: Collection[str]) -> re.Pattern:
    alternatives = [
        re.escape(k) + ("" if k.endswith("=") else _AFTER + "(?:=" + _VALUE + ")?")
        for k in sorted(keys, key=len, reverse=True)
    ]
    return re.compile(_BEFORE + "(?:" + "|".join(alternatives) + ")")


def flag_names(
    message: str,
    command: str,
    options: Collection[str] | None = None,
    keep: Collection[str] = (),
    table: Mapping[str, str] | None = None,
) -> str:
    """``message`` (a library error) with the keys it names written as ``command``'s flags.

    A value the user gave (in ``keep``: a data file called ``data.path``) keeps its name where it
    stands as a path, ``path:line``; a quoted one is never rewritten.
    """
    flags = dict(table) if table is not None else key_flags(command, options)
    if not flags:
        return message

    def flag(m: re.Match) -> str:
        text = m.group(0)
        name = text if text in flags else text[:-1]  # a key with its "=" before a value
        if name in keep and re.match(r":\d", message[m.start() + len(name) :]):
            return text
        value_follows = text.endswith("=") and re.match(_VALUE, message[m.end() :]) is not None
        return flags[name] + (" " if value_follows else "")

    return _pattern(flags).sub(flag, message)


def user_values(args: object) -> set[str]:
    """The strings a command was given (paths, names), which :func:`flag_names` leaves alone
    where they stand as ``path:line``."""
    found: set[str] = set()
    for value in vars(args).values():
        for v in value if isinstance(value, list | tuple) else [value]:
            if isinstance(v, str):
                found.add(v)
    return found
