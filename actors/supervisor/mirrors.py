"""Replica recovery's mirrors (``recovery: replica``): one per shard, on another host than its
primary where the cluster has one, kept in sync by the primary itself (``actors.shard_mirror``).
A guarded keeper thread builds the missing ones while training runs: a shard process placed
away from the primary, made a mirror of its shard, then attached (the primary copies its rows
to it and feeds it every complete step from then on). A shard's recovery promotes its mirror
(no storage read, nothing lost); the keeper then builds a new one. The journal names every
mirror; a restarted supervisor watches the ones that answer again (a promotion still refuses a
mirror that lacks a committed step) and rebuilds the others."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

import ray

from actors.fleet import ShardFleet, mirror_name
from actors.nodes import cpu_nodes
from actors.supervisor.events import EventLog
from actors.supervisor.hooks import RunHooks
from core.codec import decode, encode
from core.records import ShardInfo, Target

__all__ = ["MirrorSet"]

logger = logging.getLogger(__name__)

_ERRORS = (ray.exceptions.RayError, ray.exceptions.GetTimeoutError)
_RETRY_CAP_S = 30.0  # the longest a shard whose mirror keeps failing waits between builds


class MirrorSet:
    def __init__(self, lock: threading.RLock, events: EventLog, persist: Callable[[], None], fleet: ShardFleet,
                 primary: Callable[[int], tuple[object, ShardInfo | None]], occupied: Callable[[], list],
                 running: Callable[[], bool], num_shards: int, enabled: bool, run_id: str, timeout_s: float,
                 start_timeout_s: float, start_thread: Callable[..., threading.Thread], hooks: RunHooks,
                 spare: Callable[[set], str | None] = lambda avoid: None):
        self._lock, self._events, self._persist, self._fleet = lock, events, persist, fleet
        self._primary, self._occupied, self._running = primary, occupied, running
        self._n, self.enabled, self._run_id = num_shards, enabled, run_id
        self._timeout_s, self._start_timeout_s = timeout_s, max(timeout_s, start_timeout_s)
        self._start_thread, self._hooks, self._spare = start_thread, hooks, spare
        self._ready: dict[int, str] = {}  # shard -> its mirror, in sync
        self._building: dict[int, str] = {}  # reserved in the journal before it is spawned
        self._info: dict[str, Target] = {}
        self._next = 0
        self._tried: set[int] = set()  # shards whose first mirror is ready or failed once
        # Per shard, builds failed in a row and when the next may begin (this process's clock):
        # a shard whose mirror cannot be placed waits its turn, the others are built meanwhile.
        self._failed: dict[int, int] = {}
        self._retry_at: dict[int, float] = {}
        self._warned = False
        self._lost: dict[str, tuple[int, float]] = {}  # mirror -> (its shard, when its death was seen)
        self._changed = threading.Condition(lock)
        self._wake, self._stop = threading.Event(), threading.Event()
        self._keeper: threading.Thread | None = None

    # ------------------------------------------------------------------ what recoveries use

    def candidate(self, k: int, avoid: set) -> str | None:
        """Shard ``k``'s mirror if it is in sync and not on a host that stopped answering."""
        with self._lock:
            name = self._ready.get(k)
            return name if name is not None and self._node(name) not in avoid else None

    def take(self, names) -> None:
        """Mirrors assigned to a recovery (part of its transition) are no longer mirrors."""
        with self._lock:
            for k in [k for k, name in self._ready.items() if name in set(names)]:
                del self._ready[k]

    def drop(self, shards, promoted) -> list[tuple[int, str]]:
        """Shards whose new actor is not their mirror (a recovery from a checkpoint, or a
        rollback): their mirrors no longer match. Part of the controller's transition (no
        journal write here); ``kill_dropped`` kills them once it is journaled."""
        with self._lock:
            stale = [(k, self._ready.pop(k)) for k in list(self._ready) if k in set(shards)
                     and self._ready[k] not in promoted]
            for k, name in stale:
                self._events.append("mirror_dropped", shard=k, mirror=name, reason="its shard was restored from a checkpoint")
        return stale

    def kill_dropped(self, dropped: list[tuple[int, str]]) -> None:
        for _, name in dropped:
            self._fleet.kill(self._fleet.find_name(name))
        self._wake.set()

    def handles(self) -> dict[int, object]:
        """Shard -> its ready mirror's actor (None: the named actor is gone), for a recovery's questions."""
        return {k: self._fleet.find_name(name) for k, name in self.ready().items()}

    def nodes(self) -> list:
        with self._lock:
            return [self._info[n].node_id for n in list(self._ready.values()) + list(self._building.values())
                    if n in self._info]

    def known_nodes(self) -> set:
        with self._lock:
            return {i.node_id for i in self._info.values()}

    def on_node(self, node_id: str, since: float) -> list[str]:
        """Chaos targets of the mirrors on ``node_id``: ready there, or seen dying since ``since``
        (a lost host names them with its other actors)."""
        with self._lock:
            mirrors = {name: k for k, name in self._ready.items()}
            mirrors |= {name: k for name, (k, t) in self._lost.items() if t >= since}
            return sorted(f"mirror:{k}" for name, k in mirrors.items()
                          if name in self._info and self._info[name].node_id == node_id)

    def targets(self) -> dict[str, Target]:
        """Chaos targets: ``mirror:<k>``."""
        with self._lock:
            return {f"mirror:{k}": self._info[n] for k, n in self._ready.items() if n in self._info}

    def ready(self) -> dict[int, str]:
        with self._lock:
            return dict(self._ready)

    def wait_first(self, timeout_s: float) -> bool:
        """Waits until every shard's first mirror is ready (or failed once: training then
        starts without it), so that every step is on a mirror from the first. False on timeout.
        Training that starts with shards unprotected says so, once (a ``mirrors_missing``
        event: the console and the report show it)."""
        if not self.enabled:
            return True
        with self._changed:
            done = self._changed.wait_for(lambda: len(self._tried) >= self._n or self._stop.is_set(), timeout_s)
            missing = sorted(set(range(self._n)) - set(self._ready))
            warn = bool(missing) and not self._warned
            self._warned = self._warned or warn
        if warn:
            self._events.record("mirrors_missing", shards=missing, building=sorted(self._building),
                                failed_builds={str(k): n for k, n in sorted(self._failed.items())},
                                reason="training starts before these shards have a mirror in sync: until one is "
                                       "built, their recovery is from a checkpoint (lost samples counted)")
        return done

    def _node(self, name: str) -> str | None:
        info = self._info.get(name)
        return info.node_id if info else None

    # ------------------------------------------------------------------ keeping them

    def keep(self) -> None:
        with self._lock:
            if self._keeper is None and self.enabled:
                self._keeper = self._start_thread("mirror-keeper", self._keep)
        self._wake.set()

    def wake(self) -> None:
        self._wake.set()

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        with self._changed:
            self._changed.notify_all()

    def _keep(self) -> None:
        while not self._stop.is_set():
            self._hooks.at_point("thread.mirror-keeper")
            self._wake.wait(1.0)
            self._wake.clear()
            with self._lock:
                k = self._next_to_build(time.monotonic())
                if k is None or not self._running() or self._stop.is_set():
                    continue
                name, first_try = mirror_name(self._run_id, self._next), k not in self._failed
                self._next += 1
                self._building[k] = name
                self._persist()
            built = self._build(k, name, use_spare=first_try)
            with self._lock:
                if built:
                    self._failed.pop(k, None)
                    self._retry_at.pop(k, None)
                else:  # its turn comes again later; the other shards' mirrors are built meanwhile
                    self._failed[k] = self._failed.get(k, 0) + 1
                    self._retry_at[k] = time.monotonic() + min(_RETRY_CAP_S, 2.0 ** self._failed[k])
            self._wake.set()

    def _next_to_build(self, now: float) -> int | None:
        """The missing mirror to build next: among those whose retry is due, the one whose
        builds failed least often (then the lowest shard), so that none waits on another."""
        due = [k for k in range(self._n)
               if k not in self._ready and k not in self._building and self._retry_at.get(k, 0.0) <= now]
        return min(due, key=lambda k: (self._failed.get(k, 0), k)) if due else None

    def _build(self, k: int, name: str, use_spare: bool = True) -> bool:
        """Makes a warm spare away from shard ``k``'s primary (its imports done: a mirror in well
        under a second; only on a first try, so that a mirror that cannot be placed does not use
        up the spares recoveries need), else a new process ``name`` placed away from it, its
        mirror, and attaches it."""
        t0 = time.perf_counter()
        handle, (primary, pinfo) = None, self._primary(k)
        try:
            if primary is None or pinfo is None:
                raise RuntimeError(f"shard {k} is being recovered")
            spare = self._spare({pinfo.node_id} if len(cpu_nodes()) > 1 else set()) if use_spare else None
            if spare is not None:
                with self._lock:
                    self._building[k] = name = spare
                    self._persist()
            handle = self._fleet.find_name(spare) if spare else self._fleet.spawn_mirror(name, self._occupied(), pinfo.node_id)
            if handle is None:
                raise RuntimeError(f"spare {spare} is gone")
            info: ShardInfo = ray.get(handle.ready.remote(), timeout=self._start_timeout_s)
            if info.node_id == pinfo.node_id and len(cpu_nodes()) > 1:
                raise RuntimeError(f"placed on the host of shard {k} while another host exists")
            alloc = ray.get(handle.become_mirror.remote(k, list(self._fleet.plan.shards[k])), timeout=self._timeout_s)
            # A mirror on the primary's node takes its steps over its link, not by Ray calls.
            link = info.link if info.node_id == pinfo.node_id else None
            sync = ray.get(primary.attach_mirror.options(concurrency_group="mirror").remote(
                name, self._timeout_s, self._fleet.run_id, link), timeout=2 * self._timeout_s)
        except (*_ERRORS, RuntimeError) as err:
            self._fleet.kill(handle)
            with self._lock:
                self._building.pop(k, None)
                self._tried.add(k)
                self._changed.notify_all()
                self._persist()
            if not self._stop.is_set():
                self._events.record("mirror_failed", shard=k, mirror=name, error=str(err).splitlines()[0][:200])
            return False
        with self._lock:
            self._building.pop(k, None)
            if self._stop.is_set() or self._primary(k)[0] is not primary:
                self._fleet.kill(handle)
                return True  # its shard was replaced meanwhile: built again
            self._ready[k], self._info[name] = name, Target(info.pid, info.node_id, info.node_ip)
            self._tried.add(k)
            self._changed.notify_all()
            self._fleet.watch(name, None, handle)
            self._events.append("mirror_ready", shard=k, mirror=name, node_id=info.node_id, node_ip=info.node_ip,
                                primary_node=pinfo.node_id, build_s=round(time.perf_counter() - t0, 3),
                                alloc_s=alloc["alloc_s"], hold_s=sync["hold_s"], sync_s=sync["sync_s"],
                                base_step=sync["base_step"], from_spare=spare is not None, linked=sync.get("linked", False))
            self._persist()
        return True

    def on_death(self, name: str, cause: str, detected: float) -> bool:
        """A mirror died (False: ``name`` is not a mirror of this set): another is built."""
        with self._lock:
            shard = next((k for k, n in self._ready.items() if n == name), None)
            if shard is None:
                return name in self._info
            del self._ready[shard]
            self._lost[name] = (shard, detected)
            self._events.append("mirror_lost", shard=shard, mirror=name, cause=cause, detected_at=round(detected, 3))
            self._persist()
        self._wake.set()
        return True

    def readopt(self) -> None:
        """After a supervisor restart: journaled mirrors that answer as mirrors are watched and
        ready again (their primaries kept feeding them); the others are killed and rebuilt."""
        with self._lock:
            journaled = dict(self._ready) | dict(self._building)
            self._building = {}
        keep = {}
        for k, name in journaled.items():
            handle = self._fleet.find_name(name)
            try:
                info = ray.get(handle.ready.remote(), timeout=self._timeout_s) if handle else None
            except _ERRORS:
                info = None
            if info is not None and info.mirror_of == k and k in self._ready:
                keep[k] = name
                self._fleet.watch(name, None, handle)
            else:
                self._fleet.kill(handle)
        with self._lock:
            self._ready = keep
            self._tried = set(range(self._n))  # training ran: nobody waits for first mirrors
            self._persist()
        self.keep()

    # ------------------------------------------------------------------ journal

    def doc(self) -> dict:
        return {"ready": {str(k): n for k, n in self._ready.items()}, "building": {str(k): n for k, n in self._building.items()},
                "next": self._next, "info": {n: encode(i) for n, i in self._info.items()}}

    def load(self, doc: dict) -> None:
        self._ready = {int(k): n for k, n in doc["ready"].items()}
        self._building = {int(k): n for k, n in doc["building"].items()}
        self._next = doc["next"]
        self._info = {n: decode(Target, i) for n, i in doc["info"].items()}
