"""A training run's network: built (or loaded from a fine-tune's init), wrapped for data
parallelism and compilation, with its EMA and optimiser; on a resume every rank's optimiser, EMA
and RNG state restored (ELF_SPEC §3 step 11)."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import Tensor

from elflow.config.optim_config import OptimConfig
from elflow.config.train_config import RunConfig
from elflow.errors import ELFError
from elflow.io import checkpoint as ckpt_io
from elflow.io import train_state
from elflow.io.official import load_state_dict_strict
from elflow.model import ELF, build_model
from elflow.runtime.distributed import DistInfo, group_up, parallelize
from elflow.train.ema import EMA
from elflow.train.forward import TrainForward
from elflow.train.optim import build_optimizer


def build_network(
    cfg: RunConfig,
    optim_cfg: OptimConfig,
    info: DistInfo,
    init_state: dict[str, Tensor] | None,
    resume_from: Path | None,
    resume_state: dict | None,
    bf16: bool,
) -> tuple[ELF, torch.nn.Module, EMA, torch.optim.Optimizer, int]:
    """(the network, its wrapped forward, EMA, optimizer, the first step): built, placed, wrapped
    for data parallelism, and, when resuming, every rank's optimizer, EMA and RNG state restored."""
    model = build_model(cfg.model, info.device)
    if init_state is not None:
        load_state_dict_strict(model, {k: v.to(info.device) for k, v in init_state.items()})
    sharded = cfg.train.parallel == "fsdp2"
    start_step, rank_state, saved_world = 0, None, 1
    sharded_state = resume_state is not None and resume_state.get("format") == "dcp"
    if resume_from is not None:
        load_state_dict_strict(model, ckpt_io.load_weights(resume_from, "model.safetensors"))
        start_step = resume_state["step"]
        saved_world = resume_state.get("world_size", 1)
        if not sharded_state:  # a checkpoint of elflow < 0.3: one file of state per rank
            rank_state = ckpt_io.load_rank_state(resume_from, info, saved_world, sharded)
    model.activation_checkpointing = cfg.train.activation_checkpointing == "blocks"
    model.residual_dtype = torch.bfloat16 if cfg.train.residual_dtype == "bf16" else None
    forward = TrainForward(model)
    if cfg.train.compile == "step":
        # The whole micro-batch is compiled around this forward (train/step.py); DDP's forward
        # (its reducer calls) would break that graph, so one process runs it unwrapped.
        if info.world_size > 1:
            raise ELFError(
                f"train.compile=step compiles one process's whole step; with "
                f"{info.world_size} processes use train.compile=blocks"
            )
        wrapped = forward
    else:
        # Each block compiled, then sharded (torchtitan's order): FSDP2's hooks stay outside
        # the compiled graphs, and one compiled block serves all of them.
        wrapped = parallelize(
            forward,
            model.blocks,
            info,
            cfg.train.parallel,
            bf16=bf16,
            compile=cfg.train.compile == "blocks",
        )
    ema = EMA(model, cfg.train.ema_decay, cfg.train.ema_warmup)
    optimizer = build_optimizer(
        model, optim_cfg, sharded=sharded, distributed=group_up() and not sharded
    )
    # The global RNG only draws dropout masks (every other draw is keyed by example): each rank
    # gets its own stream, as data parallelism needs; rank 0 (and one process) keeps the seed's.
    if sharded_state:
        train_state.load(resume_from / train_state.FOLDER, optimizer, model, ema)
        ema.num_updates = int(resume_state["ema_updates"])
        own = resume_from / train_state.rng_file(info.rank)
        same = saved_world == info.world_size and own.is_file()
        rng = ckpt_io.load_rng(own if same else resume_from / train_state.rng_file(0))
        ckpt_io.set_rng_state(rng)
        if info.rank and not same:  # every rank restored rank 0's stream
            torch.manual_seed(rank_seed(cfg.train.seed, info.rank, start_step))
    elif rank_state is not None:
        ema.load_state_dict(rank_state["ema"])
        ckpt_io.restore_optimizer(optimizer, rank_state["optimizer"])
        ckpt_io.set_rng_state(rank_state["rng"])
        if info.rank and saved_world != info.world_size:  # every rank restored rank 0's stream
            torch.manual_seed(rank_seed(cfg.train.seed, info.rank, start_step))
    elif info.rank:
        torch.manual_seed(rank_seed(cfg.train.seed, info.rank, 0))
    return model, wrapped, ema, optimizer, start_step


def rank_seed(seed: int, rank: int, step: int) -> int:
    """The global-RNG seed of process ``rank`` > 0 starting at ``step`` (its dropout stream)."""
    return (seed * 1_000_003 + rank * 7_919 + step) % 2**63
