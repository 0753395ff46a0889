"""A sweep's grid: the sampler settings it varies, as data (ELF_SPEC §5).

An axis is a :class:`~elflow.config.SamplerConfig` field that ``elflow sweep`` takes as a comma
list; a cell is one sampler and one value per axis that applies to it (``gamma``: the SDE only;
``None``: the model's value). Adding an axis is one :class:`Axis` entry in :data:`AXES`: its flag,
its parsing and its part of the cell names follow. Light: no torch, so the command line imports it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from elflow.config import SAMPLERS, SamplerConfig, sampler_own_settings, unused_settings
from elflow.errors import ELFError


@dataclass(frozen=True)
class Axis:
    """One swept sampler setting."""

    field: str
    """The :class:`SamplerConfig` field (its flag is ``--field-name``)."""
    kind: Callable[[str], Any]
    """Parses one listed value (``int``, ``float`` or ``str``)."""
    tag: str
    """Its prefix in cell names: ``n`` in ``sde-n16-w3-g1.5``."""
    named_default: bool = True
    """Whether a cell at the model's value names it (``-gdefault``); an axis added later leaves
    it out, so the cells of sweeps run before it keep their names."""

    @property
    def flag(self) -> str:
        return "--" + self.field.replace("_", "-")

    def applies(self, sampler: str) -> bool:
        """Whether the axis varies ``sampler``: common settings always, a sampler's own
        settings (:attr:`elflow.config.SamplerSpec.settings`) for that sampler only."""
        return self.field not in unused_settings(sampler)


AXES: tuple[Axis, ...] = (
    Axis("steps", int, "n"),
    Axis("w", float, "w"),
    Axis("gamma", float, "g"),
    Axis("gamma_schedule", str, "s", named_default=False),
)
"""The grid's axes besides the sampler, in cell-name order."""


SHOWN_SHARED = ("project_from",)
"""Settings every cell of one sweep shares that its rows still show: projected sampling changes
the text most, and results of several sweeps are compared on it (``elflow compare --same``)."""


def row_settings() -> tuple[str, ...]:
    """The sampler settings each sweep row records (table.csv, ``elflow compare --same``): the
    sampler, the grid's axes, every sampler's own settings (``SamplerSpec.settings``) and
    :data:`SHOWN_SHARED`, in :class:`SamplerConfig` field order, with ``nfe`` (network
    evaluations per sample, what the steps cost) after ``steps``. Read when called, so a
    sampler registered later brings its settings."""
    shown = {a.field for a in AXES} | sampler_own_settings() | set(SHOWN_SHARED)
    fields = [f.name for f in dataclasses.fields(SamplerConfig) if f.name in shown]
    after = fields.index("steps") + 1
    return ("sampler", *fields[:after], "nfe", *fields[after:])


def _show(value: Any) -> str:
    if value is None:
        return "default"
    return f"{value:g}" if isinstance(value, float) else str(value)


@dataclass(frozen=True)
class Cell:
    """One grid point: a sampler and its axis values (``None``: the model's value)."""

    sampler: str
    values: tuple[tuple[str, Any], ...] = ()
    """(field, value) for every axis that applies to ``sampler``, in :data:`AXES` order."""

    @classmethod
    def of(cls, sampler: str, **values: Any) -> Cell:
        """``Cell.of("sde", steps=4, w=2.0, gamma=1.5)``; axes that do not apply are dropped."""
        unknown = set(values) - {a.field for a in AXES}
        if unknown:
            raise ValueError(f"not grid axes: {', '.join(sorted(unknown))}")
        return cls(
            sampler, tuple((a.field, values.get(a.field)) for a in AXES if a.applies(sampler))
        )

    def get(self, field: str) -> Any:
        return dict(self.values).get(field)

    @property
    def settings(self) -> dict[str, Any]:
        """The sampler flags this cell sets (None: the model's value), as ``sampler_from_args``
        takes them."""
        return {"sampler": self.sampler} | {a.field: self.get(a.field) for a in AXES}

    @property
    def name(self) -> str:
        """A file-name-safe id, e.g. ``sde-n16-w3-g1.5`` (``default`` for a model default)."""
        axes = {a.field: a for a in AXES}
        return self.sampler + "".join(
            f"-{axes[f].tag}{_show(v)}"
            for f, v in self.values
            if v is not None or axes[f].named_default
        )


def grid(samplers: Sequence[str], values: Mapping[str, Sequence[Any]]) -> list[Cell]:
    """Every cell in a fixed order (samplers, then the axes in :data:`AXES` order); ``values``
    maps an axis field to its listed values, a missing field meaning ``[None]``."""
    if not samplers:
        raise ELFError("samplers= names no sampler; give " + ", ".join(SAMPLERS))
    for name in samplers:
        if name not in SAMPLERS:
            raise ELFError(f"unknown sampler {name!r} in samplers=; use {', '.join(SAMPLERS)}")
    cells: list[Cell] = []
    for sampler in samplers:
        combos: list[tuple[tuple[str, Any], ...]] = [()]
        for axis in AXES:
            if axis.applies(sampler):
                listed = list(values.get(axis.field) or [None])
                combos = [(*c, (axis.field, v)) for c in combos for v in listed]
        for combo in combos:
            cell = Cell(sampler, combo)
            if cell not in cells:  # a value listed twice is one cell
                cells.append(cell)
    names_seen: dict[str, Cell] = {}
    for cell in cells:
        other = names_seen.setdefault(cell.name, cell)
        if other is not cell:  # e.g. --w 1,1.0000001: two cells, one file name
            raise ELFError(
                f"two sweep cells share the name {cell.name!r}; "
                "give values that differ in their first 6 significant digits"
            )
    return cells
