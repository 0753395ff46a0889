"""Token conventions: special ids, row layout, and turning generated ids back into text.

Every text segment is tokenised with the tokenizer's own special tokens (T5: `text </s>`, BERT:
`[CLS] text [SEP]`); EOS is `eos_token` if the tokenizer has one, else `sep_token` (spec §10). A
conditional row is [source truncated to `max_input_length` ; target], truncated to `max_length` and
right padded (spec §4). Row builders return plain Python lists (the collate function stacks them);
post-processing of generated ids works on (B, L) LongTensors without Python loops over positions.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass

import torch
from torch import Tensor

from elflow.errors import ELFError


@dataclass(frozen=True)
class TokenSpec:
    eos_id: int
    """End-of-sequence id: the tokenizer's EOS, else its SEP."""
    pad_id: int
    """Padding id: the tokenizer's PAD, else EOS."""
    vocab_size: int
    """len(tokenizer), the size the decoder head covers (added tokens included)."""

    def row_pad_id(self, pad_with_eos: bool) -> int:
        """The id training rows are padded with: EOS for a model trained on EOS padding."""
        return self.eos_id if pad_with_eos else self.pad_id


def token_spec(tokenizer) -> TokenSpec:
    """The special ids elflow uses for `tokenizer` (spec §10)."""
    eos_id = tokenizer.eos_token_id
    if eos_id is None:
        eos_id = tokenizer.sep_token_id
    if eos_id is None:
        raise ELFError(
            f"tokenizer {type(tokenizer).__name__} has neither an eos_token nor a sep_token; "
            "use a tokenizer that defines one of them"
        )
    pad_id = tokenizer.pad_token_id
    if pad_id is None:
        pad_id = eos_id
    return TokenSpec(eos_id=int(eos_id), pad_id=int(pad_id), vocab_size=len(tokenizer))


def special_token_count(tokenizer) -> int:
    """How many special tokens the tokenizer adds to a text (e.g. 2 for [CLS] ... [SEP])."""
    return len(tokenizer("", add_special_tokens=True)["input_ids"])


def tokenize(tokenizer, texts: list[str], max_length: int | None = None) -> list[list[int]]:
    """Tokenise `texts` in one batched call, with the tokenizer's special tokens.

    With `max_length`, Hugging Face truncation keeps the special tokens (the trailing EOS survives).
    Without it, texts longer than the encoder's limit are not warned about: callers cut them.
    """
    enc = tokenizer(
        list(texts),
        add_special_tokens=True,
        truncation=max_length is not None,
        max_length=max_length,
        verbose=False,  # "Token indices sequence length is longer than ...": rows are cut later
    )
    return [list(ids) for ids in enc["input_ids"]]


def build_unconditional_row(
    ids: list[int], max_length: int, pad_id: int
) -> tuple[list[int], list[int]]:
    """Truncate `ids` to `max_length` and right pad: returns (input_ids, attention_mask) lists."""
    ids = list(ids[:max_length])
    n_pad = max_length - len(ids)
    return ids + [pad_id] * n_pad, [1] * len(ids) + [0] * n_pad


def build_conditional_row(
    source_ids: list[int],
    target_ids: list[int],
    max_input_length: int,
    max_length: int,
    pad_id: int,
) -> tuple[list[int], list[int], list[int]]:
    """[source[:max_input_length] ; target], truncated to `max_length`, right padded (spec §4).

    Returns Python lists (input_ids, attention_mask, cond_mask), each of length `max_length`;
    `cond_mask` is 1 at source positions.
    """
    if max_input_length > max_length:
        raise ELFError(
            f"max_input_length ({max_input_length}) exceeds max_length ({max_length}); "
            "lower max_input_length or raise max_length"
        )
    source = list(source_ids[:max_input_length])
    row = (source + list(target_ids))[:max_length]
    n_pad = max_length - len(row)
    input_ids = row + [pad_id] * n_pad
    attention_mask = [1] * len(row) + [0] * n_pad
    cond_mask = [1] * len(source) + [0] * (max_length - len(source))
    return input_ids, attention_mask, cond_mask


def cut_at_eos(tokens: Tensor, eos_id: int, pad_id: int) -> Tensor:
    """Replace the first EOS of each row and everything after it with `pad_id`. (B, L) -> (B, L)."""
    after_eos = (tokens == eos_id).cumsum(dim=1) > 0
    return tokens.masked_fill(after_eos, pad_id)


def shift_out_source(
    tokens: Tensor,
    cond_mask_or_source_lengths: Tensor,
    keep: int,
    pad_id: int | None = None,
) -> Tensor:
    """Drop each row's source prefix: out[b] = tokens[b, n_b : n_b + keep]; (B, L) -> (B, keep).

    `cond_mask_or_source_lengths` is a (B, L) cond mask (n_b = its row sum) or (B,) source lengths.
    Positions past the end of a row are filled with `pad_id`; without one they are an error.
    """
    if cond_mask_or_source_lengths.dim() == 2:
        lengths = cond_mask_or_source_lengths.long().sum(dim=1)
    else:
        lengths = cond_mask_or_source_lengths.long()
    L = tokens.shape[1]
    index = lengths[:, None].to(tokens.device) + torch.arange(
        keep, device=tokens.device
    )  # (B, keep)
    beyond = index >= L
    if pad_id is None and bool(beyond.any()):
        raise ValueError(f"source length + keep ({keep}) exceeds the row length {L}; pass pad_id")
    out = tokens.gather(1, index.clamp(max=L - 1))
    return out if pad_id is None else out.masked_fill(beyond, pad_id)


def detokenize(tokenizer, tokens: Tensor, eos_id: int, pad_id: int) -> list[str]:
    """Cut each row at its first EOS and decode without special tokens."""
    return tokenizer.batch_decode(
        cut_at_eos(tokens, eos_id, pad_id).tolist(), skip_special_tokens=True
    )


def vocab_hash(tokenizer) -> str:
    """sha256 of the vocabulary and special tokens, to catch a checkpoint/tokenizer mismatch."""
    payload = {
        "vocab": sorted(tokenizer.get_vocab().items()),
        "special": {
            k: str(v) if not isinstance(v, list) else [str(x) for x in v]
            for k, v in tokenizer.special_tokens_map.items()
        },
    }
    text = json.dumps(payload, sort_keys=True, ensure_ascii=False, separators=(",", ":"))
    return hashlib.sha256(text.encode("utf-8")).hexdigest()
