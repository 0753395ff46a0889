"""A training run's set-up: everything the loop needs, decided once, in one object (ELF_SPEC §3).

:func:`prepare_run` settles, in order: where the run starts (a resume of ``out``, a fine-tune's
``train.init``, or fresh weights), the tokenizer and the rows, the frozen encoder and latent_std,
the batch geometry (processes x micro-batch x accumulation), precision, the network and its
parallel wrapping, the optimizer, EMA and RNG state of a resumed run, and the latent cache. Every
check that can fail runs before any long work (encoding), so a mistake costs seconds.
"""

from __future__ import annotations

import math
import secrets
import socket
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from elflow.config.train_config import RunConfig, check_projection
from elflow.data.latent_cache import LatentCache, shared_latent_cache
from elflow.data.preparation import measure_first_rows_latent_std, prepared_latent_std
from elflow.data.row_order import StreamOrder
from elflow.data.rows import RowDataset, build_dataset
from elflow.data.text_sources import resolve_source as data_source
from elflow.errors import ELFError, note_once
from elflow.io import checkpoint as ckpt_io
from elflow.io.artifact_config import ArtifactConfig
from elflow.io.jsonl import is_gzip
from elflow.io.paths import output_dir
from elflow.io.run_lock import RunLock
from elflow.model import ELF, check_fits, count_parameters
from elflow.runtime.distributed import (
    DistInfo,
    barrier,
    broadcast_object,
    setup,
)
from elflow.runtime.hardware import slow_bf16_warning, use_bf16
from elflow.text.encoder import FrozenEncoder, load_encoder
from elflow.text.tokenizer import load_tokenizer
from elflow.text.tokens import TokenSpec, token_spec, vocab_hash
from elflow.train.ema import EMA
from elflow.train.heldout import valid_rows
from elflow.train.network_setup import build_network
from elflow.train.optim import OptimConfig, resolve_ns_dtype
from elflow.train.resume import (
    absolute_init,
    apply_init,
    changed_settings,
    check_resumable,
    check_same_rows,
    check_vocabulary,
    resolve_resume,
    resumed_settings,
    saved_run_config,
)
from elflow.train.start_report import data_notes, run_artifact, text_lengths


@dataclass(frozen=True)
class Geometry:
    """How the global batch is split, and how long the run is."""

    global_batch: int
    """G: examples per optimizer step, over all processes and accumulation steps."""
    micro: int
    """Examples per forward on one process."""
    accum: int
    """Micro-batches per optimizer step on one process: G = world_size x micro x accum."""
    rows: int
    """N: rows in the training data (an epoch)."""
    total_steps: int
    """The step the run ends at."""


@dataclass
class Run:
    """Everything a training run needs, from :func:`prepare_run`."""

    cfg: RunConfig
    """The resolved config (E, V and latent_std filled in; a resume's or init's settings)."""
    out: Path
    info: DistInfo
    resume_from: Path | None
    """The checkpoint this run continues, or None."""
    continues_out: bool
    """Whether ``resume_from`` is one of ``out``'s own checkpoints."""
    tokenizer: Any
    spec: TokenSpec
    dataset: RowDataset
    valid: RowDataset | None
    """The validation rows (``data.valid_path``) for the held-out loss, or None."""
    encoder: FrozenEncoder
    artifact: ArtifactConfig
    """What each checkpoint records to be loaded as a model."""
    geometry: Geometry
    optim: OptimConfig
    """``cfg.optim`` with the warm-up and Newton-Schulz dtype resolved."""
    bf16: bool
    model: ELF
    forward: torch.nn.Module
    """``model`` in a ``train.forward.TrainForward``, wrapped for data parallelism."""
    ema: EMA
    optimizer: torch.optim.Optimizer
    start_step: int
    cache: LatentCache | None
    order: StreamOrder
    setup_seconds: float
    lock: RunLock
    """The run folder's lock (held by process 0 until the run ends)."""


def prepare_run(
    cfg: RunConfig,
    out: str | Path,
    resume: str | None = None,
    *,
    init_state: dict[str, Tensor] | None = None,
    latent_cache_dir: str | Path | None = None,
) -> Run:
    """Set up a training run in ``out`` (see the module docstring); ``resume``: 'auto', 'never'
    or a checkpoint/run folder; ``init_state``: a fresh run's initial weights."""
    t0 = time.perf_counter()
    out = output_dir(out, "out=")
    cfg = absolute_init(cfg)
    check_projection(cfg)
    if cfg.train.init and init_state is not None:
        raise ELFError("train.init cannot be combined with init_state; give one of them")
    info = setup(cfg.train.device, timeout=cfg.train.dist_timeout)
    check_shared_folder(out, info)
    lock = RunLock(out)
    error = None
    if info.is_main:
        try:
            lock.acquire()
        except ELFError as e:
            error = str(e)
    error = broadcast_object(error)
    if error is not None:
        raise ELFError(error)
    try:
        return _prepare(cfg, out, resume, init_state, latent_cache_dir, info, lock, t0)
    except BaseException:
        lock.release(failed_start=True)
        raise


def _prepare(cfg, out, resume, init_state, latent_cache_dir, info, lock, t0) -> Run:
    """:func:`prepare_run` once the run folder is this run's."""
    cfg, init_state, init_source, resume_from, continues_out = _start(cfg, out, resume, init_state)
    # Weights, gradients, EMA and optimizer state (at least one buffer); FSDP2 shards the last 3.
    shards = info.world_size if cfg.train.parallel == "fsdp2" else 1
    check_fits(cfg.model, info.device, 4 + 12 / shards, "to train")
    torch.manual_seed(cfg.train.seed)
    tokenizer, dataset, valid, resume_state = _rows(cfg, info, init_source, resume_from)
    lengths = text_lengths(dataset, tokenizer)
    # The model's sampler defaults must suit it (latent_std may still be measured: any value).
    unmeasured = replace(cfg, encoder=replace(cfg.encoder, latent_std=cfg.encoder.latent_std or 1))
    run_artifact(unmeasured, "", lengths).check_sampler(cfg.sampler)
    encoder = _encoder(cfg, dataset, info)
    model_cfg = replace(cfg.model, encoder_dim=encoder.hidden_size, vocab_size=len(tokenizer))
    encoder_cfg = replace(cfg.encoder, latent_std=encoder.latent_std)
    cfg = replace(cfg, model=model_cfg, encoder=encoder_cfg)
    geometry = _geometry(cfg, info, len(dataset))
    if resume_state is not None and resume_state["step"] >= geometry.total_steps:
        note_once(
            f"elflow train: {resume_from} is already at step {resume_state['step']} of "
            f"{geometry.total_steps}: nothing to train; raise train.max_steps (or --steps) to "
            "train on"
        )
    optim_cfg = cfg.optim
    if cfg.train.warmup_epochs > 0:
        warmup = round(cfg.train.warmup_epochs * geometry.rows / geometry.global_batch)
        optim_cfg = replace(optim_cfg, warmup_steps=warmup)
    # 'auto' precisions are decided by rank 0, so ranks on differing CPUs cannot disagree.
    bf16 = broadcast_object(use_bf16(cfg.train.precision, info.device))
    ns_dtype = broadcast_object(resolve_ns_dtype(optim_cfg.muon_ns_dtype, info.device))
    optim_cfg = replace(optim_cfg, muon_ns_dtype=ns_dtype)
    model, wrapped, ema, optimizer, start_step = build_network(
        cfg,
        optim_cfg,
        info,
        init_state if resume_from is None else None,
        resume_from,
        resume_state,
        bf16,
    )
    init_state = None  # the copy is no longer needed
    cache = None
    if cfg.data.latent_cache:
        where = out if latent_cache_dir is None else Path(latent_cache_dir)
        # Built once, by process 0; the others load its file.
        cache = shared_latent_cache(cfg.data, dataset, encoder, where, info)
    run = Run(
        cfg=cfg,
        out=out,
        info=info,
        resume_from=resume_from,
        continues_out=continues_out,
        tokenizer=tokenizer,
        spec=token_spec(tokenizer),
        dataset=dataset,
        valid=valid,
        encoder=encoder,
        artifact=run_artifact(cfg, vocab_hash(tokenizer), lengths),
        geometry=geometry,
        optim=optim_cfg,
        bf16=bf16,
        model=model,
        forward=wrapped,
        ema=ema,
        optimizer=optimizer,
        start_step=start_step,
        cache=cache,
        order=StreamOrder(len(dataset), cfg.train.seed),
        setup_seconds=time.perf_counter() - t0,
        lock=lock,
    )
    if info.is_main:
        _announce(run)
    return run


def _start(
    cfg: RunConfig, out: Path, resume: str | None, init_state: dict[str, Tensor] | None
) -> tuple[RunConfig, dict[str, Tensor] | None, ArtifactConfig | None, Path | None, bool]:
    """Where the run starts: (its config, initial weights, the init model's config, the
    checkpoint it resumes, whether that checkpoint is ``out``'s own)."""
    resume_from = resolve_resume(out, resume)
    existing = ckpt_io.find_checkpoint(out) if out.is_dir() else None
    # The same folder, however each was written (relative, absolute, through a symlink).
    continues_out = resume_from is not None and resume_from.parent.resolve() == out.resolve()
    if existing is not None and not continues_out:
        # Another run's checkpoints would be mixed with (and pruned by) this one's.
        raise ELFError(
            f"out={out} already holds checkpoints ({existing.name}); a new run (resume="
            f"{resume}) needs a new out=, or resume them with resume=auto"
        )
    init_source = None
    if cfg.train.init and resume_from is None:
        cfg, init_state, init_source = apply_init(cfg)
    elif resume_from is not None:  # the init is not loaded again, nor latent_std measured
        saved = saved_run_config(resume_from)
        cfg = resumed_settings(cfg, saved)
        check_resumable(cfg, saved, resume_from)
        changed = changed_settings(cfg, saved)
        if changed:
            note_once(
                f"elflow train: resuming {resume_from} with settings changed since it was "
                f"saved: {', '.join(changed)}"
            )
    return cfg, init_state, init_source, resume_from, continues_out


def _rows(
    cfg: RunConfig, info: DistInfo, init_source: ArtifactConfig | None, resume_from: Path | None
) -> tuple[Any, RowDataset, RowDataset | None, dict | None]:
    """(tokenizer, training rows, validation rows or None, the resumed checkpoint's state), every
    check on them made before any encoding."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    tokenizer = load_tokenizer(cfg.encoder.tokenizer_name)
    check_vocabulary(tokenizer, cfg, init_source, resume_from)
    pad_id = token_spec(tokenizer).row_pad_id(cfg.objective.pad_with_eos)
    conditional = cfg.task == "conditional"
    L = cfg.model.max_length
    check_raw_data(cfg, info)
    dataset = build_dataset(
        cfg.data, tokenizer, L, cfg.max_input_length, pad_id, "train", conditional
    )
    if len(dataset) == 0:
        raise ELFError(f"training data {cfg.data.path!r} yields no rows")
    resume_state = ckpt_io.read_state(resume_from) if resume_from is not None else None
    if resume_state is not None:
        check_same_rows(resume_from, resume_state, len(dataset))
    return tokenizer, dataset, valid_rows(cfg, tokenizer, pad_id, info), resume_state


RAW_DATA_LIMIT = 128 << 20
"""Raw (unprepared) training data above this size is refused under several processes, each of
which would tokenise all of it at start: ``elflow prepare`` it once instead."""


def check_raw_data(cfg: RunConfig, info: DistInfo) -> None:
    """Under several processes, refuse raw training data that every process would tokenise (more
    than :data:`RAW_DATA_LIMIT`, compressed files counted at 4x, or a Hub dataset), in one line
    that gives the ``elflow prepare`` command."""
    if info.world_size == 1:
        return
    src = data_source(cfg.data, cfg.data.path)
    if src.container == "prepared" or (src.container == "hf" and Path(src.location).is_dir()):
        return
    size = sum(p.stat().st_size * (4 if is_gzip(p) else 1) for p in src.files)
    if src.container != "hf" and size <= RAW_DATA_LIMIT:
        return
    what = "a Hugging Face Hub dataset" if src.container == "hf" else f"{size / 2**20:.0f} MB"
    command = (
        f"elflow prepare --data {cfg.data.path} --out {cfg.data.path.rstrip('/')}-prepared "
        f"--tokenizer {cfg.encoder.tokenizer_name} --max-length {cfg.model.max_length}"
    )
    if cfg.task == "conditional":
        command += f" --max-input-length {cfg.max_input_length}"
    raise ELFError(
        f"data.path {cfg.data.path} is {what} of raw data, which each of the {info.world_size} "
        f"processes would read and tokenise at start; prepare it once ({command}) and set "
        "data.path to the prepared folder"
    )


def _encoder(cfg: RunConfig, dataset: RowDataset, info: DistInfo) -> FrozenEncoder:
    """The frozen encoder with the run's latent normalisation: ``encoder.latent_std``, else the
    one ``elflow prepare`` measured, else measured now on the first rows (rank 0's value)."""
    unmeasured = replace(cfg.encoder, latent_std=0.0)  # raw latents until the std is known
    dtype = encoder_dtype(cfg.encoder.precision, info.device)
    encoder = load_encoder(unmeasured, device=info.device, dtype=dtype)
    encoder.check_length(cfg.model.max_length)
    latent_std = (
        cfg.encoder.latent_std
        or prepared_latent_std(cfg.data.path, cfg.encoder.name, cfg.encoder.layer, dataset)
        or measure_first_rows_latent_std(encoder, dataset, info.device)
    )
    encoder.latent_std = broadcast_object(latent_std)  # CPUs may differ in the last bits
    return encoder


def check_shared_folder(out: Path, info: DistInfo) -> None:
    """Refuse, at start, a run folder that some process cannot see: every process writes its part
    of each checkpoint into it, so a folder that is only local to each node would fail at the
    first save, hours in. Process 0 writes a marker there and every process looks for it."""
    if not info.distributed:
        return
    token = broadcast_object(secrets.token_hex(8) if info.is_main else None)
    marker = out / f".elflow-shared-{token}"
    if info.is_main:
        out.mkdir(parents=True, exist_ok=True)
        marker.write_text("written by process 0\n")
    barrier()
    sees = [None] * info.world_size
    dist.all_gather_object(sees, (folder_sees(marker), socket.gethostname()))
    barrier()
    if info.is_main:
        marker.unlink(missing_ok=True)
    blind = [f"{r} (on {host})" for r, (seen, host) in enumerate(sees) if not seen]
    if blind:
        raise ELFError(
            f"process(es) {', '.join(blind)} cannot see out={out}, where process 0 writes: "
            "every process writes its part of each checkpoint there; give a folder on a file "
            "system every node shares"
        )


def folder_sees(marker: Path) -> bool:
    """Whether this process sees ``marker`` (a function of its own, for the tests)."""
    return marker.exists()


def encoder_dtype(precision: str, device: torch.device) -> torch.dtype:
    """``encoder.precision`` on ``device``: 'auto' is bf16 on CUDA (the frozen encoder runs on
    every batch of an uncached run: plain fp32 there would take longer than the network's bf16
    step), fp32 elsewhere."""
    if precision == "auto":
        precision = "bf16" if device.type == "cuda" else "fp32"
    return torch.bfloat16 if precision == "bf16" else torch.float32


def _geometry(cfg: RunConfig, info: DistInfo, rows: int) -> Geometry:
    G, W = cfg.train.global_batch, info.world_size
    micro = cfg.train.micro_batch or G // W
    if micro < 1 or G % (W * micro):
        raise ELFError(
            f"train.global_batch {G} is not divisible by world_size {W} x micro_batch {micro}"
        )
    total = cfg.train.max_steps or math.ceil(cfg.train.epochs * rows / G)
    return Geometry(G, micro, G // (W * micro), rows, total)


def _announce(run: Run) -> None:
    """The run's one-line summary (rank 0), and a warning for an emulated-bf16 CPU."""
    cfg, g = run.cfg, run.geometry
    print(
        f"elflow train: {cfg.preset or 'custom'} | {count_parameters(run.model) / 1e6:.2f}M "
        f"params | {g.rows} rows | {run.info.world_size} process(es) x {g.micro} x {g.accum} "
        f"accumulation = batch {g.global_batch} | steps {run.start_step}->{g.total_steps} | "
        f"latent_std {cfg.encoder.latent_std:.4f} | {'bf16' if run.bf16 else 'fp32'}, "
        f"Newton-Schulz {run.optim.muon_ns_dtype} | set-up {run.setup_seconds:.1f} s | "
        f"out {run.out}",
        flush=True,
    )
    warning = slow_bf16_warning(cfg.train.precision, cfg.optim.muon_ns_dtype, run.info.device)
    if warning:
        print(warning, file=sys.stderr, flush=True)
    for line in data_notes(run.dataset, cfg):
        print(line, file=sys.stderr if "warning" in line else sys.stdout, flush=True)
