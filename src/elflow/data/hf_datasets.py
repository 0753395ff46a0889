"""Hugging Face datasets as a data source: `load_from_disk` folders and Hub names.

The `datasets` package is imported only when such a source is used; without it the error says
how to install it. Arrow-backed datasets are memory-mapped by `datasets`, so iterating streams.
"""

from __future__ import annotations

import os
from pathlib import Path

from elflow.config.data_config import DataConfig
from elflow.errors import ELFError, first_line


def load_hf(location: str, split: str, streaming: bool = False):
    """A dataset saved with ``save_to_disk`` (memory-mapped), or any other name ``load_dataset``
    takes (a Hub name, a local folder of data files), streamed when ``streaming``."""
    try:
        import datasets
    except ImportError:
        raise ELFError(
            f"reading the Hugging Face dataset '{location}' needs the datasets package; "
            "pip install datasets (or elflow[data])"
        ) from None
    path = Path(os.path.expanduser(location))
    try:
        if path.is_dir() and is_saved_dataset(path):
            ds = datasets.load_from_disk(str(path))
        else:
            ds = datasets.load_dataset(location, split=split, streaming=streaming)
    except Exception as e:  # datasets raises many types; all mean "cannot load this"
        raise ELFError(
            f"cannot load Hugging Face dataset '{location}' ({first_line(e)}); pass a saved "
            "dataset folder or a Hub name"
        ) from None
    if isinstance(ds, datasets.DatasetDict | datasets.IterableDatasetDict):
        if split not in ds:
            raise ELFError(
                f"dataset '{location}' has no split '{split}' (splits: {', '.join(ds)}); "
                "set data.hf_split (data.hf_valid_split for the validation data)"
            )
        ds = ds[split]
    return ds


def is_saved_dataset(path: Path) -> bool:
    """A folder written by ``Dataset.save_to_disk`` (or a DatasetDict's)."""
    names = ("dataset_info.json", "state.json", "dataset_dict.json")
    return any((path / n).is_file() for n in names)


def hf_kind(cfg: DataConfig, location: str, split: str, streaming: bool = False) -> str:
    ds = load_hf(location, split, streaming)
    names = ds.column_names
    if names is None:  # a stream whose features are not declared: its first record's
        names = list(next(iter(ds), {}))
    columns = set(names)
    if cfg.format == "pretokenized" or "input_ids" in columns:
        return "pretokenized"
    if cfg.format == "pairs" or (cfg.source_field in columns and cfg.target_field in columns):
        return "pairs"
    if cfg.text_field in columns:
        return "text"
    raise ELFError(
        f"dataset '{location}' has no '{cfg.text_field}' column, no '{cfg.source_field}'/"
        f"'{cfg.target_field}' pair and no 'input_ids' (columns: {', '.join(sorted(columns))}); "
        "set data.text_field or data.source_field and data.target_field"
    )
