"""`elflow prepare`: tokenise a corpus once into a memory-mappable folder (spec §4, §10).

With `--encoder`, latent_std is measured on a sample of the prepared rows and written to meta.json.
The data readers' errors name config keys (`data.path`), right for `elflow train`; this command's
are written with its flags (`--data`) by `elflow.cli.flags`, as every command's are.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from elflow.config import field_docs
from elflow.config.data_config import FORMATS, DataConfig
from elflow.errors import ELFError, Interrupted


def add_arguments(p: argparse.ArgumentParser) -> None:
    docs = field_docs(DataConfig)  # the data.* keys' docstrings: one source of help text
    p.add_argument("--data", required=True, help=docs["path"])
    p.add_argument("--format", default="auto", choices=FORMATS, help=docs["format"])
    p.add_argument("--tokenizer", help="tokenizer name or folder (default: --encoder's)")
    p.add_argument("--out", required=True, help="folder to write")
    p.add_argument("--max-length", type=int, required=True, help="row length L")
    p.add_argument("--max-input-length", type=int, default=0, help="source length (pairs)")
    for name in ("text_field", "source_field", "target_field", "hf_split"):
        default = getattr(DataConfig, name)
        p.add_argument("--" + name.replace("_", "-"), default=default, help=docs[name])
    p.add_argument("--doc-per", default="line", choices=["line", "file"], help=docs["doc_per"])
    p.add_argument("--packing", action="store_true", help="count truncation as packed rows")
    p.add_argument(
        "--overlong", default="truncate", choices=["truncate", "error"], help=docs["overlong"]
    )
    p.add_argument("--max-rows", type=int, default=0, help=docs["max_rows"])
    p.add_argument("--batch-size", type=int, default=1024, help=docs["tokenize_batch_size"])
    p.add_argument(
        "--workers",
        type=int,
        default=0,
        help="processes that tokenise (default 0: one per CPU core, up to 8; 1 for an input "
        "smaller than one shard)",
    )
    p.add_argument(
        "--shard-mb",
        type=float,
        default=16.0,
        help="text per shard, in MB: the unit of parallel work and of resuming a killed run",
    )
    p.add_argument("--encoder", help="encoder name or folder: measure latent_std (spec §10)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing --out folder")


def run(args: argparse.Namespace) -> int:
    from elflow.data.preparation import prepare
    from elflow.io.paths import output_dir
    from elflow.text.tokenizer import load_tokenizer

    if args.max_length < 1:  # before the tokenizer loads and the corpus is read
        raise ELFError(f"--max-length must be positive, got {args.max_length}")
    cores = os.cpu_count() or 1
    if not 0 <= args.workers <= 4 * cores:
        raise ELFError(
            f"--workers must be 0 (one per core) to {4 * cores} (4 per core here), "
            f"got {args.workers}"
        )
    if not Path(args.out).exists():  # (an existing one is the preparation's to judge)
        output_dir(args.out, "--out")  # a creatable folder, before the tokenizer loads
    name = args.tokenizer or args.encoder
    if not name:
        raise ELFError("pass --tokenizer (or --encoder, whose tokenizer is then used)")
    cfg = DataConfig(
        path=args.data,
        format=args.format,
        text_field=args.text_field,
        source_field=args.source_field,
        target_field=args.target_field,
        hf_split=args.hf_split,
        doc_per=args.doc_per,
        packing=args.packing,
        overlong=args.overlong,
        max_rows=args.max_rows,
        tokenize_batch_size=args.batch_size,
    )
    tokenizer = load_tokenizer(name)
    encoder = None
    if args.encoder:
        from elflow.text.encoder import FrozenEncoder

        encoder = FrozenEncoder.from_pretrained(args.encoder, latent_std=1.0)
    try:
        out = prepare(
            cfg,
            tokenizer,
            args.out,
            args.max_length,
            args.max_input_length,
            encoder,
            overwrite=args.overwrite,
            workers=args.workers,
            progress=True,
            shard_bytes=max(1, int(args.shard_mb * 2**20)),
        )
    except Interrupted as e:  # Ctrl-C: not an error; 130 like every command, and how to go on
        print(f"elflow prepare: {e}", file=sys.stderr)
        return e.exit_code
    meta = json.loads((out / "meta.json").read_text())
    keys = ("num_docs", "num_tokens", "num_source_tokens", "num_truncated", "dtype", "latent_std")
    keys += ("workers", "docs_per_second", "shards_kept")
    print(f"wrote {out}: " + ", ".join(f"{k}={meta[k]}" for k in keys if k in meta))
    return 0
