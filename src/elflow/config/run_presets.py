"""Named starting points for a run: the paper's five and the CPU presets (ELF_SPEC §3, §4, §10).

The paper's (``owt-b/m/l``, ``de-en-b``, ``xsum-b``) carry the released settings: T5-small,
latent_std 0.2, batch 512, EMA 0.9999. The CPU presets (``bible-tiny``, ``de-en-tiny``,
``summ-tiny``) use the offline MiniLM encoder, a measured latent_std, a latent cache and an EMA
suited to a few thousand steps (docs/training.md, "Presets"); ``bible-tiny`` reads the
World English Bible shipped in :mod:`elflow.examples`, the other two need ``data.path`` and
``data.valid_path``. ``bible-demo`` is ``bible-tiny`` sized for a few minutes of one GPU
(docs/demo-gpu.md). :func:`short_run` scales any of them to a run of N steps (``elflow train
--steps N``). ``--config``/``--set`` then override any key
(:func:`elflow.config.train_config.apply_overrides`).
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from dataclasses import replace
from typing import Any

from elflow.config.data_config import DataConfig
from elflow.config.encoder_config import EncoderConfig
from elflow.config.model_config import T5_SMALL, ModelConfig, elf_b, elf_l, elf_m, elf_small
from elflow.config.objective_config import ObjectiveConfig
from elflow.config.optim_config import OptimConfig
from elflow.config.sampler_config import SamplerConfig
from elflow.config.train_config import RunConfig, TrainConfig
from elflow.errors import ELFError, require
from elflow.examples import web_bible


def _paper(model: ModelConfig, epochs: float, steps: int = 32, gamma: float = 1.5) -> RunConfig:
    """OpenWebText, T5-small, L 1024, batch 512, blr 1e-3 (lr 2e-3), warm-up half an epoch,
    ``epochs`` passes; raw documents packed into rows of exactly 1024 tokens (rows that are
    already 1024 tokens long stay one per row: :class:`elflow.data.rows.RowDataset`)."""
    return RunConfig(
        model=replace(model, max_length=1024),
        objective=ObjectiveConfig(),
        sampler=SamplerConfig(steps=steps, sampler="sde", gamma=gamma, w=3.0),
        data=DataConfig(packing=True),
        optim=OptimConfig(blr=1e-3),
        train=TrainConfig(global_batch=512, epochs=epochs, warmup_epochs=0.5, ema_decay=0.9999),
        encoder=EncoderConfig(name=T5_SMALL, latent_std=0.2),
    )


def owt_b() -> RunConfig:
    """ELF-B on OpenWebText, 5 epochs (paper: 32-step SDE gamma 1.5, w 3)."""
    return replace(_paper(elf_b(), epochs=5), preset="owt-b")


def owt_m() -> RunConfig:
    """ELF-M on OpenWebText, 4 epochs (64-step SDE gamma 1.0)."""
    return replace(_paper(elf_m(), epochs=4, steps=64, gamma=1.0), preset="owt-m")


def owt_l() -> RunConfig:
    """ELF-L on OpenWebText, 3 epochs (64-step SDE gamma 1.0); FSDP2 recommended."""
    return replace(_paper(elf_l(), epochs=3, steps=64, gamma=1.0), preset="owt-l")


def _seq2seq(max_input_length: int, max_length: int, name: str) -> RunConfig:
    """Translation/summarisation: pad with EOS, sigma_d 1, label drop 0.1, warm-up 5000 steps,
    100 epochs."""
    return RunConfig(
        model=elf_b(max_length=max_length),
        objective=ObjectiveConfig(decoder_noise_scale=1.0, label_drop_prob=0.1, pad_with_eos=True),
        sampler=SamplerConfig(steps=64, sampler="ode", gamma=0.0, w=1.0, cfg=2.0),
        data=DataConfig(format="pairs"),
        optim=OptimConfig(blr=1e-3, warmup_steps=5000),
        train=TrainConfig(global_batch=512, epochs=100, ema_decay=0.9999),
        encoder=EncoderConfig(name=T5_SMALL, latent_std=0.2),
        task="conditional",
        max_input_length=max_input_length,
        preset=name,
    )


def de_en_b() -> RunConfig:
    """ELF-B on WMT14 De-En: 64 + 64 tokens (paper: 64-step ODE, CFG 2, w 1)."""
    return _seq2seq(64, 128, "de-en-b")


def xsum_b() -> RunConfig:
    """ELF-B on XSum: 1024 + 64 tokens."""
    return _seq2seq(1024, 1088, "xsum-b")


def _cpu(model: ModelConfig, data: DataConfig, name: str, **kw: Any) -> RunConfig:
    """CPU presets: MiniLM encoder (offline), latent_std measured, latent cache, short-run EMA."""
    base = dict(
        model=model,
        objective=ObjectiveConfig(),
        sampler=SamplerConfig(steps=32, sampler="sde", gamma=1.5, w=3.0),
        data=data,
        # auto: bf16 autocast and bf16 Newton-Schulz on CPUs with native bf16 (1.8x faster steps),
        # fp32 on the others, where emulated bf16 is ~8x slower (docs/training.md "Precision").
        optim=OptimConfig(lr=2e-3, warmup_steps=200, muon_ns_dtype="auto"),
        train=TrainConfig(
            global_batch=64,
            precision="auto",
            max_steps=10000,
            ema_decay=0.999,
            ema_warmup=True,
            save_every=500,
            log_every=20,
            sample_every=1000,
            eval_every=500,
        ),
        encoder=EncoderConfig(name="minilm", latent_std=0.0),
        preset=name,
    )
    base.update(kw)
    return RunConfig(**base)


def bible_tiny() -> RunConfig:
    """World English Bible, one verse per row (L 64), D 256 x 6 blocks (docs/training.md)."""
    data = DataConfig(
        path=web_bible("train"),  # shipped inside the package (elflow/examples)
        valid_path=web_bible("valid"),
        format="auto",  # the web_bible JSONL, and also a user's plain-text --set data.path
        text_field="text",
        packing=False,
        latent_cache=True,
    )
    # NOTE: rows are padded with EOS ([SEP]) and the padding is trained on, as the paper does for
    # its seq2seq tasks, so the model learns where a verse ends. With [PAD] padding masked out of
    # the loss, samples never ended (mean length 62 of 64 after 3000 steps).
    cfg = _cpu(
        elf_small(max_length=64), data, "bible-tiny", objective=ObjectiveConfig(pad_with_eos=True)
    )
    # 7000 steps (12.5 epochs): the lr holds at 2e-3 for 5000, then decays linearly to 0 over the
    # last 2000 (the demo model's run; docs/install.md). Its sampler: projected SDE, gamma 1 from
    # t 0.3 (docs/sampling.md; the paper's plain SDE misses the demo's bars: docs/results/).
    return replace(
        cfg,
        sampler=replace(cfg.sampler, gamma=1.0, project_from=0.3),
        optim=replace(cfg.optim, schedule="wsd", decay_steps=2000),
        train=replace(cfg.train, max_steps=7000),
    )


BIBLE_DEMO_WHY = (
    "bible-tiny's data, objective and sampler at the size one GPU trains in minutes. Width 384 x "
    "8 blocks (27.1M parameters, 11.9M of them the vocabulary head): the largest whose bf16 "
    "weights stay under 64 MB (54 MB; 448 x 8 or 512 x 6 would not); `elflow demo` takes about "
    "2.7 times the CPU time of the 256 x 6 model's on a 2-core CPU. "
    "Batch 512 (the paper's, with its lr 2e-3): at L 64 that is 32,768 "
    "tokens a step, as many as the micro-batches at which ELF-B's GPU step was measured to be "
    "bound by the device rather than by kernel launches (at 8,192 it was launch-bound). Steps: "
    "as many as the time budget allows at the measured speed, the lr held, then decayed over "
    "the last 30%."
)
"""Why ``bible-demo`` is sized as it is (a demo model's card quotes it)."""


def bible_demo() -> RunConfig:
    """``bible-tiny`` at GPU scale: D 384 x 8 blocks, batch 512, bf16 autocast, compiled blocks,
    the frozen encoder in fp32 (the latents the CPU-trained models saw), 6,000 steps nominally
    (benchmarks/train_demo_gpu.py plans the steps from the measured speed instead; see
    :data:`BIBLE_DEMO_WHY` and docs/demo-gpu.md)."""
    cfg = bible_tiny()
    return replace(
        cfg,
        model=replace(cfg.model, hidden_size=384, depth=8, num_heads=6),
        optim=replace(cfg.optim, lr=2e-3, warmup_steps=300, decay_steps=1800),
        train=replace(
            cfg.train,
            global_batch=512,
            max_steps=6000,
            compile="blocks",
            log_every=50,
            save_every=2000,
            sample_every=0,
            eval_every=1000,
        ),
        encoder=replace(cfg.encoder, precision="fp32"),
        preset="bible-demo",
    )


def _ddtp_pairs(fields: tuple[str, str], lengths: tuple[int, int], name: str) -> RunConfig:
    """A conditional CPU preset for an offline Debian-descriptions pair set: (source, target)
    fields, (source, total) lengths; the paper's seq2seq objective and sampler."""
    # NOTE: no data.path: the Debian data does not ship with the package; an empty path is a
    # one-line error at training start naming the project's shared/data/<folder> (elflow.examples).
    data = DataConfig(
        format="pairs",
        source_field=fields[0],
        target_field=fields[1],
        latent_cache=True,
    )
    return _cpu(
        elf_small(max_length=lengths[1]),
        data,
        name,
        objective=ObjectiveConfig(decoder_noise_scale=1.0, label_drop_prob=0.1, pad_with_eos=True),
        sampler=SamplerConfig(steps=32, sampler="ode", gamma=0.0, w=1.0, cfg=2.0),
        task="conditional",
        max_input_length=lengths[0],
    )


def de_en_tiny() -> RunConfig:
    """Debian descriptions German -> English (32 + 32 tokens)."""
    return _ddtp_pairs(("de", "en"), (32, 64), "de-en-tiny")


def summ_tiny() -> RunConfig:
    """Debian long description -> synopsis (96 + 32 tokens)."""
    return _ddtp_pairs(("document", "summary"), (96, 128), "summ-tiny")


def short_run(cfg: RunConfig, steps: int, keep: Collection[str] = ()) -> RunConfig:
    """``cfg`` scaled to a run of ``steps`` optimizer steps (``elflow train --steps N``).

    Warm-up over the first 5% of the steps, the wsd schedule decaying the lr linearly to its floor
    over the last 30%, a checkpoint and a held-out loss every ``steps // 5`` steps, samples at
    the end, and the EMA's warm-up on (a 0.9999 EMA of a few thousand steps is mostly the initial
    weights). Apply it to the preset before the user's overrides, which then win; ``keep`` names
    the keys they set, so that a warm-up given in epochs is not doubled by one in steps.
    """
    require(steps > 0, f"steps= must be a positive number of optimizer steps, got {steps}")
    if "train.max_steps" in keep:
        raise ELFError("steps=N sets train.max_steps; give one of them")
    every = max(1, steps // 5)
    by_epochs = "train.warmup_epochs" in keep and "optim.warmup_steps" not in keep
    warmup = 0 if by_epochs else max(1, round(0.05 * steps))
    optim = replace(
        cfg.optim, warmup_steps=warmup, schedule="wsd", decay_steps=max(1, round(0.3 * steps))
    )
    train = replace(
        cfg.train,
        max_steps=steps,
        warmup_epochs=cfg.train.warmup_epochs if by_epochs else 0.0,
        save_every=every,
        eval_every=every,
        sample_every=steps,
        ema_warmup=True,
    )
    return replace(cfg, optim=optim, train=train)


PRESETS: dict[str, Callable[[], RunConfig]] = {
    "owt-b": owt_b,
    "owt-m": owt_m,
    "owt-l": owt_l,
    "de-en-b": de_en_b,
    "xsum-b": xsum_b,
    "bible-tiny": bible_tiny,
    "bible-demo": bible_demo,
    "de-en-tiny": de_en_tiny,
    "summ-tiny": summ_tiny,
}


def preset(name: str) -> RunConfig:
    """A registered preset by name (one-line error listing the choices)."""
    if name not in PRESETS:
        raise ELFError(f"unknown preset {name!r}; choose one of {sorted(PRESETS)}")
    return PRESETS[name]()
