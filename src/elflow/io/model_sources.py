"""Where a model's weights are: a model source resolved to a local folder or file (ELF_SPEC §10).

A model source is an elflow model folder, a training run (its latest ``checkpoint-<step>``) or
checkpoint, an elflow model on the Hub, an authors' checkpoint (a ``checkpoint_<step>`` pickle, a
folder of them, or a Hub id), or ``demo``, the model shipped in the package. The authors' files
record no task: :func:`official_task_from_name` guesses it from the name.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from elflow.errors import ELFError
from elflow.io.official import latest_official_checkpoint
from elflow.io.paths import check_no_loop

WEIGHTS, EMA_WEIGHTS, CONFIG = "model.safetensors", "ema.safetensors", "config.json"
WEIGHTS_INDEX = "model.safetensors.index.json"
"""A model saved in shards (``save_model(max_shard_size=...)``): which shard holds each weight."""


def has_weights(folder: Path) -> bool:
    """Whether ``folder`` holds a model's weights: one ``model.safetensors`` or an index of
    shards."""
    return (folder / WEIGHTS).is_file() or (folder / WEIGHTS_INDEX).is_file()


DEMO_MODEL = Path(__file__).resolve().parents[1] / "demo_model"
"""The small CPU model shipped in the package; the model source ``demo`` names it."""
_RUN_CKPT_RE = re.compile(r"^checkpoint-(\d+)$")
_HUB_ID_RE = re.compile(r"^[\w.-]+/[\w.-]+(/[\w./-]+)?$")


def run_checkpoints(folder: Path) -> list[tuple[int, Path]]:
    """Every ``checkpoint-<step>`` subfolder of a run as (step, path), in numeric step order."""
    return sorted(
        (int(m.group(1)), p)
        for p in folder.iterdir()
        if p.is_dir() and (m := _RUN_CKPT_RE.match(p.name))
    )


def latest_run_checkpoint(folder: Path) -> Path | None:
    """The complete ``checkpoint-<step>`` subfolder with the largest step (numeric order)."""
    found = [p for _, p in run_checkpoints(folder) if (p / CONFIG).is_file()]
    return found[-1] if found else None


@dataclass(frozen=True)
class ResolvedSource:
    kind: str
    """'elflow' (a model/checkpoint folder) or 'official' (an authors' checkpoint file)."""
    path: Path
    name: str
    """What the user passed (for error messages and task inference)."""


def resolve_source(source: str | Path) -> ResolvedSource:
    """Find the weights behind any model source: a local folder or file, a Hub id, or ``demo``
    (the shipped demo model, unless a local ``demo`` exists)."""
    name = str(source)
    check_no_loop(source, "model source")
    path = Path(source).expanduser()
    if name == "demo" and not path.exists():
        if not (DEMO_MODEL / CONFIG).is_file() or not has_weights(DEMO_MODEL):
            raise ELFError(
                "this installation ships no demo model; train one with `elflow train --preset "
                "bible-tiny --out runs/bible-tiny` and use the model runs/bible-tiny"
            )
        return ResolvedSource("elflow", DEMO_MODEL, name)
    if not path.exists():
        if isinstance(source, str) and _HUB_ID_RE.match(source) and not source.startswith("."):
            path = _download(source)
        else:
            raise ELFError(f"model source {name!r} does not exist (not a file, folder or Hub id)")
    if path.is_file():
        if (
            path.name in (WEIGHTS, EMA_WEIGHTS, CONFIG, WEIGHTS_INDEX)
            and (path.parent / CONFIG).is_file()
        ):
            raise ELFError(f"{name!r} is a file of an elflow model; pass its folder {path.parent}")
        return ResolvedSource("official", path, name)
    if (path / CONFIG).is_file() and has_weights(path):
        return ResolvedSource("elflow", path, name)
    run_ckpt = latest_run_checkpoint(path)
    if run_ckpt is not None:
        return ResolvedSource("elflow", run_ckpt, name)
    official = latest_official_checkpoint(path)
    if official is not None:
        return ResolvedSource("official", official, name)
    rounds = sorted(p.name for p in path.glob("round-*-*x*") if p.is_dir())
    hint = f" (a distillation folder: pass one of its rounds, e.g. {rounds[-1]})" if rounds else ""
    raise ELFError(
        f"{name!r} holds no elflow model (config.json + model.safetensors), no checkpoint-<step> "
        f"folder and no authors' checkpoint_<step> file{hint}"
    )


def _download(hub_id: str) -> Path:
    from huggingface_hub import snapshot_download

    parts = hub_id.split("/")
    repo_id, sub = "/".join(parts[:2]), "/".join(parts[2:])
    try:
        root = snapshot_download(repo_id, allow_patterns=[sub, f"{sub}/*"] if sub else None)
    except Exception as e:
        raise ELFError(
            f"{hub_id!r} is not a local path, and the Hugging Face Hub did not provide it "
            f"({type(e).__name__}); check the path or the id, your network and HF_HUB_OFFLINE"
        ) from None
    path = Path(root) / sub if sub else Path(root)
    if not path.exists():
        raise ELFError(f"Hub repo {repo_id!r} has no file or folder {sub!r}")
    return path


_TASK_WORDS = (  # as words: "code-env" names no task
    ("owt", re.compile(r"(?<![a-z0-9])(owt|openwebtext)(?![a-z0-9])")),
    ("xsum", re.compile(r"(?<![a-z0-9])xsum(?![a-z])")),
    ("de-en", re.compile(r"(?<![a-z0-9])(de[-_]en|wmt\d*)(?![a-z])")),
)


def _named_task(text: str) -> str | None:
    for task, pattern in _TASK_WORDS:
        if pattern.search(text):
            return task
    return None


def official_task_from_name(name: str) -> str | None:
    """The paper task an authors' checkpoint's id or path names, or None.

    The last two parts decide (a Hub repo and its file, or a folder and its file: a parent
    folder "wmt-runs" says nothing about an OWT checkpoint in it); when they name none, the whole
    name (the Hugging Face cache keeps the repo name further up: .../models--org--ELF-B-de-en/
    snapshots/<hash>/checkpoint_5).
    """
    return guess_task(name)[0]


def guess_task(name: str) -> tuple[str | None, bool]:
    """(task, whether only a part above the last two named it)."""
    low = str(name).lower()
    near = _named_task("/".join(Path(low).parts[-2:]))
    if near is not None:
        return near, False
    far = _named_task(low)
    return far, far is not None
