"""Where a store is built: a directory of the build's own inside the store's, published by its
manifest, so that builds of one store may run at once and readers never see a part rewritten.

On a local (or mounted) filesystem a build holds a lock on the store while it looks for the
store and builds it: a second run that wants the same store waits, then reuses it; a build
that died (its lock went with its process) left a directory no manifest names, removed by the
next build. The lock only saves work: the manifest is linked into place, so that of two
builds that both got past it, the second finds the store published and drops its own.
Object stores have no such lock: builds of one store at once all build; one that finds a
manifest before it writes its own drops its files, and two whose checks interleave both
publish (``publish_manifest``), the last one wins and the other's directory is left.
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

from core.data.sources import child_uri, is_local, open_filesystem, shown
from core.store.format import MANIFEST_FILE

__all__ = ["BUILD_PREFIX", "LOCK_FILE", "StoreSlot"]

logger = logging.getLogger(__name__)

BUILD_PREFIX = "b-"
LOCK_FILE = ".lock"


class StoreSlot:
    """The store at ``uri`` (``<cache_dir>/<name>-<key>``) while one run finds or builds it."""

    def __init__(self, uri: str):
        self.uri = uri
        self._fs, self._path = open_filesystem(uri, "data.cache_dir")
        self._local = is_local(uri)
        self._made_cache = False  # held() made the cache directory: a failed build may remove it again

    @contextlib.contextmanager
    def held(self) -> Iterator[None]:
        """The store's lock (local filesystems; elsewhere nothing), for as long as the caller
        looks for the store and builds it: ``<store>/.lock``, ``flock``ed. A lock file removed
        while this waited for it (``discard``) is no lock: taken again on the new one."""
        if not self._local:
            yield
            return
        path = os.path.join(self._path, LOCK_FILE)
        cache = os.path.dirname(self._path.rstrip("/"))
        self._made_cache = self._made_cache or not os.path.isdir(cache)
        while True:
            os.makedirs(self._path, exist_ok=True)
            try:
                fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
            except FileNotFoundError:  # the directory removed meanwhile by a failed build
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                logger.warning("%s: another run is building this store; waiting for it", self._path)
                fcntl.flock(fd, fcntl.LOCK_EX)
            try:
                same = os.fstat(fd).st_ino == os.stat(path).st_ino
            except FileNotFoundError:
                same = False
            if same:
                break
            os.close(fd)
        try:
            yield
        finally:
            os.close(fd)  # releases the lock

    def discard(self, build: str) -> None:
        """A failed build's directory removed; and, holding the lock, where no store was ever
        published, the store's directory, and the cache directory if ``held`` made it, when
        nothing else is in them (a refused input leaves nothing behind)."""
        self.remove(build)
        if not self._local or os.path.exists(os.path.join(self._path, MANIFEST_FILE)):
            return
        if set(os.listdir(self._path)) <= {LOCK_FILE}:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join(self._path, LOCK_FILE))
            made = [self._path] + ([os.path.dirname(self._path.rstrip("/"))] if self._made_cache else [])
            for directory in made:
                try:
                    os.rmdir(directory)
                except OSError:  # not empty: another store, another run's build
                    break

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
        except OSError as exc:
            logger.warning("could not remove %s/%s: %s", shown(self.uri), build, exc)

    def builds(self) -> list[str]:
        """The build directories in the store's directory, whatever names them."""
        try:
            listed = self._fs.get_file_info(pafs.FileSelector(self._path, allow_not_found=True))
        except OSError:
            return []
        return sorted(i.base_name for i in listed
                      if i.type == pafs.FileType.Directory and i.base_name.startswith(BUILD_PREFIX))

    def remove_orphans(self, keep: set[str]) -> list[str]:
        """Build directories no manifest names (a build that died) removed, all but ``keep``
        (the store's build, and the builds of older bytes it replaced, which runs that started
        on them read: never removed here). Only under the lock of a local store, where no
        other build can be running. Returns the names removed."""
        if not self._local:
            return []
        gone = [name for name in self.builds() if name not in keep]
        for name in gone:
            self.remove(name)
        return gone
