"""One optimizer step's gradients: micro-batches, the objective, and the global normaliser
(ELF_SPEC §3, §10 "Distributed equality").

Every process takes its micro-batches (stream positions from the global order, so the union over
processes and accumulation steps is the global batch), draws every random quantity keyed by the
example's global position, and back-propagates numerator x W / D, with D the objective's
normaliser over the whole global batch: N processes and gradient accumulation give the update of
one process. Nothing here reads the device: D is summed on the host from the batches' masks and
all-reduced on the device, the losses stay device tensors (the loop fetches them every
``train.log_every`` steps), rows are selected by host indices, and gradients are reduced once per
step (on the last micro-batch). The objective is pluggable (``objective_factory``:
distillation's).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch
from torch import Tensor

from elflow.config.train_config import RunConfig
from elflow.objective import Batch, LossOutput, branch_loss, elf_loss
from elflow.runtime.distributed import all_reduce_sum, gradient_sync
from elflow.train.batches import BatchLoader, HostBatch
from elflow.train.objective_draws import (
    BranchRows,
    Draws,
    host_index,
    keyed_device_draws,
    keyed_row_draws,
    sample_draws_keyed,
)

NUM_STATS = 5
"""A micro-batch's logging sums: l2 sum, ce sum, l2 tokens, ce tokens, non-finite latents."""


@dataclass
class StepLoss:
    """One micro-batch's contribution: a differentiable sum and logging sums."""

    numerator: Tensor
    """Summed loss of this micro-batch; the step loss is its total over the global batch / D."""
    stats: Tensor
    """(5,) float64 on the device: l2 sum, ce sum, l2 tokens, ce tokens, and 1 if the batch's
    latents were not finite (for the logged means and the non-finite check)."""


@dataclass
class StepMetrics:
    """An optimizer step's figures, on the device until the loop fetches them."""

    loss: Tensor
    """() this process's share of the step loss (the shares sum to the loss over processes)."""
    stats: Tensor
    """(5,) this process's logging sums (:class:`StepLoss`)."""
    text_tokens: int
    """Valid tokens this process trained on (tokens/s without the padding)."""


class Objective(Protocol):
    """What the loop needs of a loss: its normaliser's share of a batch (from what the host
    knows of it), and the loss."""

    def denominator(self, batch: HostBatch | Batch) -> float: ...

    def __call__(self, forward: Any, batch: Batch, positions: np.ndarray) -> StepLoss: ...


class ELFObjective:
    """The ELF training loss (§3), normalised by the global batch's loss-mask total.

    With ``train.compile=step`` each micro-batch runs as one compiled graph
    (:meth:`micro_batch` under ``torch.compile(fullgraph=True)``): the keyed draws' device part,
    the noising and targets, both network passes, the decoder head and the losses; the backward
    pass is the graph's compiled backward. The host keeps what only it knows (the per-example
    scalars, the row plan) and hands it over as tensors.

    NOTE: which rows are decoder rows and which self-condition changes every step. Their index
    tensors have a dynamic size (``torch._dynamo.mark_dynamic``), padded to at least 2 rows
    (:meth:`RowPlan.padded`: dynamo specialises sizes 0 and 1), so one graph serves every step:
    no recompile, and no masked passes over all rows (which would run the no-grad pass and the
    V-way head on every row). The decoder head's chunk loop is one opaque op inside it
    (:mod:`elflow.runtime.fused_head_loss`). Another micro-batch shape (B, L) compiles once more.
    """

    def __init__(self, cfg: RunConfig) -> None:
        self.cfg = cfg
        self.compiled = None
        if cfg.train.compile == "step":
            self.compiled = torch.compile(
                self.micro_batch, fullgraph=True, options=_step_compile_options()
            )

    def denominator(self, batch: HostBatch | Batch) -> float:
        if batch.loss_tokens is None:  # a batch made by hand: read its mask
            return float(loss_mask(batch, self.cfg.objective.pad_with_eos).sum())
        return batch.loss_tokens

    def __call__(self, forward, batch: Batch, positions: np.ndarray) -> StepLoss:
        cfg = self.cfg
        if self.compiled is not None:
            return self._compiled_call(forward, batch, positions)
        L, E = batch.x.shape[1], batch.x.shape[2]
        draws = sample_draws_keyed(positions, L, E, cfg.objective, cfg.train.seed, batch.x.device)
        out = elf_loss(
            forward, batch, draws, cfg.objective, cfg.train.procedure, check_inputs=False
        )
        return StepLoss(out.l2_sum + out.ce_sum, self.stats(batch, draws, out))

    def stats(self, batch: Batch, draws: Draws, out: LossOutput) -> Tensor:
        """(5,) float64 logging sums of a micro-batch (:class:`StepLoss`)."""
        mask = loss_mask(batch, self.cfg.objective.pad_with_eos)
        tokens = mask.sum()
        l2_tokens = (mask * (1.0 - draws.decoder_active)[:, None]).sum()
        bad = (~torch.isfinite(batch.x)).any()
        stats = torch.stack(
            [out.l2_sum.detach(), out.ce_sum.detach(), l2_tokens, tokens - l2_tokens]
        )
        return torch.cat([stats.double(), bad.double()[None]])

    def _compiled_call(self, forward, batch: Batch, positions: np.ndarray) -> StepLoss:
        """The host's part of a compiled micro-batch: the scalars and the padded row plan,
        copied without waiting, then the compiled graph."""
        cfg, device = self.cfg, batch.x.device
        scalars, plan = keyed_row_draws(positions, cfg.objective, cfg.train.seed)
        decoder, self_cond = plan.padded(len(positions)).arrays()
        decoder, self_cond = host_index(decoder, device), host_index(self_cond, device)
        torch._dynamo.mark_dynamic(decoder, 1)
        torch._dynamo.mark_dynamic(self_cond, 0)
        numerator, stats = self.compiled(
            forward,
            batch.x,
            batch.input_ids,
            batch.attention_mask,
            batch.cond_mask,
            batch.label_drop,
            scalars.to(device, non_blocking=True),
            host_index(positions, device),
            decoder,
            self_cond,
        )
        return StepLoss(numerator, stats)

    def micro_batch(
        self,
        forward,
        x: Tensor,
        input_ids: Tensor,
        attention_mask: Tensor,
        cond_mask: Tensor | None,
        label_drop: Tensor | None,
        scalars: Tensor,
        positions: Tensor,
        decoder: Tensor,
        self_cond: Tensor,
    ) -> tuple[Tensor, Tensor]:
        """One micro-batch from tensors alone (what ``train.compile=step`` compiles): the
        keyed draws' device part, :func:`branch_loss`, the logging sums. ``scalars`` (B, 4)
        and ``decoder`` (2, R), ``self_cond`` (S,) come from :func:`keyed_row_draws` and
        :meth:`RowPlan.arrays` of a padded plan; returns (numerator, stats)."""
        cfg = self.cfg
        batch = Batch(x, input_ids, attention_mask, cond_mask, label_drop)
        L, E = x.shape[1], x.shape[2]
        draws = keyed_device_draws(scalars, positions, L, E, cfg.objective, cfg.train.seed)
        rows = BranchRows.of_tensors(decoder, self_cond)
        reference = cfg.train.procedure == "reference"
        out = branch_loss(forward, batch, draws, rows, cfg.objective, reference)
        return out.l2_sum + out.ce_sum, self.stats(batch, draws, out)


def _step_compile_options() -> dict:
    """Inductor options for the compiled step: the AVX2 vector width on a CPU with AVX-512.

    NOTE: torch 2.13's inductor, in its 512-bit CPU kernels, gave NaN gradients for the timestep
    embedders' first layers in the compiled bf16 step (finite eager, with per-block compile, and
    with 256-bit or scalar kernels; found on a Xeon with AVX-512 and AMX). The option concerns
    CPU kernels only: CUDA kernels are untouched.
    """
    try:
        from torch._inductor.cpu_vec_isa import pick_vec_isa

        isa = pick_vec_isa()
    except Exception:  # another torch layout, or no compiler: inductor decides itself
        return {}
    return {"cpp.simdlen": 256} if isa and isa.bit_width() > 256 else {}


def loss_mask(batch: Batch, pad_with_eos: bool) -> Tensor:
    """(B, L) float: the tokens the loss covers (all but the condition under EOS padding)."""
    valid = (
        torch.ones_like(batch.attention_mask, dtype=torch.bool)
        if pad_with_eos
        else batch.attention_mask.bool()
    )
    if batch.cond_mask is not None:
        valid = valid & ~batch.cond_mask.bool()
    return valid.float()


class StepContext:
    """Builds the micro-batches of one optimizer step and back-propagates them."""

    def __init__(self, run: Any, objective: Objective, autocast: Any) -> None:
        self.run, self.objective, self.autocast = run, objective, autocast
        info = run.info
        self.loader = BatchLoader(
            run.cfg,
            run.dataset,
            run.cache,
            run.order,
            run.geometry,
            info.rank,
            info.world_size,
            pin=info.device.type == "cuda",
        )

    def accumulate(self, step: int) -> StepMetrics:
        """Back-propagate step ``step``'s global batch; its loss share and logging sums."""
        run, info = self.run, self.run.info
        W = info.world_size
        batches = self.loader.get(step)
        # D: the objective's normaliser over the whole global batch (ELF: the loss-mask total;
        # distillation: the row count), from the host's masks, all-reduced on the device
        # (spec §10 "Distributed equality"). torch.full: no host-to-device copy to wait for.
        local = sum(self.objective.denominator(b) for b in batches)
        denom = all_reduce_sum(torch.full((), local, dtype=torch.float64, device=info.device))
        scale = (W / denom.clamp_min(1.0)).float()
        stats = torch.zeros(NUM_STATS, device=info.device, dtype=torch.float64)
        for k, host in enumerate(batches):
            batch = host.to_device(run.encoder, info.device)
            with gradient_sync(run.forward, k == len(batches) - 1):
                with self.autocast:
                    out = self.objective(run.forward, batch, host.positions)
                # DDP/FSDP2 average gradients over processes: scale by W to get the sum.
                (out.numerator * scale).backward()
            stats += out.stats
        loss = (stats[0] + stats[1]) / denom.clamp_min(1.0)
        return StepMetrics(loss, stats, sum(b.text_tokens for b in batches))

    def close(self) -> None:
        self.loader.close()
