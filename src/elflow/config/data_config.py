"""Where the training text comes from and how it becomes rows (ELF_SPEC §4, §10).

`DataConfig` is a frozen dataclass validated in ``__post_init__`` like the other configs.
Lengths (``max_length``, ``max_input_length``) and the tokenizer are not part of it: they belong
to the model/encoder and are passed by the caller, so a prepared token file can be reused at
several lengths.
"""

from __future__ import annotations

from dataclasses import dataclass

from elflow.errors import require

FORMATS = ("auto", "text", "jsonl", "pairs", "hf", "pretokenized", "prepared")
LATENT_CACHE_DTYPES = ("float16", "bfloat16", "float32")


@dataclass(frozen=True)
class DataConfig:
    """Training data: its location, its format and how documents become rows."""

    path: str = ""
    """Training data: a text/JSONL file, a folder of them, an HF dataset folder or Hub name, or a
    folder written by `elflow prepare`."""
    valid_path: str = ""
    """Validation data, same kinds as `path` (empty: no validation set)."""
    format: str = "auto"
    """auto | text | jsonl | pairs | hf | pretokenized | prepared; auto looks at the path and the
    first record."""
    text_field: str = "text"
    """JSONL / HF field holding a document (unconditional data)."""
    source_field: str = "source"
    """JSONL / HF field holding the condition text (conditional data)."""
    target_field: str = "target"
    """JSONL / HF field holding the text to generate (conditional data)."""
    hf_split: str = "train"
    """Split of a Hugging Face dataset used for training."""
    hf_valid_split: str = "validation"
    """Split of a Hugging Face dataset used for validation (when `valid_path` is an HF dataset)."""
    doc_per: str = "line"
    """Plain text: one document per line (`line`) or per file (`file`)."""
    packing: bool = False
    """Unconditional data: concatenate EOS-terminated documents into rows of exactly max_length
    (True), or one document per row, truncated and padded (False)."""
    overlong: str = "truncate"
    """A document longer than its row: `truncate` (and count) or `error`. An unconditional
    document that would lose only its final EOS is not over-long."""
    latent_cache: bool = False
    """Encode every row once and reuse the latents every epoch (small corpora: N*L*E values)."""
    latent_cache_dtype: str = "float16"
    """Storage dtype of the latent cache: float16 | bfloat16 | float32 (float32 is exact)."""
    latent_cache_save: bool = True
    """Save the latent cache (N*L*E values on disk) so a later run on the same rows and encoder
    loads it instead of re-encoding every row."""
    latent_cache_dir: str = ""
    """Where the saved latent cache lives: empty = `latents/` in the user cache ($ELFLOW_CACHE),
    shared by runs; `run` = the run folder; or a folder."""
    max_rows: int = 0
    """Read at most this many documents (examples) from the source; 0 reads all."""
    tokenize_batch_size: int = 1024
    """Documents per batched call of the (fast) tokenizer."""

    def __post_init__(self) -> None:
        require(
            self.format in FORMATS, f"data.format must be one of {FORMATS}, got {self.format!r}"
        )
        require(
            self.doc_per in ("line", "file"),
            f"data.doc_per must be 'line' or 'file', got {self.doc_per!r}",
        )
        require(
            self.overlong in ("truncate", "error"),
            f"data.overlong must be 'truncate' or 'error', got {self.overlong!r}",
        )
        require(
            self.latent_cache_dtype in LATENT_CACHE_DTYPES,
            f"data.latent_cache_dtype must be one of {LATENT_CACHE_DTYPES}, "
            f"got {self.latent_cache_dtype!r}",
        )
        require(
            self.latent_cache_dir == self.latent_cache_dir.strip(),
            f"data.latent_cache_dir {self.latent_cache_dir!r} has surrounding spaces; remove them",
        )
        require(
            self.latent_cache_save or not self.latent_cache_dir,
            "data.latent_cache_dir is set but data.latent_cache_save=false saves no cache; "
            "drop one of them",
        )
        require(self.max_rows >= 0, f"data.max_rows must be >= 0 (0 = all), got {self.max_rows}")
        require(
            self.tokenize_batch_size > 0,
            f"data.tokenize_batch_size must be positive, got {self.tokenize_batch_size}",
        )
        for name in ("text_field", "source_field", "target_field", "hf_split", "hf_valid_split"):
            require(bool(getattr(self, name)), f"data.{name} must not be empty")
        require(
            self.source_field != self.target_field,
            f"data.source_field and data.target_field are both {self.source_field!r}; "
            "name two different fields",
        )
