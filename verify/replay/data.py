"""The training microbatch store, read by the checker with pyarrow alone: for store microbatch
``i``, the arrays the product's trainers feed to the dense model and to the embedding shards.

The store holds its rows already transformed, once, when it was built: a label 0.0 or 1.0;
the 13 dense features as ``log1p(max(x, 0))`` (a missing value 0), float32; the 26
categorical ids as rows of their tables, uint32 (mapping ``hash``: the raw id modulo the
table's rows, ``model.table_rows`` capped at ``model.max_ind_range``; ``vocab``: rows
1..K for the values frequent in the training data, row 0 for the rest). A trainer feeds the
labels and dense features as read, and the rows widened to int64, nothing else applied.

Layout: ``store.json`` lists the parts (Arrow IPC files) in order with their microbatch
counts; record batch ``j`` of a part is its ``j``-th microbatch, with columns ``label``
(float32), ``dense`` (13 float32 each) and ``sparse`` (26 uint32 each).
"""

from __future__ import annotations

import bisect
import itertools
import json
import os
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.fs as pafs

from verify.files import RunFiles

__all__ = ["STORE_MANIFEST", "DataCache", "train_store"]

STORE_MANIFEST = "store.json"
DENSE_FEATURES = 13  # the 13 integer features of a Criteo row
SPARSE_FEATURES = 26  # its 26 categorical features, one embedding table each


def _fixed_list_of(t: pa.DataType, value: pa.DataType, size: int) -> bool:
    return pa.types.is_fixed_size_list(t) and t.list_size == size and t.value_type == value


class DataCache:
    """The training store at ``uri`` (a local path, ``file://`` or any ``pyarrow.fs`` URI such
    as ``s3://bucket/path?endpoint_override=...``, its credentials from the environment),
    read here on its own. ``len()`` microbatches; ``microbatch(i)`` what a trainer feeds for
    microbatch ``i``: (labels float32 [B], dense float32 [B, 13], rows int64 [B, 26])."""

    def __init__(self, uri: str):
        if "://" in uri and not uri.startswith("file://"):
            self._fs, base = pafs.FileSystem.from_uri(uri)
        else:
            self._fs, base = pafs.LocalFileSystem(), os.path.abspath(uri.removeprefix("file://"))
        self.uri = uri
        base = base.rstrip("/")
        with self._fs.open_input_stream(f"{base}/{STORE_MANIFEST}", compression=None) as f:
            self.manifest: dict = json.loads(f.read())
        parts = self.manifest["parts"]
        self._paths = [f"{base}/{p['file']}" for p in parts]
        self._ends = list(itertools.accumulate(int(p["microbatches"]) for p in parts))
        self._open: dict[int, pa.ipc.RecordBatchFileReader] = {}

    def __len__(self) -> int:
        return self._ends[-1] if self._ends else 0

    @property
    def table_rows(self) -> list[int] | None:
        """Rows per table that the store's ids were mapped into, as its manifest says (None:
        the manifest does not say)."""
        rows = (self.manifest.get("mapping") or {}).get("table_rows")
        return [int(r) for r in rows] if rows else None

    def _part(self, part: int) -> pa.ipc.RecordBatchFileReader:
        reader = self._open.get(part)
        if reader is None:
            reader = pa.ipc.open_file(self._fs.open_input_file(self._paths[part]))
            schema = reader.schema
            names = set(schema.names)
            if not ({"label", "dense", "sparse"} <= names
                    and schema.field("label").type == pa.float32()
                    and _fixed_list_of(schema.field("dense").type, pa.float32(), DENSE_FEATURES)
                    and _fixed_list_of(schema.field("sparse").type, pa.uint32(), SPARSE_FEATURES)):
                raise ValueError(f"{self._paths[part]}: not a microbatch part (schema {schema})")
            self._open[part] = reader
        return reader

    def _batch(self, i: int) -> pa.RecordBatch:
        if not 0 <= i < len(self):
            raise IndexError(f"microbatch {i} of a store of {len(self)}")
        part = bisect.bisect_right(self._ends, i)
        return self._part(part).get_batch(i - (self._ends[part - 1] if part else 0))

    @staticmethod
    def _matrix(batch: pa.RecordBatch, name: str) -> np.ndarray:
        column = batch.column(name)
        return column.flatten().to_numpy().reshape(len(column), column.type.list_size)

    def labels(self, i: int) -> np.ndarray:
        """float32 [B]: 0.0 or 1.0 per row."""
        return self._batch(i).column("label").to_numpy()

    def dense(self, i: int) -> np.ndarray:
        """float32 [B, 13]: the dense features as the model gets them (``log1p(max(x, 0))``)."""
        return self._matrix(self._batch(i), "dense")

    def sparse(self, i: int) -> np.ndarray:
        """uint32 [B, 26]: the table row of each categorical feature, as stored."""
        return self._matrix(self._batch(i), "sparse")

    def rows(self, i: int) -> np.ndarray:
        """int64 [B, 26]: the table rows the trainers route to the embedding shards."""
        return self.sparse(i).astype(np.int64)

    def microbatch(self, i: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(labels float32 [B], dense float32 [B, 13], rows int64 [B, 26]) of microbatch ``i``,
        read once."""
        batch = self._batch(i)
        return (batch.column("label").to_numpy(), self._matrix(batch, "dense"),
                self._matrix(batch, "sparse").astype(np.int64))


def train_store(run: RunFiles) -> str | None:
    """The URI of the run's training store: as run.json names it, else the local store in
    ``data.cache_dir`` (``<run_dir>/cache`` in runs that did not record it) whose manifest lists the run's train files;
    None where neither is found."""
    uri = run.run_info.get("train_cache")
    if uri:  # the build the run read: no other build of the store holds its bytes
        return uri if "://" in uri or (Path(uri) / STORE_MANIFEST).exists() else None
    cache_dir = run.resolve(run.config["data"].get("cache_dir") or str(Path(run.config["run_dir"]) / "cache"))
    sources = [os.path.abspath(p) for p in run.config["data"]["train"]]
    for meta in sorted(cache_dir.glob(f"train-*/{STORE_MANIFEST}")):
        if json.loads(meta.read_text()).get("sources") == sources:
            return str(meta.parent)
    return None
