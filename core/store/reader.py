"""Reading a store's microbatches by id, from any host: memory-mapped where the store is a
local path, else through ``pyarrow.fs`` (ranged reads of one record batch each) with a
bounded in-memory cache of the microbatches read last.
"""

from __future__ import annotations

import bisect
import itertools
import threading
from collections import OrderedDict

import numpy as np
import pyarrow as pa

from core.data.sources import is_local, open_filesystem, shown, split_uri
from core.errors import ConfigError
from core.store.format import StoreManifest, join, read_manifest, unpack

__all__ = ["MicrobatchStore"]

Microbatch = tuple[np.ndarray, np.ndarray, np.ndarray]
OPEN_PARTS = 16  # parts a store keeps open at once (one descriptor each)


class MicrobatchStore:
    """Microbatch ``i`` of the store at ``uri``: ``get(i)`` -> (labels float32 [B], dense
    float32 [B, 13], rows uint32 [B, 26]); ``len()`` microbatches. ``cache_bytes`` bounds the
    microbatches kept in memory from a remote store (a local one is memory-mapped: the page
    cache holds it). Safe to use from several threads."""

    def __init__(self, uri: str, cache_bytes: int = 256 << 20):
        self.uri = uri
        manifest = read_manifest(uri)
        if manifest is None:
            where = split_uri(uri)[1] if is_local(uri) else shown(uri)
            raise ConfigError(f"data.cache_dir: no microbatch store at {where} as seen from this host "
                              "(every host must reach the store: object storage, or a directory every host mounts)")
        self.manifest: StoreManifest = manifest
        self._fs, self._base = open_filesystem(uri, "data.cache_dir")
        self._local = is_local(uri)
        self._ends = list(itertools.accumulate(p["microbatches"] for p in manifest.parts))
        # The parts open now, least recently read first: a store may have more parts than a process
        # may have files open. A part closed here stays mapped while arrays read from it live.
        self._files: OrderedDict[int, pa.ipc.RecordBatchFileReader] = OrderedDict()
        self._open_lock = threading.Lock()
        self._cache: OrderedDict[int, Microbatch] = OrderedDict()
        self._cache_bytes, self._cached = cache_bytes, 0
        self._cache_lock = threading.Lock()

    def __len__(self) -> int:
        return self._ends[-1] if self._ends else 0

    def _file(self, part: int) -> pa.ipc.RecordBatchFileReader:
        with self._open_lock:
            reader = self._files.get(part)
            if reader is not None:
                self._files.move_to_end(part)
                return reader
            path = join(self._base, self.manifest.parts[part]["file"])
            source = pa.memory_map(path, "r") if self._local else self._fs.open_input_file(path)
            reader = self._files[part] = pa.ipc.open_file(source)
            while len(self._files) > OPEN_PARTS:
                self._files.popitem(last=False)
            return reader

    def get(self, i: int) -> Microbatch:
        if not 0 <= i < len(self):
            raise IndexError(f"microbatch {i} of a store of {len(self)}")
        if not self._local:
            with self._cache_lock:
                hit = self._cache.get(i)
                if hit is not None:
                    self._cache.move_to_end(i)
                    return hit
        part = bisect.bisect_right(self._ends, i)
        first = self._ends[part - 1] if part else 0
        out = unpack(self._file(part).get_batch(i - first))
        if not self._local:
            self._remember(i, out)
        return out

    def _remember(self, i: int, mb: Microbatch) -> None:
        size = sum(a.nbytes for a in mb)
        with self._cache_lock:
            if i in self._cache:  # read by two threads at once: kept once
                return
            self._cache[i] = mb
            self._cached += size
            while self._cached > self._cache_bytes and len(self._cache) > 1:
                _, old = self._cache.popitem(last=False)
                self._cached -= sum(a.nbytes for a in old)
