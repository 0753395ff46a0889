"""One-time preparation of a corpus into a memory-mappable token folder (`elflow prepare`).

The folder holds flat token files plus int64 document offsets (`tokens.*` for unconditional
data, `source.*` and `target.*` for pairs; see :mod:`elflow.data.token_tables`) and `meta.json`:
tokenizer name and vocabulary hash, dtype, document/token/truncation counts, and — when an
encoder is given — `latent_std`, the RMS of its raw outputs over a fixed sample of rows (spec
§10: measured at preparation for non-T5 encoders). The documents are tokenised in shards by N
worker processes (:mod:`elflow.data.shards`), so memory stays bounded and a killed run resumes;
the folder is built under a temporary name and renamed into place only when complete.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np
import torch

from elflow.config.data_config import DataConfig
from elflow.data.rows import RowDataset, read_meta
from elflow.data.shards import SHARD_BYTES, remove_shards, tokenize_to_folder
from elflow.data.text_sources import PREPARED_MARKER, Source, is_prepared, resolve_source
from elflow.data.token_tables import token_dtype
from elflow.errors import ELFError, Interrupted
from elflow.text.encoder import measure_latent_std
from elflow.text.encoder_protocol import Encoder
from elflow.text.tokens import token_spec, vocab_hash

LATENT_STD_ROWS = 256
LATENT_STD_BATCH = 32


def prepare(
    cfg: DataConfig,
    tokenizer,
    out_dir: str | Path,
    max_length: int,
    max_input_length: int = 0,
    encoder: Encoder | None = None,
    *,
    overwrite: bool = False,
    pad_id: int | None = None,
    workers: int = 1,
    progress: bool = False,
    shard_bytes: int = SHARD_BYTES,
) -> Path:
    """Tokenise `cfg.path` into `out_dir` with `workers` processes; returns the folder.

    `max_length`/`max_input_length` only decide the truncation count in meta.json (and the rows
    latent_std is measured on): the stored documents are complete, so the folder can be read at
    other lengths later. `overwrite` replaces an existing `out_dir` only when it is an earlier
    prepared folder that does not hold the input, and only once the new folder is complete (a
    failure keeps the old one). The work is done in `.<out>.partial` beside `out_dir`: a run that
    is killed or interrupted keeps its finished shards there, and the same call resumes from them
    (:mod:`elflow.data.shards`); a data error removes it. Hugging Face Hub datasets are streamed.
    """
    out = Path(out_dir)
    if out.exists() and not overwrite:
        raise ELFError(
            f"'{out}' already exists; remove it, choose another out_dir, or pass overwrite=True"
        )
    if out.exists():
        _check_replaceable(out, cfg.path)
    src = resolve_source(cfg, cfg.path, streaming=True)
    if src.container == "prepared":
        raise ELFError(f"'{cfg.path}' is already a prepared folder; nothing to do")
    spec = token_spec(tokenizer)
    pad_id = spec.pad_id if pad_id is None else pad_id
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.partial"
    tmp.mkdir(exist_ok=True)
    plan = _plan(cfg, src, tokenizer)
    try:
        target, source, work = tokenize_to_folder(
            src,
            cfg,
            tokenizer,
            tmp,
            plan,
            workers=workers,
            shard_bytes=shard_bytes,
            progress=progress,
        )
        rows = RowDataset(
            target,
            source=source,
            max_length=max_length,
            pad_id=pad_id,
            max_input_length=max_input_length,
            packing=cfg.packing,
            overlong=cfg.overlong,
            eos_id=spec.eos_id,
        )
        meta = {
            PREPARED_MARKER: 1,
            "source": str(cfg.path),
            "format": f"{src.container}/{src.kind}",
            "tokenizer": str(getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__),
            "vocab_hash": vocab_hash(tokenizer),
            "vocab_size": spec.vocab_size,
            "eos_id": spec.eos_id,
            "pad_id": pad_id,
            "dtype": token_dtype(spec.vocab_size).name,
            "conditional": rows.conditional,
            "num_docs": rows.num_docs,
            "num_tokens": target.num_tokens,
            "num_source_tokens": source.num_tokens if source is not None else 0,
            "max_length": max_length,
            "max_input_length": max_input_length,
            "packing": cfg.packing,
            "num_rows": len(rows),
            "num_truncated": rows.num_truncated,
            **work,
        }
        if encoder is not None:
            meta["latent_std"] = measure_rows_latent_std(rows, encoder)
            meta["latent_std_encoder"] = getattr(encoder, "name", None)
        remove_shards(tmp)
        (tmp / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")
        del rows, target, source  # release the memmaps before the rename
        if out.exists():
            old = out.parent / f".{out.name}.old-{os.getpid()}"
            out.rename(old)
            tmp.rename(out)
            shutil.rmtree(old, ignore_errors=True)
        else:
            tmp.rename(out)
    except ELFError:  # the data must change first, and with it the plan: nothing to resume
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    except KeyboardInterrupt:
        raise Interrupted(
            f"interrupted; the finished shards are kept in {tmp}: run the same command to go on "
            "from them",
            130,  # 128 + SIGINT, as every command exits on Ctrl-C
        ) from None
    return out


def _plan(cfg: DataConfig, src: Source, tokenizer) -> dict:
    """What the shards of a preparation depend on: a later run with the same plan reuses them."""
    files = [[str(p), p.stat().st_size, p.stat().st_mtime_ns] for p in src.files]
    reading = ("format", "text_field", "source_field", "target_field", "hf_split", "doc_per")
    return {
        "source": str(cfg.path),
        "files": files,
        "kind": f"{src.container}/{src.kind}",
        **{k: getattr(cfg, k) for k in reading},
        "max_rows": cfg.max_rows,
        "vocab_hash": vocab_hash(tokenizer),
    }


def _check_replaceable(out: Path, data: str) -> None:
    """`overwrite` replaces only an earlier prepared folder, never the input or other files."""
    data_path = Path(os.path.expanduser(data)).resolve() if data else None
    if data_path is not None and data_path.exists():
        target = out.resolve()
        if data_path == target or target in data_path.parents:
            what = "is" if data_path == target else "holds"
            raise ELFError(
                f"out_dir '{out}' {what} the input data '{data}', which overwrite=True would "
                "delete; choose another out_dir"
            )
    if not is_prepared(out):
        raise ELFError(
            f"'{out}' is not a folder written by elflow prepare, so overwrite=True will not "
            "replace it; choose another out_dir (or move it away yourself)"
        )


def measure_rows_latent_std(
    rows: RowDataset, encoder: Encoder, num_rows: int = LATENT_STD_ROWS, seed: int = 0
) -> float:
    """latent_std over a fixed random sample of `num_rows` rows (spec §10)."""
    rng = np.random.Generator(np.random.PCG64(seed))
    n = min(num_rows, len(rows))
    sample = np.sort(rng.choice(len(rows), size=n, replace=False))
    batches = (
        rows.get_batch(sample[i : i + LATENT_STD_BATCH]) for i in range(0, n, LATENT_STD_BATCH)
    )
    return measure_latent_std(encoder, batches)


def prepared_latent_std(data_path: str, encoder: str, layer: int, rows: RowDataset) -> float:
    """latent_std measured by ``elflow prepare --encoder``; 0 (measure it again) when absent, for
    another encoder or layer, or over rows of another shape than ``rows`` (the training rows)."""
    path = Path(data_path)
    if not is_prepared(path):  # raw data (a meta.json of its own included)
        return 0.0
    meta = read_meta(path)
    if meta.get("latent_std_encoder") != encoder or layer:
        return 0.0  # prepare measures the encoder's output only
    shape = (rows.max_length, rows.max_input_length if rows.conditional else 0, rows.packing)
    measured = (meta.get("max_length"), meta.get("max_input_length") or 0, meta.get("packing"))
    if shape != measured:
        return 0.0  # the latents of longer or packed rows have another scale
    return float(meta.get("latent_std") or 0.0)


@torch.no_grad()
def measure_first_rows_latent_std(
    encoder: Encoder, dataset: RowDataset, device: torch.device
) -> float:
    """latent_std over the first rows, for data that `elflow prepare` did not measure (spec §10)."""
    n = min(LATENT_STD_ROWS, len(dataset))
    rows = dataset.get_rows(np.arange(n))
    batches = []
    for start in range(0, n, LATENT_STD_BATCH):
        sl = slice(start, start + LATENT_STD_BATCH)
        batch = {k: torch.from_numpy(v[sl]).to(device) for k, v in rows.items()}
        if not dataset.conditional:
            batch.pop("cond_mask", None)
        batches.append(batch)
    return float(measure_latent_std(encoder, batches))
