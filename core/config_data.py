"""The data section of the run config: where the Criteo-format inputs are, how they are
preprocessed into the microbatch store, and the synthetic data written where they are missing."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from core.config_failures import Section as _Section

__all__ = ["DataConfig", "GenerateConfig"]


class GenerateConfig(_Section):
    """Synthetic data written by ``cpr datagen`` when the data files do not exist yet."""

    train_rows: int = Field(200_000, ge=1, le=10**10)
    """Training rows to write."""
    eval_rows: int = Field(20_000, ge=1, le=10**9)
    """Held-out rows to write (a separate file, never trained on)."""
    seed: int = Field(0, ge=0)
    """Generator seed: the same seed writes byte-identical files."""
    format: Literal["tsv", "tsv.gz", "parquet"] = "tsv"
    """File format of the generated data."""
    vocab_rows: int = Field(100_000, ge=2, le=2**32)
    """Distinct categorical values per feature before hashing to table rows."""


class DataConfig(_Section):
    """Where the Criteo-format data lives and how it is preprocessed (on Ray Data) into the microbatch store."""

    train: list[str] = Field(..., min_length=1)
    """Training files: local paths or ``pyarrow.fs`` URIs (``s3://bucket/day_*.gz?endpoint_override=host:port``),
    globs allowed; Criteo TSV (optionally .gz) or Parquet, read as a stream."""
    eval: list[str] = Field(..., min_length=1)
    """Held-out files, as ``train``; a fixed split that is never trained on."""
    generate: GenerateConfig | None = None
    """If set and the (local) files are missing, synthetic data is generated first: only when data.train and
    data.eval name exactly ``<dir>/train<ext>`` and ``<dir>/eval<ext>`` of one directory that is new, empty
    or the generator's own (it holds ``datagen.json``); never over a file."""
    skip_bad_lines: bool = False
    """Count and skip malformed lines instead of stopping with an error."""
    mapping: Literal["hash", "vocab"] = "hash"
    """Categorical id -> table row: ``hash`` (id mod the table's rows, ``model.table_rows``) or ``vocab``
    (values seen at least ``min_count`` times in the training data get their own row, the rest of a
    feature share one; the tables get the vocabulary's sizes)."""
    min_count: int = Field(3, ge=1, le=10**9)
    """``mapping: vocab``: how often a value must occur in the training data to get a row of its own."""
    chunk_mb: int = Field(64, ge=1, le=4096)
    """Preprocessing task size: a plain TSV file is cut into byte ranges of this many MiB (a gzip or
    Parquet file is one task)."""
    cache_dir: str | None = None
    """Where the microbatch store goes (a path or ``pyarrow.fs`` URI, reused when inputs and options match,
    safe for runs that build or read it at once);
    default ``cache`` beside the run directory (``runs/cache``: every run under ``runs/`` reuses it), or
    beside ``checkpoint.storage`` when that is an object-store URI."""
    store_cache_mb: int = Field(256, ge=0, le=1 << 20)
    """Per trainer: memory for microbatches read from a remote store (a local store is memory-mapped)."""
    verify_data: bool = False
    """Read every input byte again before reusing a store, and build it again if any differs (``cpr train
    --verify-data``). Without it a store is reused when each input's name, size, modification time and
    first and last 64 KiB match: a file rewritten in the middle with its size and time restored is missed."""
