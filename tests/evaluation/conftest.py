"""A tiny random GPT-2 judge with an offline word-level tokenizer (no downloaded weights)."""

from __future__ import annotations

import pytest
import torch
from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from tokenizers.pre_tokenizers import Whitespace
from transformers import GPT2Config, GPT2LMHeadModel, PreTrainedTokenizerFast

from elflow.evaluation.judge import Judge, from_model

WORDS = "a b c d e f g h the cat sat on mat dog ran in park . ,".split()
EOT = "<|endoftext|>"


def tiny_tokenizer() -> PreTrainedTokenizerFast:
    # EOT first, like SmolLM2 (id 0): a good test that EOT is found by name, not by position.
    vocab = {EOT: 0, "[UNK]": 1} | {w: i + 2 for i, w in enumerate(WORDS)}
    tok = Tokenizer(WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOT, unk_token="[UNK]")


def tiny_judge(n_positions: int = 64, seed: int = 0) -> Judge:
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
        initializer_range=0.5,  # peaky logits, so precision and masking errors show
    )
    model = GPT2LMHeadModel(config).eval()
    return from_model(model, tokenizer, "tiny-gpt2", revision="test")


@pytest.fixture(scope="module")
def judge() -> Judge:
    return tiny_judge()
