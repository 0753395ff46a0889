"""Latent cache: encode every row once with the frozen encoder and reuse it every epoch.

For small corpora the frozen encoder is most of a CPU step's cost, and its output for a row never
changes, so the normalised latents x = encoder(ids, masks) / latent_std are computed once (batched,
no grad) and kept in RAM as an (N, L, E) tensor in float16 (configurable; float32 is bitwise the
direct encoding at the same batch composition). Memory: N * L * E * bytes per value.

Packing: packed rows are fixed slices of the token stream, so caching by row index is exact.
Label drop (spec §3 step 10a): a dropped conditional example's target latents are computed without
the source, so conditional datasets also cache the source-blind encoding (encoder mask with
label_drop = 1) of every row; `get` picks per example, and label drop stays exact (2x memory).

Saved (``save``/``load``): by default in the user cache,
``$ELFLOW_CACHE/latents/<key>.safetensors`` (:func:`elflow.io.paths.cache_root`), so any later
run on the same rows with the same encoder loads it in seconds instead of re-encoding every row;
``data.latent_cache_dir`` keeps it in the run folder or another folder instead. The file records
a key (:func:`cache_key`: the rows, the encoder's weights, layer and normalisation, the storage
dtype); a file with another key, cut short or damaged, is rebuilt. Builders of one key hold a
file lock and write a temporary file renamed into place, so concurrent runs never see half a
file.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from pathlib import Path

import numpy as np
import torch
from filelock import FileLock, Timeout
from safetensors import SafetensorError, safe_open
from torch import Tensor

from elflow.config.data_config import DataConfig
from elflow.data.rows import RowDataset
from elflow.errors import ELFError, first_line
from elflow.io.paths import cache_root, save_safetensors
from elflow.text.encoder import FrozenEncoder

_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}
CACHE_FORMAT = 1
"""Bump when the encoding itself changes (masks, layer selection): old cache files are rebuilt."""


def cache_key(dataset: RowDataset, encoder: FrozenEncoder, dtype: str) -> str:
    """sha256 of everything the cached latents depend on: every row's ids and masks, the encoder's
    weights, config, layer and latent normalisation, the storage dtype and the cache format."""
    h = hashlib.sha256()
    norm = (encoder.layer, encoder.latent_mean, encoder.latent_std)
    h.update(repr((CACHE_FORMAT, dtype, *norm)).encode())
    config = encoder.model.config.to_dict()
    config.pop("_name_or_path", None)  # where it was loaded from: the same encoder elsewhere fits
    h.update(json.dumps(config, sort_keys=True, default=str).encode())
    h.update(repr((len(dataset), dataset.max_length, dataset.conditional)).encode())
    rows = dataset.get_rows(np.arange(len(dataset)))
    for name in sorted(rows):
        h.update(name.encode())
        h.update(np.ascontiguousarray(rows[name], dtype=np.int64).tobytes())
    for name, tensor in encoder.model.state_dict().items():
        h.update(name.encode())
        h.update(tensor.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy())
    return h.hexdigest()


_CACHE_FIX = (
    "set data.latent_cache=false (encode each batch), data.latent_cache_dtype=float16, or "
    "data.max_rows"
)


def available_memory(root: Path = Path("/")) -> int | None:
    """Bytes this process can still allocate: the kernel's MemAvailable (/proc/meminfo), capped by
    a container's cgroup limit (v2 memory.max - memory.current, or v1's limit - usage); None
    where neither can be read (``root``: the file system's root, for tests)."""
    found = []
    try:
        for line in (root / "proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                found.append(int(line.split()[1]) * 1024)
    except (OSError, ValueError, IndexError):
        pass
    for limit, usage in (
        ("memory.max", "memory.current"),
        ("memory/memory.limit_in_bytes", "memory/memory.usage_in_bytes"),
    ):
        try:
            cap = (root / "sys/fs/cgroup" / limit).read_text().strip()
            if cap != "max" and int(cap) < 2**60:  # v1 writes a huge number for "none"
                used = int((root / "sys/fs/cgroup" / usage).read_text())
                found.append(int(cap) - used)
                break
        except (OSError, ValueError):
            continue
    return min(found) if found else None


def cache_nbytes(dataset: RowDataset, encoder: FrozenEncoder, dtype: torch.dtype | str) -> int:
    """The cache's size in memory: every row's latents (twice for conditional data, whose
    source-blind latents are cached too)."""
    itemsize = (_DTYPES[dtype] if isinstance(dtype, str) else dtype).itemsize
    copies = 2 if dataset.conditional else 1
    return copies * len(dataset) * dataset.max_length * encoder.hidden_size * itemsize


def check_cache_fits(nbytes: int) -> None:
    """A cache larger than the memory available is one line before any encoding (with Linux's
    overcommit the allocation itself may succeed and the OOM killer end the run mid-build)."""
    free = available_memory()
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))  # torchrun: each process holds a copy
    if free is not None and local * nbytes > 0.9 * free:
        raise ELFError(
            f"the latent cache needs {nbytes / 2**30:.1f} GiB per process ({local} on this "
            f"machine) but {free / 2**30:.1f} GiB of memory is available; {_CACHE_FIX}"
        )


class LatentCache:
    """Normalised encoder latents of every row (plus source-blind ones for conditional data)."""

    def __init__(self, latents: Tensor, dropped: Tensor | None = None):
        assert latents.dim() == 3, latents.shape
        assert dropped is None or dropped.shape == latents.shape, (dropped.shape, latents.shape)
        self.latents, self.dropped = latents, dropped
        self.path: Path | None = None
        """The file it was loaded from or saved to (None: held in memory only)."""

    @classmethod
    @torch.no_grad()
    def build(
        cls,
        dataset: RowDataset,
        encoder: FrozenEncoder,
        *,
        batch_size: int = 64,
        dtype: torch.dtype | str = torch.float16,
        progress: bool = False,
        check_memory: bool = True,
    ) -> LatentCache:
        """Encode all rows of `dataset` in batches of `batch_size` on the encoder's device."""
        if isinstance(dtype, str):
            if dtype not in _DTYPES:
                raise ELFError(f"latent cache dtype must be one of {list(_DTYPES)}, got {dtype!r}")
            dtype = _DTYPES[dtype]
        n, L, E = len(dataset), dataset.max_length, encoder.hidden_size
        device = next(encoder.model.parameters()).device
        if check_memory:  # run_latent_cache checks once, before hashing the rows
            check_cache_fits(cache_nbytes(dataset, encoder, dtype))
        try:
            latents = torch.empty(n, L, E, dtype=dtype)
            dropped = torch.empty(n, L, E, dtype=dtype) if dataset.conditional else None
        except RuntimeError as e:  # the allocator's refusal
            raise ELFError(f"the latent cache does not fit in memory ({e}); {_CACHE_FIX}") from None
        starts = range(0, n, batch_size)
        if progress:
            from tqdm import tqdm

            starts = tqdm(starts, desc="latent cache", unit="batch")
        for s in starts:
            idx = np.arange(s, min(s + batch_size, n))
            batch = {k: v.to(device) for k, v in dataset.get_batch(idx).items()}
            cond = batch["cond_mask"] if dataset.conditional else None
            x = encoder(batch["input_ids"], batch["attention_mask"], cond)  # (B, L, E)
            latents[s : s + len(idx)] = x.to("cpu", dtype)
            if dropped is not None:
                blind = torch.ones(len(idx), dtype=torch.bool, device=device)
                x = encoder(batch["input_ids"], batch["attention_mask"], cond, blind)
                dropped[s : s + len(idx)] = x.to("cpu", dtype)
        return cls(latents, dropped)

    def save(self, path: str | Path, key: str) -> None:
        """Write the cache to ``path`` atomically (a temporary file, then a rename)."""
        path = Path(path)
        tensors = {"latents": self.latents.contiguous()}
        if self.dropped is not None:
            tensors["dropped"] = self.dropped.contiguous()
        tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
        try:
            save_safetensors(tensors, tmp, {"key": key})
            os.replace(tmp, path)
        finally:
            tmp.unlink(missing_ok=True)

    @classmethod
    def load(cls, path: str | Path, key: str) -> LatentCache | None:
        """The cache saved at ``path`` if it exists, is readable and has ``key``; else None."""
        path = Path(path)
        if not path.is_file():
            return None
        try:
            with safe_open(str(path), "pt") as f:  # one read: the key, then the tensors
                if (f.metadata() or {}).get("key") != key:
                    return None
                tensors = {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118 (not a dict)
            return cls(tensors["latents"], tensors.get("dropped"))
        except (OSError, SafetensorError, KeyError, AssertionError):
            return None

    def __len__(self) -> int:
        return self.latents.shape[0]

    @property
    def nbytes(self) -> int:
        size = self.latents.numel() * self.latents.element_size()
        return size * (1 if self.dropped is None else 2)

    def get(self, row_indices: np.ndarray, label_drop: np.ndarray | None = None) -> Tensor:
        """(n, L, E) float32 latents of `row_indices`; rows with `label_drop` get the
        source-blind encoding, as ``encoder(ids, attention_mask, cond_mask, label_drop)``."""
        idx = torch.as_tensor(np.asarray(row_indices, dtype=np.int64).reshape(-1))
        x = self.latents[idx].float()
        if label_drop is None:
            return x
        drop = torch.as_tensor(np.asarray(label_drop, dtype=bool).reshape(-1))
        if drop.shape != idx.shape:
            raise ValueError(f"label_drop has shape {tuple(drop.shape)}, rows {tuple(idx.shape)}")
        if bool(drop.any()):
            if self.dropped is None:
                raise ELFError("label drop needs a conditional dataset's latent cache")
            x[drop] = self.dropped[idx[drop]].float()
        return x


CACHE_FILE = "latent-cache.safetensors"
"""Its name in a run folder (``data.latent_cache_dir=run``); shared folders name files by key."""


def cache_path(cfg: DataConfig, out: Path, key: str) -> Path:
    """Where the cache with ``key`` is saved: ``data.latent_cache_dir`` ('' the user cache's
    ``latents/``, ``run`` the run folder ``out``, else that folder)."""
    if cfg.latent_cache_dir == "run":
        return Path(out) / CACHE_FILE
    folder = Path(cfg.latent_cache_dir).expanduser() if cfg.latent_cache_dir else None
    if folder is None:
        folder = cache_root() / "latents"
    elif folder.exists() and not folder.is_dir():
        raise ELFError(f"data.latent_cache_dir {folder} is a file; give a folder (or run)")
    return folder / f"{key[:32]}.safetensors"


def run_latent_cache(
    cfg: DataConfig, dataset: RowDataset, encoder: FrozenEncoder, out: Path, is_main: bool
) -> LatentCache:
    """Load the saved latent cache with this run's key, else build it (and save it).

    The file lives where :func:`cache_path` says; a copy in the run folder ``out`` (an older
    run's, or one that moved with its folder) loads too. Builders of one key take a lock beside
    the file, so a process that waited loads what the first one saved instead of encoding again.
    Rank 0 alone writes; another rank that finds no file builds its own copy after releasing the
    lock. A failed write only costs a later run its rebuild: a note in the line, not an error.
    """
    dtype = cfg.latent_cache_dtype
    check_cache_fits(cache_nbytes(dataset, encoder, dtype))  # before hashing every row
    if not cfg.latent_cache_save:
        return _build(dataset, encoder, dtype, is_main, note="not saved")
    key = cache_key(dataset, encoder, dtype)
    path = cache_path(cfg, out, key)
    for found in dict.fromkeys((path, Path(out) / CACHE_FILE)):
        cache = LatentCache.load(found, key)
        if cache is not None:
            return _loaded(cache, found, is_main)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        lock = _acquire(path, is_main)
    except OSError as e:  # a read-only cache folder: build, and say why nothing is saved
        return _build(dataset, encoder, dtype, is_main, note=f"not saved ({first_line(e)})")
    try:
        cache = LatentCache.load(path, key)  # saved by the process this one waited for
        if cache is None and is_main:
            for partial in path.parent.glob(f".{path.name}.tmp-*"):  # a killed writer's
                partial.unlink(missing_ok=True)
            return _build(dataset, encoder, dtype, is_main, path=path, key=key)
    finally:
        lock.release()
    if cache is None:  # not rank 0, which saves it
        return _build(dataset, encoder, dtype, is_main)
    return _loaded(cache, path, is_main)


def _loaded(cache: LatentCache, path: Path, is_main: bool) -> LatentCache:
    cache.path = path
    if is_main:
        print(f"elflow train: latent cache loaded from {path}", flush=True)
    return cache


def _acquire(path: Path, is_main: bool) -> FileLock:
    """The lock of the cache file ``path``, held; a line says when another run holds it."""
    lock = FileLock(path.with_name(f".{path.stem}.lock"))
    try:
        lock.acquire(timeout=0)
    except Timeout:
        if is_main:
            print(f"elflow train: waiting for another run to save {path}", flush=True)
        lock.acquire()
    return lock


def _build(
    dataset: RowDataset,
    encoder: FrozenEncoder,
    dtype: str,
    is_main: bool,
    *,
    path: Path | None = None,
    key: str = "",
    note: str = "",
) -> LatentCache:
    """Encode every row; with ``path``, save there under ``key``; rank 0 prints one line."""
    t0 = time.perf_counter()
    cache = LatentCache.build(dataset, encoder, dtype=dtype, check_memory=False)
    if path is not None:
        try:
            cache.save(path, key)
            cache.path = path
            note = f"saved to {path} ({path.stat().st_size / 2**30:.2f} GiB)"
        except (OSError, SafetensorError) as e:
            note = f"not saved ({first_line(e)})"
    if is_main:
        seconds = time.perf_counter() - t0
        note = f"; {note}" if note else ""
        print(
            f"elflow train: latent cache of {len(cache)} rows built in {seconds:.0f} s{note}",
            flush=True,
        )
    return cache


READY = "elflow/latent-cache"
"""The rendezvous-store key under which process 0 says where the cache is (or why not)."""
WAIT_HOURS = 48
"""How long the other processes wait for process 0 to build the cache."""


def shared_latent_cache(
    cfg: DataConfig, dataset: RowDataset, encoder: FrozenEncoder, out: Path, info
) -> LatentCache:
    """The run's latent cache, built once: by process 0, which saves it (as
    :func:`run_latent_cache`) while the others wait, then load that file. Refused in one line
    when it cannot be shared: a cache not saved (``data.latent_cache_save=false``, a read-only
    folder) or saved where another process cannot read it (a node-local folder)."""
    if info.world_size == 1:
        return run_latent_cache(cfg, dataset, encoder, out, True)
    import socket
    from datetime import timedelta

    import torch.distributed as dist

    store = dist.distributed_c10d._get_default_store()
    share = (
        "set data.latent_cache_dir to a folder every node can read (e.g. data.latent_cache_dir="
        "run, the run folder), or turn data.latent_cache off"
    )
    if info.is_main:
        if not cfg.latent_cache_save:
            problem = (
                f"data.latent_cache_save=false would make each of the {info.world_size} "
                f"processes encode every row; save the cache ({share})"
            )
            store.set(READY, "!" + problem)
            raise ELFError(problem)
        try:
            cache = run_latent_cache(cfg, dataset, encoder, out, True)
        except BaseException as e:
            store.set(READY, "!process 0 could not build the latent cache: " + first_line(e))
            raise
        if cache.path is None:
            problem = f"process 0 could not save the latent cache, which the others load; {share}"
            store.set(READY, "!" + problem)
            raise ELFError(problem)
        store.set(READY, str(cache.path))
        return cache
    store.wait([READY], timedelta(hours=WAIT_HOURS))
    said = store.get(READY).decode()
    if said.startswith("!"):
        raise ELFError(said[1:])
    key = cache_key(dataset, encoder, cfg.latent_cache_dtype)
    cache = LatentCache.load(said, key)
    if cache is None:
        raise ELFError(
            f"process {info.rank} (on {socket.gethostname()}) cannot read the latent cache "
            f"process 0 saved at {said}; {share}"
        )
    cache.path = Path(said)
    return cache
