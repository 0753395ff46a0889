"""Data pipeline: readers, preparation, rows, order and the latent cache (ELF_SPEC §4, §10).

Names load on first use (``elflow.config.data_config`` is light: the command line reads it).
"""

from elflow.runtime.lazy_exports import lazy_exports

_EXPORTS = {
    "DataConfig": "elflow.config.data_config",
    "LatentCache": "elflow.data.latent_cache",
    "StreamOrder": "elflow.data.row_order",
    "keyed_bernoulli": "elflow.data.row_order",
    "keyed_uniform": "elflow.data.row_order",
    "rank_positions": "elflow.data.row_order",
    "prepare": "elflow.data.preparation",
    "RowDataset": "elflow.data.rows",
    "build_dataset": "elflow.data.rows",
    "Source": "elflow.data.text_sources",
    "iter_examples": "elflow.data.text_sources",
    "resolve_source": "elflow.data.text_sources",
    "TokenTable": "elflow.data.token_tables",
}
__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
