"""``elflow distill``: a distillation method's rounds through the ordinary trainer (spec §8).

The method (:mod:`elflow.distill.methods`: progressive distillation by default) gives the rounds:
progressive distillation's (student steps N / teacher sub-steps K, default 16/4, 8/8, 4/16, 2/32,
1/64) in ``OUT/round-<k>-<N>x<K>/``, a one-round method's in ``OUT/round-1-<name>/``. Each is a
resumable training run with its own checkpoints, fresh optimizer and EMA. Round 1 starts from
the teacher, round k + 1 from round k's EMA weights. The teacher (the
original model's EMA weights, the same in every round) is frozen, never wrapped in DDP/FSDP2, and
its weights hash is checked unchanged after every round. A finished round (its last checkpoint at
``train.max_steps``) is skipped when the command is run again, so an interrupted curriculum
resumes mid-round. ``OUT/teacher.json`` records the teacher (path and weights hash) at the first
start; once a round has saved a checkpoint, the folder continues only with that teacher.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterable, Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from elflow.config.objective_config import ObjectiveConfig
from elflow.config.train_config import (
    RunConfig,
    run_config_from_dict,
)
from elflow.distill.distill_config import DistillConfig, check_project_from
from elflow.distill.methods import DistillMethod, Stage, distill_method, method_settings
from elflow.distill.rounds import (
    check_no_later_rounds,
    check_round_objective,
    check_round_start,
    claim_out,
    state_hash,
    unfinished,
    weights_hash,
)
from elflow.errors import ELFError
from elflow.io import checkpoint as ckpt_io
from elflow.io.artifact import ArtifactConfig, load_model
from elflow.io.model_sources import CONFIG, EMA_WEIGHTS, resolve_source
from elflow.io.paths import output_dir
from elflow.model import ELF
from elflow.objective import Batch
from elflow.runtime.distributed import DistInfo
from elflow.sampling.denoiser import projector
from elflow.sampling.projection import Projection
from elflow.text.tokenizer import load_tokenizer
from elflow.text.tokens import vocab_hash
from elflow.train.ema import initial_share
from elflow.train.forward import TrainForward
from elflow.train.loop import train
from elflow.train.resume import init_tokenizer, local_absolute, model_encoder_config
from elflow.train.step import StepLoss

MAX_EMA_INITIAL_SHARE = 0.5
"""A round whose EMA would still be mostly its starting weights at the end is refused."""


class DistillObjective:
    """A distillation stage's loss for the trainer: the method's per-row losses, normalised by
    the rows (the mean over rows of each row's own loss, ELF_SPEC §8)."""

    def __init__(
        self,
        cfg: RunConfig,
        teacher: ELF,
        stage: Stage | DistillConfig,
        projection: Projection | None = None,
        method: DistillMethod | None = None,
    ) -> None:
        self.cfg = cfg
        if isinstance(stage, DistillConfig):  # a progressive-distillation round on its own
            stage = Stage(f"{stage.student_steps}x{stage.teacher_substeps}", 0, stage)
        self.stage, self.method = stage, method or distill_method("pd")
        self.teacher = TrainForward(teacher)  # frozen, in eval mode, never wrapped
        # The teacher's projector, used only when the stage distils the projected teacher.
        self.project = None if projection is None else projector(teacher, projection)

    def denominator(self, batch) -> float:
        return float(batch.input_ids.shape[0])

    def __call__(self, forward, batch: Batch, positions: np.ndarray) -> StepLoss:
        out = self.method.loss(
            forward,
            self.teacher,
            batch,
            positions,
            self.stage,
            self.cfg.objective,
            self.cfg.train.seed,
            self.project,
        )
        dec = out.decoder_active.to(batch.x.device)
        rows = out.row_loss.detach()
        ce = (rows * dec).sum()
        n_dec = dec.sum().to(rows)
        bad = (~torch.isfinite(batch.x)).any().to(rows)
        stats = torch.stack([rows.sum() - ce, ce, dec.numel() - n_dec, n_dec, bad])
        return StepLoss(out.row_sum, stats.double())


def teacher_objective(source: str, tcfg, fallback: ObjectiveConfig) -> ObjectiveConfig:
    """The objective the teacher was trained with: its run config when it is an elflow training
    checkpoint, else ``fallback`` with the teacher's padding policy, noise scale and t_eps (and
    the paper's seq2seq decoder noise and label drop for conditional teachers)."""
    resolved = resolve_source(source)
    if resolved.kind == "elflow":
        run = json.loads((resolved.path / CONFIG).read_text()).get("run")
        if run is not None:
            return run_config_from_dict(run).objective
    objective = replace(
        fallback, pad_with_eos=tcfg.pad_with_eos, noise_scale=tcfg.noise_scale, t_eps=tcfg.t_eps
    )
    if tcfg.conditional:
        objective = replace(objective, decoder_noise_scale=1.0, label_drop_prob=0.1)
    return objective


def _value(cfg: RunConfig, key: str):
    section, name = key.split(".", 1)
    return getattr(getattr(cfg, section), name)


def teacher_tokenizer(source: str, tcfg: ArtifactConfig) -> str:
    """The tokenizer the teacher was trained with, as for a fine-tune's init (its own
    ``tokenizer/`` files when its name does not load with the recorded vocabulary); another
    vocabulary than the recorded one is an error."""
    name = init_tokenizer(tcfg, resolve_source(source).path / "tokenizer")
    here = vocab_hash(load_tokenizer(name))
    if tcfg.tokenizer_hash not in (None, here):
        raise ELFError(
            f"teacher {source} was trained with another vocabulary than "
            f"tokenizer {name!r} "
            f"here (sha256 {tcfg.tokenizer_hash[:12]}... against {here[:12]}...); install the "
            "tokenizer it was trained with or put its files in the model's tokenizer/ folder"
        )
    return name


def load_teacher(
    source: str, device: torch.device | str, task: str | None = None
) -> tuple[ELF, ArtifactConfig]:
    """The frozen teacher; ``task``: an authors' checkpoint's paper task (else from its name)."""
    teacher, config = load_model(source, device=device, task=task)
    teacher.eval().requires_grad_(False)
    return teacher, config


TEACHER_CONVENTIONS = ("pad_with_eos", "noise_scale", "t_eps")
"""Objective fields the frozen teacher's inputs depend on: always the teacher's own."""


def distill(
    teacher_source: str,
    cfg: RunConfig,
    out: str | Path,
    rounds: str | None = None,
    teacher_steps: int | None = 64,
    objective_keys: Iterable[str] = (),
    base_objective: ObjectiveConfig | None = None,
    fixed_keys: Iterable[str] = (),
    teacher_task: str | None = None,
    teacher_project_from: float = 1.0,
    *,
    method: str = "pd",
    settings: Mapping[str, Any] | None = None,
) -> Path:
    """Run (or resume) a distillation method's stages; returns the last stage's last checkpoint.

    ``method`` names a registered method (:data:`elflow.distill.methods.DISTILL_METHODS`:
    ``pd``, progressive distillation, ELF_SPEC §8; ``cd``, consistency distillation,
    :mod:`elflow.distill.consistency`); ``settings`` sets its settings by name over their defaults.
    ``rounds`` and ``teacher_steps`` are progressive distillation's (its ``rounds`` and
    ``teacher_steps`` settings; ``teacher_steps`` None or 0 allows any N x K).

    The objective is the one the teacher was trained with (:func:`teacher_objective`, falling
    back to ``base_objective``, the preset's, default ``cfg.objective``), except the fields named
    in ``objective_keys`` (those the user set), which take ``cfg.objective``'s values. The
    architecture and encoder are the teacher's: a ``model.*``/``encoder.*`` key in
    ``fixed_keys`` (those the user changed from the preset's) with another value is an error.
    ``teacher_task``: an authors' checkpoint's paper task ('owt', 'de-en', 'xsum'; default
    guessed from its name), which the students take. ``teacher_project_from`` < 1 distils the
    teacher's projected trajectory (:attr:`DistillConfig.project_from`; unconditional teachers
    without ``data.packing``, methods that support it); every round of ``out`` must use the same
    value.
    """
    from elflow.runtime.distributed import setup

    m = distill_method(method)
    check_project_from(teacher_project_from, "teacher_project_from=")
    p = float(teacher_project_from)
    if p < 1.0 and not m.projects:
        raise ELFError(
            f"method={m.name} does not distil a projected teacher: drop teacher_project_from="
        )
    chosen = method_settings(m, _with_round_arguments(m, settings, rounds, teacher_steps))
    _check_settings(cfg, p)
    out = output_dir(out, "out=")  # before the teacher loads
    m.stages(chosen, cfg.objective, p)  # the settings' errors, before the teacher loads
    info = setup(cfg.train.device)
    teacher, tcfg = load_teacher(teacher_source, info.device, teacher_task)
    if p < 1.0 and (tcfg.conditional or tcfg.packed):
        raise ELFError(
            f"teacher_project_from={p} needs an unconditional teacher with one text per row; "
            f"{teacher_source} is {'conditional' if tcfg.conditional else 'trained on packed rows'}"
            ": drop the setting"
        )
    cfg = student_config(
        cfg, teacher_source, tcfg, objective_keys, base_objective, fixed_keys, p, info
    )
    stages = m.stages(chosen, cfg.objective, p)
    folders = [out / f"round-{k}-{stage.name}" for k, stage in enumerate(stages, start=1)]
    reference_hash = weights_hash(teacher)
    claim_out(out, teacher_source, reference_hash, info)
    check_no_later_rounds(out, folders, cfg.train.max_steps, info)
    init = {k: v.detach().clone() for k, v in teacher.state_dict().items()}
    # The students sample as the method says, with the teacher's guidance and projection.
    base = replace(tcfg.sampler, project_from=cfg.sampler.project_from)
    last = out
    for k, (stage, folder) in enumerate(zip(stages, folders, strict=True), start=1):
        start = {
            "from": str(last) if k > 1 else f"teacher {teacher_source}",
            "teacher_project_from": p,
            "method": m.name,
        }
        if m.name != "pd":  # a round's settings are in its folder name
            start["settings"] = dataclasses.asdict(chosen)
        student = replace(cfg, sampler=m.sampler(base, stage))
        last = _round(student, m, stage, teacher, folder, k, start, init, info)
        if weights_hash(teacher) != reference_hash:
            raise ELFError(f"the teacher's weights changed during round {k}; this is a bug")
        init = ckpt_io.load_weights(last, EMA_WEIGHTS)
        if info.is_main:
            record = {"round": k, "method": m.name, **stage.record}
            record |= {"teacher_project_from": p, "teacher": str(teacher_source)}
            record |= {"teacher_sha256": reference_hash}
            (folder / "round.json").write_text(json.dumps(record) + "\n")
    return last


def _with_round_arguments(
    m: DistillMethod,
    settings: Mapping[str, Any] | None,
    rounds: str | None,
    teacher_steps: int | None,
) -> dict[str, Any]:
    """``settings`` with progressive distillation's ``rounds=`` and ``teacher_steps=``."""
    values = dict(settings or {})
    if m.name != "pd":
        if rounds is not None or teacher_steps not in (64, None):
            raise ELFError(
                f"rounds= and teacher_steps= are progressive distillation's (method=pd); give "
                f"method={m.name}'s settings with settings="
            )
        return values
    for key, given in (("rounds", rounds), ("teacher_steps", teacher_steps or 0)):
        if given is None:
            continue
        if key in values and values[key] != given and not (key == "teacher_steps" and given == 64):
            raise ELFError(f"{key}= and settings={{'{key}': ...}} differ: give one of them")
        values.setdefault(key, given)
    return values


def _check_settings(cfg: RunConfig, p: float) -> None:
    """What the curriculum refuses before the teacher loads."""
    t = cfg.train
    if t.init:
        raise ELFError(
            f"train.init={t.init!r} has no use in distillation: round 1 starts from the teacher "
            "(teacher_source=); drop the setting"
        )
    share = initial_share(t.ema_decay, t.ema_warmup, t.max_steps)
    if share > MAX_EMA_INITIAL_SHARE:
        raise ELFError(
            f"train.ema_decay={t.ema_decay} would keep {100 * share:.0f}% of each round's starting "
            f"weights in the student saved after train.max_steps={t.max_steps}: set "
            "train.ema_warmup=true or a lower train.ema_decay"
        )
    if p < 1.0 and cfg.data.packing:
        raise ELFError(
            "teacher_project_from= needs one text per row, but data.packing is on: drop one of them"
        )


def student_config(
    cfg: RunConfig,
    teacher_source: str,
    tcfg: ArtifactConfig,
    objective_keys: Iterable[str],
    base_objective: ObjectiveConfig | None,
    fixed_keys: Iterable[str],
    p: float,
    info: DistInfo,
) -> RunConfig:
    """The students' config: the teacher's architecture, encoder, tokenizer, normalisation, task
    and objective (but the ``objective_keys`` the user set), sampling as the teacher does and from
    ``p`` on at the latest (:func:`distill`)."""
    objective = teacher_objective(teacher_source, tcfg, base_objective or cfg.objective)
    changed = {
        k: getattr(cfg.objective, k)
        for k in sorted(objective_keys)
        if getattr(cfg.objective, k) != getattr(objective, k)
    }
    for k in TEACHER_CONVENTIONS:
        if k in changed:
            raise ELFError(
                f"objective.{k}={changed[k]} differs from the teacher's {getattr(objective, k)}; "
                "the frozen teacher only works with its own value: drop the setting"
            )
    if changed and info.is_main:
        print(
            "elflow distill: the teacher's objective, except "
            + ", ".join(f"{k} {v} (teacher {getattr(objective, k)})" for k, v in changed.items()),
            flush=True,
        )
    # The students sample as the teacher does (projection included, where their rows allow it),
    # and from --teacher-project-from on at the latest: what their training inputs were.
    project_from = 1.0 if cfg.data.packing or tcfg.packed else tcfg.sampler.project_from
    student = replace(
        cfg,
        objective=replace(objective, **changed),
        model=tcfg.model,
        encoder=model_encoder_config(tcfg, teacher_tokenizer(teacher_source, tcfg)),
        sampler=replace(cfg.sampler, project_from=min(project_from, p)),
        task=tcfg.task,
        max_input_length=tcfg.max_input_length,
    )
    for key in sorted(fixed_keys):
        asked, taken = _value(cfg, key), _value(student, key)
        if key in ("encoder.name", "encoder.tokenizer"):
            asked, taken = local_absolute(asked), local_absolute(taken)
        if asked != taken:
            raise ELFError(
                f"{key}={asked} is set, but the student takes the teacher's architecture and "
                f"encoder ({key}={taken}); drop the setting"
            )
    return student


def _round(
    cfg: RunConfig,
    method: DistillMethod,
    stage: Stage,
    teacher: ELF,
    folder: Path,
    k: int,
    start: dict,
    init: dict[str, torch.Tensor],
    info: DistInfo,
) -> Path:
    """Round ``k`` in ``folder``: trained (or continued) from ``init`` unless already finished;
    its last checkpoint."""
    done = ckpt_io.find_checkpoint(folder)
    check_round_start(folder, k, {**start, "init_sha256": state_hash(init)}, done, info)
    if done is not None:
        check_round_objective(done, cfg.objective, k)
    if not unfinished(done, cfg.train.max_steps):
        return done
    return train(
        cfg,
        folder,
        resume="auto",
        objective_factory=lambda c, i, pr: DistillObjective(c, teacher, stage, pr, method),
        init_state=init,
        latent_cache_dir=folder.parent,  # under data.latent_cache_dir=run: one for all rounds
    )
