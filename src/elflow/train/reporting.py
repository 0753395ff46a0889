"""What a training run reports beside its loop: metrics, the progress bar, held-out losses and
periodic samples (:class:`Reporter`; files on rank 0 only).

Metrics go to ``OUT/metrics.jsonl`` always (one JSON object per logging step: the step's losses,
lr, gradient norm, tokens/s, model and executed TFLOP/s, MFU and HFU, epoch; or the held-out
losses), to TensorBoard when it is installed and ``train.tensorboard`` is on, and to wandb when
``train.wandb`` asks for it. Samples of the EMA weights go to ``OUT/samples/``. A resume from
an earlier checkpoint sets the later steps' metrics and samples aside with the abandoned
branch's checkpoints.
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from elflow.config import ModelConfig
from elflow.config.train_config import RunConfig, run_config_to_dict
from elflow.data.rows import RowDataset
from elflow.errors import ELFError
from elflow.io import checkpoint as ckpt_io
from elflow.io.artifact import ArtifactConfig
from elflow.io.jsonl import finite_or_null, write_jsonl
from elflow.runtime.distributed import DistInfo, all_reduce_sum
from elflow.text.encoder import FrozenEncoder
from elflow.text.tokens import detokenize, token_spec
from elflow.train.ema import EMA, ema_network
from elflow.train.heldout import branch_means, heldout_scores, heldout_splits
from elflow.train.step import NUM_STATS, StepMetrics
from elflow.train.throughput import ThroughputMeter


class MetricsLogger:
    """Rank-0 metrics: JSONL always, TensorBoard when installed, wandb when asked."""

    def __init__(
        self,
        out: Path,
        cfg: RunConfig,
        enabled: bool,
        start_step: int = 0,
        set_aside: Path | None = None,
    ) -> None:
        """A run from ``start_step`` (a resume, or 0) drops the lines of later steps (those steps
        run again), keeping them in ``set_aside/metrics.jsonl`` when an abandoned branch went
        there."""
        self.enabled = enabled
        self.tb = self.wandb = None
        if not enabled:
            return
        path = out / "metrics.jsonl"
        if path.is_file():  # (a run stopped before its first checkpoint, too)
            later = truncate_metrics(path, start_step)
            if later and set_aside is not None:
                (set_aside / "metrics.jsonl").write_text("".join(later))
        self.jsonl = path.open("a")
        if cfg.train.tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter

                # Events of later steps are dropped.
                self.tb = SummaryWriter(str(out / "tensorboard"), purge_step=start_step + 1)
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
        # Strict JSON: a NaN (a branch without tokens) is written as null.
        line = finite_or_null({"step": step, **metrics})
        self.jsonl.write(json.dumps(line, allow_nan=False) + "\n")
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


def set_aside_samples(out: Path, step: int, aside: Path) -> None:
    """Move the periodic samples of steps after ``step`` (an abandoned branch's) into
    ``aside/samples/``, next to that branch's checkpoints."""
    for path in sorted((out / "samples").glob("step-*.jsonl")):
        k = path.stem.removeprefix("step-")
        if k.isdigit() and int(k) > step:
            (aside / "samples").mkdir(exist_ok=True)
            path.rename(aside / "samples" / path.name)


def truncate_metrics(path: Path, step: int) -> list[str]:
    """Keep the lines of ``path`` up to ``step`` (a line cut short by a crash goes too); return
    the lines of later steps."""
    keep, later = [], []
    for line in path.read_text().splitlines(keepends=True):
        if not line.endswith("\n"):
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        (keep if isinstance(record, dict) and record.get("step", 0) <= step else later).append(line)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text("".join(keep))
    tmp.replace(path)
    return later


class Progress:
    """The rank-0 progress bar (tqdm) of a training run; a no-op on the other ranks."""

    def __init__(self, bar) -> None:
        self.bar = bar

    def tick(self, done: int) -> None:
        """Step ``done`` finished (the bar moves every step; its figures at logging steps)."""
        if self.bar is not None:
            self.bar.update(done - self.bar.n)

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
            **({"mfu": f"{100 * line['mfu']:.1f}%"} if "mfu" in line else {}),
            **({"hfu": f"{100 * line['hfu']:.1f}%"} if "hfu" in line else {}),
            mem=f"{line['peak_memory_gb']:.1f}GB",
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


def progress_bar(info: DistInfo, start: int, total: int) -> Progress:
    if not info.is_main:
        return Progress(None)
    from tqdm import tqdm

    return Progress(tqdm(total=total, initial=start, desc="train", dynamic_ncols=True))


def write_samples(
    out: Path,
    step: int,
    model_cfg: ModelConfig,
    ema: EMA,
    artifact: ArtifactConfig,
    cfg: RunConfig,
    tokenizer,
    dataset: RowDataset,
    encoder: FrozenEncoder,
    info: DistInfo,
) -> None:
    """Every ``train.sample_every`` steps: samples of the EMA weights, printed and written to
    ``OUT/samples/step-<k>.jsonl`` (seeded by ``train.seed``; no global random numbers). A
    conditional run translates its first training rows' sources, recorded as ``source``."""
    ema_state = ema.state_dict_for_save()  # collective under FSDP2
    if not info.is_main or cfg.train.num_samples == 0:
        return
    from elflow.generation.pipeline import ELFPipeline

    net = ema_network(model_cfg, ema_state, info.device)
    pipe = ELFPipeline(net, artifact, tokenizer, encoder)
    n = cfg.train.num_samples
    sources = None
    if dataset.conditional:  # the first training rows' sources, as text
        spec = token_spec(tokenizer)
        rows = dataset.get_rows(np.arange(min(n, len(dataset))))
        src = torch.from_numpy(rows["input_ids"]).masked_fill(
            torch.from_numpy(rows["cond_mask"]) == 0, spec.pad_id
        )
        sources = detokenize(tokenizer, src, spec.eos_id, spec.pad_id)
        n = len(sources)
    # Periodic samples are free-length and one batch, through the pipeline's one path; eager
    # (no CUDA graphs): the network is built anew each time, so captured graphs would only hold
    # memory until the garbage collector found them.
    sampler = replace(cfg.sampler, length_range="")
    texts = pipe(
        None if sources else n,
        sources=sources,
        sampler=sampler,
        seed=cfg.train.seed,
        batch_size=n,
        cuda_graphs=False,
    ).texts
    records = [{"id": i, "step": step, "text": text} for i, text in enumerate(texts)]
    for record, source in zip(records, sources or [], strict=False):
        record["source"] = source
    write_jsonl(out / "samples" / f"step-{step}.jsonl", records)
    print(f"\n[samples @ step {step}]", *(f"  {i}: {t}" for i, t in enumerate(texts)), sep="\n")


class Reporter:
    """The loop's reports: logging windows, the held-out loss and samples when they are due."""

    def __init__(self, run: Any, objective: Any, autocast: Any) -> None:
        self.run, self.objective, self.autocast = run, objective, autocast
        cfg, info, out = run.cfg, run.info, run.out
        aside = None
        if info.is_main:
            out.mkdir(parents=True, exist_ok=True)
            if run.continues_out:
                aside = ckpt_io.set_aside_later(out, run.start_step)
                if aside is not None:
                    set_aside_samples(out, run.start_step, aside)
        self.logger = MetricsLogger(out, cfg, info.is_main, run.start_step, aside)
        self.heldout = None
        if cfg.train.eval_every:
            self.heldout = heldout_splits(
                cfg, run.valid, run.dataset, run.encoder, info, run.geometry.micro
            )
        # Made last, so that its clock starts with the first step, not with the set-up.
        self.progress = progress_bar(info, run.start_step, run.geometry.total_steps)
        if aside is not None:
            print(
                f"elflow train: resuming from {run.resume_from.name}; the later checkpoints and "
                f"metrics of the abandoned branch are kept in {aside}",
                flush=True,
            )
        self.meter = ThroughputMeter(run)
        # [loss share, the step's 5 logging sums, valid tokens], summed over the window.
        self.window = torch.zeros(2 + NUM_STATS, dtype=torch.float64, device=info.device)
        self.steps = 0

    def due(self, done: int) -> bool:
        """Whether step ``done`` writes a metrics line (and so reads the device)."""
        return done % self.run.cfg.train.log_every == 0 or done == self.run.geometry.total_steps

    def step(self, done: int, metrics: StepMetrics, lr: float, grad_norm: Tensor) -> None:
        """Add step ``done`` to the logging window (on the device); when the window is full,
        fetch it (one all-reduce, one read) and write the metrics line."""
        g, info = self.run.geometry, self.run.info
        self.window[0] += metrics.loss
        self.window[1 : 1 + NUM_STATS] += metrics.stats
        self.window[-1] += metrics.text_tokens
        self.steps += 1
        if not self.due(done):
            self.progress.tick(done)
            return
        sums = all_reduce_sum(torch.cat([self.window, grad_norm.double().reshape(1)]))
        loss, l2_sum, ce_sum, l2_n, ce_n, _, tokens, gnorm = sums.tolist()
        # The branch losses are token means over the logging window (a step whose rows give a
        # branch no token adds nothing to it).
        l2, ce = branch_means(l2_sum, ce_sum, l2_n, ce_n)
        line = {"loss": loss / self.steps, "l2": l2, "ce": ce, "lr": lr}
        line["grad_norm"] = gnorm / info.world_size  # the same global norm on every process
        line |= self.meter.figures(self.steps, tokens)
        line["epoch"] = done * g.global_batch / g.rows
        self.logger.log(done, line)
        self.progress.update(done, line)
        self.window.zero_()
        self.steps = 0

    def pause(self, seconds: float) -> None:
        """Leave ``seconds`` (a checkpoint, an evaluation, samples) out of the throughput."""
        self.meter.pause(seconds)

    def _heldout_due(self, done: int) -> bool:
        every, total = self.run.cfg.train.eval_every, self.run.geometry.total_steps
        return bool(self.heldout) and (done % every == 0 or done == total)

    def _samples_due(self, done: int) -> bool:
        every = self.run.cfg.train.sample_every
        return bool(every) and done % every == 0

    def evaluating(self, done: int) -> bool:
        """Whether step ``done`` is due for the held-out loss or samples."""
        return self._heldout_due(done) or self._samples_due(done)

    def evaluate(self, done: int) -> None:
        """The held-out loss and the periodic samples, when step ``done`` is due for them."""
        run, cfg = self.run, self.run.cfg
        if self._heldout_due(done):
            t0 = time.perf_counter()
            scores = heldout_scores(
                self.heldout, cfg.model, run.ema, self.objective, self.autocast, run.info
            )
            scores["eval_seconds"] = time.perf_counter() - t0
            self.logger.log(done, scores)
            if run.info.is_main:
                losses = ", ".join(
                    f"{k.removesuffix('_loss')} {v:.4f}"
                    for k, v in scores.items()
                    if k.endswith("_loss")
                )
                self.progress.note(f"step {done}: held-out loss (EMA weights) {losses}")
        if self._samples_due(done):
            write_samples(
                run.out,
                done,
                cfg.model,
                run.ema,
                run.artifact,
                cfg,
                run.tokenizer,
                run.dataset,
                run.encoder,
                run.info,
            )

    def close(self) -> None:
        self.progress.close()
        self.logger.close()
