"""``elflow distill``: progressive distillation rounds through the ordinary trainer (spec §8).

Each round (student steps N / teacher sub-steps K, default 16/4, 8/8, 4/16, 2/32, 1/64) is a
resumable training run in ``OUT/round-<k>-<N>x<K>/`` with its own checkpoints, fresh optimizer and
EMA. Round 1 starts from the teacher, round k + 1 from round k's EMA weights. The teacher (the
original model's EMA weights, the same in every round) is frozen, never wrapped in DDP/FSDP2, and
its weights hash is checked unchanged after every round. A finished round (its last checkpoint at
``train.max_steps``) is skipped when the command is run again, so an interrupted curriculum
resumes mid-round. ``OUT/teacher.json`` records the teacher (path and weights hash) at the first
start; once a round has saved a checkpoint, the folder continues only with that teacher.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
from collections.abc import Iterable
from dataclasses import fields, replace
from pathlib import Path

import numpy as np
import torch

from elflow.config import ObjectiveConfig, SamplerConfig
from elflow.distill import (
    DistillConfig,
    check_project_from,
    distill_loss,
    parse_rounds,
    sample_distill_draws_keyed,
)
from elflow.distributed import DistInfo, broadcast_object
from elflow.errors import ELFError
from elflow.generation.pipeline import load_tokenizer
from elflow.io import checkpoint as ckpt_io
from elflow.io.artifact import CONFIG, EMA_WEIGHTS, ArtifactConfig, load_model, resolve_source
from elflow.model import ELF
from elflow.network import TrainForward, projector
from elflow.objective import Batch
from elflow.paths import output_dir
from elflow.projection import Projection
from elflow.tokens import vocab_hash
from elflow.train.config import (
    EncoderConfig,
    RunConfig,
    apply_overrides,
    override_keys,
    run_config_from_dict,
)
from elflow.train.ema import initial_share
from elflow.train.loop import StepLoss, train
from elflow.train.presets import preset
from elflow.train.resume import architecture_changes, init_tokenizer, local_absolute

MAX_EMA_INITIAL_SHARE = 0.5
"""A round whose EMA would still be mostly its starting weights at the end is refused."""
TEACHER_RECORD = "teacher.json"
"""``OUT/teacher.json``: the teacher (``teacher``, ``teacher_sha256``) the rounds distil."""


def fewstep_sampler(steps: int) -> SamplerConfig:
    """The distilled students' sampler (spec §5): SDE, gamma 1.5 & w 2.5 up to 8 steps, else 2/2."""
    gamma, w = (1.5, 2.5) if steps <= 8 else (2.0, 2.0)
    return SamplerConfig(steps=steps, sampler="sde", gamma=gamma, w=w)


def weights_hash(model: torch.nn.Module) -> str:
    return state_hash(model.state_dict())


def state_hash(state: dict[str, torch.Tensor]) -> str:
    """sha256 over the names and bytes of a state dict's tensors (in name order)."""
    h = hashlib.sha256()
    for key, value in sorted(state.items()):
        h.update(key.encode())
        h.update(value.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


ROUND_START = "start.json"
"""In each round folder: the weights the round started from (sha256 and where they came from)."""


def _round_dir(out: Path, k: int, n_student: int, n_sub: int) -> Path:
    return out / f"round-{k}-{n_student}x{n_sub}"


def _unfinished(done: Path | None, max_steps: int) -> bool:
    """Whether a round whose latest checkpoint is ``done`` (None: none yet) still has to train."""
    return done is None or ckpt_io.read_state(done)["step"] < max_steps


def _raise_everywhere(problem: str | None) -> None:
    """Raise rank 0's ``problem`` (found by a check only rank 0 runs) on every rank."""
    problem = broadcast_object(problem)
    if problem:
        raise ELFError(problem)


def _check_no_later_rounds(
    out: Path, plan: list[tuple[int, int]], max_steps: int, info: DistInfo
) -> None:
    """Before any training: a round that still has to train (first start, resume, or more
    ``train.max_steps``) changes what the rounds after it start from, so a later round that
    already has checkpoints (in ``out``, under any ``--rounds``) is refused up front."""
    problem = None
    if info.is_main:
        for k, (n, sub) in enumerate(plan, start=1):
            if _unfinished(ckpt_io.find_checkpoint(_round_dir(out, k, n, sub)), max_steps):
                later = [
                    d
                    for d in sorted(out.glob("round-*"))
                    if (m := re.match(r"round-(\d+)-", d.name))
                    and int(m.group(1)) > k
                    and d.is_dir()
                    and ckpt_io.find_checkpoint(d) is not None
                ]
                if later:
                    problem = (
                        f"round {k} still has to train, which changes the weights {later[0].name} "
                        f"(already trained) started from; remove {later[0].name} and the rounds "
                        "after it, or use a new --out"
                    )
                break
    _raise_everywhere(problem)


def _check_round_start(
    round_dir: Path, k: int, start: dict, trained: Path | None, info: DistInfo
) -> None:
    """Record what round ``k`` starts from, or check that a round already ``trained`` (its latest
    checkpoint, None when it has none) started from it.

    A round folder is resumed or skipped as finished by its name; after a change of ``--rounds``
    or ``train.max_steps`` the rounds before it may have changed, and a round built on other
    weights would silently continue the wrong chain.
    """
    problem = None
    if info.is_main:
        path = round_dir / ROUND_START
        recorded = None  # rounds from before the record: nothing to compare with
        # A finished round's round.json also records the projection (read if start.json is not).
        for record in (path, round_dir / "round.json") if trained is not None else ():
            try:
                recorded = json.loads(record.read_text())
                break
            except (OSError, ValueError):
                continue
        if (
            isinstance(recorded, dict)
            and "init_sha256" in recorded
            and recorded["init_sha256"] != start["init_sha256"]
        ):
            problem = (
                f"round {k} ({round_dir}) was started from other weights "
                f"({recorded.get('from')}) than the previous round's now ({start['from']}), "
                "since --rounds or train.max_steps changed; remove that round folder and the "
                "ones after it, or use a new --out"
            )
        elif (
            isinstance(recorded, dict)
            and (was := recorded.get("teacher_project_from", 1.0)) != start["teacher_project_from"]
        ):
            problem = (
                f"round {k} ({round_dir}) was distilled with --teacher-project-from {was}, not "
                f"{start['teacher_project_from']}; give --teacher-project-from {was} to "
                "continue, or use a new --out"
            )
        elif trained is None:
            round_dir.mkdir(parents=True, exist_ok=True)
            tmp = round_dir / f".{ROUND_START}.tmp-{os.getpid()}"
            tmp.write_text(json.dumps(start) + "\n")
            os.replace(tmp, path)
    _raise_everywhere(problem)


class DistillObjective:
    """Spec §8's loss: the mean over rows of each row's masked token mean (normaliser: rows)."""

    def __init__(
        self,
        cfg: RunConfig,
        teacher: ELF,
        distill: DistillConfig,
        projection: Projection | None = None,
    ) -> None:
        self.cfg, self.distill = cfg, distill
        self.teacher = TrainForward(teacher)  # frozen, in eval mode, never wrapped
        # The teacher's projector, used only when distill.project_from < 1.
        self.project = None if projection is None else projector(teacher, projection)

    def denominator(self, batch: Batch) -> float:
        return float(batch.x.shape[0])

    def __call__(self, forward, batch: Batch, positions: np.ndarray) -> StepLoss:
        L, E = batch.x.shape[1], batch.x.shape[2]
        draws = sample_distill_draws_keyed(
            positions.tolist(),
            L,
            E,
            self.cfg.objective,
            self.distill.teacher_substeps,
            self.cfg.train.seed,
            batch.x.device,
        )
        out = distill_loss(forward, self.teacher, batch, draws, self.distill, self.project)
        dec = draws.decoder_active.bool().to(batch.x.device)
        rows = out.row_loss.detach()
        stats = torch.stack(
            [rows[~dec].sum(), rows[dec].sum(), (~dec).sum().to(rows), dec.sum().to(rows)]
        )
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
            f"--teacher {source} was trained with another vocabulary than tokenizer {name!r} "
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
    rounds: str,
    teacher_steps: int = 64,
    objective_keys: Iterable[str] = (),
    base_objective: ObjectiveConfig | None = None,
    fixed_keys: Iterable[str] = (),
    teacher_task: str | None = None,
    teacher_project_from: float = 1.0,
) -> Path:
    """Run (or resume) the curriculum; returns the last round's last checkpoint.

    The objective is the one the teacher was trained with (:func:`teacher_objective`, falling
    back to ``base_objective``, the preset's, default ``cfg.objective``), except the fields named
    in ``objective_keys`` (those the user set), which take ``cfg.objective``'s values. The
    architecture and encoder are the teacher's: a ``model.*``/``encoder.*`` key in
    ``fixed_keys`` (those the user changed from the preset's) with another value is an error.
    ``teacher_task``: an authors' checkpoint's paper task ('owt', 'de-en', 'xsum'; default
    guessed from its name), which the students take. ``teacher_project_from`` < 1 distils the
    teacher's projected trajectory (:attr:`DistillConfig.project_from`; unconditional teachers
    without ``data.packing``); every round of ``out`` must use the same value.
    """
    from elflow.distributed import setup

    t = cfg.train
    if t.init:
        raise ELFError(
            f"train.init={t.init!r} has no use in distillation: round 1 starts from --teacher; "
            "drop the setting"
        )
    share = initial_share(t.ema_decay, t.ema_warmup, t.max_steps)
    if share > MAX_EMA_INITIAL_SHARE:
        raise ELFError(
            f"train.ema_decay={t.ema_decay} would keep {100 * share:.0f}% of each round's starting "
            f"weights in the student saved after train.max_steps={t.max_steps}: set "
            "train.ema_warmup=true or a lower train.ema_decay"
        )
    p = teacher_project_from
    check_project_from(p, "--teacher-project-from")
    if p < 1.0 and cfg.data.packing:
        raise ELFError(
            "--teacher-project-from needs one text per row, but data.packing is on: drop one of "
            "them"
        )
    out = output_dir(out, "--out")  # before the teacher loads
    teacher_steps = teacher_steps or None
    plan = parse_rounds(rounds, teacher_steps)
    info = setup(cfg.train.device)
    teacher, tcfg = load_teacher(teacher_source, info.device, teacher_task)
    if p < 1.0 and (tcfg.conditional or tcfg.packed):
        raise ELFError(
            f"--teacher-project-from {p} needs an unconditional teacher with one text per row; "
            f"{teacher_source} is {'conditional' if tcfg.conditional else 'trained on packed rows'}"
            ": drop the flag"
        )
    # The student is the teacher's architecture, encoder, tokenizer, normalisation and objective.
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
    user = cfg
    # The students sample as the teacher does (projection included, where their rows allow it),
    # and from --teacher-project-from on at the latest: what their training inputs were.
    project_from = 1.0 if cfg.data.packing or tcfg.packed else tcfg.sampler.project_from
    project_from = min(project_from, float(p))
    cfg = replace(
        cfg,
        objective=replace(objective, **changed),
        model=tcfg.model,
        encoder=EncoderConfig.of_model(tcfg, teacher_tokenizer(teacher_source, tcfg)),
        sampler=replace(cfg.sampler, project_from=project_from),
        task=tcfg.task,
        max_input_length=tcfg.max_input_length,
    )
    for key in sorted(fixed_keys):
        asked, student = _value(user, key), _value(cfg, key)
        if key in ("encoder.name", "encoder.tokenizer"):
            asked, student = local_absolute(asked), local_absolute(student)
        if asked != student:
            raise ELFError(
                f"{key}={asked} is set, but the student takes the teacher's architecture and "
                f"encoder ({key}={student}); drop the setting"
            )
    reference_hash = weights_hash(teacher)
    _claim_out(out, teacher_source, reference_hash, info)
    _check_no_later_rounds(out, plan, cfg.train.max_steps, info)
    init = {k: v.detach().clone() for k, v in teacher.state_dict().items()}
    last = out
    for k, (n_student, n_sub) in enumerate(plan, start=1):
        round_dir = _round_dir(out, k, n_student, n_sub)
        # The few-step settings, with the teacher's guidance and projection (README "Few-step").
        sampler = replace(
            fewstep_sampler(n_student),
            cfg=tcfg.sampler.cfg,
            project_from=project_from,
        )
        round_cfg = replace(cfg, sampler=sampler)
        spec = DistillConfig(
            student_steps=n_student,
            teacher_substeps=n_sub,
            teacher_steps=teacher_steps,
            objective=cfg.objective,
            project_from=float(p),
        )
        start = {
            "from": str(last) if k > 1 else f"teacher {teacher_source}",
            "teacher_project_from": float(p),
        }
        done = ckpt_io.find_checkpoint(round_dir)
        _check_round_start(round_dir, k, {**start, "init_sha256": state_hash(init)}, done, info)
        if done is not None:
            _check_round_objective(done, round_cfg.objective, k)
        if _unfinished(done, round_cfg.train.max_steps):
            last = train(
                round_cfg,
                round_dir,
                resume="auto",
                objective_factory=lambda c, i, pr, s=spec: DistillObjective(c, teacher, s, pr),
                init_state=init,
                latent_cache_dir=out,  # one cache for every round: the same rows and encoder
            )
        else:
            last = done
        if weights_hash(teacher) != reference_hash:
            raise ELFError(f"the teacher's weights changed during round {k}; this is a bug")
        init = ckpt_io.load_weights(last, EMA_WEIGHTS)
        if info.is_main:
            (round_dir / "round.json").write_text(
                json.dumps(
                    {
                        "round": k,
                        "student_steps": n_student,
                        "teacher_substeps": n_sub,
                        "teacher_project_from": float(p),
                        "teacher": str(teacher_source),
                        "teacher_sha256": reference_hash,
                    }
                )
                + "\n"
            )
    return last


def _claim_out(out: Path, teacher_source: str, sha: str, info: DistInfo) -> None:
    """Record the teacher in ``out``; refuse another one once a round has saved a checkpoint
    (its rounds would mix two teachers), as ``train`` refuses a changed ``--init``."""
    problem = None
    if info.is_main:
        recorded = _recorded_teacher(out)
        trained = any(ckpt_io.find_checkpoint(d) for d in out.glob("round-*") if d.is_dir())
        checkpoint = str(resolve_source(teacher_source).path.resolve())  # a run: its latest
        if trained and recorded is not None and recorded["teacher_sha256"] != sha:
            was = recorded.get("checkpoint", recorded.get("teacher"))
            problem = (
                f"--out {out} holds rounds distilled from teacher {was} (weights sha256 "
                f"{recorded['teacher_sha256'][:12]}...), not {checkpoint} ({sha[:12]}...; a run "
                "folder gives its latest checkpoint); give that --teacher to continue, or use a "
                "new --out"
            )
        else:  # the first start, or the same weights (perhaps moved): (re)write the record
            local = Path(teacher_source).expanduser()
            name = str(local.resolve()) if local.exists() else str(teacher_source)
            out.mkdir(parents=True, exist_ok=True)
            tmp = out / f".{TEACHER_RECORD}.tmp-{os.getpid()}"
            record = {"teacher": name, "checkpoint": checkpoint, "teacher_sha256": sha}
            tmp.write_text(json.dumps(record) + "\n")
            os.replace(tmp, out / TEACHER_RECORD)
    _raise_everywhere(problem)


def _recorded_teacher(out: Path) -> dict | None:
    """``OUT/teacher.json``, else (folders distilled before it was written) a round's round.json."""
    for path in (out / TEACHER_RECORD, *sorted(out.glob("round-*/round.json"))):
        try:
            record = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if isinstance(record, dict) and isinstance(record.get("teacher_sha256"), str):
            return record
    return None


def _check_round_objective(ckpt: Path, objective: ObjectiveConfig, k: int) -> None:
    """A round is resumed (or skipped as finished) only with the objective it was trained with."""
    saved = run_config_from_dict(ckpt_io.read_run_config(ckpt)).objective
    diff = [f.name for f in fields(saved) if getattr(saved, f.name) != getattr(objective, f.name)]
    if diff:
        was = ", ".join(f"{name}={getattr(saved, name)}" for name in diff)
        raise ELFError(
            f"round {k} in {ckpt.parent} was trained with objective {was}; give the same "
            "objective settings to continue the curriculum, or use a new --out"
        )


def add_arguments(p: argparse.ArgumentParser) -> None:
    from elflow.generation.records import add_task_argument

    p.add_argument("--teacher", required=True, help="any model source (elflow or authors')")
    add_task_argument(p)
    p.add_argument("--out", required=True, help="folder for the rounds")
    p.add_argument("--preset", default="bible-tiny", help="data/optim/train settings to start from")
    p.add_argument("--config", help="YAML or JSON overrides")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument(
        "--rounds",
        default="16/4,8/8,4/16,2/32,1/64",
        help="student steps / teacher sub-steps per round",
    )
    p.add_argument("--teacher-steps", type=int, default=64, help="N x K of every round (0: any)")
    p.add_argument(
        "--teacher-project-from",
        type=float,
        default=1.0,
        metavar="T",
        help="distil the teacher's projected trajectory: its x-predictions at t >= T replaced by "
        "the encoder's latents of their text (elflow addition; default 1 = off, the paper)",
    )


def run(args: argparse.Namespace) -> int:
    from elflow.distributed import teardown

    cfg = apply_overrides(preset(args.preset), args.config, args.set)
    if cfg.train.max_steps <= 0:
        raise ELFError("set the steps per round with --set train.max_steps=N")
    objective_keys = {
        key.removeprefix("objective.")
        for key in override_keys(args.config, args.set)
        if key.startswith("objective.")
    }
    fixed_keys = set(architecture_changes(cfg, preset(args.preset)))  # changed from the preset
    try:
        last = distill(
            args.teacher,
            cfg,
            args.out,
            args.rounds,
            args.teacher_steps or None,
            objective_keys,
            preset(args.preset).objective,
            fixed_keys,
            args.task,
            args.teacher_project_from,
        )
    finally:
        teardown()
    if os.environ.get("RANK", "0") == "0":  # once under torchrun
        print(f"done: {last}")
    return 0
