"""Training rows from token tables: packing, one document per row, and conditional rows (§4).

Unconditional rows either pack the EOS-terminated documents into rows of exactly `max_length`
(the last partial row is dropped; nothing is padded or truncated) or hold one document per row,
truncated to `max_length` and right padded with `pad_id`. Conditional rows are
[source[:max_input_length] ; target][:max_length], right padded, with `cond_mask` 1 at source
positions (spec §4; the paper's translation/summarisation tasks pad with EOS: the caller passes
`pad_id`). Rows are gathered with vectorised numpy indexing straight from the (memory-mapped)
tables; `build_dataset` resolves a `DataConfig` to a `RowDataset`.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from elflow.config.data_config import DataConfig
from elflow.data.text_sources import PREPARED_MARKER, resolve_source
from elflow.data.token_tables import TokenTable, tokenize_source
from elflow.errors import ELFError
from elflow.examples import missing_data_hint
from elflow.text.tokens import token_spec, vocab_hash


class RowDataset:
    """Fixed-length rows over a target table (and a source table for conditional data)."""

    def __init__(
        self,
        target: TokenTable,
        *,
        max_length: int,
        pad_id: int,
        source: TokenTable | None = None,
        max_input_length: int = 0,
        packing: bool = False,
        overlong: str = "truncate",
        eos_id: int | None = None,
    ):
        """``eos_id``: the final EOS of an unconditional document, which alone does not make it
        over-long (the data-reading code appends one where pre-tokenised ids lack it)."""
        if max_length <= 0:
            raise ELFError(f"max_length must be positive, got {max_length}")
        self.target, self.source = target, source
        self.max_length, self.max_input_length = max_length, max_input_length
        self.pad_id, self.eos_id = int(pad_id), eos_id
        self.conditional = source is not None
        self.prechunked = packing and not self.conditional and self._one_row_each()
        """Packing was asked for, but the documents are rows already: kept one per row."""
        self.packing = packing and not self.prechunked
        if self.conditional:
            if packing:
                raise ELFError(
                    "data.packing applies to unconditional data only; turn data.packing off"
                )
            if not 0 < max_input_length <= max_length:
                raise ELFError(
                    f"conditional data needs 0 < max_input_length <= max_length ({max_length}), "
                    f"got {max_input_length}; set max_input_length"
                )
            if len(source) != len(target):
                raise ELFError(f"{len(source)} sources but {len(target)} targets; fix the data")
        over = self._overlong()
        self.num_truncated = int(over.sum())
        if overlong == "error" and self.num_truncated:
            i = int(np.flatnonzero(over)[0])
            if self.conditional:
                what = (
                    f"source {source.lengths[i]} (max_input_length {max_input_length}) + target "
                    f"{target.lengths[i]} tokens (max_length {max_length})"
                )
            else:
                what = f"{target.lengths[i]} tokens, more than max_length {max_length}"
            raise ELFError(
                f"document {i} has {what}; raise the length or set data.overlong to truncate"
            )
        self._num_rows = target.num_tokens // max_length if self.packing else len(target)
        if self._num_rows == 0:
            raise ELFError(
                f"the data has {target.num_tokens} tokens, fewer than one packed row of "
                f"{max_length}; add data or lower max_length"
            )

    def _one_row_each(self) -> bool:
        """Whether the documents are already rows of ``max_length`` tokens (the paper's
        pre-chunked data): each fits one row, the final EOS a reader appends aside, and they
        fill 90% of it on average."""
        t, L = self.target.lengths, self.max_length
        if not len(t) or (t > L + 1).any():
            return False
        fits = self._fits_but_final_eos(t <= L)
        return bool(fits.all()) and float(np.minimum(t, L).mean()) >= 0.9 * L

    def _fits_but_final_eos(self, fits: np.ndarray) -> np.ndarray:
        """``fits``, with the documents of ``max_length`` + 1 tokens whose last is EOS added."""
        if self.eos_id is None:
            return fits
        L = self.max_length
        edge = np.flatnonzero(self.target.lengths == L + 1)
        last = self.target.at(self.target.offsets[edge] + L)
        fits = fits.copy()
        fits[edge[last == self.eos_id]] = True
        return fits

    def _overlong(self) -> np.ndarray:
        t = self.target.lengths
        if self.packing:
            return np.zeros(len(t), dtype=bool)
        if not self.conditional:
            # A document that only loses its final EOS keeps all its text: pre-chunked ids of
            # exactly max_length (the paper's pre-chunked data) fit, although an EOS was added.
            return ~self._fits_but_final_eos(t <= self.max_length)
        s = self.source.lengths
        return (s > self.max_input_length) | (
            np.minimum(s, self.max_input_length) + t > self.max_length
        )

    def __len__(self) -> int:
        return self._num_rows

    @property
    def num_docs(self) -> int:
        return len(self.target)

    def get_rows(self, indices: np.ndarray) -> dict[str, np.ndarray]:
        """`input_ids`, `attention_mask`, `cond_mask`: (n, L) int64 arrays for rows `indices`."""
        idx = np.asarray(indices, dtype=np.int64).reshape(-1)
        if idx.size and (idx.min() < 0 or idx.max() >= len(self)):
            raise IndexError(f"row index out of range [0, {len(self)})")
        L = self.max_length
        pos = np.arange(L, dtype=np.int64)[None, :]  # (1, L)
        if self.packing:
            ids = np.asarray(self.target.tokens[idx[:, None] * L + pos], dtype=np.int64)
            ones = np.ones_like(ids)
            return {"input_ids": ids, "attention_mask": ones, "cond_mask": np.zeros_like(ids)}
        t_start = self.target.offsets[idx][:, None]
        t_len = self.target.lengths[idx][:, None]
        if self.conditional:
            s_start = self.source.offsets[idx][:, None]
            s_len = np.minimum(self.source.lengths[idx][:, None], self.max_input_length)
        else:
            s_start = s_len = np.zeros_like(t_start)
        t_len = np.minimum(t_len, L - s_len)
        is_src = pos < s_len  # (n, L)
        is_tgt = ~is_src & (pos < s_len + t_len)
        ids = np.full(is_src.shape, self.pad_id, dtype=np.int64)
        if is_tgt.any():
            ids[is_tgt] = self.target.tokens[(t_start + pos - s_len)[is_tgt]]
        if is_src.any():
            ids[is_src] = self.source.tokens[(s_start + pos)[is_src]]
        return {
            "input_ids": ids,
            "attention_mask": (is_src | is_tgt).astype(np.int64),
            "cond_mask": is_src.astype(np.int64),
        }

    def get_batch(self, indices: np.ndarray) -> dict[str, Tensor]:
        """`get_rows` as (n, L) LongTensors."""
        return {k: torch.from_numpy(v) for k, v in self.get_rows(indices).items()}

    @classmethod
    def from_prepared(
        cls,
        folder: str | Path,
        *,
        max_length: int,
        pad_id: int,
        max_input_length: int = 0,
        packing: bool = False,
        overlong: str = "truncate",
        tokenizer=None,
        max_rows: int = 0,
    ) -> RowDataset:
        """Rows over a folder written by `elflow prepare` (memory-mapped, nothing loaded); its
        first `max_rows` documents when > 0, as `data.max_rows` reads raw data."""
        folder = Path(folder)
        meta = read_meta(folder)
        if tokenizer is not None and meta["vocab_hash"] != vocab_hash(tokenizer):
            raise ELFError(
                f"'{folder}' was prepared with tokenizer {meta['tokenizer']!r}, not the one given "
                "(vocabulary hash differs); re-run elflow prepare with the encoder's tokenizer"
            )
        if meta["conditional"]:
            target = TokenTable.open(folder, "target", meta["dtype"])
            source = TokenTable.open(folder, "source", meta["dtype"])
        else:
            target, source = TokenTable.open(folder, "tokens", meta["dtype"]), None
        if max_rows:
            target = target.head(max_rows)
            source = None if source is None else source.head(max_rows)
        return cls(
            target,
            source=source,
            max_length=max_length,
            pad_id=pad_id,
            max_input_length=max_input_length,
            packing=packing,
            overlong=overlong,
            eos_id=meta.get("eos_id"),
        )


def read_meta(folder: Path) -> dict:
    """meta.json of a prepared folder; a one-line error if it is not one."""
    path = Path(folder) / "meta.json"
    try:
        meta = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        raise ELFError(
            f"'{folder}' is not a folder written by elflow prepare (no meta.json)"
        ) from None
    if not isinstance(meta, dict) or PREPARED_MARKER not in meta:
        raise ELFError(f"'{folder}/meta.json' was not written by elflow prepare")
    return meta


def build_dataset(
    cfg: DataConfig,
    tokenizer,
    max_length: int,
    max_input_length: int = 0,
    pad_id: int | None = None,
    split: str = "train",
    conditional: bool | None = None,
) -> RowDataset:
    """The rows of `cfg.path` (split "train") or `cfg.valid_path` (split "valid").

    Prepared folders are memory-mapped; every other format is read and tokenised in memory at
    start-up (use `elflow prepare` for corpora that do not fit). `pad_id` defaults to the
    tokenizer's pad id (spec §10); pass the EOS id for the paper's seq2seq tasks (spec §4).
    With `conditional` given, data of the other kind (pairs for a plain-text task, or the
    reverse) is refused.
    """
    if split not in ("train", "valid"):
        raise ELFError(f"split must be 'train' or 'valid', got {split!r}")
    location = cfg.path if split == "train" else cfg.valid_path
    key = "data.path" if split == "train" else "data.valid_path"
    if split == "valid" and not location:
        raise ELFError("no validation data; set data.valid_path")
    if not location:  # the Debian-description presets ship no data
        hint = missing_data_hint(cfg.source_field, cfg.target_field)
        raise ELFError(
            "data.path is empty; set data.path (and data.valid_path) to your training (and "
            f"validation) data{hint}"
        )
    hf_split = cfg.hf_split if split == "train" else cfg.hf_valid_split
    spec = token_spec(tokenizer)
    if pad_id is None:
        pad_id = spec.pad_id
    kwargs = dict(
        max_length=max_length,
        pad_id=pad_id,
        max_input_length=max_input_length,
        packing=cfg.packing,
        overlong=cfg.overlong,
    )
    src = resolve_source(cfg, location, hf_split, key)
    if src.container == "prepared":
        _check_kind(key, location, read_meta(Path(location))["conditional"], conditional)
        return RowDataset.from_prepared(
            location, tokenizer=tokenizer, max_rows=cfg.max_rows, **kwargs
        )
    target, source = tokenize_source(src, cfg, tokenizer)
    _check_kind(key, location, source is not None, conditional)
    return RowDataset(target, source=source, eos_id=spec.eos_id, **kwargs)


def _check_kind(key: str, location: str, pairs: bool, conditional: bool | None) -> None:
    """Data of the task's kind (checked before the rows are built, whose own checks would
    otherwise ask for the other task's settings)."""
    if conditional is None or pairs == conditional:
        return
    if pairs:
        raise ELFError(
            f"{key} {location!r} holds source/target pairs but the run's task is unconditional; "
            "for a conditional run start from a conditional preset (de-en-tiny, summ-tiny) or "
            "set task=conditional and max_input_length (the source's share of each row), or give "
            "plain text"
        )
    raise ELFError(
        f"{key} {location!r} holds plain text (no sources) but the run's task is conditional; "
        "give source/target pairs (data.source_field, data.target_field), or start from an "
        "unconditional preset (bible-tiny)"
    )
