"""The sampler registry (ELF_SPEC §5): what a sampler is (:class:`SamplerSpec`) and which exist
(:data:`SAMPLERS`).

A built-in sampler is one module of :mod:`elflow.sampling.samplers`, named as the sampler: its
``SPEC`` (name, settings, costs, step) and its ``RANK`` in listings. The registry finds the
built-ins by listing that folder; their modules import torch only when a step runs, so names and
membership (``--help``'s choices, :class:`~elflow.config.SamplerConfig`'s check) cost no torch.
:func:`register_sampler` adds a sampler from anywhere else. Nothing here imports torch.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from elflow.errors import ELFError
from elflow.runtime.lazy_exports import module_attribute, submodules

BUILTIN_PACKAGE = "elflow.sampling.samplers"
"""Where the built-in samplers live, one module each, named as the sampler."""


@dataclass(frozen=True)
class SamplerSpec:
    """What a sampler is, in one place: its name, what the trajectory page says of it, the
    :class:`~elflow.config.SamplerConfig` fields only it uses, its network evaluations, noise
    draws and step. Records, sweep cells, the trajectory page, the model's sampler check, the
    server and the command line's ``--sampler`` all read :data:`SAMPLERS`."""

    name: str
    title: str
    """As the trajectory page names it ("SDE")."""
    description: str
    """One line on what a step does."""
    settings: tuple[str, ...] = ()
    """The SamplerConfig fields only this sampler uses (recorded as null for the others, and
    sweep axes of their own)."""
    evals_per_step: int = 1
    """Network evaluations a step makes (the last step is always one Euler evaluation)."""
    step: Callable[..., Any] | None = None
    """``step(denoise, z, x_prev, t, t_next, ctx) -> (z_next, x_hat)`` with ``ctx`` an
    :class:`elflow.sampling.step_context.StepContext`."""
    noise_draws: int | None = None
    """How many times a step calls ``ctx.noise()`` (the last, Euler step none); None: unknown,
    and the sampler then runs eagerly only (a CUDA graph needs the draws up front)."""
    eval_time: Callable[..., Any] | None = None
    """``eval_time(t, t_next, settings) -> t_eval``: the time of a step's (first) network
    evaluation when it is not ``t`` (the SDE's, after stepping back); the trajectory page
    names the projected steps from it."""
    check_choice: Callable[[Any, Mapping[str, Any]], str | None] | None = None
    """``check_choice(base, changes) -> message or None``: when a change of settings picks this
    sampler over ``base`` (:func:`elflow.config.change_sampler`), what is wrong with the
    settings it would run with (the SDE at the model's gamma 0 is the ODE)."""

    def nfe(self, steps: int) -> int:
        return self.evals_per_step * (steps - 1) + 1


class _Samplers(Mapping[str, SamplerSpec]):
    """The samplers by name: the built-ins by rank, then the registered ones in the order they
    came."""

    def __init__(self) -> None:
        self._builtin: tuple[str, ...] | None = None
        self._loaded: dict[str, SamplerSpec] = {}
        self._added: dict[str, SamplerSpec] = {}

    @property
    def builtin(self) -> tuple[str, ...]:
        """The built-in samplers' names, by their modules' ``RANK``."""
        if self._builtin is None:
            names = submodules(BUILTIN_PACKAGE)
            rank = {n: module_attribute(f"{BUILTIN_PACKAGE}.{n}", "RANK") for n in names}
            self._builtin = tuple(sorted(names, key=lambda n: (rank[n], n)))
        return self._builtin

    def __getitem__(self, name: str) -> SamplerSpec:
        if name in self._added:
            return self._added[name]
        if name not in self.builtin:
            raise KeyError(name)
        if name not in self._loaded:
            spec = module_attribute(f"{BUILTIN_PACKAGE}.{name}", "SPEC")
            if spec.name != name:
                raise ELFError(f"{BUILTIN_PACKAGE}.{name}'s SPEC is named {spec.name!r}")
            self._loaded[name] = spec
        return self._loaded[name]

    def __contains__(self, name: object) -> bool:
        return name in self._added or name in self.builtin

    def __iter__(self) -> Iterator[str]:
        return iter((*self.builtin, *self._added))

    def __len__(self) -> int:
        return len(self.builtin) + len(self._added)

    def __repr__(self) -> str:
        return f"SAMPLERS({', '.join(self)})"


SAMPLERS: Mapping[str, SamplerSpec] = _Samplers()
"""The samplers by name, a live mapping: :func:`register_sampler` adds to it."""


def register_sampler(spec: SamplerSpec) -> SamplerSpec:
    """Make ``spec`` a sampler everywhere (``SamplerConfig(sampler=spec.name)``, ``--sampler``,
    records, sweeps, the trajectory page, the server); its ``step`` is required. Returns it."""
    if spec.step is None:
        raise ELFError(f"sampler {spec.name!r} needs a step function")
    if spec.name in SAMPLERS:
        raise ELFError(f"a sampler named {spec.name!r} is already registered")
    SAMPLERS._added[spec.name] = spec  # type: ignore[attr-defined]
    return spec


def unregister_sampler(name: str) -> None:
    """Remove a sampler :func:`register_sampler` added (the built-in ones stay)."""
    if name in SAMPLERS.builtin:  # type: ignore[attr-defined]
        raise ELFError(f"{name!r} is a built-in sampler")
    SAMPLERS._added.pop(name, None)  # type: ignore[attr-defined]


def sampler_own_settings() -> set[str]:
    """The SamplerConfig fields some sampler uses alone (``gamma`` for the SDE, ...)."""
    return {f for s in SAMPLERS.values() for f in s.settings}


def unused_settings(name: str) -> set[str]:
    """The SamplerConfig fields other samplers use alone, which sampler ``name`` ignores."""
    own = SAMPLERS[name].settings
    return {f for s in SAMPLERS.values() for f in s.settings if f not in own}


def sampler_step(name: str) -> Callable[..., Any]:
    """The step of sampler ``name``:
    ``step(denoise, z, x_prev, t, t_next, ctx: StepContext) -> (z_next, x_hat)``."""
    step = SAMPLERS[name].step
    if step is None:
        raise ELFError(f"sampler {name!r} has no step function")
    return step


def noise_draws(name: str) -> int | None:
    """How many times a step of sampler ``name`` calls ``ctx.noise()`` (the last, Euler step
    none); None when its spec does not say (it then runs eagerly only)."""
    return SAMPLERS[name].noise_draws
