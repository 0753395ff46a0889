"""`elflow prepare`: tokenise a corpus once into a memory-mappable folder (spec §4, §10).

`add_arguments(parser)` and `run(args)` plug into the command table of :mod:`elflow.__main__`.
With `--encoder`, latent_std is measured on a sample of the prepared rows and written to meta.json.
The data readers' errors name config keys (`data.path`), right for `elflow train`; here they are
reworded once, through `FLAGS`, to name this command's flags (`--data`).
"""

from __future__ import annotations

import argparse
import json
import re

from elflow.data.config import FORMATS, DataConfig
from elflow.errors import ELFError
from elflow.generation.pipeline import load_tokenizer

FLAGS = {
    "data.path": "--data",
    "data.format": "--format",
    "data.text_field": "--text-field",
    "data.source_field": "--source-field",
    "data.target_field": "--target-field",
    "data.hf_split": "--hf-split",
    "data.doc_per": "--doc-per",
    "data.packing": "--packing",
    "data.overlong": "--overlong",
    "data.max_rows": "--max-rows",
    "data.tokenize_batch_size": "--batch-size",
    "model.max_length": "--max-length",
    "max_length": "--max-length",
    "max_input_length": "--max-input-length",
    "out_dir": "--out",
    "overwrite=True": "--overwrite",
}
"""What a setting named in an error is called on the `elflow prepare` command line."""
# A key only where it stands alone: not inside a longer name, a path or a quoted value.
_SETTING = re.compile(
    r"(?<![\w.'\"/-])("
    + "|".join(re.escape(k) for k in sorted(FLAGS, key=len, reverse=True))
    + r")(?![\w'\"/-]|\.\w)"
)


def flag_names(message: str, keep: tuple[str, ...] = ()) -> str:
    """`message` with the settings it names written as `elflow prepare` flags.

    A user's path that spells a setting (a data file called `data.path`) keeps its name where it
    stands as a path: quoted (which the pattern never rewrites) or as `path:line`.
    """

    def flag(m: re.Match) -> str:
        name = m.group(1)
        if name in keep and re.match(r":\d", message[m.end() :]):
            return name
        return FLAGS[name]

    return _SETTING.sub(flag, message)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--data", required=True, help="text/JSONL file or folder, HF dataset or name")
    p.add_argument("--format", default="auto", choices=FORMATS, help="input format (auto)")
    p.add_argument("--tokenizer", help="tokenizer name or folder (default: --encoder)")
    p.add_argument("--out", required=True, help="folder to write")
    p.add_argument("--max-length", type=int, required=True, help="row length L")
    p.add_argument("--max-input-length", type=int, default=0, help="source length (pairs)")
    p.add_argument("--text-field", default="text")
    p.add_argument("--source-field", default="source")
    p.add_argument("--target-field", default="target")
    p.add_argument("--hf-split", default="train")
    p.add_argument("--doc-per", default="line", choices=["line", "file"], help="plain text")
    p.add_argument("--packing", action="store_true", help="count truncation as packed rows")
    p.add_argument("--overlong", default="truncate", choices=["truncate", "error"])
    p.add_argument("--max-rows", type=int, default=0, help="read at most N documents (0: all)")
    p.add_argument("--batch-size", type=int, default=1024, help="documents per tokenizer call")
    p.add_argument("--encoder", help="encoder name or folder: measure latent_std (spec §10)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing --out folder")


def run(args: argparse.Namespace) -> int:
    try:
        return _run(args)
    except ELFError as e:
        e.args = (flag_names(str(e), keep=(args.data, args.out, args.tokenizer, args.encoder)),)
        raise


def _run(args: argparse.Namespace) -> int:
    from elflow.data.prepare import prepare

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
        from elflow.encoder import FrozenEncoder

        encoder = FrozenEncoder.from_pretrained(args.encoder, latent_std=1.0)
    out = prepare(
        cfg,
        tokenizer,
        args.out,
        args.max_length,
        args.max_input_length,
        encoder,
        overwrite=args.overwrite,
    )
    meta = json.loads((out / "meta.json").read_text())
    keys = ("num_docs", "num_tokens", "num_source_tokens", "num_truncated", "dtype", "latent_std")
    print(f"wrote {out}: " + ", ".join(f"{k}={meta[k]}" for k in keys if k in meta))
    return 0
