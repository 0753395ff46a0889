"""The README's two commands (demo, tests) are exactly what CI runs."""

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


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


def test_ci_pins_cpu_torch_only_through_constraints():
    constraints = (ROOT / ".ci" / "constraints-cpu.txt").read_text()
    assert "torch==2.13.0" in constraints
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert "torch==" not in pyproject  # GPU users keep their own CUDA build
