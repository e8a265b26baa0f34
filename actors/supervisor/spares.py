"""Warm spare shards: processes with torch, fbgemm and the load path imported and no table
memory, kept ready (``embeddings.spares``) on a guarded keeper thread. A shard's recovery
adopts the oldest one on a host that answers instead of starting a process; a spare that dies
is replaced; a spare on a node holding shards moves to a node that holds none."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

import ray

from actors.fleet import ShardFleet, spare_name, spare_target
from actors.supervisor.events import EventLog
from actors.supervisor.hooks import RunHooks
from core.codec import decode, encode
from core.records import ShardInfo, Target

__all__ = ["SparePool"]

logger = logging.getLogger(__name__)


class SparePool:
    def __init__(
        self,
        lock: threading.RLock,
        events: EventLog,
        persist: Callable[[], None],
        fleet: ShardFleet,
        usable_nodes: Callable[[], list[str]],
        occupied: Callable[[], list],
        shard_nodes: Callable[[], set],
        running: Callable[[], bool],
        wanted: int,
        run_id: str,
        timeout_s: float,
        start_thread: Callable[..., threading.Thread],
        hooks: RunHooks,
        start_timeout_s: float = 0.0,
        recovering: Callable[[], bool] = lambda: False,
    ):
        self._lock = lock
        self._events = events
        self._persist = persist
        self._fleet = fleet
        self._usable_nodes = usable_nodes
        self._occupied = occupied
        self._shard_nodes = shard_nodes
        self._running = running
        self._wanted = wanted
        self._run_id = run_id
        self._timeout_s = timeout_s
        # A spare warms up at idle priority (EmbeddingShard): on a busy node that takes longer.
        self._start_timeout_s = max(timeout_s, start_timeout_s)
        self._recovering = recovering
        self._start_thread = start_thread
        self._hooks = hooks
        self._filled = False  # the pool was full once (its first spares were ready)
        self._ready: list[str] = []  # ready to adopt, oldest first
        self._starting: list[str] = []  # reserved in the journal before they are spawned
        self._info: dict[str, Target] = {}
        self._next = 0
        self._move_tried: set = set()  # nodes a spare was moved to (_misplaced)
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._keeper: threading.Thread | None = None

    # ------------------------------------------------------------------ what recoveries use

    def candidate(self, avoid: set) -> str | None:
        """The oldest ready spare, but none on a host that stopped answering (it is dying too)."""
        with self._lock:
            return next((s for s in self._ready if self._node(s) not in avoid), None)

    def claim(self, avoid: set) -> str | None:
        """The oldest ready spare not on a node of ``avoid``, taken out of the pool (it becomes
        a mirror: ``actors.supervisor.mirrors``); a replacement starts."""
        with self._lock:
            name = self.candidate(avoid)
            if name is not None:
                self.take([name])
                self._persist()
        self._wake.set()
        return name

    def take(self, names) -> None:
        """Spares assigned to a recovery (part of its transition): no other recovery takes them."""
        with self._lock:
            for name in names:
                if name in self._ready:
                    self._ready.remove(name)

    def ready(self) -> list[str]:
        with self._lock:
            return list(self._ready)

    def nodes(self, names) -> list:
        with self._lock:
            return [self._info[n].node_id for n in names if n in self._info]

    def known_nodes(self) -> set:
        """Nodes of every spare this pool started (ready, adopted or lost): the host watch
        probes them, so a host that held only a spare is still seen going."""
        with self._lock:
            return {i.node_id for i in self._info.values()}

    def _node(self, name: str) -> str | None:
        info = self._info.get(name)
        return info.node_id if info else None

    def targets(self) -> dict[str, Target]:
        with self._lock:
            return {spare_target(n): self._info[n] for n in self._ready if n in self._info}

    def on_node(self, node_id: str, since: float) -> list[str]:
        """Chaos targets of the spares on ``node_id``: still in the pool, or seen dying since ``since``."""
        gone = {e["spare"] for e in self._events.of("spare_lost", since_time=since)}
        with self._lock:
            return [spare_target(s) for s, i in self._info.items()
                    if i.node_id == node_id and (s in self._ready or s in gone)]

    # ------------------------------------------------------------------ keeping them ready

    def keep(self) -> None:
        """Starts (once) the keeper thread; wakes it."""
        with self._lock:
            if self._keeper is None and self._wanted > 0:
                self._keeper = self._start_thread("spare-keeper", self._keep)
        self._wake.set()

    def wake(self) -> None:
        self._wake.set()

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()

    def _keep(self) -> None:
        while not self._stop.is_set():
            self._hooks.at_point("thread.spare-keeper")
            self._wake.wait(1.0)
            self._wake.clear()
            misplaced = self._misplaced() if self.ready() and not self._starting else None
            with self._lock:
                short = self._wanted - len(self._ready) - len(self._starting)
                if short <= 0 and misplaced is not None:
                    short = 1  # one more spare, on the empty node; the misplaced one retires when it is ready
                # Not while a recovery loads: a spare's start (imports, tables) took the cores and
                # memory bandwidth that a 1 GB shard's load needed (2.9 s instead of 0.9).
                if short <= 0 or not self._running() or self._recovering() or self._stop.is_set():
                    continue
                names = [spare_name(self._run_id, self._next + i) for i in range(short)]
                self._next += short
                self._starting += names  # reserved before spawning: a restart finds them
                nodes = self._occupied()
                self._persist()
            t0 = time.perf_counter()
            # The first spares start beside the run's start and its first steps, and warm up
            # on idle CPU only; a replacement (after a recovery or a spare's death) at normal
            # priority, so that the next failure finds it ready.
            idle = not self._filled
            handles = {name: self._fleet.spawn_spare(name, nodes, idle=idle) for name in names}
            for name, handle in handles.items():
                self._add_when_ready(name, handle, t0, retire=misplaced)

    def _misplaced(self) -> str | None:
        """A ready spare on a node that holds shards, while an alive node holds neither shards
        nor spares (a host added back, or one that joined): moved there, a spare no longer
        dies with the shards it would replace."""
        nodes = self._usable_nodes()
        with self._lock:
            taken = self._occupied()
            empty = {node for node in nodes if node not in taken} - self._move_tried
            if not empty:
                return None
            shard_nodes = self._shard_nodes()
            spare = next((s for s in self._ready if self._node(s) in shard_nodes), None)
            if spare is not None:
                self._move_tried |= empty  # one move per new node, wherever Ray puts the new spare
            return spare

    def _add_when_ready(self, name: str, handle, t0: float, retire: str | None = None) -> None:
        """Adds the spare ``name`` to the pool once it answers; ``retire``: a ready spare that
        it replaces if it landed on another node (``_misplaced``)."""
        try:
            info: ShardInfo = ray.get(handle.ready.remote(), timeout=self._start_timeout_s)
        except (ray.exceptions.RayError, ray.exceptions.GetTimeoutError) as err:
            self._fleet.kill(handle)
            with self._lock:
                if name in self._starting:
                    self._starting.remove(name)
            if self._stop.is_set():
                return  # the run ended while it was starting
            self._events.record("spare_failed", spare=name, error=str(err).splitlines()[0][:200])
            self._filled = True  # its successor warms up at normal priority: idle may never come
            time.sleep(1.0)  # do not spin on a cluster that cannot place one
            self._wake.set()
            return
        with self._lock:
            if name in self._starting:
                self._starting.remove(name)
            if self._stop.is_set() or not self._running():
                self._fleet.kill(handle)
                return
            self._ready.append(name)
            self._filled = self._filled or len(self._ready) >= self._wanted
            self._info[name] = Target(info.pid, info.node_id, info.node_ip)
            self._fleet.watch(name, None, handle)
            self._events.append("spare_ready", spare=name, start_s=round(time.perf_counter() - t0, 3),
                                node_id=info.node_id, node_ip=info.node_ip, pool=len(self._ready),
                                tables_ready_mb=round(info.tables_ready_bytes / 1e6, 1))
            old = self._node(retire or "")
            retired = retire in self._ready
            if retired:
                self._ready.remove(retire)
                self._events.append("spare_moved", spare=retire, to=name, from_node=old, to_node=info.node_id,
                                    to_ip=info.node_ip)
            self._persist()
        if retired:
            self._fleet.kill(self._fleet.find_name(retire))

    def on_death(self, name: str, cause: str, detected: float) -> None:
        """A warm spare died: it leaves the pool and another one starts. An adopted spare is
        a shard; its death is seen by the shard watch."""
        with self._lock:
            if name not in self._ready:
                return
            self._ready.remove(name)
            self._events.append("spare_lost", spare=name, cause=cause, detected_at=round(detected, 3))
            self._persist()
        self._wake.set()

    def readopt(self, training_started: bool) -> None:
        """After a supervisor restart: the journaled spares (ready or being started) that
        answer are the pool again; the others are killed and replaced."""
        with self._lock:
            names = list(dict.fromkeys(self._ready + self._starting))
        keep = []
        for name in names:
            handle = self._fleet.find_name(name)
            try:
                info = ray.get(handle.ready.remote(), timeout=self._timeout_s) if handle else None
            except (ray.exceptions.RayError, ray.exceptions.GetTimeoutError):
                info = None
            if info is not None and info.shard_id is None:
                keep.append(name)
                with self._lock:
                    self._info[name] = Target(info.pid, info.node_id, info.node_ip)
                self._fleet.watch(name, None, handle)
            elif info is None:
                self._fleet.kill(handle)
        with self._lock:
            self._ready, self._starting = keep, []
            self._persist()
        if training_started:
            self.keep()

    # ------------------------------------------------------------------ journal

    def doc(self) -> dict:
        return {"ready": list(self._ready), "starting": list(self._starting), "next": self._next,
                "info": {n: encode(i) for n, i in self._info.items()}}

    def load(self, doc: dict) -> None:
        self._ready, self._starting, self._next = list(doc["ready"]), list(doc["starting"]), doc["next"]
        self._info = {n: decode(Target, i) for n, i in doc["info"].items()}
