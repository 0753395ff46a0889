"""What a distillation folder records, and the checks that keep its rounds one chain (ELF_SPEC §8).

``OUT/teacher.json`` names the teacher (path and weights hash) from the first start; each round
folder's ``start.json`` records the weights it started from (and the teacher projection), and a
finished round's ``round.json`` what it was (and, for a method other than progressive
distillation, its settings, which a continued round must keep). A round is continued or
skipped as finished by its folder name, so these records catch a changed ``--rounds``,
``train.max_steps``, teacher, method or objective before a round silently continues the wrong
chain. Checks run on rank 0 and raise on every rank.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from dataclasses import fields
from pathlib import Path

import torch

from elflow.config.objective_config import ObjectiveConfig
from elflow.config.train_config import run_config_from_dict
from elflow.errors import ELFError
from elflow.io import checkpoint as ckpt_io
from elflow.io.model_sources import resolve_source
from elflow.runtime.distributed import DistInfo, broadcast_object

TEACHER_RECORD = "teacher.json"
"""``OUT/teacher.json``: the teacher (``teacher``, ``teacher_sha256``) the rounds distil."""


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


def round_dir(out: Path, k: int, n_student: int, n_sub: int) -> Path:
    return out / f"round-{k}-{n_student}x{n_sub}"


def unfinished(done: Path | None, max_steps: int) -> bool:
    """Whether a round whose latest checkpoint is ``done`` (None: none yet) still has to train."""
    return done is None or ckpt_io.read_state(done)["step"] < max_steps


def raise_everywhere(problem: str | None) -> None:
    """Raise rank 0's ``problem`` (found by a check only rank 0 runs) on every rank."""
    problem = broadcast_object(problem)
    if problem:
        raise ELFError(problem)


def check_no_later_rounds(out: Path, folders: list[Path], max_steps: int, info: DistInfo) -> None:
    """Before any training: a round that still has to train (first start, resume, or more
    ``train.max_steps``) changes what the rounds after it start from, so a later round that
    already has checkpoints (in ``out``, under any ``--rounds``) is refused up front.
    ``folders``: the rounds' folders, round 1 first."""
    problem = None
    if info.is_main:
        for k, folder in enumerate(folders, start=1):
            if unfinished(ckpt_io.find_checkpoint(folder), max_steps):
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
                        "after it, or use a new out="
                    )
                break
    raise_everywhere(problem)


def check_round_start(
    round_dir: Path, k: int, start: dict, trained: Path | None, info: DistInfo
) -> None:
    """Record what round ``k`` starts from, or check that a round already ``trained`` (its latest
    checkpoint, None when it has none) started from it.

    A round folder is resumed or skipped as finished by its name; after a change of ``rounds``
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
                "since rounds= or train.max_steps changed; remove that round folder and the "
                "ones after it, or use a new out="
            )
        elif (
            isinstance(recorded, dict)
            and (was := recorded.get("teacher_project_from", 1.0)) != start["teacher_project_from"]
        ):
            problem = (
                f"round {k} ({round_dir}) was distilled with teacher_project_from={was}, not "
                f"{start['teacher_project_from']}; give teacher_project_from={was} to "
                "continue, or use a new out="
            )
        elif isinstance(recorded, dict) and (
            (was := recorded.get("method", "pd"), recorded.get("settings"))
            != (start.get("method", "pd"), start.get("settings"))
        ):
            problem = (
                f"round {k} ({round_dir}) was distilled with method={was} "
                f"{recorded.get('settings') or ''}, not method={start.get('method', 'pd')} "
                f"{start.get('settings') or ''}; give the same method and settings to continue, "
                "or use a new out="
            )
        elif trained is None:
            round_dir.mkdir(parents=True, exist_ok=True)
            tmp = round_dir / f".{ROUND_START}.tmp-{os.getpid()}"
            tmp.write_text(json.dumps(start) + "\n")
            os.replace(tmp, path)
    raise_everywhere(problem)


def claim_out(out: Path, teacher_source: str, sha: str, info: DistInfo) -> None:
    """Record the teacher in ``out``; refuse another one once a round has saved a checkpoint
    (its rounds would mix two teachers), as ``train`` refuses a changed init model."""
    problem = None
    if info.is_main:
        recorded = _recorded_teacher(out)
        trained = any(ckpt_io.find_checkpoint(d) for d in out.glob("round-*") if d.is_dir())
        checkpoint = str(resolve_source(teacher_source).path.resolve())  # a run: its latest
        if trained and recorded is not None and recorded["teacher_sha256"] != sha:
            was = recorded.get("checkpoint", recorded.get("teacher"))
            problem = (
                f"out={out} holds rounds distilled from teacher {was} (weights sha256 "
                f"{recorded['teacher_sha256'][:12]}...), not {checkpoint} ({sha[:12]}...; a run "
                "folder gives its latest checkpoint); give that teacher_source= (teacher) to "
                "continue, or use a new out="
            )
        else:  # the first start, or the same weights (perhaps moved): (re)write the record
            local = Path(teacher_source).expanduser()
            name = str(local.resolve()) if local.exists() else str(teacher_source)
            out.mkdir(parents=True, exist_ok=True)
            tmp = out / f".{TEACHER_RECORD}.tmp-{os.getpid()}"
            record = {"teacher": name, "checkpoint": checkpoint, "teacher_sha256": sha}
            tmp.write_text(json.dumps(record) + "\n")
            os.replace(tmp, out / TEACHER_RECORD)
    raise_everywhere(problem)


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


def check_round_objective(ckpt: Path, objective: ObjectiveConfig, k: int) -> None:
    """A round is resumed (or skipped as finished) only with the objective it was trained with."""
    saved = run_config_from_dict(ckpt_io.read_run_config(ckpt)).objective
    diff = [f.name for f in fields(saved) if getattr(saved, f.name) != getattr(objective, f.name)]
    if diff:
        was = ", ".join(f"{name}={getattr(saved, name)}" for name in diff)
        raise ELFError(
            f"round {k} in {ckpt.parent} was trained with objective {was}; give the same "
            "objective settings to continue the curriculum, or use a new out="
        )
