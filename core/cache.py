"""The preprocessed microbatch cache: Criteo records streamed once through the reader,
validated, preprocessed and written as an Arrow IPC file whose record batch ``i`` is
microbatch ``i``. Trainers memory-map it and read any microbatch by id without parsing.
``prepare_data`` makes a run's data ready: synthetic files generated if configured and
missing, then the train and eval caches.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np
import pyarrow as pa

from core.config import RunConfig
from core.data import NUM_DENSE, NUM_SPARSE, CriteoReader, generate
from core.errors import ConfigError, InsufficientData

__all__ = ["CacheInfo", "MicrobatchFile", "build_cache", "prepare_data"]

logger = logging.getLogger(__name__)

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
    reader, and a file without usable rows, or too few rows for one microbatch, raises
    InsufficientData; neither leaves a cache behind.
    """
    key = _source_key(paths, microbatch_rows, skip_bad_lines, keep_tail)
    out = Path(cache_dir).resolve() / f"{name}-{key}.arrow"
    meta_path = out.with_suffix(".json")
    if out.exists() and meta_path.exists():
        meta = json.loads(meta_path.read_text())
        if meta["microbatches"] > 0:  # an empty cache (written before empty data was an error) is rebuilt, and fails
            return CacheInfo(str(out), meta["rows"], meta["microbatches"], microbatch_rows, meta["bad_lines"], True)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(f".tmp{os.getpid()}")
    per_file: list[tuple[str, int, int]] = []  # (path, usable rows, lines skipped as malformed)
    rows = batches = 0
    schema = pa.schema(
        [("label", pa.float32()), ("dense", pa.list_(pa.float32(), NUM_DENSE)), ("sparse", pa.list_(pa.uint32(), NUM_SPARSE))]
    )
    carry = None
    try:
        with pa.OSFile(str(tmp), "wb") as sink, pa.ipc.new_file(sink, schema) as writer:
            for path in paths:
                # One reader per file, for its own counts; a microbatch may span two files.
                reader = CriteoReader([path], batch_rows=max(microbatch_rows, 65536), skip_bad_lines=skip_bad_lines)
                usable = 0
                for raw in reader:
                    usable += raw.num_rows
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
                per_file.append((path, usable, reader.bad_lines))
            if keep_tail and carry is not None:
                writer.write_batch(_record_batch(*carry))
                batches += 1
                rows += len(carry[0])
        _check_usable(name, per_file, batches, microbatch_rows)
        os.replace(tmp, out)
    finally:
        if tmp.exists():
            tmp.unlink()
    bad_lines = sum(skipped for _, _, skipped in per_file)
    meta = {"rows": rows, "microbatches": batches, "bad_lines": bad_lines, "sources": list(paths)}
    meta_path.write_text(json.dumps(meta))
    return CacheInfo(str(out), rows, batches, microbatch_rows, bad_lines, False)


def _check_usable(name: str, per_file: list[tuple[str, int, int]], microbatches: int, microbatch_rows: int) -> None:
    """Stops a run before it starts on data that cannot train or evaluate anything: a file
    without a usable row (empty, or all of it skipped) or fewer rows than one microbatch."""

    def counts(path: str, usable: int, skipped: int) -> str:
        if usable + skipped == 0:
            return f"{path}: empty (0 lines)"
        return f"{path}: {usable + skipped} lines read, {skipped} skipped as malformed, {usable} usable"

    empty = [f for f in per_file if f[1] == 0]
    if empty:
        raise InsufficientData(
            f"{name} data: {len(empty)} of {len(per_file)} file(s) hold no usable row; "
            + "; ".join(counts(*f) for f in empty)
        )
    if microbatches == 0:
        usable = sum(f[1] for f in per_file)
        raise InsufficientData(
            f"{name} data: {usable} usable rows, fewer than one microbatch of {microbatch_rows} rows; "
            + "; ".join(counts(*f) for f in per_file)
        )


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


def prepare_data(cfg: RunConfig) -> dict:
    """Generates synthetic data if configured and missing, then builds the microbatch caches."""
    missing = [p for p in cfg.data.train + cfg.data.eval if not Path(p).exists()]
    ceiling_auc = None
    if missing:
        gen = cfg.data.generate
        if gen is None:
            raise ConfigError(f"data files not found: {missing} (set data.generate to create synthetic data)")
        out_dir = Path(cfg.data.train[0]).parent
        logger.info("generating %d + %d synthetic rows into %s", gen.train_rows, gen.eval_rows, out_dir)
        summary = generate(
            str(out_dir), gen.train_rows, gen.eval_rows, fmt=gen.format, seed=gen.seed, vocab_rows=gen.vocab_rows
        )
        produced = {summary.train_path, summary.eval_path}
        if not all(str(Path(p)) in {str(Path(q)) for q in produced} for p in cfg.data.train + cfg.data.eval):
            raise ConfigError(
                f"data.generate wrote {sorted(produced)} but data.train/data.eval name {cfg.data.train + cfg.data.eval}"
            )
    datagen_json = Path(cfg.data.train[0]).parent / "datagen.json"
    if datagen_json.exists():
        ceiling_auc = json.loads(datagen_json.read_text()).get("ceiling_auc")
    tr = cfg.training
    train = build_cache(cfg.data.train, cfg.cache_dir, "train", tr.microbatch_rows, cfg.data.skip_bad_lines)
    evaluation = build_cache(
        cfg.data.eval, cfg.cache_dir, "eval", tr.microbatch_rows, cfg.data.skip_bad_lines, keep_tail=True
    )
    return {"train": train, "eval": evaluation, "ceiling_auc": ceiling_auc}
