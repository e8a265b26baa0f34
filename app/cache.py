"""The preprocessed microbatch cache: Criteo records streamed once through the reader,
validated, preprocessed and written as an Arrow IPC file whose record batch ``i`` is
microbatch ``i``. Trainers memory-map it and read any microbatch by id without parsing.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np
import pyarrow as pa

from app.data import NUM_DENSE, NUM_SPARSE, CriteoReader

__all__ = ["CacheInfo", "MicrobatchFile", "build_cache"]

_FORMAT_VERSION = 1


@dataclass(frozen=True)
class CacheInfo:
    path: str
    rows: int
    microbatches: int
    microbatch_rows: int
    bad_lines: int
    reused: bool


def _source_key(paths: Sequence[str], microbatch_rows: int, skip_bad_lines: bool, keep_tail: bool) -> str:
    h = hashlib.blake2b(digest_size=10)
    h.update(json.dumps([_FORMAT_VERSION, microbatch_rows, skip_bad_lines, keep_tail]).encode())
    for p in paths:
        st = os.stat(p)
        h.update(f"{os.path.abspath(p)}|{st.st_size}|{st.st_mtime_ns}".encode())
    return h.hexdigest()


def _record_batch(labels: np.ndarray, dense: np.ndarray, sparse: np.ndarray) -> pa.RecordBatch:
    return pa.record_batch(
        [
            pa.array(labels, type=pa.float32()),
            pa.FixedSizeListArray.from_arrays(pa.array(dense.reshape(-1), type=pa.float32()), NUM_DENSE),
            pa.FixedSizeListArray.from_arrays(pa.array(sparse.reshape(-1), type=pa.uint32()), NUM_SPARSE),
        ],
        names=["label", "dense", "sparse"],
    )


def build_cache(
    paths: Sequence[str],
    cache_dir: str,
    name: str,
    microbatch_rows: int,
    skip_bad_lines: bool = False,
    keep_tail: bool = False,
) -> CacheInfo:
    """Writes (or reuses) the cache of ``paths`` cut into microbatches of ``microbatch_rows``.

    The cache is keyed by the files' paths, sizes and mtimes, so changed data is re-read.
    ``keep_tail`` keeps a last, shorter microbatch (evaluation); training drops it so that
    every microbatch has the same size. A malformed line raises DataFormatError from the
    reader and leaves no cache behind.
    """
    key = _source_key(paths, microbatch_rows, skip_bad_lines, keep_tail)
    out = Path(cache_dir).resolve() / f"{name}-{key}.arrow"
    meta_path = out.with_suffix(".json")
    if out.exists() and meta_path.exists():
        meta = json.loads(meta_path.read_text())
        return CacheInfo(str(out), meta["rows"], meta["microbatches"], microbatch_rows, meta["bad_lines"], True)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(f".tmp{os.getpid()}")
    reader = CriteoReader(paths, batch_rows=max(microbatch_rows, 65536), skip_bad_lines=skip_bad_lines)
    rows = batches = 0
    schema = pa.schema(
        [("label", pa.float32()), ("dense", pa.list_(pa.float32(), NUM_DENSE)), ("sparse", pa.list_(pa.uint32(), NUM_SPARSE))]
    )
    carry = None
    try:
        with pa.OSFile(str(tmp), "wb") as sink, pa.ipc.new_file(sink, schema) as writer:
            for raw in reader:
                parts = (raw.labels, raw.dense, raw.sparse)
                if carry is not None:
                    parts = tuple(np.concatenate([c, p]) for c, p in zip(carry, parts))
                    carry = None
                n = len(parts[0])
                full = n - n % microbatch_rows
                for start in range(0, full, microbatch_rows):
                    sl = slice(start, start + microbatch_rows)
                    writer.write_batch(_record_batch(*(p[sl] for p in parts)))
                    batches += 1
                    rows += microbatch_rows
                if full < n:
                    carry = tuple(p[full:] for p in parts)
            if keep_tail and carry is not None:
                writer.write_batch(_record_batch(*carry))
                batches += 1
                rows += len(carry[0])
        os.replace(tmp, out)
    finally:
        if tmp.exists():
            tmp.unlink()
    meta = {"rows": rows, "microbatches": batches, "bad_lines": reader.bad_lines, "sources": list(paths)}
    meta_path.write_text(json.dumps(meta))
    return CacheInfo(str(out), rows, batches, microbatch_rows, reader.bad_lines, False)


class MicrobatchFile:
    """Random access to the microbatches of a cache file, memory-mapped (zero-copy)."""

    def __init__(self, path: str):
        self._reader = pa.ipc.open_file(pa.memory_map(path, "r"))

    def __len__(self) -> int:
        return self._reader.num_record_batches

    def get(self, i: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(labels float32 [B], dense float32 [B, 13], raw sparse uint32 [B, 26]) of microbatch i."""
        b = self._reader.get_batch(i)
        labels = b.column(0).to_numpy()
        dense = b.column(1).values.to_numpy().reshape(-1, NUM_DENSE)
        sparse = b.column(2).values.to_numpy().reshape(-1, NUM_SPARSE)
        return labels, dense, sparse
