"""(De)serialising the config dataclasses: :func:`from_dict` rejects unknown keys and wrong types
with one-line errors instead of dropping them; :func:`field_docs` reads each field's docstring,
the one source of a config key's documentation and command-line help."""

from __future__ import annotations

import contextlib
import dataclasses
import math
from typing import Any, TypeVar

from elflow.errors import ELFError

T = TypeVar("T")


def to_dict(cfg: Any) -> dict[str, Any]:
    """A JSON-ready dict of a config dataclass (nested dataclasses included)."""
    return dataclasses.asdict(cfg)


def from_dict(cls: type[T], data: dict[str, Any], where: str = "") -> T:
    """Build ``cls`` from ``data``; unknown keys and wrong types are one-line errors."""
    if not isinstance(data, dict):
        raise ELFError(f"config section {where or cls.__name__} must be a mapping, got {data!r}")
    fields = {f.name: f for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    unknown = sorted(set(data) - set(fields))
    if unknown:
        prefix = f"{where}." if where else ""
        raise ELFError(
            f"unknown config key(s) {', '.join(prefix + k for k in unknown)}; "
            f"valid keys: {', '.join(sorted(fields))}"
        )
    kwargs = {}
    for name, value in data.items():
        kwargs[name] = _coerce(value, fields[name], f"{where}.{name}" if where else name)
    return cls(**kwargs)


def coerce_field(cls: type, name: str, value: Any, where: str) -> Any:
    """``value`` for field ``name`` of dataclass ``cls``, type-checked as :func:`from_dict` does."""
    field = next(f for f in dataclasses.fields(cls) if f.name == name)
    return _coerce(value, field, where)


def _coerce(value: Any, f: dataclasses.Field, where: str) -> Any:
    typ = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", str(f.type))
    if typ == "bool":
        if isinstance(value, bool):
            return value
        raise ELFError(f"{where} must be true or false, got {value!r}")
    if typ == "int":
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise ELFError(f"{where} must be an integer, got {value!r}")
    if typ == "float":
        if isinstance(value, str):  # YAML 1.1 reads 3e-4 (no dot) as a string
            with contextlib.suppress(ValueError):
                value = float(value)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            if not math.isfinite(value):
                raise ELFError(f"{where} must be a finite number, got {value!r}")
            return float(value)
        raise ELFError(f"{where} must be a number, got {value!r}")
    if typ == "str":
        if isinstance(value, str):
            return value
        raise ELFError(f"{where} must be a string, got {value!r}")
    return value


def field_docs(cls: type) -> dict[str, str]:
    """Each field's docstring (the string literal under it), whitespace-collapsed: the one
    source of a config key's documentation and command-line help."""
    import ast
    import inspect
    import itertools
    import textwrap

    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    except (OSError, TypeError):  # no source (a frozen application): no help text
        return {}
    body = tree.body[0].body  # type: ignore[attr-defined]
    docs = {}
    for node, after in itertools.pairwise(body):
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and isinstance(after, ast.Expr)
            and isinstance(after.value, ast.Constant)
            and isinstance(after.value.value, str)
        ):
            docs[node.target.id] = " ".join(after.value.value.split())
    return docs
