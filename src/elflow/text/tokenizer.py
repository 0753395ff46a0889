"""Tokenizers: loading one (Hub id, folder, alias, or a model's own) and checking it against a
model (ELF_SPEC §10 "Tokens with BERT-style encoders")."""

from __future__ import annotations

from pathlib import Path

from elflow.errors import ELFError, first_line
from elflow.io.artifact_config import ArtifactConfig, read_config
from elflow.io.model_sources import resolve_source
from elflow.text.encoder import check_hub_download, resolve_pretrained
from elflow.text.tokens import vocab_hash

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "vocab.txt",
    "vocab.json",
    "spiece.model",
    "tokenizer.model",
    "sentencepiece.bpe.model",
)
"""A folder holding none of these is not a tokenizer (transformers would build an empty one)."""


def load_tokenizer(name_or_path: str | Path):
    """A fast Hugging Face tokenizer, with a one-line error when it is unavailable.

    Takes a Hub id, a tokenizer folder, the offline alias ``minilm``, or an elflow model,
    checkpoint or run folder (its shipped ``tokenizer/`` files, else the tokenizer its config
    names). Remote code is never trusted.
    """
    from transformers import AutoTokenizer

    name = resolve_pretrained(str(name_or_path))
    folder = Path(name).expanduser()
    if folder.exists():
        name = str(folder)  # "~/tok" is a folder here, not a Hub id
    if folder.is_dir() and not any((folder / f).is_file() for f in TOKENIZER_FILES):
        name = _model_tokenizer(folder)
    if not Path(name).expanduser().exists():
        check_hub_download(name, "tokenizer")  # one line at once when the Hub cannot provide it
    try:
        return AutoTokenizer.from_pretrained(name, use_fast=True, trust_remote_code=False)
    except Exception as e:  # OSError, or a parser's KeyError/TypeError on a damaged file
        if Path(name).is_dir():
            raise ELFError(
                f"cannot load tokenizer {str(name_or_path)!r} ({first_line(e)}); its files are "
                "damaged or not a Hugging Face tokenizer: use the files tokenizer.save_pretrained "
                "writes"
            ) from None
        raise ELFError(
            f"cannot load tokenizer {str(name_or_path)!r} ({first_line(e)}); it must be a local "
            "folder or a Hub id reachable from here"
        ) from None


def _model_tokenizer(folder: Path) -> str:
    """The tokenizer of an elflow model, checkpoint or run folder: its shipped files, else the
    name its config records; a one-line error for any other folder without tokenizer files."""
    try:
        resolved = resolve_source(folder)
    except ELFError:
        resolved = None
    if resolved is None or resolved.kind != "elflow":
        raise ELFError(
            f"folder {folder} holds no tokenizer files ({', '.join(TOKENIZER_FILES[:3])}, ...) "
            "and no elflow model; pass a tokenizer's folder or Hub id"
        )
    return resolve_pretrained(model_tokenizer(resolved.path, read_config(resolved.path)))


def model_tokenizer(path: Path, config: ArtifactConfig) -> str:
    """A model's tokenizer: the ``tokenizer/`` files shipped in its folder (small models ship
    their vocabulary), else the one its config names."""
    shipped = path / "tokenizer"
    return str(shipped) if shipped.is_dir() else config.tokenizer


def check_tokenizer(tokenizer, config: ArtifactConfig) -> None:
    """The tokenizer must match the decoder head (and the stored vocabulary hash, if any)."""
    n = len(tokenizer)
    if n != config.model.vocab_size:
        raise ELFError(
            f"tokenizer has {n} tokens but the model's decoder head has {config.model.vocab_size}; "
            "pass the tokenizer the model was trained with"
        )
    if config.tokenizer_hash and vocab_hash(tokenizer) != config.tokenizer_hash:
        raise ELFError(
            "tokenizer vocabulary differs from the one the model was trained with (hash mismatch); "
            "pass the model's own tokenizer"
        )
