"""Where a store is built: a directory of the build's own inside the store's, published by its
manifest, so that builds of one store may run at once and readers never see a part rewritten.

On a local (or mounted) filesystem a build holds a lock on the store while it looks for the
store and builds it: a second run that wants the same store waits, then reuses it; a build
that died (its lock went with its process) left a directory no manifest names, removed by the
next build. Object stores have no such lock: two builds of one store both build, the first
manifest written is the store (``publish_manifest``), and the other build removes its files.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import shutil
import uuid
from collections.abc import Iterator

import pyarrow.fs as pafs

from core.data.sources import child_uri, is_local, open_filesystem, split_uri

__all__ = ["BUILD_PREFIX", "StoreSlot"]

logger = logging.getLogger(__name__)

BUILD_PREFIX = "b-"


class StoreSlot:
    """The store at ``uri`` (``<cache_dir>/<name>-<key>``) while one run finds or builds it."""

    def __init__(self, uri: str):
        self.uri = uri
        self._fs, self._path = open_filesystem(uri, "data.cache_dir")
        self._local = is_local(uri)

    @contextlib.contextmanager
    def held(self) -> Iterator[None]:
        """The store's lock (local filesystems; elsewhere nothing), for as long as the caller
        looks for the store and builds it."""
        if not self._local:
            yield
            return
        parent, name = os.path.split(self._path.rstrip("/"))
        os.makedirs(parent, exist_ok=True)
        fd = os.open(os.path.join(parent, f".{name}.lock"), os.O_RDWR | os.O_CREAT, 0o644)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                logger.warning("%s: another run is building this store; waiting for it", self._path)
                fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)  # releases the lock

    def new_build(self) -> tuple[str, str]:
        """(directory name, URI) of a new build's own directory."""
        name = f"{BUILD_PREFIX}{uuid.uuid4().hex[:12]}"
        return name, child_uri(self.uri, name)

    def remove(self, build: str) -> None:
        """Removes a build's directory, all of it (a failed build, a lost race, a stale store)."""
        path = f"{self._path.rstrip('/')}/{build}"
        try:
            if self._local:
                shutil.rmtree(path, ignore_errors=True)
            else:
                self._fs.delete_dir(path)
        except (OSError, FileNotFoundError) as exc:
            logger.warning("could not remove %s/%s: %s", split_uri(self.uri)[1], build, exc)

    def remove_orphans(self, keep: str | None) -> list[str]:
        """Build directories no manifest names (a build that died), removed; only under the
        lock of a local store, where no other build can be running. Returns their names."""
        if not self._local:
            return []
        try:
            listed = self._fs.get_file_info(pafs.FileSelector(self._path, allow_not_found=True))
        except OSError:
            return []
        gone = [i.base_name for i in listed if i.type == pafs.FileType.Directory
                and i.base_name.startswith(BUILD_PREFIX) and i.base_name != keep]
        for name in gone:
            self.remove(name)
        return gone
