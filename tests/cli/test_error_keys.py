"""Library errors name config keys and Python arguments; the command line names its flags.

The rule: code outside ``elflow.cli`` (and ``elflow/__main__.py``) never names a command-line flag
(``--steps``, ``-n``) in a message. It names what a Python or config-file user sets: a config key
(``sampler.steps``, ``data.path``, ``train.max_steps``) or a Python argument written with its
``=`` (``sources=``, ``n=``, ``out=/x``, ``overwrite=True``). ``elflow``'s ``main`` writes those
as the failing command's flags, from the one table in :mod:`elflow.cli.flags`.

Allowed in library text: a command the user is told to run, quoted whole (``elflow prepare
--data ...``, ``pip install --no-deps ...``, ``torchrun --nproc_per_node N``): a flag after
``elflow <command>``, ``pip install`` or ``torchrun`` in the same string is part of that command.
Not checked: docstrings, and notes the library prints itself (``note_once``, ``say``, ``print``,
``warnings.warn``), which are not errors; plus the few strings listed in :data:`ALLOWED`.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import re
from pathlib import Path

import pytest

import elflow
from elflow.__main__ import COMMANDS, build_parser, main
from elflow.cli.flags import (
    COMMAND_KEY_FLAGS,
    KEEP,
    KEY_FLAGS,
    SAMPLER_FLAGS,
    flag_names,
    key_flags,
)
from elflow.config import SamplerConfig
from elflow.errors import ELFError

PACKAGE = Path(elflow.__file__).parent
FLAG = re.compile(r"(?<![\w-])(--[a-z][a-z0-9-]*|-n)(?![\w-])")
COMMAND = re.compile(r"\b(elflow [a-z-]+|pip install|torchrun)\b")
NOT_ERRORS = {"note_once", "say", "print", "warn"}
ALLOWED = {
    ("train/setup.py", " --max-input-length {}"): "the rest of the `elflow prepare` command that "
    "check_raw_data builds over two statements",
}
"""(module, string) -> why its flag may stay."""


def _library_modules() -> list[Path]:
    return sorted(
        p
        for p in PACKAGE.rglob("*.py")
        if "cli" not in p.relative_to(PACKAGE).parts[:1] and p.name != "__main__.py"
    )


def _text(node: ast.AST) -> str:
    """A string constant, or an f-string with ``{}`` for its values."""
    if isinstance(node, ast.Constant):
        return node.value
    return "".join(v.value if isinstance(v, ast.Constant) else "{}" for v in node.values)


def _strings(tree: ast.AST) -> list[str]:
    """The module's strings that are not docstrings nor inside a printed note."""
    skip: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant | ast.JoinedStr):
            skip.update(id(n) for n in ast.walk(node))  # a docstring (a module's, a field's)
        if isinstance(node, ast.Call):
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            if name in NOT_ERRORS:
                skip.update(id(n) for n in ast.walk(node))
        if isinstance(node, ast.JoinedStr):
            skip.update(id(v) for v in node.values)  # read as part of the f-string
    return [
        _text(node)
        for node in ast.walk(tree)
        if id(node) not in skip
        and (
            isinstance(node, ast.JoinedStr)
            or (isinstance(node, ast.Constant) and isinstance(node.value, str))
        )
    ]


def _library_strings() -> dict[str, list[str]]:
    return {
        str(p.relative_to(PACKAGE)): _strings(ast.parse(p.read_text(encoding="utf-8")))
        for p in _library_modules()
    }


def _flags_outside_commands(text: str) -> list[str]:
    found = []
    for m in FLAG.finditer(text):
        if not COMMAND.search(text[: m.start()]):
            found.append(m.group(0))
    return found


def test_library_messages_name_keys_not_flags():
    named = {
        (module, text): flags
        for module, texts in _library_strings().items()
        for text in texts
        if (flags := _flags_outside_commands(text))
    }
    offenders = [
        f"{m}: {t!r} names {', '.join(f)}" for (m, t), f in named.items() if (m, t) not in ALLOWED
    ]
    assert not offenders, "\n".join(offenders)
    assert set(ALLOWED) <= set(named), "an exception no longer needed"
    # The scan sees the strings it must: a flag in a raised message would be caught.
    sample = 'raise ELFError(f"--steps {n} must be >= 1")\n"""doc --steps"""\n'
    sample += 'note_once("--steps")\nrequire(ok, "n: -n" + x)\n'
    found = [_flags_outside_commands(t) for t in _strings(ast.parse(sample))]
    assert found == [["--steps"], ["-n"]]
    assert _flags_outside_commands("prepare it once (elflow prepare --data x --out y)") == []


def test_every_key_in_the_table_is_named_by_a_library_message():
    """No dead entries: each key is a SamplerConfig field's or spelled in library text (a sweep's
    resume check names the settings of sweep.json as ``key=``)."""
    from elflow.evaluation.sweep_plan import RESUME_KEYS

    text = "\n".join(t for texts in _library_strings().values() for t in texts)
    named = {f"{k}=" for k in RESUME_KEYS} | {f"sampler.{k}=" for k in RESUME_KEYS}
    keys = set(KEY_FLAGS) | {k for table in COMMAND_KEY_FLAGS.values() for k in table}
    dead = sorted(
        k
        for k in keys - set(SAMPLER_FLAGS)
        if k not in named and not re.search(r"(?<![\w.])" + re.escape(k), text)
    )
    assert not dead, f"keys no library message names: {dead}"
    assert set(SAMPLER_FLAGS) == {f"sampler.{f.name}" for f in dataclasses.fields(SamplerConfig)}


def test_every_flag_in_the_table_is_a_flag_of_its_command():
    (sub,) = [a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)]
    options = {name: sub.choices[name].get_default("command_options") for name in COMMANDS}
    for command, table in COMMAND_KEY_FLAGS.items():
        for key, flag in table.items():
            if flag != KEEP and key not in SAMPLER_FLAGS:
                missing = [f for f in flag.split("/") if f.split()[0] not in options[command]]
                assert not missing, (command, key, flag)
    for key, flag in KEY_FLAGS.items():  # in some command at least
        assert any(f.split()[0] in opts for f in flag.split("/") for opts in options.values()), key
    # Every sampler field is a flag of the sampling commands.
    for command in ("sample", "generate", "demo", "sweep"):
        assert set(key_flags(command, options[command])) >= set(SAMPLER_FLAGS), command


def test_flag_names():
    assert flag_names("drop n=; out=/x is a file; give sources (sources=)", "sample") == (
        "drop -n; --out /x is a file; give sources (--source/--sources)"
    )
    # Only the flags the command has: a sweep reads sources from a file; likelihood has no -n
    # here, so the key stays.
    assert flag_names("sources=", "sweep", {"--sources"}) == "--sources"
    assert flag_names("n=4", "sweep", {"--sources"}) == "n=4"
    # A config key with a value; and the sampler keys only where the sampler flags are.
    assert flag_names("set sampler.project_from=1.0", "sample") == "set --project-from 1.0"
    assert flag_names("set sampler.project_from=1.0", "train") == "set sampler.project_from=1.0"
    # Not inside longer names, paths or quoted values.
    message = "train.max_steps=3, 'n=', /x/out=y, sampler.w.x, max_n=2"
    assert flag_names(message, "sample") == message
    # distill's --task is the teacher's paper task: the config's task=conditional stays.
    assert flag_names("set task=conditional", "distill") == "set task=conditional"
    assert flag_names("task= applies to authors' checkpoints", "info") == (
        "--task applies to authors' checkpoints"
    )


# The same mistake: through the Python API the message names the key or argument, through the
# command line the flag.


@pytest.fixture(scope="module")
def uncond(uncond_model):
    return uncond_model


def _cli_error(capsys, argv: list[str]) -> str:
    capsys.readouterr()
    assert main([str(a) for a in argv]) == 2
    (line,) = [x for x in capsys.readouterr().err.splitlines() if x.startswith("elflow: error:")]
    return line


def test_sources_for_an_unconditional_model(uncond, tmp_path, capsys):
    from elflow import ELFPipeline

    with pytest.raises(ELFError) as e:
        ELFPipeline.from_pretrained(uncond).generate(sources=["Im Anfang"])
    assert "takes no sources (sources=); ask for a number of samples (n=)" in str(e.value)
    argv = ["sample", "--model", uncond, "--source", "Im Anfang", "--steps", "2"]
    line = _cli_error(capsys, [*argv, "--out", tmp_path / "s.jsonl"])
    assert "takes no sources (--source/--sources); ask for a number of samples (-n)" in line


def test_a_sampler_setting_and_a_batch_size(uncond, tmp_path, capsys):
    from elflow import ELFPipeline

    pipe = ELFPipeline.from_pretrained(uncond)
    with pytest.raises(ELFError, match=r"^sampler\.w must be > -1, got -2\.0$"):
        dataclasses.replace(pipe.sampler, w=-2.0)
    argv = ["sample", "--model", uncond, "-n", "1", "--steps", "2"]
    assert _cli_error(capsys, [*argv, "--w", "-2"]).endswith("error: --w must be > -1, got -2.0")
    with pytest.raises(ELFError, match=r"^batch_size= must be >= 1, got 0$"):
        pipe.generate(1, batch_size=0)
    line = _cli_error(capsys, [*argv, "--batch-size", "0", "--out", tmp_path / "s.jsonl"])
    assert line.endswith("error: --batch-size must be >= 1, got 0")


def test_a_bad_value_in_a_models_config_names_the_file_not_a_flag(uncond, tmp_path, capsys):
    import json
    import shutil

    folder = Path(shutil.copytree(uncond, tmp_path / "model"))
    config = json.loads((folder / "config.json").read_text())
    config["sampler"]["steps"] = -4
    (folder / "config.json").write_text(json.dumps(config))
    line = _cli_error(capsys, ["sample", "--model", folder, "-n", "1"])
    assert line.endswith(f"error: {folder / 'config.json'}: 'sampler.steps' must be >= 1, got -4")


def test_distillation_rounds(tmp_path, capsys):
    from elflow.distill.distill_config import parse_rounds

    with pytest.raises(ELFError) as e:
        parse_rounds("3/4", teacher_steps=64)
    assert "round 3/4 in rounds= has N x K = 12, but teacher_steps= is 64" in str(e.value)
    assert "pass teacher_steps=0" in str(e.value)
    argv = ["distill", "--model", "demo", "--out", tmp_path / "d", "--rounds", "3/4"]
    line = _cli_error(capsys, [*argv, "--set", "train.max_steps=1"])
    assert "round 3/4 in --rounds has N x K = 12, but --teacher-steps is 64" in line
    assert "pass --teacher-steps 0" in line
