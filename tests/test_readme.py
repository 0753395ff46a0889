"""The README's test command is exactly what CI runs."""

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _test_command() -> str:
    lines = (ROOT / "README.md").read_text().splitlines()
    start = lines.index("## Run the tests")
    block = lines[start:]
    first = block.index("```")
    return block[first + 1].strip()


def test_ci_runs_the_readme_test_command():
    command = _test_command()
    assert "pytest" in command
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    assert command in [line.strip() for line in ci]


def test_ci_pins_cpu_torch_only_through_constraints():
    constraints = (ROOT / ".ci" / "constraints-cpu.txt").read_text()
    assert "torch==2.13.0" in constraints
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert "torch==" not in pyproject  # GPU users keep their own CUDA build
