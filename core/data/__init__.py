"""Criteo click logs: the record layout, a streaming reader of TSV, TSV.gz and Parquet files
into model-ready batches, and a seeded generator of Criteo-shaped synthetic data.
"""

from core.data.criteo import (
    COLUMNS,
    DENSE_COLUMNS,
    NUM_DENSE,
    NUM_SPARSE,
    SPARSE_COLUMNS,
    RawBatch,
    preprocess_dense,
    sparse_to_rows,
)
from core.data.datagen import GeneratorSummary, auc, generate
from core.data.reader import CriteoReader

# The name benchmarks/ddp_baseline.py imports.
_auc = auc

__all__ = [
    "COLUMNS",
    "DENSE_COLUMNS",
    "NUM_DENSE",
    "NUM_SPARSE",
    "SPARSE_COLUMNS",
    "CriteoReader",
    "GeneratorSummary",
    "RawBatch",
    "auc",
    "generate",
    "preprocess_dense",
    "sparse_to_rows",
]
