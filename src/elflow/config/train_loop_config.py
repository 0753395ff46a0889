"""The training loop's settings (ELF_SPEC §3 step 11): the ``train`` section of a run config
(batch sizes, length, EMA, precision, parallelism, checkpoints, logging, compilation)."""

from __future__ import annotations

from dataclasses import dataclass

from elflow.errors import require

COMPILE_MODES = ("none", "blocks", "step")
"""``train.compile``'s values (docs/training.md "Compilation")."""


@dataclass(frozen=True)
class TrainConfig:
    """The training loop (ELF_SPEC §3 step 11)."""

    global_batch: int = 512
    """Examples per optimizer step, over all processes and accumulation steps."""
    micro_batch: int = 0
    """Examples per forward on one process; 0 = global_batch / world_size (no accumulation)."""
    max_steps: int = 0
    """Optimizer steps to run; 0 = ``epochs`` worth."""
    epochs: float = 1.0
    """Training length in passes over the data when max_steps is 0."""
    warmup_epochs: float = 0.0
    """If > 0, the linear warm-up lasts this many epochs (overrides optim.warmup_steps)."""
    ema_decay: float = 0.9999
    """EMA decay per optimizer step."""
    ema_warmup: bool = False
    """Use min(ema_decay, (1 + k) / (10 + k)) so short runs are not dominated by the init."""
    precision: str = "auto"
    """'auto' (bf16 autocast on CUDA and on CPUs with native bf16, else fp32), 'fp32' or 'bf16'."""
    tf32: bool = True
    """On CUDA, let the matrix products the spec keeps in fp32 (input projections, embedders,
    heads; everything under precision=fp32) use TF32 tensor cores (~7x plain fp32's speed, a
    10-bit mantissa for the products' inputs); false: plain fp32."""
    peak_tflops: float = 0.0
    """The device's dense bf16 peak in TFLOP/s for the logged MFU; 0 = from elflow's table of
    common GPUs (no MFU on a CPU or an unknown GPU)."""
    parallel: str = "ddp"
    """'ddp' or 'fsdp2' (shards each block; for ELF-L-sized models)."""
    dist_timeout: float = 30.0
    """Minutes a collective waits for the other processes before it fails (the process group's
    timeout); a process that sees one fail ends with a line naming the processes gone."""
    stop_timeout: float = 300.0
    """Seconds a process waits, after SIGINT/SIGTERM, for its step and save to finish when
    other processes take part; past it (a collective blocked on a process that is gone) it
    exits with one line, the last checkpoint kept. 0: wait for ever."""
    procedure: str = "efficient"
    """Objective procedure: 'efficient' or 'reference' (same loss and gradients)."""
    seed: int = 0
    """Seeds the initial weights, the data order and every per-example draw."""
    device: str = "auto"
    """'auto' (cuda:LOCAL_RANK when available, else cpu), 'cpu' or 'cuda'."""
    log_every: int = 10
    """Steps between metric lines (JSONL, TensorBoard, progress bar)."""
    save_every: int = 1000
    """Steps between checkpoints (a final one is always written)."""
    keep_last: int = 3
    """Checkpoints kept on disk (older ones are deleted)."""
    async_save: bool = False
    """Write each checkpoint's training state in the background while training goes on (it is
    complete, and becomes the latest, by the next checkpoint or the run's end)."""
    sample_every: int = 0
    """Steps between sample generations (0 = never)."""
    num_samples: int = 4
    """Samples generated at each sample_every."""
    eval_every: int = 0
    """Steps between held-out losses (0 = never; also after the last step): the EMA weights on
    fixed rows of the validation split (when ``data.valid_path`` is set) and of the training
    split, with fixed draws (``heldout.py``)."""
    eval_rows: int = 256
    """Rows of each split in the held-out loss."""
    tensorboard: bool = True
    """Write TensorBoard events when the tensorboard package is installed."""
    wandb: bool = False
    """Log to Weights & Biases (needs the wandb package and its login)."""
    compile: str = "none"
    """torch.compile: 'none'; 'blocks' (each transformer block, before FSDP2 shards it: fused
    kernels for the norms, RoPE and SwiGLU); 'step' (a whole micro-batch: draws, both network
    passes, decoder head, losses; one process only). A one-off compile time of tens of seconds
    (blocks) to minutes (step); true/false (older configs) mean blocks/none."""
    residual_dtype: str = "fp32"
    """The residual stream between blocks under bf16 autocast: 'fp32' (the spec's) or 'bf16'
    (experimental: less memory traffic; kept only if its loss curve matches fp32's on a GPU,
    which has not been measured). No effect without bf16 autocast."""
    activation_checkpointing: str = "none"
    """'none' or 'blocks': recompute each block's activations in the backward pass instead of
    storing them: much less activation memory (larger micro-batches for ELF-M/L at L 1024) for
    about one more forward of the blocks per step; the same updates (tested, also under
    FSDP2). true/false (older configs) mean blocks/none."""
    init: str = ""
    """Fine-tuning: a model source (run, checkpoint, model folder, Hub id, authors' checkpoint)
    whose weights (EMA when present) start a fresh run. Its architecture (all but max_length),
    encoder, tokenizer and latent normalisation replace this config's; a resume takes them from
    its checkpoint (the init is not read again)."""

    def __post_init__(self) -> None:
        require(
            self.global_batch > 0, f"train.global_batch must be positive, got {self.global_batch}"
        )
        require(self.micro_batch >= 0, f"train.micro_batch must be >= 0, got {self.micro_batch}")
        require(self.max_steps >= 0, f"train.max_steps must be >= 0, got {self.max_steps}")
        require(self.seed >= 0, f"train.seed must be >= 0, got {self.seed}")
        require(self.epochs > 0, f"train.epochs must be positive, got {self.epochs}")
        require(self.warmup_epochs >= 0, "train.warmup_epochs must be >= 0")
        require(
            0.0 <= self.ema_decay < 1.0, f"train.ema_decay must be in [0, 1), got {self.ema_decay}"
        )
        require(self.precision in ("auto", "fp32", "bf16"), "train.precision: auto, fp32 or bf16")
        require(self.peak_tflops >= 0, f"train.peak_tflops must be >= 0, got {self.peak_tflops}")
        require(self.dist_timeout > 0, f"train.dist_timeout must be > 0, got {self.dist_timeout}")
        require(self.stop_timeout >= 0, f"train.stop_timeout must be >= 0, got {self.stop_timeout}")
        require(
            self.activation_checkpointing in ("none", "blocks"),
            "train.activation_checkpointing must be 'none' or 'blocks', got "
            f"{self.activation_checkpointing!r}",
        )
        require(self.parallel in ("ddp", "fsdp2"), "train.parallel must be 'ddp' or 'fsdp2'")
        require(
            self.residual_dtype in ("fp32", "bf16"),
            f"train.residual_dtype must be 'fp32' or 'bf16', got {self.residual_dtype!r}",
        )
        require(
            self.compile in COMPILE_MODES,
            f"train.compile must be 'none', 'blocks' or 'step', got {self.compile!r}",
        )
        require(
            not (self.compile == "step" and self.parallel == "fsdp2"),
            "train.compile=step compiles one process's whole step and does not apply with "
            "train.parallel=fsdp2; use train.compile=blocks",
        )
        require(
            self.procedure in ("efficient", "reference"), "train.procedure: efficient or reference"
        )
        require(self.device in ("auto", "cpu", "cuda"), "train.device must be auto, cpu or cuda")
        for name in ("log_every", "save_every", "keep_last"):
            require(getattr(self, name) > 0, f"train.{name} must be positive")
        require(self.sample_every >= 0 and self.num_samples >= 0, "train.sample_* must be >= 0")
        require(self.eval_every >= 0, f"train.eval_every must be >= 0, got {self.eval_every}")
        require(self.eval_rows > 0, f"train.eval_rows must be positive, got {self.eval_rows}")
