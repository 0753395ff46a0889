"""The package's shape (docs/contributing.md "Where things live"): a root of the few modules a
reader starts from, folders named for what they hold, no two modules of one name, no import
cycle (an import inside a function, a ``TYPE_CHECKING`` import and a lazy export all count), pure
maths that imports no I/O, command line or data, and nothing that imports the command line."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src" / "elflow"
ROOT = {"__init__", "__main__", "errors", "model", "flow", "objective"}
"""The modules a reader starts from: the network, the flow maths, the objective, the errors."""
FOLDERS = {
    "cli",
    "config",
    "data",
    "distill",
    "evaluation",
    "examples",
    "generation",
    "io",
    "runtime",
    "sampling",
    "serving",
    "testing",
    "text",
    "train",
    "demo_model",
}
MATHS = ("flow", "objective")
MATH_FOLDERS = ("sampling", "distill")
"""The pure layer: these modules, and the whole of these folders but the ones in IMPURE."""
IMPURE = {"sampling.denoiser", "distill.curriculum", "distill.rounds", "distill.methods"}
"""Modules in the maths folders that wire the maths to a model, a run or a registry."""
PURE = {"train.objective_draws"}
"""Pure maths outside the maths folders: the objective's random draws, kept with training."""
LOWER = {"config", "errors", "runtime.keyed_random", "runtime.lazy_exports"}
"""What the maths may import besides itself."""


def _module(path: Path) -> str:
    parts = path.relative_to(SRC).with_suffix("").parts
    return ".".join(p for p in parts if p != "__init__") or "elflow"


def _lazy_exports(tree: ast.Module) -> set[str]:
    """The module names of a ``lazy_exports`` table's values (``{"name": "elflow.x.y"}``)."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Dict):
            for value in node.values:
                if isinstance(value, ast.Constant) and str(value.value).startswith("elflow."):
                    found.add(value.value)
    return found


def _imports(path: Path) -> set[str]:
    """Every module ``path`` imports, at any depth (a local or TYPE_CHECKING import counts)."""
    tree = ast.parse(path.read_text())
    found = _lazy_exports(tree) if path.name == "__init__.py" else set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            for a in node.names:  # from elflow.x import y: y may be a module
                found.add(f"{node.module}.{a.name}")
    return found


PATHS = {_module(p): p for p in sorted(SRC.rglob("*.py"))}
MODULES = {name: _imports(path) for name, path in PATHS.items()}


def _ours(imports: set[str]) -> set[str]:
    """The elflow modules among ``imports`` (a name that is not a module maps to its module)."""
    found = set()
    for name in imports:
        if not name.startswith("elflow"):
            continue
        name = name.removeprefix("elflow").removeprefix(".") or "elflow"
        while name not in PATHS and "." in name:
            name = name.rpartition(".")[0]
        if name in PATHS:
            found.add(name)
    return found


GRAPH = {name: _ours(imports) - {name} for name, imports in MODULES.items()}


def _reach(start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        for nxt in GRAPH[todo.pop()]:
            if nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)
    return seen


def _in_maths(name: str) -> bool:
    if name in PURE:
        return True
    return name not in IMPURE and (name in MATHS or name.split(".")[0] in MATH_FOLDERS)


def test_the_root_holds_the_few_modules_a_reader_starts_from():
    modules = {p.stem for p in SRC.glob("*.py")}
    folders = {p.name for p in SRC.iterdir() if p.is_dir() and p.name != "__pycache__"}
    assert modules == ROOT
    assert folders == FOLDERS


def test_no_two_modules_share_a_name():
    names: dict[str, list[str]] = {}
    for name in PATHS:
        stem = PATHS[name].stem
        if stem != "__init__":
            names.setdefault(stem, []).append(name)
    assert {k: v for k, v in names.items() if len(v) > 1} == {}


def test_there_is_no_import_cycle():
    cycles = sorted(name for name in GRAPH if name in _reach(name))
    assert cycles == [], f"modules on an import cycle: {cycles}"


def test_package_inits_import_nothing_eagerly():
    """A folder's ``__init__`` only lists lazy exports, so importing one module of a folder never
    imports its siblings (and a folder import cannot close a cycle)."""
    for name, path in PATHS.items():
        if path.name != "__init__.py" or not [*path.parent.glob("[!_]*.py")]:
            continue  # a folder without modules (examples/: data and its reader) has no siblings
        tree = ast.parse(path.read_text())
        eager = {
            n.module
            for n in tree.body
            if isinstance(n, ast.ImportFrom) and n.module and n.module.startswith("elflow")
        }
        assert eager <= {"elflow.runtime.lazy_exports"}, (name, eager)


def test_the_maths_imports_no_io_command_line_or_data():
    for name in filter(_in_maths, GRAPH):
        outside = {m for m in _reach(name) if not _in_maths(m)}
        allowed = {m for m in outside if m in LOWER or m.split(".")[0] == "config"}
        assert outside == allowed, (name, outside - allowed)
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


def test_the_network_knows_nothing_of_noise_or_samplers():
    """model.py imports no maths and no sampler; its bf16 inference fast path is network code
    too, and model.py never imports it (the denoiser applies it)."""
    for name in ("model", "runtime.bf16_fast_path"):
        assert not {m for m in _reach(name) if _in_maths(m) or m == "sampling.denoiser"}, name


def test_configs_do_not_import_model_io():
    """Configs reach no model files, training or data code (``io.jsonl``, the text-file reader
    the packaged examples use, is not model I/O)."""
    for name in (n for n in GRAPH if n.startswith("config")):
        reached = _reach(name) - {"io.jsonl"}
        assert not {m for m in reached if m.split(".")[0] in ("io", "train", "data")}, name


def test_model_folder_io_takes_the_network_class():
    """ELF inherits its folder I/O (``io.pretrained_mixin``), and the I/O takes the class it
    builds, so no module of it reaches ``elflow.model``."""
    for name in ("artifact_config", "model_folder", "pretrained_mixin", "safetensors_files"):
        assert "model" not in _reach(f"io.{name}"), name


def test_nothing_imports_the_command_line():
    for name, imports in MODULES.items():
        if name.startswith("cli") or name == "__main__":
            continue
        assert not {m for m in GRAPH[name] if m.startswith("cli")}, name
        assert "argparse" not in imports, name


def test_no_lazy_export_is_shadowed_by_a_submodule():
    """``from package import name`` would give the submodule once something imports it."""
    for name, path in PATHS.items():
        if path.name != "__init__.py":
            continue
        package = "elflow" if name == "elflow" else f"elflow.{name}"
        for export in getattr(importlib.import_module(package), "__all__", ()):
            clash = (path.parent / f"{export}.py").exists() or (path.parent / export).is_dir()
            assert not clash, f"{package}.{export} is both a lazy export and a submodule"


def test_modules_stay_under_400_lines():
    """One concept a file; Muon (the optimizer and its distributed work split) is the one that
    needs more."""
    long = {n: len(p.read_text().splitlines()) for n, p in PATHS.items()}
    assert {n: k for n, k in long.items() if k > 400 and n != "train.muon"} == {}
