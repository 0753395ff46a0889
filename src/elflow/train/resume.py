"""Starting a run from earlier weights: resuming a run, or fine-tuning a model (``train.init``).

A resume continues the same run bitwise, so it must see the same init, architecture, encoder and
latent scale, global batch, seed and number of rows (the data order and every draw depend on
them); anything else is refused with a one-line error that says how to start a new run instead.
A fine-tune takes the init model's architecture, encoder, tokenizer and latent normalisation,
since its weights only make sense in its own latent space.
"""

from __future__ import annotations

from dataclasses import fields, replace
from pathlib import Path

import torch.distributed as dist
from torch import Tensor

from elflow.config.encoder_config import EncoderConfig
from elflow.config.train_config import RunConfig, run_config_from_dict, run_config_to_dict
from elflow.errors import ELFError
from elflow.io import checkpoint as ckpt_io
from elflow.io.artifact import load_resolved
from elflow.io.artifact_config import ArtifactConfig, read_config
from elflow.io.manifest import intact
from elflow.io.model_sources import resolve_source
from elflow.runtime.distributed import broadcast_object
from elflow.text.encoder_sources import PACKAGED_MODELS
from elflow.text.tokenizer import load_tokenizer
from elflow.text.tokens import vocab_hash


def resolve_resume(out: Path, resume: str | None) -> Path | None:
    """``resume``: None/'auto' (latest checkpoint in ``out`` if any), 'never', or a path.

    The checkpoint's files are checked against its manifest (by process 0, which tells the
    others): a damaged latest checkpoint of ``out`` gives way to the newest intact one (said in
    one line); a damaged checkpoint named by ``--resume`` is an error naming that one.
    """
    if resume in (None, "auto"):
        found = ckpt_io.find_checkpoint(out) if out.exists() else None
        explicit = False
    elif resume == "never":
        return None
    else:
        found = ckpt_io.find_checkpoint(Path(resume))
        if found is None:
            raise ELFError(f"resume={resume}: no checkpoint-<step> with state.json there")
        explicit = (Path(resume) / ckpt_io.STATE).is_file()  # a checkpoint, not a run folder
    if found is None:
        return None
    answer: tuple[str, str] | None = None
    if not (dist.is_initialized() and dist.get_rank() > 0):
        try:
            answer = ("ok", str(intact(found, fallback=not explicit, doing="resuming from")))
        except ELFError as e:
            answer = ("error", str(e))
    kind, text = broadcast_object(answer)
    if kind == "error":
        raise ELFError(f"cannot resume: {text}")
    return Path(text)


def model_encoder_config(model: ArtifactConfig, tokenizer: str | None = None) -> EncoderConfig:
    """A trained model's encoder, layer, tokenizer (unless given) and latent normalisation."""
    encoder = model.encoder_config
    return encoder if tokenizer is None else replace(encoder, tokenizer=tokenizer)


def apply_init(cfg: RunConfig) -> tuple[RunConfig, dict[str, Tensor], ArtifactConfig]:
    """Fine-tuning: load ``cfg.train.init`` (EMA weights when present) and take its architecture
    (all but max_length, which only bounds the rotary positions), encoder, encoder layer, tokenizer
    and latent normalisation, since its weights only make sense in its own latent space. Data,
    objective, optimiser, sampler and task stay ``cfg``'s."""
    resolved = resolve_source(cfg.train.init)
    # An authors' checkpoint records no task. A paper task would only set the lengths, sampler,
    # task and padding, which the fine-tune takes from cfg: pick one that fits instead of a guess
    # from the name (with its note).
    task = None
    if resolved.kind == "official":
        task = "owt" if cfg.task == "unconditional" else "de-en"
    model, source = load_resolved(resolved, use_ema=True, device="cpu", task=task)
    state = {k: v.detach().float() for k, v in model.state_dict().items()}
    encoder = model_encoder_config(source, init_tokenizer(source, resolved.path / "tokenizer"))
    arch = replace(source.model, max_length=cfg.model.max_length)
    return replace(cfg, model=arch, encoder=encoder), state, source


def local_absolute(name: str) -> str:
    """A local path as an absolute one (a resume or a model may be used from anywhere, where a
    relative name would also read as a Hub id); aliases (``minilm``) and Hub ids as given."""
    path = Path(name).expanduser()
    return str(path.resolve()) if name and name not in PACKAGED_MODELS and path.exists() else name


def absolute_init(cfg: RunConfig) -> RunConfig:
    """``train.init`` as an absolute path when it is a local one (a resume may start elsewhere)."""
    return replace(cfg, train=replace(cfg.train, init=local_absolute(cfg.train.init)))


def same_init(a: str, b: str) -> bool:
    """The same model source, also when one is a relative path (moved since) and one absolute."""
    if a == b:
        return True
    return bool(a and b) and Path(a).expanduser().resolve() == Path(b).expanduser().resolve()


def architecture_changes(cfg: RunConfig, base: RunConfig) -> list[str]:
    """The ``model.*``/``encoder.*`` keys whose value in ``cfg`` differs from the preset ``base``:
    those a ``--set`` or ``--config`` changed (apply_overrides changes nothing else)."""
    return [
        f"{section}.{f.name}"
        for section in ("model", "encoder")
        for f in fields(getattr(cfg, section))
        if getattr(getattr(cfg, section), f.name) != getattr(getattr(base, section), f.name)
        and f"{section}.{f.name}" not in DERIVED_KEYS
    ]


DERIVED_KEYS = ("model.encoder_dim", "model.vocab_size")
"""Set from the encoder and tokenizer whatever a config says (a printed config has them)."""


def check_no_architecture(cfg: RunConfig, base: RunConfig) -> None:
    """A fine-tune takes the architecture and encoder from ``train.init``: a value set for them
    other than ``model.max_length`` would be silently replaced, so it is an error."""
    for key in architecture_changes(cfg, base):
        if key != "model.max_length":
            raise ELFError(
                f"{key} is set (by sets= or file=), but the architecture and encoder are "
                f"fixed: a fine-tuning run takes them from {cfg.train.init!r} (only "
                "model.max_length may change); drop it"
            )


def init_tokenizer(source: ArtifactConfig, shipped: Path) -> str:
    """The tokenizer the init names when it loads here with the recorded vocabulary, else the
    model folder's own ``tokenizer/`` files (by absolute path), else the name (checked later)."""
    if not shipped.is_dir():
        return source.tokenizer
    try:
        if source.tokenizer_hash in (None, vocab_hash(load_tokenizer(source.tokenizer))):
            return source.tokenizer
    except (ELFError, OSError, ValueError):
        pass
    return str(shipped.resolve())


def saved_run_config(ckpt: Path) -> RunConfig:
    """The run config a checkpoint was saved with (read once per resume)."""
    return run_config_from_dict(ckpt_io.read_run_config(ckpt))


def resumed_settings(cfg: RunConfig, saved: RunConfig) -> RunConfig:
    """``cfg`` with what the ``saved`` run was started with and a resume must not redo.

    A fine-tune's architecture and encoder came from its init, which a resume does not load again.
    A latent_std that was measured (``encoder.latent_std=0``, the CPU presets) is the saved one,
    not measured anew: the latent space, and the latent cache keyed by it, stay exactly the run's
    (a new measurement on another machine can differ in the last bits).
    """
    if cfg.train.init and same_init(saved.train.init, cfg.train.init):
        model = replace(saved.model, max_length=cfg.model.max_length)
        return replace(cfg, model=model, encoder=saved.encoder)
    if not cfg.encoder.latent_std and saved.encoder.latent_std:
        return replace(cfg, encoder=replace(cfg.encoder, latent_std=saved.encoder.latent_std))
    return cfg  # a different init is refused by check_resumable


_SET_AT_START = {"model.encoder_dim", "model.vocab_size", "encoder.latent_std", "preset"}
"""Settings a run fills in when it starts (from the encoder, the tokenizer, a measurement): a
resume's config holds the preset's value until then."""


def changed_settings(cfg: RunConfig, saved: RunConfig) -> list[str]:
    """The settings ``cfg`` gives other values than the ``saved`` run's, as ``key old -> new``."""

    def flat(d: dict, prefix: str = "") -> dict:
        out = {}
        for k, v in d.items():
            if isinstance(v, dict):
                out |= flat(v, f"{prefix}{k}.")
            else:
                out[f"{prefix}{k}"] = v
        return out

    new, old = flat(run_config_to_dict(cfg)), flat(run_config_to_dict(saved))
    return [
        f"{k} {old.get(k)!r} -> {v!r}"
        for k, v in new.items()
        if k not in _SET_AT_START and k in old and old[k] != v
    ]


def check_resumable(cfg: RunConfig, saved: RunConfig, ckpt: Path) -> None:
    """A resume of ``ckpt`` (saved with ``saved``) must continue the same run: init,
    architecture, encoder and latent scale, parallel mode, optimizer, task and source length,
    global batch and seed."""
    if not same_init(saved.train.init, cfg.train.init):
        raise ELFError(
            f"cannot resume {ckpt}: it was started from train.init {saved.train.init or 'none'!r}, "
            f"now {cfg.train.init or 'none'!r}; give the same train.init or use a new out="
        )
    changed = [k for k in architecture_changes(cfg, saved) if k.startswith("model.")]
    if changed:  # not encoder_dim or vocab_size: they follow the encoder and tokenizer
        shown = ", ".join(
            f"{k} {getattr(saved.model, k[6:])} (now {getattr(cfg.model, k[6:])})" for k in changed
        )
        raise ELFError(
            f"cannot resume {ckpt}: it holds another architecture, {shown}; "
            "use a new out= or the same model settings"
        )
    if (saved.encoder.name, saved.encoder.layer) != (cfg.encoder.name, cfg.encoder.layer):
        raise ELFError(
            f"cannot resume {ckpt}: it was trained on encoder {saved.encoder.name!r} layer "
            f"{saved.encoder.layer}, now {cfg.encoder.name!r} layer {cfg.encoder.layer}; "
            "use the same encoder settings or a new out="
        )
    if saved.encoder.latent_mean != cfg.encoder.latent_mean:
        raise ELFError(
            f"cannot resume {ckpt}: it was trained with encoder.latent_mean "
            f"{saved.encoder.latent_mean}, now {cfg.encoder.latent_mean}; set "
            f"encoder.latent_mean={saved.encoder.latent_mean} or use a new out="
        )
    if saved.encoder.latent_std and cfg.encoder.latent_std != saved.encoder.latent_std:
        raise ELFError(
            f"cannot resume {ckpt}: it was trained with encoder.latent_std "
            f"{saved.encoder.latent_std}, now {cfg.encoder.latent_std}; the latent scale must not "
            f"change within a run — set encoder.latent_std={saved.encoder.latent_std} (or 0) or "
            "use a new out="
        )
    was, now = saved.train.parallel, cfg.train.parallel
    if was != now:
        raise ELFError(
            f"cannot resume {ckpt}: it was saved with train.parallel={was}, this run uses {now}; "
            f"the optimizer state is laid out for {was}: set train.parallel={was} to continue"
        )
    was, now = saved.optim.optimizer, cfg.optim.optimizer
    if was != now:
        raise ELFError(
            f"cannot resume {ckpt}: it was trained with optim.optimizer={was}, now {now}; its "
            f"optimizer state is {was}'s: set optim.optimizer={was}, or start a new out= with "
            "train.init set to it to continue from its weights"
        )

    def source_share(c: RunConfig) -> int:  # unconditional runs once saved an unused value
        return c.max_input_length if c.task == "conditional" else 0

    if (saved.task, source_share(saved)) != (cfg.task, source_share(cfg)):
        raise ELFError(
            f"cannot resume {ckpt}: it was trained with task={saved.task}, max_input_length="
            f"{saved.max_input_length}, now {cfg.task}, {cfg.max_input_length}; the rows depend "
            "on them — set them back or use a new out="
        )
    for key in ("global_batch", "seed"):
        old, new = getattr(saved.train, key), getattr(cfg.train, key)
        if old != new:
            raise ELFError(
                f"cannot resume {ckpt}: train.{key} was {old}, now {new}; the data order and "
                f"draws depend on it — set train.{key}={old} or use a new out="
            )


def check_vocabulary(
    tokenizer, cfg: RunConfig, init: ArtifactConfig | None, resume_from: Path | None
) -> None:
    """The tokenizer loaded for ``cfg`` has the vocabulary its init (a fine-tune's start) or the
    resumed checkpoint was trained with: another one would silently remap every token id."""
    if init is not None:
        recorded, what = init.tokenizer_hash, f"train.init {cfg.train.init!r}"
        fix = "install the tokenizer it was trained with or put its files in its tokenizer/ folder"
    elif resume_from is not None:
        recorded, what = read_config(resume_from).tokenizer_hash, f"checkpoint {resume_from}"
        fix = "set encoder.tokenizer to the one it was trained with, or use a new out="
    else:
        return
    here = vocab_hash(tokenizer)
    if recorded not in (None, here):
        raise ELFError(
            f"{what} was trained with another vocabulary than tokenizer "
            f"{cfg.encoder.tokenizer_name!r} here (sha256 {recorded[:12]}... against "
            f"{here[:12]}...); {fix}"
        )


def check_same_rows(ckpt: Path, state: dict, rows: int) -> None:
    """The data order is a function of the row count: a resume must see the same rows."""
    saved = state.get("rows")
    if saved is None and state.get("epoch"):  # checkpoints from before "rows" was written
        saved = round(state["examples_seen"] / state["epoch"])
    if saved is not None and saved != rows:
        raise ELFError(
            f"cannot resume {ckpt}: it was trained on {saved} rows, the data now gives {rows}; "
            "the data order depends on it — restore that data (and data.max_rows), or start a "
            "new out= (with train.init set to it to continue from its weights)"
        )
