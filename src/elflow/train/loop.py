"""The training loop: one code path for 1 process and N processes under torchrun (ELF_SPEC §3).

:func:`train` sets the run up (:func:`elflow.train.setup.prepare_run`), then per step: the
learning rate, the global batch's gradients (:class:`elflow.train.step.StepContext`), clipping,
Muon + Adam, EMA; then the reports (:class:`elflow.train.reporting.Reporter`), checkpoints and a
clean stop on SIGINT/SIGTERM. A non-finite loss stops every rank with the last good checkpoint
intact. Checkpoints: ``io/checkpoint.py``; what a resume or a fine-tune must match: ``resume.py``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from elflow.distributed import DistInfo
from elflow.errors import ELFError, Interrupted
from elflow.hardware import bf16_autocast
from elflow.io import checkpoint as ckpt_io
from elflow.projection import Projection
from elflow.train.config import RunConfig, run_config_to_dict
from elflow.train.optim import learning_rate, set_lr
from elflow.train.reporting import Reporter
from elflow.train.setup import Run, prepare_run
from elflow.train.step import ELFObjective, StepContext
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
    cfg, info, g = run.cfg, run.info, run.geometry
    autocast = bf16_autocast(run.bf16, info.device)
    pad_id = run.spec.row_pad_id(cfg.objective.pad_with_eos)
    projection = Projection(run.encoder, run.spec.eos_id, pad_id)
    objective = objective_factory(cfg, info, projection) if objective_factory else ELFObjective(cfg)
    step_grads = StepContext(run, objective, autocast)
    report = Reporter(run, objective, autocast)
    # 0 disables clipping; the norm is still measured (logged, and checked for NaN). Clipping to 0
    # itself would zero every gradient.
    max_grad_norm = run.optim.clip_grad_norm or math.inf
    last_ckpt, saved_step = run.resume_from, run.start_step
    stop = StopSignal()
    try:
        stop.install()
        for step in range(run.start_step, g.total_steps):
            lr, metrics, grad_norm = optimizer_step(run, step_grads, step, max_grad_norm, last_ckpt)
            done = step + 1
            report.step(done, metrics, lr, grad_norm)
            if done % cfg.train.save_every == 0 or done == g.total_steps:
                last_ckpt, saved_step = save(run, done), done
            report.evaluate(done)
            if stop.agreed(info):  # after sampling too, so a signal there is not held a step
                if saved_step != done:
                    last_ckpt, saved_step = save(run, done), done
                raise _stopped(stop, done, g.total_steps, last_ckpt)
    finally:
        stop.restore()
        report.close()
    return last_ckpt if last_ckpt is not None else run.out


def optimizer_step(
    run: Run, step_grads: StepContext, step: int, max_grad_norm: float, last_ckpt: Path | None
) -> tuple[float, dict[str, Any], float]:
    """One optimizer step: the lr, the global batch's gradients, clipping, Muon + Adam, EMA;
    returns (lr, the step's metrics, the gradient norm)."""
    g = run.geometry
    lr = learning_rate(run.optim, step, g.total_steps, g.global_batch)
    set_lr(run.optimizer, lr)
    metrics = step_grads.accumulate(step)
    grad_norm = float(torch.nn.utils.clip_grad_norm_(run.model.parameters(), max_grad_norm))
    if not (math.isfinite(metrics["loss"]) and math.isfinite(grad_norm)):
        raise ELFError(
            f"non-finite loss or gradient at step {step}; stopping (last good checkpoint: "
            f"{last_ckpt or 'none'}); lower the learning rate or check the data"
        )
    run.optimizer.step()
    run.optimizer.zero_grad(set_to_none=True)
    run.ema.update(run.model)
    return lr, metrics, grad_norm


def _stopped(stop: StopSignal, done: int, total: int, last_ckpt: Path) -> Interrupted:
    """The error a signal ends the run with. Also after the last step: the signal is honoured (a
    curriculum stops before its next round), and the message says the run itself is complete."""
    rest = (
        "this run is complete (a distillation curriculum continues with the same command)"
        if done == total
        else "run the same command (with --resume auto, the default) to continue"
    )
    return Interrupted(
        f"stopped by {stop.name} after step {done} of {total}; saved {last_ckpt}; {rest}",
        stop.exit_code,
    )


def save(run: Run, step: int) -> Path:
    """Checkpoint ``step`` of ``run`` (every rank takes part; rank 0 writes the shared files)."""
    g = run.geometry
    state = {
        "step": step,
        "epoch": step * g.global_batch / g.rows,
        "examples_seen": step * g.global_batch,
        "rows": g.rows,
    }
    return ckpt_io.save_checkpoint(
        run.out,
        step,
        model_state=ckpt_io.full_state(run.model.state_dict()),
        ema_state=run.ema.state_dict_for_save(),
        rank_state={"optimizer": run.optimizer.state_dict(), "ema": run.ema.state_dict()},
        artifact=run.artifact,
        run_config=run_config_to_dict(run.cfg),
        state=state,
        info=run.info,
        keep_last=run.cfg.train.keep_last,
    )
