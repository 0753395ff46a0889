"""Few-step distillation methods, registered by name like the samplers (ELF_SPEC §8).

A method is a :class:`DistillMethod`: its settings (a frozen dataclass), the stages it trains
(progressive distillation's rounds; one stage for a method that trains once), each stage's loss
(a function of the student, the frozen teacher, a batch and its stream positions) and the sampler
its students are saved with. ``elflow distill --method NAME`` and
:func:`elflow.distill.curriculum.distill` read :data:`DISTILL_METHODS`; the built-in ones are
``pd`` (the maths in :mod:`elflow.distill.progressive`) and ``cd``
(:mod:`elflow.distill.consistency`), registered at the end of this module;
:func:`register_distill_method` adds another, so a third method is one module: its maths, its
settings and its :class:`DistillMethod`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any, NamedTuple

from torch import Tensor

from elflow.config.objective_config import ObjectiveConfig
from elflow.config.sampler_config import SamplerConfig, fewstep_sampler
from elflow.config.serialise import field_docs, from_dict
from elflow.distill.consistency import (
    ConsistencyConfig,
    ConsistencySettings,
    consistency_loss,
    sample_consistency_draws_keyed,
)
from elflow.distill.distill_config import ROUNDS, DistillConfig, parse_rounds
from elflow.distill.progressive import distill_loss, sample_distill_draws_keyed
from elflow.errors import ELFError


@dataclass(frozen=True)
class Stage:
    """One training run of a method: the folder ``round-<k>-<name>`` of the distillation
    output, the student's sampling steps, the stage's objective settings and what its
    ``start.json`` and ``round.json`` record of it."""

    name: str
    """The folder's suffix (progressive distillation: ``NxK``)."""
    steps: int
    """The student's sampling steps, written into its config."""
    spec: Any
    """The settings the stage's loss takes (progressive distillation's: a round's
    :class:`elflow.distill.distill_config.DistillConfig`)."""
    record: dict[str, Any] = field(default_factory=dict)
    """JSON-ready: recorded in the round's ``round.json``; a ``settings`` entry is also checked
    against an existing round before it is continued."""


class StageLoss(NamedTuple):
    """One micro-batch's distillation loss: each row's own loss, summed for back-propagation."""

    row_sum: Tensor
    """Sum of the per-row losses (the step loss is the sum over the global batch / its rows)."""
    row_loss: Tensor
    """(B,) each row's loss, detached."""
    decoder_active: Tensor
    """(B,) 1 on decoder (cross-entropy) rows (for the logged l2 and ce)."""


StageLossFn = Callable[..., StageLoss]
"""``loss(student, teacher, batch, positions, stage, objective, seed, project) -> StageLoss``:
``student``/``teacher`` are forward functions (:class:`elflow.train.forward.TrainForward`),
``positions`` the batch's stream positions (every random draw keyed by (``seed``, position)),
``stage`` a :class:`Stage`, ``objective`` the §3 :class:`ObjectiveConfig`, ``project`` the
teacher's projector or None."""


@dataclass(frozen=True)
class DistillMethod:
    """What a distillation method is, in one place (read by ``elflow distill --method``)."""

    name: str
    title: str
    """As the docs name it ("progressive distillation")."""
    settings: type
    """A frozen dataclass of the method's settings, each field with a default and a docstring
    (``elflow distill --method-set KEY=VALUE``)."""
    stages: Callable[[Any, ObjectiveConfig, float], list[Stage]]
    """``stages(settings, objective, teacher_project_from) -> [Stage, ...]``, in training order."""
    loss: StageLossFn
    """A stage's loss (:data:`StageLossFn`)."""
    sampler: Callable[[SamplerConfig, Stage], SamplerConfig]
    """``sampler(base, stage)``: the student's saved sampler from ``base``, the teacher's with the
    run's projection start."""
    projects: bool = False
    """Whether the method can distil a projected teacher (``teacher_project_from`` < 1)."""


DISTILL_METHODS: dict[str, DistillMethod] = {}
"""The methods by name (a live mapping: :func:`register_distill_method` adds to it)."""


def register_distill_method(method: DistillMethod) -> DistillMethod:
    """Make ``method`` available to ``elflow distill --method`` and ``distill(method=)``."""
    if method.name in DISTILL_METHODS:
        raise ELFError(f"a distillation method named {method.name!r} is already registered")
    if not dataclasses.is_dataclass(method.settings):
        raise ELFError(f"distillation method {method.name!r}: settings must be a dataclass")
    DISTILL_METHODS[method.name] = method
    return method


def distill_method(name: str) -> DistillMethod:
    """The method called ``name``; an unknown name is a one-line error listing them."""
    methods = DISTILL_METHODS
    if name not in methods:
        raise ELFError(
            f"unknown distillation method={name!r}; choose one of {', '.join(sorted(methods))}"
        )
    return methods[name]


def method_settings(method: DistillMethod, values: Mapping[str, Any] | None = None) -> Any:
    """``method``'s settings with ``values`` over the defaults; an unknown key is an error naming
    the valid ones (with their documentation's first words)."""
    values = dict(values or {})
    names = {f.name for f in dataclasses.fields(method.settings)}
    unknown = sorted(set(values) - names)
    if unknown:
        docs = field_docs(method.settings)
        valid = "; ".join(f"{n} ({docs.get(n, '').split('.')[0]})" for n in sorted(names))
        raise ELFError(
            f"unknown setting(s) {', '.join(unknown)} for method {method.name}; valid: {valid}"
        )
    text = {f.name for f in dataclasses.fields(method.settings) if f.type in ("str", str)}
    values = {
        k: str(v) if k in text and isinstance(v, int | float) else v for k, v in values.items()
    }
    return from_dict(method.settings, values, f"method {method.name}")


# The built-in methods.


@dataclass(frozen=True)
class PDSettings:
    """Progressive distillation's curriculum (ELF_SPEC §8)."""

    rounds: str = ROUNDS
    """Student steps / teacher sub-steps per round, e.g. 16/4,8/8 (``--rounds``)."""
    teacher_steps: int = 64
    """N x K of every round (``--teacher-steps``; 0 allows any)."""


def _pd_stages(settings: PDSettings, objective: ObjectiveConfig, project_from: float) -> list:
    teacher_steps = settings.teacher_steps or None
    return [
        Stage(
            name=f"{n}x{k}",
            steps=n,
            spec=DistillConfig(n, k, teacher_steps, objective, project_from),
            record={"student_steps": n, "teacher_substeps": k},
        )
        for n, k in parse_rounds(settings.rounds, teacher_steps)
    ]


def pd_stage_loss(student, teacher, batch, positions, stage, objective, seed, project):
    """A progressive-distillation round's loss, its draws keyed by the stream positions."""
    L, E = batch.x.shape[1], batch.x.shape[2]
    spec: DistillConfig = replace(stage.spec, objective=objective)
    draws = sample_distill_draws_keyed(
        positions, L, E, objective, spec.teacher_substeps, seed, batch.x.device
    )
    out = distill_loss(student, teacher, batch, draws, spec, project, check_inputs=False)
    return StageLoss(out.row_sum, out.row_loss, draws.decoder_active)


def _pd_sampler(base: SamplerConfig, stage: Stage) -> SamplerConfig:
    """The paper's few-step students' sampler, with the teacher's guidance and projection."""
    sampler = fewstep_sampler(SamplerConfig(), stage.steps)
    return replace(sampler, cfg=base.cfg, project_from=base.project_from)


def _cd_stages(settings: ConsistencySettings, objective: ObjectiveConfig, project_from: float):
    spec = ConsistencyConfig.of(settings, objective)
    record = {"student_steps": settings.steps, "teacher_substeps": spec.teacher_substeps}
    return [Stage("cd", settings.steps, spec, record | {"spans": list(spec.spans)})]


def cd_stage_loss(student, teacher, batch, positions, stage, objective, seed, project):
    """The consistency-distillation stage's loss, its draws keyed by the stream positions."""
    L, E = batch.x.shape[1], batch.x.shape[2]
    cfg = replace(stage.spec, objective=objective)
    draws = sample_consistency_draws_keyed(positions, L, E, cfg, seed, batch.x.device)
    out = consistency_loss(student, teacher, batch, draws, cfg, check_inputs=False)
    return StageLoss(out.row_sum, out.row_loss, draws.base.decoder_active)


def _cd_sampler(base: SamplerConfig, stage: Stage) -> SamplerConfig:
    """Multistep consistency sampling on a uniform grid, the teacher's guidance and projection."""
    return replace(base, sampler="renoise", steps=stage.steps, time_grid="uniform")


PD = register_distill_method(
    DistillMethod(
        "pd",
        "progressive distillation",
        PDSettings,
        _pd_stages,
        pd_stage_loss,
        _pd_sampler,
        projects=True,
    )
)
CD = register_distill_method(
    DistillMethod(
        "cd",
        "consistency distillation",
        ConsistencySettings,
        _cd_stages,
        cd_stage_loss,
        _cd_sampler,
    )
)
