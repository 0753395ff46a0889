"""Data pipeline: readers, preparation, rows, order and the latent cache (ELF_SPEC §4, §10)."""

from elflow.data.config import DataConfig
from elflow.data.latent_cache import LatentCache
from elflow.data.order import StreamOrder, keyed_bernoulli, keyed_uniform, rank_positions
from elflow.data.prepare import prepare
from elflow.data.rows import RowDataset, build_dataset
from elflow.data.sources import Source, iter_examples, resolve_source
from elflow.data.tables import TokenTable

__all__ = [
    "DataConfig",
    "LatentCache",
    "RowDataset",
    "Source",
    "StreamOrder",
    "TokenTable",
    "build_dataset",
    "iter_examples",
    "keyed_bernoulli",
    "keyed_uniform",
    "prepare",
    "rank_positions",
    "resolve_source",
]
