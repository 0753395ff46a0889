"""What a training run's log lines say about speed: tokens/s, MFU and peak memory.

tokens/s counts the valid (non-padding) tokens of every process, over the window's time less the
time spent in checkpoints, evaluations and samples. MFU is the model's matrix FLOPs per step
(:mod:`elflow.train.flops`, at the objective's branch probabilities, padding positions included:
the device computes them) per second, over the processes' summed bf16 peak
(:func:`elflow.hardware.peak_tflops`, or ``train.peak_tflops``). Peak memory is this process's:
the CUDA allocator's high-water mark on a GPU, the peak resident set on a CPU.
"""

from __future__ import annotations

import resource
import sys
import time
from typing import Any

import torch

from elflow.hardware import peak_tflops
from elflow.train.flops import encoder_flops_per_token, expected_row_flops


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
        row = expected_row_flops(cfg.model, cfg.objective, L, encoder, cfg.train.procedure)
        self.flops_per_step = row * g.global_batch
        tflops = cfg.train.peak_tflops or peak_tflops(run.info.device)
        self.peak = tflops * 1e12 * run.info.world_size if tflops else None
        self.device = run.info.device
        self.start, self.paused = time.perf_counter(), 0.0

    def pause(self, seconds: float) -> None:
        self.paused += seconds

    def figures(self, steps: int, tokens: float) -> dict[str, float]:
        """tokens/s, seconds per step, MFU (when the peak is known) and peak memory of the
        window of ``steps`` steps and ``tokens`` valid tokens; starts the next window."""
        now = time.perf_counter()
        seconds = max(now - self.start - self.paused, 1e-9)
        self.start, self.paused = now, 0.0
        out = {"tokens_per_s": tokens / seconds, "step_s": seconds / steps}
        if self.peak:
            out["mfu"] = self.flops_per_step * steps / seconds / self.peak
        out["peak_memory_gb"] = peak_memory_gb(self.device)
        return out
