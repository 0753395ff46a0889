"""The training loop: one code path for 1 process and N processes under torchrun (ELF_SPEC §3).

:func:`train` sets the run up (:func:`elflow.train.setup.prepare_run`) and hands it to a
:class:`Trainer`, whose :meth:`Trainer.step` is one optimizer step: the learning rate, the global
batch's gradients (:class:`elflow.train.step.StepContext`), clipping, Muon + Adam, EMA, the
step's metrics (kept on the device) and the stop-signal agreement. The host never waits for the
device inside a step: the metrics and the non-finite check are fetched every ``train.log_every``
steps and before each checkpoint, so a non-finite loss stops every rank with the last good
checkpoint intact (:class:`NonFiniteGuard`). Checkpoints: ``io/checkpoint.py``; what a resume or
a fine-tune must match: ``resume.py``.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor

from elflow.config.train_config import RunConfig, run_config_to_dict
from elflow.errors import ELFError, Interrupted
from elflow.io import checkpoint as ckpt_io
from elflow.runtime.distributed import DistInfo, all_reduce_min, failure_line, is_collective_failure
from elflow.runtime.hardware import bf16_autocast
from elflow.sampling.projection import Projection
from elflow.train.optim import learning_rate, set_lr
from elflow.train.reporting import Reporter
from elflow.train.setup import Run, prepare_run
from elflow.train.step import ELFObjective, Objective, StepContext
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
            distillation passes its own (``curriculum.py``).
        init_state: initial weights for a fresh run (ignored when resuming); ``train.init``
            gives them from a model source instead (fine-tuning, see
            :func:`elflow.train.resume.apply_init`).
        latent_cache_dir: where the latent cache file lives (default: as ``data`` says).
    """
    run = prepare_run(cfg, out, resume, init_state=init_state, latent_cache_dir=latent_cache_dir)
    cfg, info = run.cfg, run.info
    pad_id = run.spec.row_pad_id(cfg.objective.pad_with_eos)
    projection = Projection(run.encoder, run.spec.eos_id, pad_id)
    objective = objective_factory(cfg, info, projection) if objective_factory else ELFObjective(cfg)
    trainer = Trainer(run, objective)
    try:
        return trainer.fit()
    finally:
        trainer.close()


class NonFiniteGuard:
    """The first step whose loss, gradient norm or latents were not finite, kept on the device
    (two ops a step) and read only when :meth:`check` is called."""

    def __init__(self, device: torch.device) -> None:
        # [first non-finite loss or gradient, first non-finite batch latents]; inf: none yet.
        self.first = torch.full((2,), math.inf, dtype=torch.float64, device=device)

    def observe(self, step: int, loss: Tensor, grad_norm: Tensor, bad_latents: Tensor) -> None:
        bad = torch.stack([~torch.isfinite(loss + grad_norm), bad_latents > 0])
        self.first = torch.minimum(self.first, torch.where(bad, float(step), math.inf))

    def check(self, last_ckpt: Path | None, weights: list[Tensor] | None = None) -> None:
        """Raise the one-line error if any step so far, on any process, was not finite; with
        ``weights`` (before a checkpoint), also if any of them is not finite (an optimizer can
        turn finite gradients into non-finite weights)."""
        first = self.first.clone()
        if weights:
            finite = torch.stack([torch.isfinite(w).all() for w in weights]).all()
            first[0] = torch.where(finite, first[0], -1.0)  # -1: found in the weights
        loss_step, latents_step = all_reduce_min(first).tolist()
        where = f"stopping (last good checkpoint: {last_ckpt or 'none'})"
        if loss_step == -1:
            raise ELFError(
                f"the weights hold NaN or inf values; {where}; lower the learning rate or "
                "check the data"
            )
        if math.isfinite(latents_step):
            raise ELFError(
                f"the batch's latents contain NaN or inf values at step {int(latents_step)}; "
                f"{where}; check the data, the encoder or the latent cache"
            )
        if math.isfinite(loss_step):
            raise ELFError(
                f"non-finite loss or gradient at step {int(loss_step)}; {where}; lower the "
                "learning rate or check the data"
            )


class Trainer:
    """The loop over a prepared run: :meth:`step` per optimizer step, :meth:`fit` for the run."""

    def __init__(self, run: Run, objective: Objective) -> None:
        self.run = run
        # What the spec's fp32 parts' products may use on CUDA; process-wide, so put back on close.
        self._tf32 = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
        if run.info.device.type == "cuda":
            torch.backends.cuda.matmul.allow_tf32 = run.cfg.train.tf32
            torch.backends.cudnn.allow_tf32 = run.cfg.train.tf32
        autocast = bf16_autocast(run.bf16, run.info.device)
        self.grads = StepContext(run, objective, autocast)
        self.report = Reporter(run, objective, autocast)
        self.guard = NonFiniteGuard(run.info.device)
        self.stop = StopSignal()
        # 0 disables clipping; the norm is still measured (logged, and checked for NaN). Clipping
        # to 0 itself would zero every gradient.
        self.max_grad_norm = run.optim.clip_grad_norm or math.inf
        self.last_ckpt, self.saved_step = run.resume_from, run.start_step
        self.pending: ckpt_io.PendingSave | None = None

    def step(self, step: int) -> None:
        """Optimizer step ``step`` (0-based) and its report."""
        run, g = self.run, self.run.geometry
        lr = learning_rate(run.optim, step, g.total_steps, g.global_batch)
        set_lr(run.optimizer, lr)
        metrics = self.grads.accumulate(step)
        grad_norm = torch.nn.utils.clip_grad_norm_(run.model.parameters(), self.max_grad_norm)
        if isinstance(grad_norm, DTensor):  # FSDP2: the (replicated) global norm
            grad_norm = grad_norm.full_tensor()
        run.optimizer.step()
        run.optimizer.zero_grad(set_to_none=True)
        run.ema.update(run.model)
        self.guard.observe(step, metrics.loss, grad_norm, metrics.stats[4])
        done = step + 1
        if self.report.due(done):
            self.guard.check(self.last_ckpt)
        self.report.step(done, metrics, lr, grad_norm)

    def fit(self) -> Path:
        """Every step from the run's start to its end, with checkpoints, evaluations, samples and
        a clean stop on SIGINT/SIGTERM; returns the last checkpoint folder."""
        run, cfg, g = self.run, self.run.cfg, self.run.geometry
        try:
            self.stop.install(run.info, cfg.train.stop_timeout, self._stuck_line)
            for step in range(run.start_step, g.total_steps):
                self.step(step)
                done = step + 1
                saving = done % cfg.train.save_every == 0 or done == g.total_steps
                if saving or self.report.evaluating(done):
                    synchronize(run.info.device)  # the steps queued so far are training time
                    t0 = time.perf_counter()
                    if saving:
                        self.save(done)
                    self.report.evaluate(done)
                    self.report.pause(time.perf_counter() - t0)  # not training time
                # Once a step, after sampling too, so that a signal there is not held a step.
                if self.stop.agreed(run.info):
                    if self.saved_step != done:
                        self.save(done)
                    self.settle()
                    raise _stopped(self.stop, done, g.total_steps, self.last_ckpt)
            self.settle()
        except Exception as e:
            if run.info.world_size > 1 and is_collective_failure(e):
                line = failure_line(run.info.rank, "a collective failed", self.last_ckpt)
                raise ELFError(line) from e
            raise
        finally:
            self.stop.restore()
        return self.last_ckpt if self.last_ckpt is not None else run.out

    def _stuck_line(self, wait_s: float) -> str:
        """What a process says when a stop signal's step did not end within ``wait_s``."""
        what = (
            f"stopped by {self.stop.name}, but its step did not finish within {wait_s:.0f} s "
            "(train.stop_timeout)"
        )
        return "elflow: error: " + failure_line(self.run.info.rank, what, self.last_ckpt)

    def save(self, done: int) -> None:
        """Checkpoint step ``done``, after checking that every step so far, and the weights, are
        finite; with ``train.async_save`` it completes in the background (by the next save or
        the run's end)."""
        weights = [_local(p).detach() for p in self.run.model.parameters()]
        self.guard.check(self.last_ckpt, weights)
        self.settle()
        self.pending = begin_save(self.run, done)
        self.saved_step = done
        if not self.run.cfg.train.async_save:
            self.settle()

    def settle(self) -> None:
        """Wait for the checkpoint being written, if any, and make it the last good one."""
        if self.pending is not None:
            pending, self.pending = self.pending, None
            self.last_ckpt = ckpt_io.finish_checkpoint(pending, self.run.info)

    def close(self) -> None:
        self.grads.close()
        self.report.close()
        self.run.lock.release()
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = self._tf32


def _local(t: Tensor) -> Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work (a no-op on a CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _stopped(stop: StopSignal, done: int, total: int, last_ckpt: Path) -> Interrupted:
    """The error a signal ends the run with. Also after the last step: the signal is honoured (a
    curriculum stops before its next round), and the message says the run itself is complete."""
    rest = (
        "this run is complete (a distillation curriculum continues with the same command)"
        if done == total
        else "run the same command (with resume=auto, the default) to continue"
    )
    return Interrupted(
        f"stopped by {stop.name} after step {done} of {total}; saved {last_ckpt}; {rest}",
        stop.exit_code,
    )


def begin_save(run: Run, step: int) -> ckpt_io.PendingSave:
    """Start checkpointing ``step`` of ``run``: every rank takes part; rank 0 gathers and writes
    the full weights, each rank writes its shards of the training state (in the background with
    ``train.async_save``)."""
    from elflow.io import train_state

    g = run.geometry
    state = {
        "step": step,
        "epoch": step * g.global_batch / g.rows,
        "examples_seen": step * g.global_batch,
        "rows": g.rows,
        "ema_updates": run.ema.num_updates,
    }

    def write_state(folder: Path):
        return train_state.save(folder, run.optimizer, run.model, run.ema, run.cfg.train.async_save)

    return ckpt_io.begin_checkpoint(
        run.out,
        step,
        model_state=ckpt_io.full_state(run.model.state_dict(), run.info),
        ema_state=ckpt_io.full_state(run.ema.shadow, run.info),
        write_state=write_state,
        artifact=run.artifact,
        run_config=run_config_to_dict(run.cfg),
        state=state,
        info=run.info,
        keep_last=run.cfg.train.keep_last,
    )


def save(run: Run, step: int) -> Path:
    """Checkpoint ``step`` of ``run`` and wait until it is complete."""
    return ckpt_io.finish_checkpoint(begin_save(run, step), run.info)
