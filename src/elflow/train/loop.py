"""The training loop: one code path for 1 process and N processes under torchrun (ELF_SPEC §3).

Per optimizer step every process loads its micro-batches (stream positions from the global order,
so the union over processes and accumulation steps is the global batch), encodes them with the
frozen encoder (or reads the latent cache), draws every random quantity keyed by the example's
global position, and back-propagates (l2_sum + ce_sum) / D with D the loss-mask total of the whole
global batch (all-reduced), so N processes and gradient accumulation give the update of one process.
Then: global-norm clipping, Muon + Adam, EMA. A non-finite loss stops every rank with the last good
checkpoint intact. Checkpoints: ``checkpoint.py``; what a resume or a fine-tune must match:
``resume.py``.
"""

from __future__ import annotations

import contextlib
import math
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from elflow.data.latent_cache import run_latent_cache
from elflow.data.order import StreamOrder, rank_positions
from elflow.data.prepare import measure_first_rows_latent_std, prepared_latent_std
from elflow.data.rows import build_dataset
from elflow.distributed import DistInfo, all_reduce_sum, broadcast_object, parallelize, setup
from elflow.encoder import FrozenEncoder
from elflow.errors import ELFError, Interrupted
from elflow.generation.pipeline import load_tokenizer
from elflow.hardware import bf16_autocast, slow_bf16_warning, use_bf16
from elflow.io import checkpoint as ckpt_io
from elflow.io.artifact import ArtifactConfig
from elflow.model import build_model, count_parameters
from elflow.network import TrainForward
from elflow.objective import Batch, elf_loss, sample_draws_keyed
from elflow.paths import output_dir
from elflow.projection import Projection
from elflow.tokens import token_spec, vocab_hash
from elflow.train.batches import make_batch
from elflow.train.config import RunConfig, check_projection, run_config_to_dict
from elflow.train.ema import EMA
from elflow.train.heldout import branch_means, heldout_scores, heldout_splits, valid_rows
from elflow.train.optim import build_optimizer, learning_rate, resolve_ns_dtype, set_lr
from elflow.train.reporting import MetricsLogger, progress_bar, set_aside_samples, write_samples
from elflow.train.resume import (
    absolute_init,
    apply_init,
    check_resumable,
    check_same_rows,
    check_vocabulary,
    local_absolute,
    resolve_resume,
    resumed_settings,
    saved_run_config,
)
from elflow.train.stop import StopSignal


def train(
    cfg: RunConfig,
    out: str | Path,
    resume: str | None = None,
    *,
    objective_factory: Callable[[RunConfig, DistInfo, Projection], Any] | None = None,
    init_state: dict[str, Tensor] | None = None,
    latent_cache_dir: str | Path | None = None,
) -> Path:
    """Train (or resume) a run into ``out``; returns the last checkpoint folder.

    Args:
        objective_factory: builds the loss (default :class:`ELFObjective`) from the run's
            config, processes and encoder (with the rows' ids, as projected sampling takes it);
            distillation passes its own (see ``distill_train.py``).
        init_state: initial weights for a fresh run (ignored when resuming); ``train.init``
            gives them from a model source instead (fine-tuning, see
            :func:`elflow.train.resume.apply_init`).
        latent_cache_dir: where the latent cache file lives (default ``out``); distillation
            rounds share one (its key says whether a file fits the rows and the encoder).
    """
    out = output_dir(out, "--out")
    cfg = absolute_init(cfg)
    check_projection(cfg)
    if cfg.train.init and init_state is not None:
        raise ELFError("train.init cannot be combined with init_state; give one of them")
    info = setup(cfg.train.device)
    resume_from = resolve_resume(out, resume)
    existing = ckpt_io.find_checkpoint(out) if out.is_dir() else None
    # The same folder, however each was written (relative, absolute, through a symlink).
    in_out = resume_from is not None and resume_from.parent.resolve() == out.resolve()
    if existing is not None and not in_out:
        # Another run's checkpoints would be mixed with (and pruned by) this one's.
        raise ELFError(
            f"--out {out} already holds checkpoints ({existing.name}); a new run (--resume "
            f"{resume}) needs a new --out, or resume them with --resume auto"
        )
    init_source = None
    if cfg.train.init and resume_from is None:
        cfg, init_state, init_source = apply_init(cfg)
    elif resume_from is not None:  # the init is not loaded again, nor latent_std measured
        saved = saved_run_config(resume_from)
        cfg = resumed_settings(cfg, saved)
        check_resumable(cfg, saved, resume_from)
    torch.manual_seed(cfg.train.seed)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    tokenizer = load_tokenizer(cfg.encoder.tokenizer_name)
    check_vocabulary(tokenizer, cfg, init_source, resume_from)
    spec = token_spec(tokenizer)
    pad_id = spec.row_pad_id(cfg.objective.pad_with_eos)
    L = cfg.model.max_length
    dataset = build_dataset(
        cfg.data, tokenizer, L, cfg.max_input_length, pad_id, "train", cfg.task == "conditional"
    )
    if len(dataset) == 0:
        raise ELFError(f"training data {cfg.data.path!r} yields no rows")
    resume_state = ckpt_io.read_state(resume_from) if resume_from is not None else None
    if resume_state is not None:  # before any encoding
        check_same_rows(resume_from, resume_state, len(dataset))
    valid = valid_rows(cfg, tokenizer, pad_id, info)  # before any encoding: fails early
    encoder = FrozenEncoder.from_pretrained(
        cfg.encoder.name,
        latent_mean=cfg.encoder.latent_mean,
        latent_std=1.0,
        layer=cfg.encoder.layer,
    ).to(info.device)
    encoder.check_length(L)
    latent_std = (
        cfg.encoder.latent_std
        or prepared_latent_std(cfg.data.path, cfg.encoder.name, cfg.encoder.layer, dataset)
        or measure_first_rows_latent_std(encoder, dataset, info.device)
    )
    latent_std = broadcast_object(latent_std)  # rank 0's: CPUs may differ in the last bits
    encoder.latent_std = latent_std
    model_cfg = replace(cfg.model, encoder_dim=encoder.hidden_size, vocab_size=len(tokenizer))
    cfg = replace(cfg, model=model_cfg, encoder=replace(cfg.encoder, latent_std=latent_std))
    artifact = _artifact(cfg, vocab_hash(tokenizer))

    G, W = cfg.train.global_batch, info.world_size
    micro = cfg.train.micro_batch or G // W
    if micro < 1 or G % (W * micro):
        raise ELFError(
            f"train.global_batch {G} is not divisible by world_size {W} x micro_batch {micro}"
        )
    accum = G // (W * micro)
    N = len(dataset)
    total_steps = cfg.train.max_steps or math.ceil(cfg.train.epochs * N / G)
    optim_cfg = cfg.optim
    if cfg.train.warmup_epochs > 0:
        optim_cfg = replace(optim_cfg, warmup_steps=round(cfg.train.warmup_epochs * N / G))
    # 'auto' precisions are decided by rank 0, so ranks on differing CPUs cannot disagree.
    bf16 = broadcast_object(use_bf16(cfg.train.precision, info.device))
    ns_dtype = broadcast_object(resolve_ns_dtype(optim_cfg.muon_ns_dtype, info.device))
    optim_cfg = replace(optim_cfg, muon_ns_dtype=ns_dtype)

    model = build_model(model_cfg, info.device)
    if init_state is not None and resume_from is None:
        from elflow.io.official import load_state_dict_strict

        load_state_dict_strict(model, {k: v.to(info.device) for k, v in init_state.items()})
    init_state = None  # the copy is no longer needed (train.init loads a whole model)
    sharded = cfg.train.parallel == "fsdp2"
    start_step = 0
    rank_state = None
    if resume_from is not None:
        from elflow.io.official import load_state_dict_strict

        load_state_dict_strict(model, ckpt_io.load_weights(resume_from, "model.safetensors"))
        start_step = resume_state["step"]
        saved_world = resume_state.get("world_size", 1)
        rank_state = ckpt_io.load_rank_state(resume_from, info, saved_world, sharded)
    model.activation_checkpointing = cfg.train.activation_checkpointing
    forward = TrainForward(model)
    if cfg.train.compile:
        model.compile()
    wrapped = parallelize(forward, model.blocks, info, cfg.train.parallel)
    ema = EMA(model, cfg.train.ema_decay, cfg.train.ema_warmup)
    optimizer = build_optimizer(model, optim_cfg, sharded=sharded)
    # The global RNG only draws dropout masks (every other draw is keyed by example): each rank
    # gets its own stream, as data parallelism needs; rank 0 (and one process) keeps the seed's.
    if rank_state is not None:
        ema.load_state_dict(rank_state["ema"])
        ckpt_io.restore_optimizer(optimizer, rank_state["optimizer"])
        ckpt_io.set_rng_state(rank_state["rng"])
        if info.rank and saved_world != info.world_size:  # every rank restored rank 0's stream
            torch.manual_seed(rank_seed(cfg.train.seed, info.rank, start_step))
    elif info.rank:
        torch.manual_seed(rank_seed(cfg.train.seed, info.rank, 0))

    cache = None
    if cfg.data.latent_cache:
        where = out if latent_cache_dir is None else Path(latent_cache_dir)
        cache = run_latent_cache(cfg.data, dataset, encoder, where, info.is_main)
    order = StreamOrder(N, cfg.train.seed)
    aside = None
    if info.is_main:
        out.mkdir(parents=True, exist_ok=True)
        if in_out:
            aside = ckpt_io.set_aside_later(out, start_step)
            if aside is not None:
                set_aside_samples(out, start_step, aside)
    logger = MetricsLogger(out, cfg, info.is_main, start_step, aside)
    if info.is_main:
        n_params = count_parameters(model)
        print(
            f"elflow train: {cfg.preset or 'custom'} | {n_params / 1e6:.2f}M params | {N} rows | "
            f"{W} process(es) x {micro} x {accum} accumulation = batch {G} | "
            f"steps {start_step}->{total_steps} | latent_std {latent_std:.4f} | "
            f"{'bf16' if bf16 else 'fp32'}, Newton-Schulz {ns_dtype} | out {out}",
            flush=True,
        )
        warning = slow_bf16_warning(cfg.train.precision, cfg.optim.muon_ns_dtype, info.device)
        if warning:
            print(warning, file=sys.stderr, flush=True)
    progress = progress_bar(info, start_step, total_steps)
    autocast = bf16_autocast(bf16, info.device)
    objective = (
        objective_factory(cfg, info, Projection(encoder, spec.eos_id, pad_id))
        if objective_factory
        else ELFObjective(cfg)
    )
    ctx = _StepContext(
        cfg, info, dataset, order, cache, encoder, wrapped, micro, accum, autocast, objective
    )
    heldout = None
    if cfg.train.eval_every:
        heldout = heldout_splits(cfg, valid, dataset, encoder, info, micro)
    last_ckpt = resume_from
    if aside is not None:
        print(
            f"elflow train: resuming from {resume_from.name}; the later checkpoints and metrics "
            f"of the abandoned branch are kept in {aside}",
            flush=True,
        )
    # 0 disables clipping; the norm is still measured (logged, and checked for NaN). Clipping to 0
    # itself would zero every gradient.
    max_grad_norm = optim_cfg.clip_grad_norm or math.inf
    t_last, tokens_since = time.perf_counter(), 0
    sums: dict[str, float] = {}
    step, saved_step = start_step, start_step
    stop = StopSignal()
    try:
        stop.install()
        for step in range(start_step, total_steps):
            lr = learning_rate(optim_cfg, step, total_steps, G)
            set_lr(optimizer, lr)
            metrics = ctx.accumulate(step)
            grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
            if not (math.isfinite(metrics["loss"]) and math.isfinite(float(grad_norm))):
                raise ELFError(
                    f"non-finite loss or gradient at step {step}; stopping (last good checkpoint: "
                    f"{last_ckpt or 'none'}); lower the learning rate or check the data"
                )
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            ema.update(model)
            tokens_since += G * L
            sums["loss"] = sums.get("loss", 0.0) + metrics["loss"]
            sums["n"] = sums.get("n", 0) + 1
            for k, v in zip(("l2_sum", "ce_sum", "l2_n", "ce_n"), metrics["stats"], strict=True):
                sums[k] = sums.get(k, 0.0) + v
            done = step + 1
            if done % cfg.train.log_every == 0 or done == total_steps:
                now = time.perf_counter()
                # The branch losses are token means over the logging window (a step whose rows
                # give a branch no token adds nothing to it).
                l2, ce = branch_means(*(sums[k] for k in ("l2_sum", "ce_sum", "l2_n", "ce_n")))
                line = {"loss": sums["loss"] / sums["n"], "l2": l2, "ce": ce}
                line |= {
                    "lr": lr,
                    "grad_norm": float(grad_norm),
                    "tokens_per_s": tokens_since / (now - t_last),
                    "epoch": done * G / N,
                }
                logger.log(done, line)
                progress.update(done, line)
                t_last, tokens_since, sums = now, 0, {}
            if done % cfg.train.save_every == 0 or done == total_steps:
                last_ckpt = _save(out, done, model, ema, optimizer, artifact, cfg, info, N, G)
                saved_step = done
            if heldout and (done % cfg.train.eval_every == 0 or done == total_steps):
                t_eval = time.perf_counter()
                scores = heldout_scores(heldout, model_cfg, ema, objective, autocast, info)
                scores["eval_seconds"] = time.perf_counter() - t_eval
                t_last += scores["eval_seconds"]  # kept out of the next interval's tokens/s
                logger.log(done, scores)
                if info.is_main:
                    progress.note(
                        f"step {done}: held-out loss (EMA weights) "
                        + ", ".join(
                            f"{k.removesuffix('_loss')} {v:.4f}"
                            for k, v in scores.items()
                            if k.endswith("_loss")
                        )
                    )
            if cfg.train.sample_every and done % cfg.train.sample_every == 0:
                write_samples(
                    out, done, model_cfg, ema, artifact, cfg, tokenizer, dataset, encoder, info
                )
            if stop.agreed(info):  # after sampling too, so a signal there is not held a step
                if saved_step != done:
                    last_ckpt = _save(out, done, model, ema, optimizer, artifact, cfg, info, N, G)
                    saved_step = done
                # Also after the last step: the signal is honoured (a curriculum stops before its
                # next round), and the message says the run itself is complete.
                rest = (
                    "this run is complete (a distillation curriculum continues with the same "
                    "command)"
                    if done == total_steps
                    else "run the same command (with --resume auto, the default) to continue"
                )
                raise Interrupted(
                    f"stopped by {stop.name} after step {done} of {total_steps}; saved "
                    f"{last_ckpt}; {rest}",
                    stop.exit_code,
                )
    finally:
        stop.restore()
        progress.close()
        logger.close()
    return last_ckpt if last_ckpt is not None else out


def rank_seed(seed: int, rank: int, step: int) -> int:
    """The global-RNG seed of process ``rank`` > 0 starting at ``step`` (its dropout stream)."""
    return (seed * 1_000_003 + rank * 7_919 + step) % 2**63


@dataclass
class StepLoss:
    """One micro-batch's contribution: a differentiable sum and logging sums."""

    numerator: Tensor
    """Summed loss of this micro-batch; the step loss is its total over the global batch / D."""
    stats: Tensor
    """(4,) float64: l2 sum, ce sum, l2 count, ce count (for the logged l2 and ce means)."""


class ELFObjective:
    """The ELF training loss (§3), normalised by the global batch's loss-mask total."""

    def __init__(self, cfg: RunConfig) -> None:
        self.cfg = cfg

    def denominator(self, batch: Batch) -> float:
        return _mask_total(batch, self.cfg.objective.pad_with_eos)

    def __call__(self, forward, batch: Batch, positions: np.ndarray) -> StepLoss:
        cfg = self.cfg
        L, E = batch.x.shape[1], batch.x.shape[2]
        draws = sample_draws_keyed(
            positions.tolist(), L, E, cfg.objective, cfg.train.seed, batch.x.device
        )
        out = elf_loss(forward, batch, draws, cfg.objective, cfg.train.procedure)
        den_rows = ~draws.decoder_active.bool().to(batch.x.device)
        l2_tokens, ce_tokens = _branch_tokens(batch, den_rows, cfg.objective.pad_with_eos)
        stats = torch.stack([out.l2_sum.detach(), out.ce_sum.detach(), l2_tokens, ce_tokens])
        return StepLoss(out.l2_sum + out.ce_sum, stats.double())


def _artifact(cfg: RunConfig, tokenizer_hash: str) -> ArtifactConfig:
    """What a checkpoint of this run records to be loaded as a model (spec §10)."""
    return ArtifactConfig(
        model=cfg.model,
        sampler=cfg.sampler,
        encoder=local_absolute(cfg.encoder.name),
        encoder_layer=cfg.encoder.layer,
        tokenizer=local_absolute(cfg.encoder.tokenizer_name),
        tokenizer_hash=tokenizer_hash,
        latent_mean=cfg.encoder.latent_mean,
        latent_std=cfg.encoder.latent_std,
        task=cfg.task,
        max_input_length=cfg.max_input_length if cfg.task == "conditional" else 0,
        pad_with_eos=cfg.objective.pad_with_eos,
        packed=cfg.data.packing,
        noise_scale=cfg.objective.noise_scale,
        t_eps=cfg.objective.t_eps,
        origin=f"elflow train (preset {cfg.preset or 'custom'})"
        + (f", fine-tuned from {cfg.train.init}" if cfg.train.init else ""),
    )


class _StepContext:
    """Builds the micro-batches of one optimizer step and back-propagates them."""

    def __init__(
        self, cfg, info, dataset, order, cache, encoder, wrapped, micro, accum, autocast, objective
    ):
        self.cfg, self.info, self.dataset, self.order = cfg, info, dataset, order
        self.cache, self.encoder, self.wrapped = cache, encoder, wrapped
        self.micro, self.accum, self.autocast = micro, accum, autocast
        self.objective = objective

    def batch(self, positions: np.ndarray) -> Batch:
        row_idx = self.order.rows(positions)
        return make_batch(
            self.cfg, self.dataset, self.cache, self.encoder, self.info.device, row_idx, positions
        )

    def accumulate(self, step: int) -> dict[str, Any]:
        cfg, info = self.cfg, self.info
        G, W = cfg.train.global_batch, info.world_size
        parts = []
        for k in range(self.accum):
            pos = rank_positions(step, G, W, info.rank, self.micro, k)
            parts.append((pos, self.batch(pos)))
        # D: the objective's normaliser over the whole global batch (ELF: the loss-mask total;
        # distillation: the row count), all-reduced (spec §10 "Distributed equality").
        local = sum(self.objective.denominator(b) for _, b in parts)
        denom = all_reduce_sum(torch.tensor([float(local)], device=info.device)).item()
        stats = torch.zeros(4, device=info.device, dtype=torch.float64)
        for k, (pos, batch) in enumerate(parts):
            sync = contextlib.nullcontext()
            if k < self.accum - 1 and hasattr(self.wrapped, "no_sync"):
                sync = self.wrapped.no_sync()
            with sync:
                with self.autocast:
                    out = self.objective(self.wrapped, batch, pos)
                # DDP/FSDP2 average gradients over processes: scale by W to get the sum.
                (out.numerator * (W / max(denom, 1.0))).backward()
            stats += out.stats
        stats = all_reduce_sum(stats).tolist()
        return {"loss": (stats[0] + stats[1]) / max(denom, 1.0), "stats": stats}


def _loss_mask(batch: Batch, pad_with_eos: bool) -> Tensor:
    valid = (
        torch.ones_like(batch.attention_mask, dtype=torch.bool)
        if pad_with_eos
        else batch.attention_mask.bool()
    )
    if batch.cond_mask is not None:
        valid = valid & ~batch.cond_mask.bool()
    return valid.float()


def _mask_total(batch: Batch, pad_with_eos: bool) -> float:
    return float(_loss_mask(batch, pad_with_eos).sum())


def _branch_tokens(batch: Batch, den_rows: Tensor, pad_with_eos: bool) -> tuple[Tensor, Tensor]:
    mask = _loss_mask(batch, pad_with_eos)
    den = (mask * den_rows.float()[:, None]).sum()
    return den, mask.sum() - den


def _save(out, step, model, ema, optimizer, artifact, cfg, info: DistInfo, N, G) -> Path:
    model_state = ckpt_io.full_state(model.state_dict())
    ema_state = ema.state_dict_for_save()
    state = {"step": step, "epoch": step * G / N, "examples_seen": step * G, "rows": N}
    return ckpt_io.save_checkpoint(
        out,
        step,
        model_state=model_state,
        ema_state=ema_state,
        rank_state={"optimizer": optimizer.state_dict(), "ema": ema.state_dict()},
        artifact=artifact,
        run_config=run_config_to_dict(cfg),
        state=state,
        info=info,
        keep_last=cfg.train.keep_last,
    )
