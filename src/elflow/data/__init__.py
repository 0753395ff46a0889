"""Data pipeline: readers, preparation, rows, order and the latent cache (ELF_SPEC §4, §10).

Names load on first use (``elflow.data.config`` is light: the command line reads it).
"""

from elflow.lazy import lazy_exports

_EXPORTS = {
    "DataConfig": "elflow.data.config",
    "LatentCache": "elflow.data.latent_cache",
    "StreamOrder": "elflow.data.order",
    "keyed_bernoulli": "elflow.data.order",
    "keyed_uniform": "elflow.data.order",
    "rank_positions": "elflow.data.order",
    "prepare": "elflow.data.preparation",
    "RowDataset": "elflow.data.rows",
    "build_dataset": "elflow.data.rows",
    "Source": "elflow.data.sources",
    "iter_examples": "elflow.data.sources",
    "resolve_source": "elflow.data.sources",
    "TokenTable": "elflow.data.tables",
}
__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
