"""The training loop: one code path for 1 process and N processes under torchrun (ELF_SPEC §3).

Per optimizer step every process loads its micro-batches (stream positions from the global order,
so the union over processes and accumulation steps is the global batch), encodes them with the
frozen encoder (or reads the latent cache), draws every random quantity keyed by the example's
global position, and back-propagates (l2_sum + ce_sum) / D with D the loss-mask total of the whole
global batch (all-reduced), so N processes and gradient accumulation give the update of one process.
Then: global-norm clipping, Muon + Adam, EMA. A non-finite loss stops every rank with the last good
checkpoint intact. Checkpoints and resume: ``checkpoint.py``.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors import SafetensorError
from torch import Tensor

from elflow import checkpoint as ckpt_io
from elflow.artifact import ArtifactConfig, load_resolved, resolve_source
from elflow.data.latent_cache import LatentCache, cache_key
from elflow.data.order import StreamOrder, keyed_bernoulli, rank_positions
from elflow.data.rows import RowDataset, build_dataset, read_meta
from elflow.distributed import DistInfo, all_reduce_sum, broadcast_object, parallelize, setup
from elflow.ema import EMA
from elflow.encoder import FrozenEncoder, measure_latent_std
from elflow.errors import ELFError, Interrupted
from elflow.hardware import cpu_has_native_bf16, fast_bf16
from elflow.heldout import HeldOutSplit, RowSubset, heldout_loss, spread_rows
from elflow.model import ELF, build_model, count_parameters
from elflow.objective import Batch, TrainForward, elf_loss, sample_draws_keyed
from elflow.optim import build_optimizer, learning_rate, resolve_ns_dtype, set_lr
from elflow.paths import output_dir
from elflow.pipeline import load_tokenizer
from elflow.run_config import EncoderConfig, RunConfig, run_config_from_dict, run_config_to_dict
from elflow.sampling import Condition, sample, sample_generators
from elflow.tokens import detokenize, shift_out_source, token_spec, vocab_hash

LATENT_STD_ROWS = 256


def use_bf16(precision: str, device: torch.device) -> bool:
    """``train.precision`` on ``device``: 'auto' is bf16 autocast on CUDA and on CPUs with native
    bf16 (``elflow.hardware``), fp32 elsewhere."""
    return precision == "bf16" or (precision == "auto" and fast_bf16(device))


def _autocast(bf16: bool, device: torch.device):
    if not bf16:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=torch.bfloat16)


def _slow_bf16_warning(cfg: RunConfig, device: torch.device) -> str | None:
    """A one-line warning when bf16 was asked for explicitly on a CPU that emulates it."""
    if device.type != "cpu" or cpu_has_native_bf16():
        return None
    asked = [
        name
        for name, value in (
            ("train.precision", cfg.train.precision),
            ("optim.muon_ns_dtype", cfg.optim.muon_ns_dtype),
        )
        if value in ("bf16", "bfloat16")
    ]
    if not asked:
        return None
    return (
        f"elflow train: warning: {' and '.join(asked)} set bf16, which this CPU emulates "
        "(no AVX-512 BF16/AMX/Arm BF16): steps run several times slower than fp32; set "
        f"{'=auto and '.join(asked)}=auto to use fp32 here"
    )


class _Logger:
    """Rank-0 metrics: JSONL always, TensorBoard when installed, wandb when asked."""

    def __init__(self, out: Path, cfg: RunConfig, enabled: bool) -> None:
        self.enabled = enabled
        self.tb = self.wandb = None
        if not enabled:
            return
        self.jsonl = (out / "metrics.jsonl").open("a")
        if cfg.train.tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self.tb = SummaryWriter(str(out / "tensorboard"))
            except ImportError:
                self.tb = None
        if cfg.train.wandb:
            try:
                import wandb
            except ImportError:
                raise ELFError(
                    "train.wandb is on but wandb is not installed: pip install wandb"
                ) from None
            self.wandb = wandb.init(project="elflow", config=run_config_to_dict(cfg))

    def log(self, step: int, metrics: dict[str, float]) -> None:
        if not self.enabled:
            return
        self.jsonl.write(json.dumps({"step": step, **metrics}) + "\n")
        self.jsonl.flush()
        if self.tb is not None:
            for k, v in metrics.items():
                self.tb.add_scalar(k, v, step)
        if self.wandb is not None:
            self.wandb.log(metrics, step=step)

    def close(self) -> None:
        if self.enabled:
            self.jsonl.close()
            if self.tb is not None:
                self.tb.close()


def resolve_resume(out: Path, resume: str | None) -> Path | None:
    """``resume``: None/'auto' (latest checkpoint in ``out`` if any), 'never', or a path."""
    if resume in (None, "auto"):
        return ckpt_io.find_checkpoint(out) if out.exists() else None
    if resume == "never":
        return None
    found = ckpt_io.find_checkpoint(Path(resume))
    if found is None:
        raise ELFError(f"--resume {resume}: no checkpoint-<step> with state.json there")
    return found


def train(
    cfg: RunConfig,
    out: str | Path,
    resume: str | None = None,
    *,
    objective_factory: Callable[[RunConfig, DistInfo], Any] | None = None,
    init_state: dict[str, Tensor] | None = None,
) -> Path:
    """Train (or resume) a run into ``out``; returns the last checkpoint folder.

    Args:
        objective_factory: builds the loss (default :class:`ELFObjective`); distillation passes
            its own (see ``distill_train.py``).
        init_state: initial weights for a fresh run (ignored when resuming); ``train.init``
            gives them from a model source instead (fine-tuning, see :func:`apply_init`).
    """
    out = output_dir(out, "--out")
    cfg = absolute_init(cfg)
    if cfg.train.init and init_state is not None:
        raise ELFError("train.init cannot be combined with init_state; give one of them")
    info = setup(cfg.train.device)
    resume_from = resolve_resume(out, resume)
    existing = ckpt_io.find_checkpoint(out) if out.is_dir() else None
    if existing is not None and (resume_from is None or resume_from.parent != out):
        # Another run's checkpoints would be mixed with (and pruned by) this one's.
        raise ELFError(
            f"--out {out} already holds checkpoints ({existing.name}) of another run; resume it "
            "(--resume auto) or choose a new --out"
        )
    init_source = None
    if cfg.train.init and resume_from is None:
        cfg, init_state, init_source = apply_init(cfg)
    elif cfg.train.init:  # a resume needs only the settings the init gave, not the init itself
        cfg = _init_settings_of(cfg, resume_from)
    if resume_from is not None:
        _check_resumable(cfg, resume_from)
    torch.manual_seed(cfg.train.seed)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    tokenizer = load_tokenizer(cfg.encoder.tokenizer_name)
    here = vocab_hash(tokenizer) if init_source is not None else None
    if init_source is not None and init_source.tokenizer_hash not in (None, here):
        raise ELFError(
            f"train.init {cfg.train.init!r} was trained with another vocabulary than tokenizer "
            f"{cfg.encoder.tokenizer_name!r} here (sha256 {init_source.tokenizer_hash[:12]}... "
            f"against {here[:12]}...); install the tokenizer it was trained with "
            "or put its files in the model's tokenizer/ folder"
        )
    spec = token_spec(tokenizer)
    pad_id = spec.eos_id if cfg.objective.pad_with_eos else spec.pad_id
    L = cfg.model.max_length
    dataset = build_dataset(cfg.data, tokenizer, L, cfg.max_input_length, pad_id, "train")
    if len(dataset) == 0:
        raise ELFError(f"training data {cfg.data.path!r} yields no rows")
    resume_state = ckpt_io.read_state(resume_from) if resume_from is not None else None
    if resume_state is not None:  # before any encoding
        _check_same_rows(resume_from, resume_state, len(dataset))
    valid = _valid_rows(cfg, tokenizer, pad_id, info)  # before any encoding: fails early
    encoder = FrozenEncoder.from_pretrained(
        cfg.encoder.name,
        latent_mean=cfg.encoder.latent_mean,
        latent_std=1.0,
        layer=cfg.encoder.layer,
    ).to(info.device)
    latent_std = (
        cfg.encoder.latent_std
        or _prepared_latent_std(cfg)
        or _measure_latent_std(encoder, dataset, info.device)
    )
    encoder.latent_std = latent_std
    model_cfg = replace(cfg.model, encoder_dim=encoder.hidden_size, vocab_size=len(tokenizer))
    cfg = replace(cfg, model=model_cfg, encoder=replace(cfg.encoder, latent_std=latent_std))
    artifact = ArtifactConfig(
        model=model_cfg,
        sampler=cfg.sampler,
        encoder=cfg.encoder.name,
        encoder_layer=cfg.encoder.layer,
        tokenizer=cfg.encoder.tokenizer_name,
        tokenizer_hash=vocab_hash(tokenizer),
        latent_mean=cfg.encoder.latent_mean,
        latent_std=latent_std,
        task=cfg.task,
        max_input_length=cfg.max_input_length,
        pad_with_eos=cfg.objective.pad_with_eos,
        noise_scale=cfg.objective.noise_scale,
        t_eps=cfg.objective.t_eps,
        origin=f"elflow train (preset {cfg.preset or 'custom'})"
        + (f", fine-tuned from {cfg.train.init}" if cfg.train.init else ""),
    )

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
        from elflow.official import load_state_dict_strict

        load_state_dict_strict(model, {k: v.to(info.device) for k, v in init_state.items()})
    init_state = None  # the copy is no longer needed (train.init loads a whole model)
    start_step = 0
    rank_state = None
    if resume_from is not None:
        from elflow.official import load_state_dict_strict

        load_state_dict_strict(model, ckpt_io.load_weights(resume_from, "model.safetensors"))
        start_step = resume_state["step"]
        rank_state = ckpt_io.load_rank_state(resume_from, info)
    forward = TrainForward(model)
    if cfg.train.compile:
        model.compile()
    sharded = cfg.train.parallel == "fsdp2"
    wrapped = parallelize(forward, model.blocks, info, cfg.train.parallel)
    ema = EMA(model, cfg.train.ema_decay, cfg.train.ema_warmup)
    optimizer = build_optimizer(model, optim_cfg, sharded=sharded)
    if rank_state is not None:
        ema.load_state_dict(rank_state["ema"])
        ckpt_io.restore_optimizer(optimizer, rank_state["optimizer"])
        ckpt_io.set_rng_state(rank_state["rng"])

    cache = _latent_cache(cfg, dataset, encoder, out, info) if cfg.data.latent_cache else None
    order = StreamOrder(N, cfg.train.seed)
    if info.is_main:
        out.mkdir(parents=True, exist_ok=True)
    logger = _Logger(out, cfg, info.is_main)
    if info.is_main:
        n_params = count_parameters(model)
        print(
            f"elflow train: {cfg.preset or 'custom'} | {n_params / 1e6:.2f}M params | {N} rows | "
            f"{W} process(es) x {micro} x {accum} accumulation = batch {G} | "
            f"steps {start_step}->{total_steps} | latent_std {latent_std:.4f} | "
            f"{'bf16' if bf16 else 'fp32'}, Newton-Schulz {ns_dtype} | out {out}",
            flush=True,
        )
        warning = _slow_bf16_warning(cfg, info.device)
        if warning:
            print(warning, file=sys.stderr, flush=True)
    progress = _progress(info, start_step, total_steps)
    autocast = _autocast(bf16, info.device)
    objective = objective_factory(cfg, info) if objective_factory else ELFObjective(cfg)
    ctx = _StepContext(
        cfg, info, dataset, order, cache, encoder, wrapped, micro, accum, autocast, objective
    )
    heldout = None
    if cfg.train.eval_every:
        heldout = _heldout_splits(cfg, valid, dataset, encoder, info, micro)
    last_ckpt = resume_from
    t_last, tokens_since = time.perf_counter(), 0
    sums: dict[str, float] = {}
    step, saved_step = start_step, start_step
    stop = _StopSignal()
    try:
        stop.install()
        for step in range(start_step, total_steps):
            lr = learning_rate(optim_cfg, step, total_steps, G)
            set_lr(optimizer, lr)
            metrics = ctx.accumulate(step)
            grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), optim_cfg.clip_grad_norm)
            if not (math.isfinite(metrics["loss"]) and math.isfinite(float(grad_norm))):
                raise ELFError(
                    f"non-finite loss or gradient at step {step}; stopping (last good checkpoint: "
                    f"{last_ckpt or 'none'}); lower the learning rate or check the data"
                )
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            ema.update(model)
            tokens_since += G * L
            for k in ("loss", "l2", "ce"):
                sums[k] = sums.get(k, 0.0) + metrics[k]
            sums["n"] = sums.get("n", 0) + 1
            done = step + 1
            if done % cfg.train.log_every == 0 or done == total_steps:
                now = time.perf_counter()
                line = {k: sums[k] / sums["n"] for k in ("loss", "l2", "ce")}
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
                scores = _heldout(heldout, model_cfg, ema, objective, autocast, info)
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
                _sample_and_print(
                    out, done, model_cfg, ema, artifact, cfg, tokenizer, dataset, encoder, info
                )
            if stop.agreed(info):  # after sampling too, so a signal there is not held a step
                if saved_step != done:
                    last_ckpt = _save(out, done, model, ema, optimizer, artifact, cfg, info, N, G)
                    saved_step = done
                raise Interrupted(
                    f"stopped by {stop.name} after step {done} of {total_steps}; saved "
                    f"{last_ckpt}; run the same command (with --resume auto, the default) to "
                    "continue",
                    stop.exit_code,
                )
    finally:
        stop.restore()
        progress.close()
        logger.close()
    return last_ckpt if last_ckpt is not None else out


class _StopSignal:
    """SIGINT/SIGTERM during training: finish the step, save a checkpoint, then stop.

    A second SIGINT (Ctrl-C twice) stops at once (KeyboardInterrupt; the last checkpoint stays
    intact); a repeated SIGTERM is ignored, since launchers (Slurm, torchrun) often deliver it
    twice. A signal the process ignores (SIGINT under ``nohup ... &``) stays ignored. With N
    processes the ranks agree each step (one all-reduce), so all of them save the same step.
    """

    _SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self) -> None:
        self.number = 0
        self._previous: dict[int, Any] = {}

    @property
    def name(self) -> str:
        return signal.Signals(self.number).name if self.number > 0 else "a signal on another rank"

    @property
    def exit_code(self) -> int:
        """128 + the signal number, the shell's convention (SIGTERM's when another rank got it)."""
        return 128 + (self.number if self.number > 0 else int(signal.SIGTERM))

    def install(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        for sig in self._SIGNALS:
            current = signal.getsignal(sig)
            if current in (signal.SIG_DFL, signal.default_int_handler):
                self._previous[sig] = signal.signal(sig, self._handle)

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def _handle(self, signum: int, frame: Any) -> None:
        if self.number:
            if signum == signal.SIGINT:
                raise KeyboardInterrupt
            return
        self.number = signum
        # os.write, not print: a handler that prints while the main thread prints would fail.
        name = signal.Signals(signum).name
        again = " (Ctrl-C again stops at once)" if signum == signal.SIGINT else ""
        os.write(2, f"\nelflow train: {name}: saving after this step{again}\n".encode())

    def agreed(self, info: DistInfo) -> bool:
        """Whether any process was signalled (every rank gets the same answer)."""
        if info.world_size == 1:
            return self.number != 0
        signalled = all_reduce_sum(torch.tensor([float(self.number != 0)], device=info.device))
        stop = bool(signalled.item())
        if stop and not self.number:
            self.number = -1
        return stop


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


CACHE_FILE = "latent-cache.safetensors"


def _latent_cache(
    cfg: RunConfig, dataset, encoder: FrozenEncoder, out: Path, info: DistInfo
) -> LatentCache:
    """Load the run folder's latent cache when its key matches, else build it (and save it).

    Every rank builds or loads its own copy; rank 0 writes the file. A failed write only costs
    the next start its rebuild, so it is a warning, not an error.
    """
    dtype = cfg.data.latent_cache_dtype
    path = out / CACHE_FILE
    key = cache_key(dataset, encoder, dtype) if cfg.data.latent_cache_save else ""
    cache = LatentCache.load(path, key) if key else None
    if cache is not None:
        if info.is_main:
            print(f"elflow train: latent cache loaded from {path}", flush=True)
        return cache
    t0 = time.perf_counter()
    cache = LatentCache.build(dataset, encoder, dtype=dtype)
    if key and info.is_main:
        try:
            out.mkdir(parents=True, exist_ok=True)
            cache.save(path, key)
            saved = f"; saved to {path}"
        except (OSError, SafetensorError) as e:
            saved = f"; not saved ({str(e).splitlines()[0]})"
        print(
            f"elflow train: latent cache of {len(cache)} rows built in "
            f"{time.perf_counter() - t0:.0f} s{saved}",
            flush=True,
        )
    return cache


def apply_init(cfg: RunConfig) -> tuple[RunConfig, dict[str, Tensor], ArtifactConfig]:
    """Fine-tuning: load ``cfg.train.init`` (EMA weights when present) and take its architecture
    (all but max_length, which only bounds the rotary positions), encoder, encoder layer, tokenizer
    and latent normalisation, since its weights only make sense in its own latent space. Data,
    objective, optimiser, sampler and task stay ``cfg``'s."""
    resolved = resolve_source(cfg.train.init)
    model, source = load_resolved(resolved, use_ema=True, device="cpu", task=None)
    state = {k: v.detach().float() for k, v in model.state_dict().items()}
    encoder = EncoderConfig.of_model(source, _init_tokenizer(source, resolved.path / "tokenizer"))
    arch = replace(source.model, max_length=cfg.model.max_length)
    return replace(cfg, model=arch, encoder=encoder), state, source


def absolute_init(cfg: RunConfig) -> RunConfig:
    """``train.init`` as an absolute path when it is a local one (a resume may start elsewhere)."""
    path = Path(cfg.train.init).expanduser()
    if not cfg.train.init or not path.exists():
        return cfg
    return replace(cfg, train=replace(cfg.train, init=str(path.resolve())))


def same_init(a: str, b: str) -> bool:
    """The same model source, also when one is a relative path (moved since) and one absolute."""
    if a == b:
        return True
    return bool(a and b) and Path(a).expanduser().resolve() == Path(b).expanduser().resolve()


def _init_tokenizer(source: ArtifactConfig, shipped: Path) -> str:
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


def _init_settings_of(cfg: RunConfig, ckpt: Path) -> RunConfig:
    """The architecture and encoder a fine-tuning run resumed from ``ckpt`` was started with."""
    saved = run_config_from_dict(ckpt_io.read_run_config(ckpt))
    if not same_init(saved.train.init, cfg.train.init):
        return cfg  # refused by _check_resumable
    return replace(
        cfg, model=replace(saved.model, max_length=cfg.model.max_length), encoder=saved.encoder
    )


def _check_resumable(cfg: RunConfig, ckpt: Path) -> None:
    """A resume must continue the same run: init, architecture, encoder, global batch and seed."""
    saved = run_config_from_dict(ckpt_io.read_run_config(ckpt))
    if not same_init(saved.train.init, cfg.train.init):
        raise ELFError(
            f"cannot resume {ckpt}: it was started from train.init {saved.train.init or 'none'!r}, "
            f"now {cfg.train.init or 'none'!r}; give the same --init or use a new --out"
        )
    if saved.model != replace(
        cfg.model, encoder_dim=saved.model.encoder_dim, vocab_size=saved.model.vocab_size
    ):
        raise ELFError(
            f"cannot resume {ckpt}: it holds another architecture ({saved.model}); "
            "use a new --out or the same model settings"
        )
    if (saved.encoder.name, saved.encoder.layer) != (cfg.encoder.name, cfg.encoder.layer):
        raise ELFError(
            f"cannot resume {ckpt}: it was trained on encoder {saved.encoder.name!r} layer "
            f"{saved.encoder.layer}, now {cfg.encoder.name!r} layer {cfg.encoder.layer}; "
            "use the same encoder settings or a new --out"
        )
    for key in ("global_batch", "seed"):
        old, new = getattr(saved.train, key), getattr(cfg.train, key)
        if old != new:
            raise ELFError(
                f"cannot resume {ckpt}: train.{key} was {old}, now {new}; the data order and "
                f"draws depend on it — set train.{key}={old} or use a new --out"
            )


def _check_same_rows(ckpt: Path, state: dict, rows: int) -> None:
    """The data order is a function of the row count: a resume must see the same rows."""
    saved = state.get("rows")
    if saved is None and state.get("epoch"):  # checkpoints from before "rows" was written
        saved = round(state["examples_seen"] / state["epoch"])
    if saved is not None and saved != rows:
        raise ELFError(
            f"cannot resume {ckpt}: it was trained on {saved} rows, the data now gives {rows}; "
            "the data order depends on it — restore that data, or start a new --out "
            "(with --init to continue from its weights)"
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

    def accumulate(self, step: int) -> dict[str, float]:
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
        return {
            "loss": (stats[0] + stats[1]) / max(denom, 1.0),
            "l2": stats[0] / max(stats[2], 1.0),
            "ce": stats[1] / max(stats[3], 1.0),
        }


def make_batch(
    cfg: RunConfig,
    dataset,
    cache: LatentCache | None,
    encoder: FrozenEncoder,
    device: torch.device,
    row_idx: np.ndarray,
    positions: np.ndarray,
) -> Batch:
    """The batch of dataset rows ``row_idx`` at stream ``positions`` (which key the label drop)."""
    rows = dataset.get_rows(row_idx)
    ids = torch.from_numpy(rows["input_ids"]).to(device)
    attn = torch.from_numpy(rows["attention_mask"]).to(device)
    cond = torch.from_numpy(rows["cond_mask"]).to(device) if dataset.conditional else None
    drop_np = None
    if dataset.conditional and cfg.objective.label_drop_prob > 0:
        drop_np = keyed_bernoulli(
            positions, cfg.objective.label_drop_prob, cfg.train.seed, "label_drop"
        )
    drop = torch.from_numpy(drop_np).to(device) if drop_np is not None else None
    if cache is not None:
        x = cache.get(row_idx, drop_np).to(device)
    else:
        x = encoder(ids, attn, cond, drop)
    return Batch(x=x, input_ids=ids, attention_mask=attn, cond_mask=cond, label_drop=drop)


def _valid_rows(cfg: RunConfig, tokenizer, pad_id: int, info: DistInfo) -> RowDataset | None:
    """The rows of ``data.valid_path`` (None without one), read at start-up so that a bad path
    or bad data is an error before any encoding. With ``train.eval_every=0`` nothing uses them,
    so they are not read (a line says so)."""
    if not cfg.data.valid_path:
        return None
    if not cfg.train.eval_every:  # unused, so not read (a Hub dataset would be downloaded)
        if info.is_main:
            print("elflow train: data.valid_path is not used, as train.eval_every=0", flush=True)
        return None
    L = cfg.model.max_length
    valid = build_dataset(cfg.data, tokenizer, L, cfg.max_input_length, pad_id, "valid")
    if len(valid) == 0:
        raise ELFError(
            f"validation data {cfg.data.valid_path!r} yields no rows; fix data.valid_path"
        )
    return valid


def _heldout_splits(cfg, valid, dataset, encoder, info, chunk):
    """The fixed validation rows (`valid`, from ``data.valid_path``, or None) and training rows of
    ``train.eval_every`` (``heldout.py``), with their latents cached once when the run caches."""
    sources = [("train_rows", dataset)]
    if valid is not None:
        sources.insert(0, ("valid", valid))
    elif info.is_main:
        print(
            "elflow train: no data.valid_path, so the held-out loss covers training rows only",
            flush=True,
        )
    splits = []
    for name, data in sources:
        rows, keys = spread_rows(len(data), cfg.train.eval_rows, info.rank, info.world_size)
        subset = RowSubset(data, rows)
        cache = None
        if cfg.data.latent_cache and len(subset):
            cache = LatentCache.build(subset, encoder, dtype=cfg.data.latent_cache_dtype)

        def make(idx, keys, subset=subset, cache=cache):
            return make_batch(cfg, subset, cache, encoder, info.device, idx, keys)

        splits.append(HeldOutSplit(name, make, keys, chunk))
    return splits


def _ema_network(model_cfg, ema_state: dict, device: torch.device) -> ELF:
    """A network in eval mode holding ``ema_state``, built on the meta device: no initialisation,
    so no time, no host copy and no draws from the global RNG (dropout's, so resume is exact)."""
    with torch.device("meta"):
        net = ELF(model_cfg)
    net = net.to_empty(device=device)
    net.load_state_dict(ema_state)
    return net.eval()


def _heldout(splits, model_cfg, ema, objective, autocast, info) -> dict[str, float]:
    """The held-out losses of the EMA weights, in a network built for the occasion."""
    net = _ema_network(model_cfg, ema.state_dict_for_save(), info.device)  # collective: FSDP2
    net.requires_grad_(False)
    metrics: dict[str, float] = {}
    for split in splits:
        metrics |= heldout_loss(objective, TrainForward(net), split, info.device, autocast)
    return metrics


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


def _prepared_latent_std(cfg: RunConfig) -> float:
    """latent_std measured by ``elflow prepare --encoder`` (0 when absent or another encoder)."""
    path = Path(cfg.data.path)
    if not (path / "meta.json").is_file():
        return 0.0
    meta = read_meta(path)
    if meta.get("latent_std_encoder") != cfg.encoder.name or cfg.encoder.layer:
        return 0.0  # prepare measures the encoder's output only
    return float(meta.get("latent_std") or 0.0)


@torch.no_grad()
def _measure_latent_std(encoder: FrozenEncoder, dataset, device: torch.device) -> float:
    """RMS of the encoder's outputs over the first rows (deterministic; spec §10)."""
    n = min(LATENT_STD_ROWS, len(dataset))
    rows = dataset.get_rows(np.arange(n))
    batches = []
    for start in range(0, n, 32):
        sl = slice(start, start + 32)
        batch = {k: torch.from_numpy(v[sl]).to(device) for k, v in rows.items()}
        if not dataset.conditional:
            batch.pop("cond_mask", None)
        batches.append(batch)
    return float(measure_latent_std(encoder, batches))


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


def _sample_and_print(out, step, model_cfg, ema, artifact, cfg, tokenizer, dataset, encoder, info):
    ema_state = ema.state_dict_for_save()  # collective under FSDP2
    if not info.is_main or cfg.train.num_samples == 0:
        return
    net = _ema_network(model_cfg, ema_state, info.device)
    spec = token_spec(tokenizer)
    n = cfg.train.num_samples
    gens = sample_generators(cfg.train.seed, range(n), info.device)
    cond, cond_mask = None, None
    if dataset.conditional:
        rows = dataset.get_rows(np.arange(min(n, len(dataset))))
        ids = torch.from_numpy(rows["input_ids"]).to(info.device)
        cond_mask = torch.from_numpy(rows["cond_mask"]).to(info.device)
        src = ids.masked_fill(cond_mask == 0, spec.pad_id)
        cond = Condition(encoder(src, cond_mask, cond_mask), cond_mask)
        gens = gens[: len(ids)]
    result = sample(
        net, gens, model_cfg.max_length, cfg.sampler, artifact.noise_scale, artifact.t_eps, cond
    )
    tokens = result.tokens
    if cond_mask is not None:
        keep = model_cfg.max_length - cfg.max_input_length
        tokens = shift_out_source(tokens, cond_mask, keep, spec.pad_id)
    texts = detokenize(tokenizer, tokens, spec.eos_id, spec.pad_id)
    folder = out / "samples"
    folder.mkdir(exist_ok=True)
    with (folder / f"step-{step}.jsonl").open("w") as f:
        for i, text in enumerate(texts):
            f.write(json.dumps({"id": i, "step": step, "text": text}) + "\n")
    print(f"\n[samples @ step {step}]", *(f"  {i}: {t}" for i, t in enumerate(texts)), sep="\n")


class _Progress:
    def __init__(self, bar) -> None:
        self.bar = bar

    def update(self, done: int, line: dict[str, Any]) -> None:
        if self.bar is None:
            return
        self.bar.n = done
        self.bar.set_postfix(
            loss=f"{line['loss']:.4f}",
            l2=f"{line['l2']:.4f}",
            ce=f"{line['ce']:.3f}",
            lr=f"{line['lr']:.2e}",
            gnorm=f"{line['grad_norm']:.2f}",
            tok_s=f"{line['tokens_per_s']:.0f}",
            refresh=False,
        )
        self.bar.refresh()

    def note(self, text: str) -> None:
        """A line above the bar (stdout)."""
        if self.bar is None:
            print(text, flush=True)
        else:
            self.bar.write(text, file=sys.stdout)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def _progress(info: DistInfo, start: int, total: int) -> _Progress:
    if not info.is_main:
        return _Progress(None)
    from tqdm import tqdm

    return _Progress(tqdm(total=total, initial=start, desc="train", dynamic_ncols=True))
