"""elflow and the authors' PyTorch port side by side on one GPU: training, sampling, serving.

Usage (one prepared command for a lent H100/H200, about 6-8 minutes; then a CPU dry run):

    cp -r ../shared/reference/elf_pytorch .sbs/          # once, here: ../shared does not travel
    python benchmarks/gpu_sbs.py --prepare-wheels        # once, here: serve's wheels -> .sbs/whl
    # on the GPU machine (carry: [".sbs"]):
    pip install -q --no-index --no-deps --target /tmp/site .sbs/whl/*.whl && \
    PYTHONPATH=src:/tmp/site python3 benchmarks/gpu_sbs.py --json sbs.json  # writes under $OUT
    python benchmarks/gpu_sbs.py --cpu-dry-run           # tiny shapes, same code, on a CPU

The authors' code (``--reference PATH``; default ``.sbs/elf_pytorch`` if present, else
``../shared/reference/elf_pytorch``) is imported from that path by this script alone and driven
directly: their ``ELF`` model class, their ``train_step`` with their Muon (a stand-in base class
when the ``muon`` package is absent: their subclass's ``step`` is theirs either way), their
sampler (``_generate_samples_single_batch`` and ``_dlm_decode_batch``), their config defaults
and ``train_owt_ELF-B.yml``. No data loader, wandb or download: one random T5-small-shaped
encoder (T5Config: d_model 512, 6 layers, 8 heads, d_ff 2048, vocab 32128; seed 0) serves both
sides, and the batches are the packed Bible rows elflow's own loader makes (packaged WordPiece
tokenizer), recorded and fed to their step in the same order. Their files are never edited.

Measured, each side as its users run it (``.sbs/`` must be in ``.git/info/exclude``):

- training ELF-B at L 1024, batch 32, the same lr (blr 1e-3 x B / 256, 5 warm-up steps) and
  Muon: elflow with ``train.compile`` ``blocks`` and ``step`` (skipped with a note where this elflow
  lacks it), the authors' step on ``torch.compile(model)`` (their train.py compiles on CUDA only);
  tokens/s over steps 9 to 20 (compilation is over), peak memory
  (``torch.cuda.max_memory_allocated``), model and executed FLOPs a step and MFU / HFU by
  docs/training.md "FLOPs and MFU" (peak from ``elflow.runtime.hardware.GPU_BF16_TFLOPS``: H100 SXM
  and H200 989 TFLOP/s dense bf16), and the first 20 losses side by side (same batches and
  hyperparameters; not the same initial weights). The dry run also counts one authors' step with
  :class:`elflow.runtime.profiling.OpCounter` against ``reference_step_flops``.
- sampling s/batch at B 1, 8, 64 x L 256, 1024: the 32-step SDE (gamma 1.5, w 3) with decode,
  bf16, random ELF-B weights; elflow eager and with CUDA graphs (``cuda_graphs=`` of
  ``elflow.sampling.denoiser.sample_model``; CUDA only), the authors' sampler (their bf16
  autocast is CUDA only: fp32 in the dry run).
- ``benchmarks/serve.py``'s load at 1, 16 and 64 clients against ``elflow serve`` on the GPU
  (the packaged demo model with projected sampling off: its encoder package is not on the
  GPU machine); needs fastapi and uvicorn (``--prepare-wheels`` fetches them).

It prints the device, torch, the commit, then one table with the ratios the targets use
(elflow/authors tokens/s, sampling speed-up at B 8, serve 16 clients / 1 client); ``--json``
writes the figures under ``--out`` (default ``$OUT``, else ``gpu_sbs_out``; the encoder, runs
and served model go to ``--work``, a temporary folder by default). A section that fails, or a
non-finite loss, is reported in the table and the exit code is 1. The dry run compiles with the
``aot_eager`` backend (dynamo and AOTAutograd as on the GPU, without inductor's CPU code
generation; ``--compile-backend`` to change it) and samples 8 steps; it took 100 s of CPU time,
3 to 4 minutes' wall time on a 2-core machine shared with other jobs (load 8 to 10).
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import inspect
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
import types
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
REFERENCE_PATHS = (ROOT / ".sbs" / "elf_pytorch", ROOT.parent / "shared/reference/elf_pytorch")
SERVE_WHEELS = (
    "fastapi==0.115.12",
    "starlette==0.46.2",
    "uvicorn==0.34.2",
    "pydantic==2.11.4",
    "pydantic-core==2.33.2",
    "annotated-types==0.7.0",
    "typing-inspection==0.4.0",
)
"""What ``elflow serve`` needs beyond the GPU image (``--prepare-wheels``; Python 3.12)."""


@dataclass(frozen=True)
class Shapes:
    """Everything the dry run shrinks; the code paths are the same."""

    depth: int = 12
    hidden: int = 768
    heads: int = 12
    encoder: dict = field(
        default_factory=lambda: (
            {"d_model": 512, "d_kv": 64, "d_ff": 2048, "num_layers": 6}
            | {"num_heads": 8, "vocab_size": 32128}
        )
    )
    train_length: int = 1024
    data_rows: int = 0  # Bible verses read (0: all)
    batch: int = 32
    steps: int = 20
    warmup: int = 8
    sample_batches: tuple[int, ...] = (1, 8, 64)
    sample_lengths: tuple[int, ...] = (256, 1024)
    sample_steps: int = 32
    repeats: int = 3
    clients: tuple[int, ...] = (1, 16, 64)
    serve_seconds: float = 10.0
    serve_steps: int | None = None


FULL = Shapes()
DRY = Shapes(
    depth=2,
    hidden=64,
    heads=4,
    encoder={"d_model": 32, "d_kv": 8, "d_ff": 64, "num_layers": 2, "num_heads": 4}
    | {"vocab_size": 32128},
    train_length=32,
    data_rows=2000,
    batch=4,
    steps=8,
    warmup=2,
    sample_batches=(1, 8),
    sample_lengths=(16, 32),
    sample_steps=8,
    repeats=1,
    clients=(1, 4),
    serve_seconds=1.0,
    serve_steps=4,
)


# --- set-up -------------------------------------------------------------------------------------


def commit() -> str:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True
        )
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=ROOT,
            capture_output=True,
            text=True,
        )
        return out.stdout.strip() + (" (modified)" if dirty.stdout.strip() else "") or "unknown"
    except OSError:
        return "unknown (no git)"


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def reset_memory(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def peak_gb(device: torch.device) -> float | None:
    return torch.cuda.max_memory_allocated(device) / 1e9 if device.type == "cuda" else None


def build_encoder(root: Path, shapes: Shapes) -> Path:
    """The random T5-small-shaped encoder both sides use, saved for elflow's config."""
    from transformers import T5Config, T5EncoderModel

    torch.manual_seed(0)
    T5EncoderModel(T5Config(**shapes.encoder)).save_pretrained(root / "encoder")
    return root / "encoder"


def elflow_config(shapes: Shapes, encoder: Path, mode: str, device: torch.device):
    """owt-b (the paper's ELF-B recipe) on the packed Bible rows, one micro-batch a step."""
    import elflow
    from elflow.config.run_presets import preset
    from elflow.config.train_config import apply_overrides
    from elflow.examples import web_bible

    tokenizer = Path(elflow.__file__).resolve().parent / "demo_model" / "tokenizer"
    sets = [
        f"model.max_length={shapes.train_length}",
        f"model.depth={shapes.depth}",
        f"model.hidden_size={shapes.hidden}",
        f"model.num_heads={shapes.heads}",
        f"encoder.name={encoder}",
        f"encoder.tokenizer={tokenizer}",
        "encoder.latent_std=0.2",
        f"data.path={web_bible('train')}",
        "data.valid_path=",
        "data.format=jsonl",
        "data.packing=true",
        "data.latent_cache=false",
        f"data.max_rows={shapes.data_rows}",
        f"train.global_batch={shapes.batch}",
        f"train.micro_batch={shapes.batch}",
        f"train.max_steps={shapes.steps + 1000}",  # never the last step: no final checkpoint
        "train.save_every=1000000",
        "train.log_every=1000000",
        "train.tensorboard=false",
        "train.sample_every=0",
        "train.eval_every=0",
        "train.warmup_epochs=0",
        "optim.warmup_steps=5",
        f"train.device={device.type}",
        f"train.compile={mode}",
    ]
    return apply_overrides(preset("owt-b"), sets=sets)


# --- elflow's training ---------------------------------------------------------------------------


def elflow_train(shapes: Shapes, encoder: Path, mode: str, device: torch.device, out: Path):
    """``shapes.steps`` optimizer steps through elflow's Trainer; the batches it trained on."""
    from elflow.train.flops import encoder_flops_per_token, executed_row_flops, model_row_flops
    from elflow.train.loop import Trainer
    from elflow.train.optim import peak_lr
    from elflow.train.setup import prepare_run
    from elflow.train.step import ELFObjective

    cfg = elflow_config(shapes, encoder, mode, device)
    shutil.rmtree(out / f"elflow-{mode}", ignore_errors=True)
    run = prepare_run(cfg, out / f"elflow-{mode}", "never")
    trainer = Trainer(run, ELFObjective(run.cfg))
    batches, losses = [], []
    get, accumulate = trainer.grads.loader.get, trainer.grads.accumulate

    def recorded_get(step):
        host = get(step)
        batches.append(torch.cat([b.input_ids for b in host]).clone())
        return host

    def recorded_accumulate(step):
        metrics = accumulate(step)
        losses.append(metrics.loss.detach())  # read after the timed steps: no syncs
        return metrics

    trainer.grads.loader.get, trainer.grads.accumulate = recorded_get, recorded_accumulate
    reset_memory(device)
    try:
        for k in range(shapes.steps):
            if k == shapes.warmup:
                sync(device)
                start = time.perf_counter()
            trainer.step(k)
        sync(device)
        seconds = (time.perf_counter() - start) / (shapes.steps - shapes.warmup)
    finally:
        trainer.close()
    m, L, B = run.cfg.model, shapes.train_length, shapes.batch
    per_token = encoder_flops_per_token(run.encoder.model.config, L)
    model = B * model_row_flops(m, run.cfg.objective, L, per_token)
    executed = B * executed_row_flops(
        m,
        run.cfg.objective,
        L,
        per_token,
        procedure=run.cfg.train.procedure,
        checkpointing=run.cfg.train.activation_checkpointing == "blocks",
        micro_batch=B,
        min_branch_rows=2 if mode == "step" else 0,
    )
    result = {
        "name": f"elflow {mode}",
        "step_s": seconds,
        "tokens_per_s": B * L / seconds,
        "peak_gb": peak_gb(device),
        "model_flops": model,
        "executed_flops": executed,
        "losses": [float(x) for x in losses],
    }
    facts = {
        "model": m,
        "objective": run.cfg.objective,
        "lr": peak_lr(run.optim, B),
        "encoder_per_token": per_token,
        "batches": batches,
    }
    del trainer, run
    return result, facts


# --- the authors' code ---------------------------------------------------------------------------


class Authors:
    """The authors' port imported from ``path/src`` (their modules are top-level names)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        src = str(path / "src")
        if src not in sys.path:
            sys.path.insert(0, src)
        self.notes: list[str] = []
        try:
            import muon  # noqa: F401
        except ImportError:
            sys.modules["muon"] = muon_stand_in()
            self.notes.append(
                "the muon package is absent: their Muon subclass runs on a stand-in base class "
                "(its step() is their code)"
            )
        import train_step
        from configs import config as configs
        from modules import model, t5_encoder
        from utils import encoder_utils, generation_utils, sampling_utils, train_utils

        self.train_step, self.configs, self.model = train_step, configs, model
        self.t5, self.encoder_utils, self.train_utils = t5_encoder, encoder_utils, train_utils
        self.generation, self.sampling = generation_utils, sampling_utils

    def config(self, length: int, batch: int, lr: float):
        """Their Config with train_owt_ELF-B.yml's values (its sampling path left out)."""
        import yaml

        config = self.configs.Config()
        yml = self.path / "src/configs/training_configs/train_owt_ELF-B.yml"
        for key, value in (yaml.safe_load(yml.read_text()) or {}).items():
            if hasattr(config, key) and key != "sampling_configs_path":
                setattr(config, key, value)
        overrides = {"max_length": length, "global_batch_size": batch, "batch_size": batch}
        overrides |= {"lr": lr, "warmup_steps": 5, "use_wandb": False, "online_eval": False}
        for key, value in overrides.items():
            setattr(config, key, value)
        return config

    def network(self, shapes: Shapes, length: int, vocab: int, device: torch.device, seed: int):
        """Their ELF at ``shapes`` (bottleneck 128, their prefix tokens), seeded."""
        config = self.configs.Config()
        torch.manual_seed(seed)
        net = self.model.ELF(
            text_encoder_dim=shapes.encoder["d_model"],
            max_length=length,
            hidden_size=shapes.hidden,
            depth=shapes.depth,
            num_heads=shapes.heads,
            bottleneck_dim=config.bottleneck_dim,
            num_time_tokens=config.num_time_tokens,
            num_self_cond_cfg_tokens=config.num_self_cond_cfg_tokens,
            num_model_mode_tokens=config.num_model_mode_tokens,
            vocab_size=vocab,
        )
        return net.to(device)

    def encoder(self, folder: Path, device: torch.device):
        """Their T5 wrapper around the shared random encoder (their from_pretrained downloads)."""
        from transformers import T5EncoderModel

        enc = self.t5.T5Encoder.__new__(self.t5.T5Encoder)
        torch.nn.Module.__init__(enc)
        enc.model = T5EncoderModel.from_pretrained(str(folder))
        enc = enc.to(device).eval()
        for p in enc.parameters():
            p.requires_grad_(False)
        return enc

    def batch(self, ids: torch.Tensor, config, generator) -> dict:
        """Their collate's masks for full rows without a condition, then their prepare_batch."""
        B, L = ids.shape
        is_valid = np.ones((B, L), bool)
        masks = self.encoder_utils.build_self_attn_cond_masks(~is_valid, is_valid)
        keys = ("encoder_attention_mask", "attention_mask", "cond_seq_mask")
        batch = {"input_ids": ids.numpy()} | dict(zip(keys, masks, strict=True))
        from utils.data_utils import prepare_batch

        return prepare_batch(batch, config, generator=generator)


def muon_stand_in() -> types.ModuleType:
    """What their ``muon_with_aux_adam`` takes from the ``muon`` package when it is absent: the
    base classes' constructor (their subclass replaces ``step``) and two functions they patch."""
    module = types.ModuleType("muon")

    class SingleDeviceMuonWithAuxAdam(torch.optim.Optimizer):
        def __init__(self, param_groups):
            super().__init__(param_groups, {})

    module.SingleDeviceMuonWithAuxAdam = module.MuonWithAuxAdam = SingleDeviceMuonWithAuxAdam
    module.adam_update = module.zeropower_via_newtonschulz5 = None  # both patched by them
    return module


def authors_train(authors: Authors, shapes: Shapes, encoder: Path, facts, device, counted: bool):
    """Their train_step on elflow's recorded batches, their model compiled on CUDA."""
    from elflow.train.flops import model_row_flops, reference_step_flops

    L, B = shapes.train_length, shapes.batch
    config = authors.config(L, B, facts["lr"])
    tu = authors.train_utils
    if device.type == "cuda":  # what their train.py sets
        torch.set_float32_matmul_precision("high")
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
    model = authors.network(shapes, L, facts["model"].vocab_size, device, seed=config.seed)
    optimizer = tu.get_optimizer(model, config, lr=config.lr)
    schedule = tu.create_learning_rate_fn(
        num_train_steps=shapes.steps, num_warmup_steps=5, learning_rate=config.lr
    )
    generator = torch.Generator().manual_seed(config.seed)
    state = tu.TrainState(
        model=model,
        optimizer=optimizer,
        lr_scheduler=tu.attach_lr_scheduler(optimizer, schedule),
        ema_params1=tu.TrainState.init_ema(model),
        dropout_generator=generator,
    )
    if device.type == "cuda":
        state = state.replace(model=torch.compile(state.model))
    enc = authors.encoder(encoder, device)
    reset_memory(device)
    losses = []
    for k, ids in enumerate(facts["batches"]):
        if k == shapes.warmup:
            sync(device)
            start = time.perf_counter()
        batch = authors.batch(ids, config, generator)
        state, metrics = authors.train_step.train_step(state, enc, batch, config)
        losses.append(metrics["loss"])
    sync(device)
    seconds = (time.perf_counter() - start) / (len(facts["batches"]) - shapes.warmup)
    per_token = facts["encoder_per_token"]
    result = {
        "name": "authors",
        "step_s": seconds,
        "tokens_per_s": B * L / seconds,
        "peak_gb": peak_gb(device),
        "model_flops": B * model_row_flops(facts["model"], facts["objective"], L, per_token),
        "executed_flops": B * reference_step_flops(facts["model"], L, per_token),
        "losses": [float(x) for x in losses],
    }
    if counted:  # one more step without their optimizer (its Newton-Schulz is not the step's)
        from elflow.runtime.profiling import OpCounter

        idle = types.SimpleNamespace(step=lambda: None, zero_grad=lambda set_to_none=True: None)
        idle.param_groups = optimizer.param_groups
        ids = facts["batches"][0]
        with OpCounter() as counter:
            authors.train_step.train_step(
                state.replace(optimizer=idle, lr_scheduler=None),
                enc,
                authors.batch(ids, config, generator),
                config,
            )
        result["counted_flops"] = float(sum(counter.counts.flops.values()))
    return result


# --- sampling ------------------------------------------------------------------------------------


def time_batches(fn, repeats: int, device: torch.device) -> float:
    """Median seconds of ``fn()`` over ``repeats`` calls after one warm-up call."""
    fn()
    times = []
    for _ in range(repeats):
        sync(device)
        start = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def elflow_sample(model, B: int, L: int, sampler, device, kw: dict) -> None:
    """One batch of elflow's sampler with decode, bf16 autocast (cached bf16 weights)."""
    from elflow.sampling import sample_generators
    from elflow.sampling.denoiser import sample_model

    gens = sample_generators(0, range(B), device)
    with torch.autocast(device.type, dtype=torch.bfloat16), torch.no_grad():
        sample_model(model, gens, L, sampler, **kw)


def authors_sample(authors: Authors, net, config, sampler, B: int, L: int, steps: int, device):
    """One batch of the authors' unconditional generation (test_generation_uncond's calls)."""
    g = torch.Generator().manual_seed(0)
    t_steps = authors.sampling.get_sampling_steps(
        n_steps=steps,
        time_schedule="logit_normal",
        P_mean=config.denoiser_p_mean,
        P_std=config.denoiser_p_std,
        device=device,
    )
    z = torch.randn((B, L, net.text_encoder_dim), device=device) * config.denoiser_noise_scale
    latent = authors.generation._generate_samples_single_batch(
        model=net,
        generator=g,
        z=z,
        t_steps=t_steps,
        cond_seq=None,
        cond_seq_mask=None,
        config=config,
        sampling_config=sampler,
        cfg_scale=1,
        self_cond_cfg_scale=3.0,
    )
    authors.generation._dlm_decode_batch(latent, net, t_steps[-1].item(), config, 3.0)


def sampling(shapes: Shapes, authors: Authors | None, vocab: int, device, notes) -> list[dict]:
    """s/batch of the 32-step SDE with decode, bf16, at each (B, L)."""
    from elflow.config import SamplerConfig, model_preset
    from elflow.model import build_model
    from elflow.sampling.denoiser import sample_model

    sampler = SamplerConfig(steps=shapes.sample_steps, sampler="sde", gamma=1.5, w=3.0)
    graphs = "cuda_graphs" in inspect.signature(sample_model).parameters
    if not graphs:
        notes.append("elflow CUDA graphs: skipped, sample_model has no cuda_graphs= here")
    elif device.type != "cuda":
        notes.append("elflow CUDA graphs: skipped, they need a CUDA device")
    eager = {"cuda_graphs": False} if graphs else {}
    rows = []
    for L in shapes.sample_lengths:
        torch.manual_seed(0)
        m = model_preset(
            "elf-b",
            encoder_dim=shapes.encoder["d_model"],
            vocab_size=vocab,
            max_length=L,
            depth=shapes.depth,
            hidden_size=shapes.hidden,
            num_heads=shapes.heads,
        )
        model = build_model(m, device).eval()
        with torch.no_grad():  # a zero-initialised flow head would make every step trivial
            torch.nn.init.normal_(model.final_layer.linear.weight, std=0.02)
        theirs = None
        if authors is not None:
            theirs = authors.network(shapes, L, vocab, device, seed=0).eval()
            config = authors.config(L, 1, 0.0)
            their_sampler = authors.configs.SamplingConfig(
                sampling_method="sde",
                num_sampling_steps=[shapes.sample_steps],
                sde_gamma=1.5,
                self_cond_cfg_scales=[3.0],
                time_schedule="logit_normal",
            )
        for B in shapes.sample_batches:
            row = {"batch": B, "length": L}
            ours = partial(elflow_sample, model, B, L, sampler, device)
            row["elflow eager"] = time_batches(partial(ours, eager), shapes.repeats, device)
            if graphs and device.type == "cuda":
                graphed = partial(ours, {"cuda_graphs": True})
                row["elflow graphs"] = time_batches(graphed, shapes.repeats, device)
            if theirs is not None:
                fn = partial(
                    authors_sample,
                    authors,
                    theirs,
                    config,
                    their_sampler,
                    B,
                    L,
                    shapes.sample_steps,
                    device,
                )
                row["authors"] = time_batches(fn, shapes.repeats, device)
            rows.append(row)
            print(f"  sampling B {B} L {L}: {row}", flush=True)
        del model, theirs
        reset_memory(device)
    if authors is not None and device.type != "cuda":
        notes.append("authors' sampling: fp32 (their bf16 autocast is CUDA only)")
    return rows


# --- serving -------------------------------------------------------------------------------------


def serving(shapes: Shapes, out: Path, notes: list[str]) -> list[dict]:
    """benchmarks/serve.py's load at each client count against ``elflow serve`` here."""
    missing = [m for m in ("fastapi", "uvicorn", "httpx") if importlib.util.find_spec(m) is None]
    if missing:
        notes.append(
            f"serve: skipped, {', '.join(missing)} missing (python benchmarks/gpu_sbs.py "
            "--prepare-wheels here, then carry .sbs and install them there)"
        )
        return []
    import elflow

    spec = importlib.util.spec_from_file_location("sbs_serve", ROOT / "benchmarks" / "serve.py")
    serve = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(serve)
    model = out / "serve-model"
    shutil.rmtree(model, ignore_errors=True)
    shutil.copytree(Path(elflow.__file__).resolve().parent / "demo_model", model)
    config = json.loads((model / "config.json").read_text())
    config["sampler"]["project_from"] = 1.0  # projection needs the encoder package
    (model / "config.json").write_text(json.dumps(config, indent=1))
    args = argparse.Namespace(model=str(model), max_queue=128, max_batch=64)
    os.environ["PYTHONPATH"] = os.pathsep.join(
        [str(ROOT / "src"), *filter(None, [os.environ.get("PYTHONPATH")])]
    )
    port = serve.free_port()
    proc = serve.start_server(args, port)
    base = f"http://127.0.0.1:{port}"
    body = {"prompt": "", "n": 1} | ({"steps": shapes.serve_steps} if shapes.serve_steps else {})
    try:
        serve.load(base, 1, 0.0, body, 600.0)  # first-call costs out of the way
        rows = [serve.load(base, c, shapes.serve_seconds, body, 600.0) for c in shapes.clients]
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    for r in rows:
        print(f"  serve {r['clients']} clients: {r['samples_per_s']:.2f} samples/s", flush=True)
    return rows


# --- the table -----------------------------------------------------------------------------------


def fmt(x, spec: str = ",.0f") -> str:
    return "-" if x is None else format(x, spec)


def table(report: dict) -> list[str]:
    """The one table: training, losses, sampling, serving, the targets' ratios, the notes."""
    lines = []
    train = report["train"]
    peak = report["peak_flops"]
    if train:
        names = [r["name"] for r in train]
        w = max(14, *map(len, names))
        lines.append(
            f"== training: L {report['length']}, batch {report['batch']}, steps "
            f"{report['warmup']}..{report['steps']} timed"
        )
        lines.append(f"{'measure':<22}" + "".join(f"{n:>{w + 2}}" for n in names))

        def row(label, values):
            lines.append(f"{label:<22}" + "".join(f"{v:>{w + 2}}" for v in values))

        row("tokens/s", [fmt(r["tokens_per_s"]) for r in train])
        row("s/step", [fmt(r["step_s"], ".3f") for r in train])
        row("peak memory GB", [fmt(r["peak_gb"], ".1f") for r in train])
        row("model TFLOP/step", [fmt(r["model_flops"] / 1e12, ".3f") for r in train])
        row("executed TFLOP/step", [fmt(r["executed_flops"] / 1e12, ".3f") for r in train])
        if any("counted_flops" in r for r in train):
            row(
                "counted/formula",
                [
                    fmt(
                        r["counted_flops"] / r["executed_flops"] if "counted_flops" in r else None,
                        ".4f",
                    )
                    for r in train
                ],
            )
        for key, what in (("model_flops", "MFU"), ("executed_flops", "HFU")):
            values = [r[key] / r["step_s"] / peak if peak else None for r in train]
            row(what, [fmt(v and 100 * v, ".1f") + ("%" if v else "") for v in values])
        for k in range(max(len(r["losses"]) for r in train)):
            row(f"loss step {k + 1}", [fmt(at(r["losses"], k), ".4f") for r in train])
    if report["sample"]:
        kinds = sorted(
            {k for r in report["sample"] for k in r} - {"batch", "length"}, key=ORDER.index
        )
        lines.append(f"== sampling s/batch: {report['sample_steps']}-step SDE with decode, bf16")
        lines.append(f"{'B x L':<22}" + "".join(f"{k:>16}" for k in kinds) + f"{'speed-up':>10}")
        for r in report["sample"]:
            best = min(r[k] for k in kinds if k.startswith("elflow"))
            up = f"{r['authors'] / best:.2f}x" if "authors" in r else "-"
            label = f"{r['batch']} x {r['length']}"
            lines.append(
                f"{label:<22}" + "".join(f"{fmt(r.get(k), '.3f'):>16}" for k in kinds) + f"{up:>10}"
            )
    if report["serve"]:
        lines.append("== elflow serve (benchmarks/serve.py): samples/s, p50 s, 429s, failed, lost")
        for r in report["serve"]:
            lines.append(
                f"{str(r['clients']) + ' clients':<22}{r['samples_per_s']:>16.2f}"
                f"{r['p50_s']:>16.2f}{r['busy']:>8}{r['failed']:>8}{r['lost']:>8}"
            )
    lines.append("== targets' ratios")
    for k, v in report["ratios"].items():
        lines.append(f"{k:<62}{fmt(v, '.2f')}")
    for note in report["notes"]:
        lines.append(f"note: {note}")
    return lines


ORDER = ["elflow eager", "elflow graphs", "authors"]


def at(values: list, k: int):
    return values[k] if k < len(values) else None


def ratios(report: dict) -> dict[str, float | None]:
    train = {r["name"]: r for r in report["train"]}
    ours = [r["tokens_per_s"] for n, r in train.items() if n.startswith("elflow")]
    out = {
        "training tokens/s, best elflow / authors": (
            max(ours) / train["authors"]["tokens_per_s"] if ours and "authors" in train else None
        )
    }
    for r in report["sample"]:
        if r["batch"] == 8 and "authors" in r:
            best = min(v for k, v in r.items() if k.startswith("elflow"))
            out[f"sampling speed-up at B 8, L {r['length']} (authors s / elflow s)"] = (
                r["authors"] / best
            )
    serve = {r["clients"]: r["samples_per_s"] for r in report["serve"]}
    many = 16 if 16 in serve else max(serve, default=None)
    out[f"serve samples/s, {many} clients / 1 client"] = (
        serve[many] / serve[1] if many and serve.get(1) else None
    )
    return out


# --- main ----------------------------------------------------------------------------------------


def find_reference(given: str | None) -> Path | None:
    for path in [Path(given)] if given else REFERENCE_PATHS:
        if (path / "src" / "train_step.py").is_file():
            return path
    return None


def prepare_wheels() -> int:
    """Download serve's wheels for the GPU machine's Python 3.12 into .sbs/whl (needs PyPI)."""
    target = ROOT / ".sbs" / "whl"
    target.mkdir(parents=True, exist_ok=True)
    platforms = ["manylinux_2_17_x86_64", "manylinux2014_x86_64", "manylinux_2_28_x86_64"]
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:"]
    cmd += ["--python-version", "3.12", "--implementation", "cp", "-d", str(target)]
    for p in platforms:
        cmd += ["--platform", p]
    return subprocess.run(cmd + list(SERVE_WHEELS)).returncode


def section(name: str, report: dict, fn, *a):
    """Run one section; a failure is recorded (the table still prints) and fails the run."""
    t0 = time.perf_counter()
    try:
        return fn(*a)
    except Exception as e:  # a benchmark reports a failure and goes on
        traceback.print_exc()
        report["notes"].append(f"{name}: FAILED ({type(e).__name__}: {str(e).splitlines()[0]})")
        report["failed"] = True
        return None
    finally:
        report["seconds"][name] = round(time.perf_counter() - t0, 1)


def run(args: argparse.Namespace) -> dict:
    from elflow.config.train_loop_config import COMPILE_MODES
    from elflow.runtime.hardware import peak_tflops

    shapes = DRY if args.cpu_dry_run else FULL
    device = torch.device("cpu" if args.cpu_dry_run else "cuda")
    backend = args.compile_backend or ("aot_eager" if args.cpu_dry_run else "inductor")
    if backend != "inductor":  # every torch.compile of both sides, elflow's included
        torch.compile = partial(torch.compile, backend=backend)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    # The encoder, the runs and the served model (hundreds of MB) stay out of --out.
    work = Path(args.work or tempfile.mkdtemp(prefix="gpu_sbs-"))
    work.mkdir(parents=True, exist_ok=True)
    tflops = args.peak_tflops or peak_tflops(device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    print(f"device: {name}; torch {torch.__version__}; elflow commit {commit()}", flush=True)
    print(
        "peak: "
        + (f"{tflops:g} TFLOP/s dense bf16 (H100 SXM, H200: 989)" if tflops else "unknown (no MFU)")
    )
    print(f"torch.compile backend: {backend}", flush=True)
    report = {"device": name, "torch": torch.__version__, "commit": commit()}
    report["compile_backend"] = backend
    report |= {"dry_run": args.cpu_dry_run, "peak_flops": tflops * 1e12 if tflops else None}
    report |= {"length": shapes.train_length, "batch": shapes.batch, "steps": shapes.steps}
    report |= {"warmup": shapes.warmup, "sample_steps": shapes.sample_steps}
    report |= {"train": [], "sample": [], "serve": [], "notes": [], "seconds": {}}
    report["failed"] = False
    ref = find_reference(args.reference)
    authors = None
    if ref is None:
        where = args.reference or " or ".join(map(str, REFERENCE_PATHS))
        report["notes"].append(f"authors' side: skipped, no reference code at {where}")
    else:
        try:
            authors = Authors(ref)
        except ModuleNotFoundError as e:  # a package their code needs (einops, ...)
            report["notes"].append(
                f"authors' side: skipped, their code needs {e.name} (pip install {e.name})"
            )
        if authors is not None:
            report["notes"] += authors.notes
            report["reference"] = str(ref)
    encoder = build_encoder(work, shapes)
    facts = None
    if "train" in args.sections:
        for mode in args.modes:
            if mode not in COMPILE_MODES:
                report["notes"].append(f"elflow train.compile={mode}: skipped, not in this elflow")
                continue
            print(f"training: elflow, train.compile={mode}", flush=True)
            got = section(
                f"train elflow {mode}", report, elflow_train, shapes, encoder, mode, device, work
            )
            if got:
                report["train"].append(got[0])
                facts = facts or got[1]
        if authors is not None and facts is not None:
            print("training: the authors' step", flush=True)
            got = section(
                "train authors",
                report,
                authors_train,
                authors,
                shapes,
                encoder,
                facts,
                device,
                device.type == "cpu",
            )
            if got:
                report["train"].append(got)
    if "sample" in args.sections:
        vocab = facts["model"].vocab_size if facts else 30522
        got = section("sample", report, sampling, shapes, authors, vocab, device, report["notes"])
        report["sample"] = got or []
    if "serve" in args.sections:
        got = section("serve", report, serving, shapes, work, report["notes"])
        report["serve"] = got or []
    for r in report["train"]:
        bad = [k + 1 for k, x in enumerate(r["losses"]) if not np.isfinite(x)]
        if bad:
            report["notes"].append(f"{r['name']}: FAILED, non-finite loss from step {bad[0]}")
            report["failed"] = True
    report["ratios"] = ratios(report)
    if not args.work:
        shutil.rmtree(work, ignore_errors=True)
    return report


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cpu-dry-run", action="store_true", help="tiny shapes on the CPU, same code")
    p.add_argument("--reference", help="the authors' port (default: .sbs/elf_pytorch, ../shared)")
    p.add_argument("--out", default=os.environ.get("OUT") or "gpu_sbs_out", help="output folder")
    p.add_argument("--work", help="scratch folder for the encoder and runs (default: a temp one)")
    p.add_argument("--json", help="write the report to this file (under --out when relative)")
    p.add_argument("--modes", default="blocks,step", help="elflow's train.compile modes to time")
    p.add_argument("--sections", default="train,sample,serve", help="what to run")
    p.add_argument(
        "--compile-backend",
        help="torch.compile's backend for both sides (default: inductor; the dry run aot_eager)",
    )
    p.add_argument("--peak-tflops", type=float, default=0.0, help="override the device's peak")
    p.add_argument("--prepare-wheels", action="store_true", help="fetch serve's wheels and stop")
    args = p.parse_args(argv)
    if args.prepare_wheels:
        return prepare_wheels()
    args.modes = [m for m in args.modes.split(",") if m]
    args.sections = set(args.sections.split(","))
    if unknown := args.sections - {"train", "sample", "serve"}:
        p.error(f"--sections: unknown {sorted(unknown)}; choose from train, sample, serve")
    if not args.cpu_dry_run and not torch.cuda.is_available():
        p.error("no CUDA device here: run on a GPU, or pass --cpu-dry-run")
    report = run(args)
    lines = table(report)
    print("\n".join(lines), flush=True)
    if args.json:
        path = Path(args.json) if Path(args.json).is_absolute() else Path(args.out) / args.json
        path.write_text(json.dumps(report, indent=1, default=str))
        print(f"wrote {path}")
    return 1 if report["failed"] else 0


if __name__ == "__main__":
    raise SystemExit(main())
