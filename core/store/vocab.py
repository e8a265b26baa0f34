"""The frequency-thresholded vocabulary of the categorical features, as the DLRM reference and
torchrec's Criteo preprocessing build it: a value seen at least ``min_count`` times in the
training data gets a row of its own, every other value of the feature shares row 0.

Counting is distributed: each preprocessing task counts its chunk (``IdCounter``) into a
file with one record batch per feature, a Ray Data pass of one task per feature sums that
feature's counts over the chunks and keeps its frequent values (``frequent_values``), and
the kept values, sorted, are the vocabulary (``vocab.arrow``).
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.fs as pafs

from core.data.criteo import NUM_SPARSE, SPARSE_COLUMNS
from core.data.sources import open_filesystem

__all__ = ["COUNTS_SCHEMA", "IdCounter", "VOCAB_FILE", "Vocabulary", "frequent_values"]

COUNTS_SCHEMA = pa.schema([("feature", pa.uint8()), ("value", pa.uint32()), ("count", pa.int64())])
VOCAB_FILE = "vocab.arrow"


def _sum_counts(values: np.ndarray, counts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Distinct values, ascending, with their summed counts."""
    order = np.argsort(values, kind="stable")
    values, counts = values[order], counts[order]
    starts = np.flatnonzero(np.r_[True, values[1:] != values[:-1]]) if len(values) else np.zeros(0, dtype=np.int64)
    return values[starts], np.add.reduceat(counts, starts) if len(values) else counts


class IdCounter:
    """How often each raw id of each feature occurs in the batches it is given."""

    def __init__(self) -> None:
        self._parts: list[list[tuple[np.ndarray, np.ndarray]]] = [[] for _ in range(NUM_SPARSE)]

    def __call__(self, sparse: np.ndarray) -> None:
        for f in range(NUM_SPARSE):
            values, counts = np.unique(sparse[:, f], return_counts=True)
            self._parts[f].append((values, counts.astype(np.int64)))

    def write(self, fs: pafs.FileSystem, path: str) -> None:
        """The counts as an IPC file of 26 record batches, batch ``f`` feature ``f``'s distinct
        values with their counts: a feature's counts are read alone (``read_feature_counts``)."""
        with fs.open_output_stream(path, compression=None) as sink, pa.ipc.new_file(sink, COUNTS_SCHEMA) as out:
            for f, parts in enumerate(self._parts):
                if parts:
                    values, counts = _sum_counts(np.concatenate([p[0] for p in parts]),
                                                 np.concatenate([p[1] for p in parts]))
                else:
                    values, counts = np.zeros(0, dtype=np.uint32), np.zeros(0, dtype=np.int64)
                out.write_batch(pa.record_batch(
                    [pa.array(np.full(len(values), f, dtype=np.uint8)), pa.array(values.astype(np.uint32)),
                     pa.array(counts)], schema=COUNTS_SCHEMA))


def frequent_values(count_uris: list[str], feature: int, min_count: int) -> np.ndarray:
    """Feature ``feature``'s values counted at least ``min_count`` times over the counts files
    ``count_uris`` (one per chunk), ascending: one task of the vocabulary's Ray Data pass."""
    values, counts = [], []
    for uri in count_uris:
        fs, path = open_filesystem(uri)
        with fs.open_input_file(path) as f:
            batch = pa.ipc.open_file(f).get_batch(feature)
        values.append(batch.column(1).to_numpy())
        counts.append(batch.column(2).to_numpy())
    if not values:
        return np.zeros(0, dtype=np.uint32)
    distinct, totals = _sum_counts(np.concatenate(values), np.concatenate(counts))
    return distinct[totals >= min_count].astype(np.uint32)


class Vocabulary:
    """Per feature, the sorted values that have a row of their own: value ``v`` of feature
    ``f`` is row ``1 + index of v``, any other value row 0."""

    def __init__(self, values: list[np.ndarray]):
        if len(values) != NUM_SPARSE:
            raise ValueError(f"a vocabulary needs {NUM_SPARSE} features, got {len(values)}")
        self.values = [np.asarray(v, dtype=np.uint32) for v in values]

    @property
    def table_rows(self) -> tuple[int, ...]:
        return tuple(len(v) + 1 for v in self.values)

    def map_ids(self, sparse: np.ndarray) -> np.ndarray:
        """uint32 [n, 26] raw ids -> uint32 [n, 26] rows."""
        out = np.zeros(sparse.shape, dtype=np.uint32)
        for f, values in enumerate(self.values):
            if len(values) == 0:
                continue
            column = sparse[:, f]
            at = np.minimum(np.searchsorted(values, column), len(values) - 1)
            hit = values[at] == column
            out[:, f] = np.where(hit, at + 1, 0)
        return out

    @classmethod
    def from_table(cls, table: pa.Table) -> "Vocabulary":
        feature = table.column("feature").to_numpy()
        value = table.column("value").to_numpy()
        order = np.lexsort((value, feature))
        feature, value = feature[order], value[order]
        bounds = np.searchsorted(feature, np.arange(NUM_SPARSE + 1))
        return cls([value[bounds[f]:bounds[f + 1]] for f in range(NUM_SPARSE)])

    def to_table(self) -> pa.Table:
        return pa.table({
            "feature": pa.array(np.concatenate([np.full(len(v), f, dtype=np.uint8) for f, v in enumerate(self.values)])),
            "column": pa.array(np.concatenate([np.full(len(v), SPARSE_COLUMNS[f]) for f, v in enumerate(self.values)])),
            "value": pa.array(np.concatenate(self.values)),
            "row": pa.array(np.concatenate([np.arange(1, len(v) + 1, dtype=np.uint32) for v in self.values])),
        })

    def write(self, uri: str) -> None:
        """As an IPC file: (feature, column name, value, row), rows 1..K per feature."""
        fs, path = open_filesystem(uri, "data.cache_dir")
        if isinstance(fs, pafs.LocalFileSystem):
            fs.create_dir(path.rsplit("/", 1)[0], recursive=True)
        table = self.to_table()
        with fs.open_output_stream(path, compression=None) as sink, pa.ipc.new_file(sink, table.schema) as writer:
            writer.write_table(table)

    @classmethod
    def read(cls, uri: str) -> "Vocabulary":
        fs, path = open_filesystem(uri, "data.cache_dir")
        with fs.open_input_file(path) as f:
            return cls.from_table(pa.ipc.open_file(f).read_all())
