"""The package's arrows point one way: the maths imports only torch (and numpy, for the host's
half of the keyed draws) and the configs, the network
knows nothing of noise or samplers, configs do not import model I/O, and nothing imports the
command line (which alone imports argparse)."""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src" / "elflow"
MATHS = (
    "flow",
    "sampling",
    "projection",
    "objective",
    "distill_objective",
    "consistency",
    "infill_maths",
    "likelihood_maths",
    "keyed",
)
SHIMS = {
    "score": "evaluation",
    "infill": "infill_maths",
    "likelihood": "likelihood_maths",
    "distill": "distill_objective",
    "network": "wiring",
}
"""Older module names kept for one release (tests/test_deprecations.py): each imports only its
new module (and ``warnings``), and nothing in the package imports one."""
CONFIGS = ("config", "train.config", "train.presets", "data.config")


def _module(path: Path) -> str:
    parts = path.relative_to(SRC).with_suffix("").parts
    return ".".join(p for p in parts if p != "__init__")


def _imports(path: Path) -> set[str]:
    """Every module ``path`` imports, at any depth (a local import counts too)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            if node.module == "elflow":  # from elflow import x: x may be a module
                found |= {f"elflow.{a.name}" for a in node.names}
    return found


MODULES = {_module(p): _imports(p) for p in sorted(SRC.rglob("*.py"))}


def _elflow(imports: set[str]) -> set[str]:
    return {m.removeprefix("elflow.") for m in imports if m.startswith("elflow.")}


def test_the_maths_imports_only_torch_the_configs_and_itself():
    allowed = {"config", "errors", *MATHS}
    for name in MATHS:
        ours = _elflow(MODULES[name])
        assert ours <= allowed, (name, ours - allowed)
        third = {m.split(".")[0] for m in MODULES[name] if not m.startswith("elflow")}
        assert third <= {
            "__future__",
            "torch",
            "numpy",
            "collections",
            "dataclasses",
            "hashlib",
            "math",
            "functools",
            "typing",
        }, (name, third)


def test_old_module_names_are_only_shims_and_nothing_imports_them():
    for old, new in SHIMS.items():
        assert MODULES[old] == {"warnings", f"elflow.{new}"}, old
    for name, imports in MODULES.items():
        assert not _elflow(imports) & set(SHIMS), (name, _elflow(imports) & set(SHIMS))


def test_the_network_knows_nothing_of_noise_or_samplers():
    """model.py imports no maths, sampler or wiring; it reaches model I/O only lazily (in
    ELF.from_pretrained/save_pretrained: io.artifact imports it). Its bf16 inference fast path,
    fastpath.py, is network code too, and model.py never imports it (the wiring applies it)."""
    assert _elflow(MODULES["model"]) <= {"config", "errors", "hardware", "head_loss", "io.artifact"}
    assert _elflow(MODULES["fastpath"]) <= {"config", "errors", "hardware", "model"}
    for name in ("model", "fastpath"):
        assert not _elflow(MODULES[name]) & {*MATHS, "wiring", "network"}, name
    top = {
        node.module
        for node in ast.parse((SRC / "model.py").read_text()).body
        if isinstance(node, ast.ImportFrom)
    }
    assert "elflow.io.artifact" not in top  # a cycle: only inside the methods


def test_configs_do_not_import_model_io():
    for name in CONFIGS:
        assert not {m for m in _elflow(MODULES[name]) if m.startswith("io")}, name


def test_nothing_imports_the_command_line():
    for name, imports in MODULES.items():
        if name.startswith("cli") or name == "__main__":
            continue
        assert not {m for m in _elflow(imports) if m.startswith("cli")}, name
        assert "argparse" not in imports, name


def test_no_lazy_export_is_shadowed_by_a_submodule():
    """``from package import name`` would give the submodule once something imports it."""
    import importlib

    for package in ("elflow", "elflow.data", "elflow.train", "elflow.evaluation"):
        folder = SRC.joinpath(*package.split(".")[1:])
        for name in importlib.import_module(package).__all__:
            clash = (folder / f"{name}.py").exists() or (folder / name).is_dir()
            assert not clash, f"{package}.{name} is both a lazy export and a submodule"
