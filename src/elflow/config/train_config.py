"""The full configuration of a training run and its overrides (ELF_SPEC §3, §4).

:class:`RunConfig` nests one frozen dataclass per concern (model, objective, sampler, data, optim,
train, encoder); the named starting points are in :mod:`elflow.config.run_presets`. ``--config FILE``
and ``--set a.b=value`` go through :func:`apply_overrides`: unknown keys and wrong types are
one-line errors. The network's E and V always come from the encoder and tokenizer.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from elflow.config.data_config import DataConfig
from elflow.config.model_config import T5_SMALL, ModelConfig, elf_b
from elflow.config.objective_config import ObjectiveConfig
from elflow.config.sampler_config import SamplerConfig, check_guidance, check_task
from elflow.config.serialise import coerce_field, from_dict, to_dict
from elflow.errors import ELFError, first_line, note_once, require
from elflow.train.optim import OptimConfig


@dataclass(frozen=True)
class EncoderConfig:
    """The frozen encoder and its latent normalisation (ELF_SPEC §1, §10)."""

    name: str = T5_SMALL
    """Hub id, local folder, or the offline alias 'minilm'."""
    tokenizer: str = ""
    """Tokenizer id or folder; empty = the encoder's own."""
    latent_mean: float = 0.0
    """Latents are (h - latent_mean) / latent_std."""
    latent_std: float = 0.2
    """0.2 for T5-small (the paper's); 0 = measure it on the training data at start-up."""
    layer: int = 0
    """0 = the encoder's output (the paper's); k = its block k's output (docs/differences.md)."""
    precision: str = "auto"
    """The frozen encoder's compute dtype in training: auto (bf16 on CUDA, fp32 elsewhere),
    bf16 or fp32 (the latents' last bits; a latent cache built in one is not reused by the
    other)."""

    def __post_init__(self) -> None:
        if self.precision not in ("auto", "bf16", "fp32"):
            raise ELFError(f"encoder.precision must be auto, bf16 or fp32, got {self.precision!r}")
        if self.latent_std < 0:
            raise ELFError(f"encoder.latent_std must be >= 0 (0 = measure), got {self.latent_std}")
        if self.layer < 0:
            raise ELFError(f"encoder.layer must be >= 0 (0 = the output), got {self.layer}")
        if self.layer and self.latent_std == 0.2:
            raise ELFError(
                f"encoder.layer={self.layer} with latent_std 0.2 (T5's output's): set "
                "encoder.latent_std=0 to measure it for that layer, or give its value"
            )

    @property
    def tokenizer_name(self) -> str:
        return self.tokenizer or self.name


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


@dataclass(frozen=True)
class RunConfig:
    """Everything a training run needs; written as ``config.json`` next to every checkpoint."""

    model: ModelConfig = field(default_factory=elf_b)
    objective: ObjectiveConfig = field(default_factory=ObjectiveConfig)
    sampler: SamplerConfig = field(default_factory=SamplerConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    encoder: EncoderConfig = field(default_factory=EncoderConfig)
    task: str = "unconditional"
    """'unconditional' or 'conditional'."""
    max_input_length: int = 0
    """Conditional tasks: source tokens kept; the target gets max_length - max_input_length."""
    preset: str = ""
    """The preset this config started from (informational)."""

    def __post_init__(self) -> None:
        check_task(self.task, self.max_input_length, self.model.max_length)


SECTIONS: dict[str, type] = {
    "model": ModelConfig,
    "objective": ObjectiveConfig,
    "sampler": SamplerConfig,
    "data": DataConfig,
    "optim": OptimConfig,
    "train": TrainConfig,
    "encoder": EncoderConfig,
}
_SCALARS = ("task", "max_input_length", "preset")


def run_config_to_dict(cfg: RunConfig) -> dict[str, Any]:
    return to_dict(cfg)


def run_config_from_dict(data: dict[str, Any]) -> RunConfig:
    """Build a RunConfig from nested dicts; unknown sections/keys and wrong types are errors."""
    if not isinstance(data, dict):
        raise ELFError(f"a run config must be a mapping, got {type(data).__name__}")
    unknown = sorted(set(data) - set(SECTIONS) - set(_SCALARS))
    if unknown:
        raise ELFError(
            f"unknown config key(s) {unknown}; valid: {sorted(SECTIONS) + list(_SCALARS)}"
        )
    train = data.get("train", {})
    if isinstance(train, dict):
        # Configs before 'none' | 'blocks' (| 'step') said false | true.
        old = {k: v for k, v in train.items() if k in ("activation_checkpointing", "compile")}
        flags = {k: "blocks" if v else "none" for k, v in old.items() if isinstance(v, bool)}
        if flags:
            data = {**data, "train": {**train, **flags}}
    kwargs: dict[str, Any] = {
        name: from_dict(cls, data.get(name, {}), name) for name, cls in SECTIONS.items()
    }
    for key in _SCALARS:
        if key in data:
            kwargs[key] = coerce_field(RunConfig, key, data[key], key)
    return RunConfig(**kwargs)


def parse_value(text: str) -> Any:
    """Parse a ``key=value`` setting's value: JSON (numbers, true/false, null, lists) or else a
    bare string."""
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def apply_overrides(
    cfg: RunConfig, file: str | Path | None = None, sets: list[str] | tuple[str, ...] = ()
) -> RunConfig:
    """Apply a YAML/JSON config file, then ``key.path=value`` settings, to ``cfg``."""
    data = run_config_to_dict(cfg)
    if file:
        _merge(data, _read_config_file(Path(file)), str(file))
    for item in sets:
        if "=" not in item:
            raise ELFError(f"sets= expects key.path=value, got {item!r}")
        key, value = item.split("=", 1)
        parts = key.strip().split(".")
        node = data
        for i, part in enumerate(parts[:-1]):
            if not isinstance(node.get(part), dict):
                raise ELFError(f"unknown config key {'.'.join(parts[: i + 1])!r} in {item!r}")
            node = node[part]
        if parts[-1] not in node:
            raise ELFError(f"unknown config key {key!r}; valid keys there: {sorted(node)}")
        if isinstance(node[parts[-1]], dict):
            raise ELFError(
                f"{key.strip()}=... names a whole section; set its keys one at a time, "
                f"e.g. {key.strip()}.{sorted(node[parts[-1]])[0]}=VALUE"
            )
        node[parts[-1]] = parse_value(value)
    return check_user_config(run_config_from_dict(data), cfg)


def _unprojectable(cfg: RunConfig) -> str | None:
    """Why projected sampling cannot run on this run's rows (it re-encodes one text per row)."""
    if cfg.task == "conditional":
        return "a conditional task"
    return "data.packing" if cfg.data.packing else None


def check_projection(cfg: RunConfig) -> None:
    """Projected sampling (``sampler.project_from < 1``) only on rows of one unconditional text."""
    why = _unprojectable(cfg)
    if cfg.sampler.project_from < 1.0 and why:
        raise ELFError(
            f"sampler.project_from={cfg.sampler.project_from} (projected sampling) re-encodes "
            f"one text per row and does not apply with {why}; set sampler.project_from=1"
        )


def check_user_config(cfg: RunConfig, base: RunConfig) -> RunConfig:
    """Settings that would be silently ignored, refused: those only a conditional task uses on an
    unconditional one, two warm-up lengths, and schedule settings the schedule does not use
    (those changed from ``base``, the config overridden: a preset's own decay_steps is harmless
    when the user picks another schedule). Checked on what a user asks for, not in
    :class:`RunConfig` itself, so that runs saved before the check still resume (their values
    were ignored)."""
    why = _unprojectable(cfg)
    project_from = cfg.sampler.project_from
    if project_from < 1.0 and why and project_from == base.sampler.project_from:
        # The preset's projection (bible-tiny's), not the user's: off for rows it cannot handle.
        note_once(
            f"elflow: note: the preset samples with projection (sampler.project_from "
            f"{project_from}), which does not apply with {why}: it is off for this run"
        )
        cfg = replace(cfg, sampler=replace(cfg.sampler, project_from=1.0))
    check_projection(cfg)
    check_guidance(cfg.task, cfg.sampler)
    if cfg.task == "conditional" and cfg.objective.span_cond_prob > 0:
        raise ELFError(
            "objective.span_cond_prob trains unconditional models to infill; a conditional task "
            "keeps its source as the condition: leave it at 0"
        )
    if cfg.task == "unconditional" and cfg.max_input_length:
        raise ELFError(
            f"max_input_length {cfg.max_input_length} applies to conditional tasks only "
            "(the source's share of each row); leave it at 0, or set task=conditional for "
            "source/target data"
        )
    if (
        cfg.train.eval_every
        and base.data.valid_path
        and cfg.data.path != base.data.path
        and cfg.data.valid_path == base.data.valid_path
    ):
        note_once(
            f"elflow: note: data.path is yours but data.valid_path is still the preset's "
            f"({cfg.data.valid_path}): the held-out 'valid' loss is measured on it; set "
            "data.valid_path to your validation data (empty: none)"
        )
    if cfg.train.epochs != base.train.epochs and cfg.train.max_steps > 0:
        raise ELFError(
            f"train.epochs={cfg.train.epochs} applies when train.max_steps=0 (it is "
            f"{cfg.train.max_steps}); drop it, or set train.max_steps=0 to train by epochs"
        )
    o = cfg.optim
    if cfg.train.warmup_epochs > 0 and o.warmup_steps > 0:
        raise ELFError(
            f"train.warmup_epochs={cfg.train.warmup_epochs} and optim.warmup_steps="
            f"{o.warmup_steps} both set the warm-up; set the other one to 0"
        )
    was = base.optim
    if o.decay_steps != was.decay_steps and o.decay_steps and o.schedule != "wsd":
        raise ELFError(
            f"optim.decay_steps={o.decay_steps} applies to optim.schedule=wsd only (it is "
            f"{o.schedule}); set the schedule or leave decay_steps at 0"
        )
    if o.min_lr_ratio != was.min_lr_ratio and o.min_lr_ratio and o.schedule == "constant":
        raise ELFError(
            f"optim.min_lr_ratio={o.min_lr_ratio} applies to the cosine and wsd schedules only; "
            "set optim.schedule or leave min_lr_ratio at 0"
        )
    return cfg


def override_keys(
    file: str | Path | None = None, sets: list[str] | tuple[str, ...] = ()
) -> set[str]:
    """The dotted keys a config file and ``key.path=value`` settings name (call after
    :func:`apply_overrides` has validated them)."""
    keys: set[str] = set()

    def walk(node: dict[str, Any], prefix: str) -> None:
        for key, value in node.items():
            if isinstance(value, dict):
                walk(value, prefix + key + ".")
            else:
                keys.add(prefix + key)

    if file:
        walk(_read_config_file(Path(file)), "")
    keys.update(item.split("=", 1)[0].strip() for item in sets)
    return keys


def _read_config_file(path: Path) -> dict[str, Any]:
    if path.is_dir():
        raise ELFError(f"config file {path} is a folder; give a YAML or JSON file")
    if not path.is_file():
        raise ELFError(f"config file {path} does not exist")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        where = f"{e.reason} at byte {e.start}"
        raise ELFError(f"config file {path} is not UTF-8 text ({where})") from None
    if path.suffix == ".json":
        try:
            loaded = json.loads(text)
        except json.JSONDecodeError as e:
            raise ELFError(f"{path}: invalid JSON ({e})") from None
    else:
        try:
            import yaml
        except ImportError:
            raise ELFError("YAML config files need PyYAML: pip install pyyaml") from None
        try:
            loaded = yaml.safe_load(text)
        except yaml.YAMLError as e:
            raise ELFError(f"{path}: invalid YAML ({first_line(e)})") from None
    if not isinstance(loaded, dict):
        raise ELFError(f"{path} must hold a mapping of config sections")
    return loaded


def _merge(base: dict[str, Any], update: dict[str, Any], where: str, prefix: str = "") -> None:
    for key, value in update.items():
        if key not in base:
            raise ELFError(f"unknown config key {prefix + key!r} in {where}")
        if isinstance(base[key], dict):
            if not isinstance(value, dict):
                raise ELFError(f"config key {prefix + key!r} in {where} must be a mapping")
            _merge(base[key], value, where, prefix + key + ".")
        else:
            base[key] = value
