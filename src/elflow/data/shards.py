"""Tokenising a corpus in shards, in parallel and resumably (``elflow prepare --workers N``).

The documents are read in order and cut into shards of about ``shard_bytes`` of text. Each shard is
tokenised by one of ``workers`` processes (:class:`concurrent.futures.ProcessPoolExecutor`), which
writes it as a small token table (:mod:`elflow.data.token_tables`) into ``FOLDER/shards/`` under a
temporary name and renames it when complete; at most two shards per worker are in flight, so memory
does not grow with the corpus. When every shard is there, they are concatenated in order into the
folder's tables. A run that was killed keeps its finished shards: run again with the same plan
(input, tokenizer, reading settings: ``plan.json``), it reads past them without tokenising them
again. The result is the same file, byte for byte, whatever the number of workers and however often
the run was interrupted.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import shutil
import sys
import time
from collections import deque
from collections.abc import Iterator
from concurrent.futures import Future, ProcessPoolExecutor
from pathlib import Path

import numpy as np

from elflow.config.data_config import DataConfig
from elflow.data.text_sources import Example, Source, iter_examples
from elflow.data.token_tables import TableWriter, TokenTable, to_ids, token_dtype
from elflow.errors import ELFError
from elflow.io.jsonl import is_gzip

SHARD_BYTES = 16 << 20
"""Text per shard (bytes of UTF-8): small enough to keep memory flat, large enough that a
worker's per-shard costs are noise."""
SHARDS, PLAN, DONE = "shards", "plan.json", "shard.json"

_STATE: dict = {}
"""A worker's encoder of texts and settings (set once per process by :func:`_init`)."""


def _encoder(tokenizer):
    """What a worker tokenises with: a fast tokenizer's Rust ``tokenizers.Tokenizer`` (light to
    send and to load: the workers import neither transformers nor torch), with no truncation or
    padding of its own, as ``tokenizer(texts)`` calls it; any other tokenizer as it is."""
    import copy

    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return tokenizer
    backend = copy.deepcopy(backend)
    backend.no_truncation()
    backend.no_padding()
    return backend


def _init(encoder, eos: int, vocab: int, batch_size: int, single_thread: bool) -> None:
    if single_thread:  # N processes: the tokenizer's own thread pool would oversubscribe
        os.environ["TOKENIZERS_PARALLELISM"] = "false"
    if hasattr(encoder, "encode_batch"):  # tokenizers.Tokenizer

        def encode(texts: list[str]) -> list[list[int]]:
            return [e.ids for e in encoder.encode_batch(texts, add_special_tokens=True)]

    else:
        from elflow.text.tokens import tokenize

        def encode(texts: list[str]) -> list[list[int]]:
            return tokenize(encoder, texts)

    _STATE.update(encode=encode, batch=batch_size, eos=eos, vocab=vocab, dtype=token_dtype(vocab))


def _tokenize_shard(
    index: int,
    examples: list[Example],
    size: int,
    conditional: bool,
    where: str,
    first: int,
    root: str,
) -> None:
    """Tokenise one shard (``size`` bytes of text) into ``root/shard-<index>``, renamed into
    place when complete."""
    s = _STATE
    final = Path(root) / _name(index)
    tmp = Path(root) / f".{_name(index)}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    target = TableWriter(s["dtype"], tmp, "target" if conditional else "tokens")
    source = TableWriter(s["dtype"], tmp, "source") if conditional else None
    for k in range(0, len(examples), s["batch"]):
        batch = examples[k : k + s["batch"]]
        at = f"{where} (examples {first + k}..{first + k + len(batch) - 1})"
        tgt = to_ids(s["encode"], [t for _, t in batch], s["vocab"], at)
        if source is not None:
            source.append(to_ids(s["encode"], [x for x, _ in batch], s["vocab"], at))
        else:
            # Packing concatenates stored documents, so each must end with its EOS separator.
            tgt = [d if d and d[-1] == s["eos"] else [*d, s["eos"]] for d in tgt]
        target.append(tgt)
    (tmp / DONE).write_text(json.dumps({"docs": len(examples), "bytes": size, "first": first}))
    tmp.rename(final)


def _name(index: int) -> str:
    return f"shard-{index:06d}"


def _example_bytes(example: Example) -> int:
    """An example's size as read: UTF-8 bytes of text, 4 bytes per pre-tokenised id."""
    return sum(len(t.encode("utf-8")) if isinstance(t, str) else 4 * len(t) for t in example if t)


def _shards(examples: Iterator[Example], shard_bytes: int) -> Iterator[tuple[list[Example], int]]:
    """The examples in shards of at least ``shard_bytes`` of text (the last one smaller), each
    with its size."""
    shard: list[Example] = []
    size = 0
    for ex in examples:
        shard.append(ex)
        size += _example_bytes(ex)
        if size >= shard_bytes:
            yield shard, size
            shard, size = [], 0
    if shard:
        yield shard, size


def input_bytes(src: Source) -> int | None:
    """The size of ``src``'s files when they are read as they are (None: compressed files or a
    dataset, whose text size is not known in advance)."""
    if not src.files or any(is_gzip(p) for p in src.files):
        return None
    return sum(p.stat().st_size for p in src.files)


def tokenize_to_folder(
    src: Source,
    cfg: DataConfig,
    tokenizer,
    folder: Path,
    plan: dict,
    *,
    workers: int = 1,
    shard_bytes: int = SHARD_BYTES,
    progress: bool = True,
) -> tuple[TokenTable, TokenTable | None, dict]:
    """Tokenise every example of ``src`` into ``folder``'s tables (target, source or None) with
    ``workers`` processes, keeping the finished shards of an earlier run with the same ``plan``.
    Also returns what was done: shards made and kept, seconds, documents per second."""
    if workers < 0:
        raise ELFError(f"workers must be >= 0 (0: one per CPU core, up to 8), got {workers}")
    total = input_bytes(src)
    if workers == 0:
        one_shard = total is not None and total < shard_bytes
        workers = 1 if one_shard else max(1, min(os.cpu_count() or 1, 8))
    root = folder / SHARDS
    plan = {**plan, "shard_bytes": shard_bytes}
    if (folder / PLAN).is_file() and _read(folder / PLAN) != plan:
        print(
            f"elflow prepare: note: the unfinished output in {folder} was made with other "
            "settings or input; starting over",
            file=sys.stderr,
        )
        shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True, exist_ok=True)
    (folder / PLAN).write_text(json.dumps(plan, indent=1) + "\n")
    for stale in root.glob(".shard-*"):  # a killed worker's half-written shard
        shutil.rmtree(stale, ignore_errors=True)
    bar = _bar(total, progress)
    start = time.perf_counter()
    made = kept = docs = 0
    conditional = None
    pool = None
    from elflow.text.tokens import token_spec

    spec = token_spec(tokenizer)
    init = (_encoder(tokenizer), spec.eos_id, spec.vocab_size, cfg.tokenize_batch_size)
    if workers > 1:
        context = multiprocessing.get_context("spawn")  # no fork of a process with threads
        pool = ProcessPoolExecutor(
            workers, mp_context=context, initializer=_init, initargs=(*init, True)
        )
    else:
        _init(*init, False)
    pending: deque[tuple[Future, int, int]] = deque()

    def collect(n: int, size: int) -> None:
        """A shard of ``n`` documents and ``size`` bytes is done."""
        nonlocal docs
        docs += n
        bar.update(size)
        bar.set_postfix_str(f"{docs / max(time.perf_counter() - start, 1e-9):,.0f} docs/s")

    def wait(future: Future, n: int, size: int) -> None:
        future.result()  # a worker's error is raised here
        collect(n, size)

    try:
        index = first = 0
        for index, (shard, size) in enumerate(_shards(iter_examples(src, cfg), shard_bytes)):
            if conditional is None:
                conditional = shard[0][0] is not None
            done = _read(root / _name(index) / DONE)
            if done is not None and (done.get("docs"), done.get("first")) == (len(shard), first):
                kept += 1
                collect(len(shard), size)
            else:
                made += 1
                args = (index, shard, size, conditional, src.location, first, str(root))
                if pool is None:
                    _tokenize_shard(*args)
                    collect(len(shard), size)
                else:
                    pending.append((pool.submit(_tokenize_shard, *args), len(shard), size))
                    while len(pending) >= 2 * workers:
                        wait(*pending.popleft())
            first += len(shard)
        num_shards = index + 1
        while pending:
            wait(*pending.popleft())
    except BaseException:
        if pool is not None:
            pool.shutdown(wait=False, cancel_futures=True)
        bar.close()
        raise
    if pool is not None:
        pool.shutdown()
    if bar.total:  # the input's size counts what reading skips (newlines, JSON): all read now
        bar.update(bar.total - bar.n)
    bar.close()
    seconds = time.perf_counter() - start
    names = ["target", "source"] if conditional else ["tokens"]
    dtype = token_dtype(spec.vocab_size)
    for name in names:
        _concatenate(root, num_shards, name, folder, dtype)
    target = TokenTable.open(folder, names[0], dtype.name)
    source = TokenTable.open(folder, "source", dtype.name) if conditional else None
    stats = {
        "shards": num_shards,
        "shards_made": made,
        "shards_kept": kept,
        "workers": workers,
        "tokenize_seconds": round(seconds, 3),
        "docs_per_second": round(docs / max(seconds, 1e-9), 1),
    }
    return target, source, stats


def remove_shards(folder: Path) -> None:
    """Delete the shards (and plan) once the folder's tables are complete."""
    shutil.rmtree(folder / SHARDS, ignore_errors=True)
    (folder / PLAN).unlink(missing_ok=True)


def _concatenate(root: Path, num_shards: int, name: str, folder: Path, dtype: np.dtype) -> None:
    """The shards' tables ``name`` as one table in ``folder`` (streamed: one shard at a time)."""
    end = 0
    with (
        open(folder / f"{name}.bin", "wb") as tokens,
        open(folder / f"{name}.offsets.bin", "wb") as offsets,
    ):
        offsets.write(np.zeros(1, dtype=np.int64).tobytes())
        for i in range(num_shards):
            shard = root / _name(i)
            with open(shard / f"{name}.bin", "rb") as f:
                shutil.copyfileobj(f, tokens, 16 << 20)
            own = np.fromfile(shard / f"{name}.offsets.bin", dtype=np.int64)
            offsets.write((own[1:] + end).tobytes())
            end += int(own[-1])


def _read(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _bar(total: int | None, enabled: bool):
    from tqdm.auto import tqdm

    return tqdm(
        total=total,
        unit="B",
        unit_scale=True,
        desc="prepare",
        disable=not enabled,
        file=sys.stderr,
        dynamic_ncols=True,
    )
