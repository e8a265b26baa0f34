"""The work of building a store, one call per preprocessing task (Ray Data runs them, see
app.dataprep; nothing here needs Ray): a chunk parsed into whole microbatches, the chunks'
leftover rows stitched into the last part, and the parts of a vocabulary run remapped.
"""

from __future__ import annotations

import resource
import time

import pyarrow as pa

from core.data.chunks import Chunk
from core.data.criteo import RawBatch
from core.data.reader import CriteoReader
from core.data.sources import open_filesystem
from core.store.format import Mapping, PartWriter, join, unpack
from core.store.identity import new_digest, parquet_digest
from core.store.vocab import IdCounter, Vocabulary

__all__ = ["part_name", "remap_part", "stitch_tails", "write_chunk"]


def part_name(index: int, kind: str = "part") -> str:
    return f"{kind}-{index:05d}.arrow"


def _peak_rss_mb() -> float:
    """This process's peak resident memory (VmHWM: ru_maxrss would carry over a forking
    parent's peak)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def write_chunk(chunk: Chunk, store_uri: str, index: int, microbatch_rows: int, skip_bad_lines: bool,
                mapping: Mapping | None) -> dict:
    """One preprocessing task: the chunk parsed and validated, its ids mapped by ``mapping``
    (None: raw ids kept, and counted into ``counts-<index>.arrow`` for a vocabulary), written
    as ``part-<index>.arrow``; the rows left over, fewer than a microbatch, go to
    ``tail-<index>.arrow``. Returns what it did, for the manifest and the report, with the
    digest of the chunk's bytes (core.store.identity.chunk_digest, taken while parsing)."""
    t0 = time.perf_counter()
    fs, base = open_filesystem(store_uri, "data.cache_dir")
    digest = None if chunk.file.parquet else new_digest()  # of the text parsed, taken as it is read
    reader = CriteoReader([chunk], batch_rows=max(microbatch_rows, 65536), skip_bad_lines=skip_bad_lines,
                          digest=digest)
    kind = "part" if mapping is not None else "raw"
    part = PartWriter(fs, join(base, part_name(index, kind)), microbatch_rows)
    counter = IdCounter() if mapping is None else None
    usable = 0
    for raw in reader:
        usable += raw.num_rows
        if counter is not None:
            counter(raw.sparse)
        sparse = raw.sparse if mapping is None else mapping.map_ids(raw.sparse)
        part.add(RawBatch(raw.labels, raw.dense, sparse))
    tail = part.close()
    tail_rows = 0 if tail is None else tail.num_rows
    if tail is not None:
        writer = PartWriter(fs, join(base, part_name(index, "tail")), tail_rows)
        writer.add(tail)
        writer.close()
    if counter is not None:
        counter.write(fs, join(base, part_name(index, "counts")))
    return {
        "index": index, "file": chunk.file.name, "start": chunk.start, "stop": chunk.stop,
        "digest": parquet_digest(chunk.file) if digest is None else digest.hexdigest(),
        "kind": kind, "microbatches": part.microbatches, "usable": usable,
        "tail_rows": tail_rows, "bad_lines": reader.bad_lines, "seconds": time.perf_counter() - t0,
        "peak_rss_mb": _peak_rss_mb(),
    }


def _read_rows(fs, path: str) -> list[RawBatch]:
    with fs.open_input_file(path) as f:
        reader = pa.ipc.open_file(f)
        return [RawBatch(*unpack(reader.get_batch(b))) for b in range(reader.num_record_batches)]


def stitch_tails(store_uri: str, tails: list[int], index: int, microbatch_rows: int, keep_tail: bool,
                 kind: str) -> dict:
    """The chunks' leftover rows (``tail-<i>.arrow`` of ``tails``, in order) as whole
    microbatches in ``<kind>-<index>.arrow``; a last shorter one kept if ``keep_tail``
    (evaluation), else its rows dropped. The tail files are removed."""
    t0 = time.perf_counter()
    fs, base = open_filesystem(store_uri, "data.cache_dir")
    part = PartWriter(fs, join(base, part_name(index, kind)), microbatch_rows)
    for i in tails:
        for rows in _read_rows(fs, join(base, part_name(i, "tail"))):
            part.add(rows)
    rest = part.close(keep_short=keep_tail)
    for i in tails:
        fs.delete_file(join(base, part_name(i, "tail")))
    return {"index": index, "kind": kind, "microbatches": part.microbatches,
            "dropped_rows": 0 if rest is None else rest.num_rows, "seconds": time.perf_counter() - t0,
            "peak_rss_mb": _peak_rss_mb()}


def remap_part(store_uri: str, index: int, vocabulary: Vocabulary) -> dict:
    """``raw-<index>.arrow`` with its raw ids mapped through the vocabulary, as ``part-<index>.arrow``."""
    t0 = time.perf_counter()
    fs, base = open_filesystem(store_uri, "data.cache_dir")
    source = join(base, part_name(index, "raw"))
    with fs.open_input_file(source) as f:
        reader = pa.ipc.open_file(f)
        part = PartWriter(fs, join(base, part_name(index)), 1)
        for b in range(reader.num_record_batches):
            labels, dense, sparse = unpack(reader.get_batch(b))
            part.write_short(RawBatch(labels, dense, vocabulary.map_ids(sparse)))
        part.close()
    fs.delete_file(source)
    return {"index": index, "microbatches": part.microbatches, "seconds": time.perf_counter() - t0,
            "peak_rss_mb": _peak_rss_mb()}
