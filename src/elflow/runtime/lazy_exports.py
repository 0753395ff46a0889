"""Lazy package exports (PEP 562), so that ``import elflow`` and the command line's ``--help`` do
not import torch or transformers until a name that needs them is used."""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Callable
from typing import Any


def lazy_exports(
    package: str, exports: dict[str, str]
) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """``(__getattr__, __dir__)`` for ``package`` exporting ``name -> module`` on first use."""

    def getattr_(name: str) -> Any:
        if name not in exports:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        return getattr(importlib.import_module(exports[name]), name)

    def dir_() -> list[str]:
        return sorted(exports)

    return getattr_, dir_


def submodules(package: str) -> tuple[str, ...]:
    """The names of ``package``'s modules (``pkgutil.iter_modules``), listed without importing
    them, sorted."""
    path = importlib.import_module(package).__path__
    return tuple(sorted(m.name for m in pkgutil.iter_modules(path) if not m.name.startswith("_")))


def module_attribute(module: str, name: str) -> Any:
    """``module.name``, importing ``module`` on first use."""
    return getattr(importlib.import_module(module), name)
