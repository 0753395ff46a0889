"""What a training run's log lines say about speed: tokens/s, MFU and peak memory.

tokens/s counts the valid (non-padding) tokens of every process, over the window's time less the
time spent in checkpoints, evaluations and samples. FLOPs follow docs/training.md "FLOPs and
MFU" (:mod:`elflow.train.flops`, padding positions included: the device computes them): the
model's and the executed FLOPs per second, and MFU (model) and HFU (executed) over the
processes' summed bf16 peak (:func:`elflow.runtime.hardware.peak_tflops`, or ``train.peak_tflops``).
Peak memory is this process's: the CUDA allocator's high-water mark on a GPU, the peak resident
set on a CPU.
"""

from __future__ import annotations

import resource
import sys
import time
from typing import Any

import torch

from elflow.runtime.hardware import peak_tflops
from elflow.train.flops import encoder_flops_per_token, executed_row_flops, model_row_flops


def peak_memory_gb(device: torch.device) -> float:
    """This process's peak memory in GB (GPU: allocated by torch; CPU: resident set size)."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 1e9
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss / (1e9 if sys.platform == "darwin" else 1e6)  # bytes on macOS, KiB on Linux


class ThroughputMeter:
    """Time and FLOPs of a logging window (:meth:`figures` closes it)."""

    def __init__(self, run: Any) -> None:
        cfg, g = run.cfg, run.geometry
        L = cfg.model.max_length
        encoder = 0.0
        if run.cache is None:
            encoder = encoder_flops_per_token(run.encoder.model.config, L)
        self.flops_per_step = model_row_flops(cfg.model, cfg.objective, L, encoder)
        self.flops_per_step *= g.global_batch
        executed = executed_row_flops(
            cfg.model,
            cfg.objective,
            L,
            encoder,
            procedure=cfg.train.procedure,
            checkpointing=cfg.train.activation_checkpointing == "blocks",
            micro_batch=g.micro,
            min_branch_rows=2 if cfg.train.compile == "step" else 0,
        )
        self.executed_per_step = executed * g.global_batch
        tflops = cfg.train.peak_tflops or peak_tflops(run.info.device)
        self.peak = tflops * 1e12 * run.info.world_size if tflops else None
        self.device = run.info.device
        self.start, self.paused = time.perf_counter(), 0.0

    def pause(self, seconds: float) -> None:
        self.paused += seconds

    def figures(self, steps: int, tokens: float) -> dict[str, float]:
        """tokens/s, seconds per step, model and executed TFLOP/s, MFU and HFU (when the peak is
        known) and peak memory of the window of ``steps`` steps and ``tokens`` valid tokens;
        starts the next window."""
        now = time.perf_counter()
        seconds = max(now - self.start - self.paused, 1e-9)
        self.start, self.paused = now, 0.0
        out = {"tokens_per_s": tokens / seconds, "step_s": seconds / steps}
        model = self.flops_per_step * steps / seconds
        executed = self.executed_per_step * steps / seconds
        out |= {"model_tflops": model / 1e12, "executed_tflops": executed / 1e12}
        if self.peak:
            out |= {"mfu": model / self.peak, "hfu": executed / self.peak}
        out["peak_memory_gb"] = peak_memory_gb(self.device)
        return out
