"""Token tables: documents as one flat token array plus int64 offsets (the prepared format).

Document i is ``tokens[offsets[i]:offsets[i + 1]]``. The same layout serves small corpora tokenised
in memory at start-up and large ones written once by `elflow prepare` and read back as numpy
memmaps, so training code never distinguishes them. Tokens are uint16 when the vocabulary has
fewer than 65536 entries, else uint32. Tokenisation uses the encoder's own tokenizer in batches
with its special tokens (spec §10); an unconditional document always ends with EOS, so packing can
concatenate documents as they are stored.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np

from elflow.config.data_config import DataConfig
from elflow.data.text_sources import Example, Source, iter_examples
from elflow.errors import ELFError

# (elflow.text.tokens, which imports torch, is imported where it is used: the tokenising workers of
# elflow.data.shards import this module and stay light.)


def token_dtype(vocab_size: int) -> np.dtype:
    """uint16 if every id fits, else uint32."""
    return np.dtype(np.uint16 if vocab_size < 65536 else np.uint32)


PREAD_LIMIT = 1 << 16
"""Up to this many tokens of a memory-mapped table are read by :meth:`TokenTable.at` one by one."""


class TokenTable:
    """Documents stored as flat `tokens` and `offsets` (num_docs + 1 entries, offsets[0] == 0)."""

    def __init__(self, tokens: np.ndarray, offsets: np.ndarray, file: Path | None = None):
        """``file``: the file ``tokens`` maps from its first byte, if any."""
        assert offsets.ndim == 1 and len(offsets) >= 1 and offsets[0] == 0, offsets[:2]
        assert int(offsets[-1]) == len(tokens), (int(offsets[-1]), len(tokens))
        self.tokens, self.file = tokens, file
        self.offsets = offsets.astype(np.int64, copy=False)
        self.lengths = np.diff(self.offsets)

    def __len__(self) -> int:
        return len(self.offsets) - 1

    @property
    def num_tokens(self) -> int:
        return int(self.offsets[-1])

    def head(self, n: int) -> TokenTable:
        """The first ``n`` documents (a view: nothing is copied from a memory-mapped table)."""
        n = min(n, len(self))
        offsets = self.offsets[: n + 1]
        return TokenTable(self.tokens[: int(offsets[-1])], offsets, self.file)

    def doc(self, i: int) -> np.ndarray:
        return np.asarray(self.tokens[self.offsets[i] : self.offsets[i + 1]])

    def at(self, positions: np.ndarray) -> np.ndarray:
        """The tokens at ``positions`` (flat indices). A few positions of a memory-mapped table
        are read from its file one by one: indexing the map would bring the pages around each
        into memory (the kernel maps 64 KB around a fault), most of the file for a spread-out
        handful."""
        positions = np.asarray(positions, dtype=np.int64)
        if self.file is None or len(positions) > PREAD_LIMIT:
            return np.asarray(self.tokens[positions])
        size = self.tokens.dtype.itemsize
        out = bytearray(len(positions) * size)
        fd = os.open(self.file, os.O_RDONLY)
        try:
            for k, i in enumerate(positions.tolist()):
                out[k * size : (k + 1) * size] = os.pread(fd, size, i * size)
        finally:
            os.close(fd)
        return np.frombuffer(bytes(out), dtype=self.tokens.dtype)

    @classmethod
    def open(cls, folder: Path, name: str, dtype: str) -> TokenTable:
        """Memory-map ``name.bin`` and ``name.offsets.bin`` in a prepared folder (read-only);
        a one-line error when the files are missing, cut short or inconsistent."""
        damaged = f"prepared folder '{folder}' is damaged ({{}}); re-run elflow prepare"
        try:
            offsets = np.fromfile(folder / f"{name}.offsets.bin", dtype=np.int64)
            token_bytes = (folder / f"{name}.bin").stat().st_size
        except OSError as e:
            raise ELFError(damaged.format(f"{e.strerror}: {e.filename}")) from None
        if len(offsets) == 0 or offsets[0] != 0 or (np.diff(offsets) < 0).any():
            raise ELFError(damaged.format(f"{name}.offsets.bin is not a table of offsets"))
        size = int(offsets[-1])
        if token_bytes != size * np.dtype(dtype).itemsize:
            raise ELFError(damaged.format(f"{name}.bin has {token_bytes} bytes, not {size} ids"))
        if size == 0:
            return cls(np.zeros(0, dtype=dtype), offsets)
        tokens = np.memmap(folder / f"{name}.bin", dtype=dtype, mode="r", shape=(size,))
        return cls(tokens, offsets, folder / f"{name}.bin")


class TableWriter:
    """Appends documents to a table, in memory (`folder` None) or to files in `folder`."""

    def __init__(self, dtype: np.dtype, folder: Path | None = None, name: str = "tokens"):
        self.dtype, self.folder, self.name = dtype, folder, name
        self._chunks: list[np.ndarray] = []
        self._lengths: list[np.ndarray] = []
        self._end = 0
        if folder is not None:
            (folder / f"{name}.bin").write_bytes(b"")
            (folder / f"{name}.offsets.bin").write_bytes(np.zeros(1, dtype=np.int64).tobytes())

    def append(self, docs: list[list[int]]) -> None:
        lengths = np.fromiter((len(d) for d in docs), dtype=np.int64, count=len(docs))
        flat = np.fromiter(
            itertools.chain.from_iterable(docs), dtype=self.dtype, count=int(lengths.sum())
        )
        if self.folder is None:
            self._chunks.append(flat)
            self._lengths.append(lengths)
        else:
            # Append per batch (no long-lived handles): memory stays at one batch of tokens.
            with open(self.folder / f"{self.name}.bin", "ab") as f:
                f.write(flat.tobytes())
            with open(self.folder / f"{self.name}.offsets.bin", "ab") as f:
                f.write((self._end + np.cumsum(lengths)).tobytes())
        self._end += int(lengths.sum())

    def finish(self) -> TokenTable:
        if self.folder is None:
            lengths = np.concatenate([np.zeros(1, np.int64), *self._lengths])
            tokens = np.concatenate(self._chunks) if self._chunks else np.zeros(0, self.dtype)
            return TokenTable(tokens, np.cumsum(lengths))
        return TokenTable.open(self.folder, self.name, self.dtype.name)


def _batches(examples: Iterator[Example], size: int) -> Iterator[list[Example]]:
    while batch := list(itertools.islice(examples, size)):
        yield batch


def to_ids(
    encode: Callable[[list[str]], list[list[int]]], items: list, vocab_size: int, where: str
) -> list[list[int]]:
    """Token ids of ``items``: texts through ``encode``, pre-tokenised id lists checked."""
    if all(isinstance(x, str) for x in items):
        return encode(items)
    ids = [list(x) for x in items]
    top = max((max(d) for d in ids if d), default=0)
    low = min((min(d) for d in ids if d), default=0)
    if top >= vocab_size or low < 0:
        bad = top if top >= vocab_size else low
        raise ELFError(
            f"{where}: token id {bad} is outside the tokenizer's vocabulary (size {vocab_size}); "
            "pre-tokenised data must come from the encoder's tokenizer"
        )
    return ids


def tokenize_source(
    src: Source, cfg: DataConfig, tokenizer, folder: Path | None = None
) -> tuple[TokenTable, TokenTable | None]:
    """Tokenise every example of `src` in batches into (target table, source table or None).

    With `folder`, tables are written there as they grow (bounded memory); else held in memory.
    """
    from elflow.text.tokens import token_spec, tokenize

    spec = token_spec(tokenizer)
    dtype = token_dtype(spec.vocab_size)

    def encode(texts: list[str]) -> list[list[int]]:
        return tokenize(tokenizer, texts)

    examples = iter_examples(src, cfg)
    first = next(examples)
    conditional = first[0] is not None
    target = TableWriter(dtype, folder, "target" if conditional else "tokens")
    source = TableWriter(dtype, folder, "source") if conditional else None
    done = 0
    for batch in _batches(itertools.chain([first], examples), cfg.tokenize_batch_size):
        where = f"{src.location} (examples {done}..{done + len(batch) - 1})"
        tgt = to_ids(encode, [t for _, t in batch], spec.vocab_size, where)
        if source is not None:
            source.append(to_ids(encode, [s for s, _ in batch], spec.vocab_size, where))
        else:
            # Packing concatenates stored documents, so each must end with its EOS separator.
            tgt = [d if d and d[-1] == spec.eos_id else [*d, spec.eos_id] for d in tgt]
        target.append(tgt)
        done += len(batch)
    return target.finish(), None if source is None else source.finish()
