"""Leases: a process of the run changes the run's state only while it holds its place.

A host cut off from the cluster keeps running: its shards and trainers cannot tell that Ray
declared the host dead and that the supervisor replaced them, and when the link returns they
go on (a trainer there joins a quorum, a shard there applies its steps) until their raylet
learns its fate and exits, seconds later. Ray routes no call of the live run to them, but
nothing stops them acting among themselves or calling the supervisor.

So each shard and trainer holds a lease (a term of ``ray.lease_s``) and acts only while it is
valid: a shard applies a step, a trainer joins a quorum or calls the supervisor. A thread
renews it every quarter term by reading the holder's key in the GCS's key-value store; a
read that names this process grants the term from the moment it was sent. The supervisor
writes the key before anyone else takes the place (a shard's new generation, a trainer's new
process) and when a host is lost (its trainers). A process that reads another holder is
fenced: it exits at once. A process that cannot reach the GCS stops acting within a term.

The successor waits out the term after writing the key whenever the predecessor may still
be alive (anything but Ray's word that its process exited), so the two never act at once.
This holds while ``ray.lease_s`` is shorter than the time Ray takes to declare a silent host
dead (``health_check_period_ms`` x ``health_check_failure_threshold``), and while an act
begun under ``hold()`` ends within the lease: ``check_act`` fences a process whose act outlasted
it (the act may have overlapped its successor's).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable

from ray.experimental.internal_kv import internal_kv_get_gcs_client

__all__ = ["Lease", "Fences", "Fenced", "LeaseSpec", "FENCED_EXIT", "lease_key", "gcs_kv", "shard_place",
           "trainer_place"]

logger = logging.getLogger(__name__)

NAMESPACE = b"cpr-lease"
FENCED_EXIT = 75  # the exit code of a fenced process
_WRITE_TIMEOUT_S = 10.0


class Fenced(RuntimeError):
    """This process's place belongs to another: it must not act (it is exiting)."""


Read = Callable[[bytes, float], "bytes | None"]
Write = Callable[[bytes, bytes], None]


def lease_key(run_id: str, role: str) -> bytes:
    """``role``: ``shard_place`` or ``trainer_place``."""
    return f"{run_id}/{role}".encode()


def shard_place(k: int, generation: int) -> tuple[str, str]:
    """(role, holder) of shard ``k``'s lease held by its generation ``generation``."""
    return f"shard-{k}", f"g{generation}"


def trainer_place(rank: int, pid: int | None, node_id: str | None) -> tuple[str, str]:
    """(role, holder) of trainer ``rank``'s lease held by one process (``pid`` None: by none,
    its host was lost)."""
    return f"trainer-{rank}", f"{pid if pid is not None else 'lost'}@{node_id}"


def gcs_kv() -> tuple[Read, Write]:
    """Reads and writes of the GCS's key-value store, from any process of the cluster."""
    client = internal_kv_get_gcs_client()
    if client is None:
        raise RuntimeError("leases need a process connected to Ray")

    def read(key: bytes, timeout_s: float) -> bytes | None:
        return client.internal_kv_get(key, NAMESPACE, timeout=timeout_s)

    def write(key: bytes, value: bytes) -> None:
        client.internal_kv_put(key, value, True, NAMESPACE, timeout=_WRITE_TIMEOUT_S)

    return read, write


def _exit_fenced(holder: str, why: str) -> None:
    logger.error("fenced: %s %s; this process exits", holder, why)
    for h in logging.getLogger().handlers:
        h.flush()
    os._exit(FENCED_EXIT)


class LeaseSpec:
    """What a process needs to hold a lease: the run, the term (picklable, for actor args)."""

    def __init__(self, run_id: str, term_s: float):
        self.run_id, self.term_s = run_id, term_s

    def lease(self, place: tuple[str, str], **kw) -> Lease:
        role, holder = place
        return Lease(lease_key(self.run_id, role), holder, self.term_s, **kw)


class Lease:
    """Held by ``holder`` while the key names it (or is unset) as of a read less than
    ``term_s`` ago. ``hold()`` returns once a quarter term of it is left at least (the act
    that follows must end within it, which ``check_act`` enforces); a read of another holder,
    or an act that outlasted the lease, calls ``on_fenced(holder, why)`` (which exits the
    process) and every ``hold()`` raises ``Fenced`` from then on. Moments are this process's
    own clock's (``now``): no other host's clock is compared with it."""

    def __init__(self, key: bytes, holder: str, term_s: float, read: Read | None = None,
                 on_fenced: Callable[[str, str], None] = _exit_fenced, clock: Callable[[], float] = time.monotonic):
        self.key, self.holder, self.term_s = key, holder, term_s
        self._read = read
        self._on_fenced = on_fenced
        self._clock = clock
        self._until = float("-inf")
        self._changed = threading.Condition()
        self.fenced: str | None = None  # why this process may no longer act

    def start(self) -> Lease:
        """One renewal now (the caller holds the lease when this returns, unless fenced), then
        a thread renews every quarter term."""
        if self._read is None:
            self._read = gcs_kv()[0]
        self.renew()
        threading.Thread(target=self._loop, name="lease", daemon=True).start()
        return self

    def renew(self) -> None:
        sent = self._clock()
        try:
            value = self._read(self.key, self.term_s)
        except Exception as err:  # noqa: BLE001 - the GCS out of reach: the term runs out
            logger.warning("lease %s not renewed: %s", self.key.decode(), err)
            return
        if value is not None and value.decode() != self.holder:
            self._fence(f"was replaced by {value.decode()}")
            return
        with self._changed:
            self._until = max(self._until, sent + self.term_s)
            self._changed.notify_all()

    def _fence(self, why: str) -> None:
        with self._changed:  # from now on no hold() returns; then the process exits
            self.fenced = self.fenced or why
        self._on_fenced(self.holder, why)
        with self._changed:
            self._changed.notify_all()

    def _loop(self) -> None:  # for the process's lifetime (a shard or trainer holds one place)
        while True:
            time.sleep(self.term_s / 4)
            self.renew()

    def now(self) -> float:
        """This lease's clock (this host's monotonic one): the moments ``held_through`` takes."""
        return self._clock()

    def valid(self, margin_s: float = 0.0) -> bool:
        return self.held_through(self._clock() + margin_s)

    def held_through(self, moment: float) -> bool:
        """Whether no successor can have acted before ``moment`` (a reading of ``now``): a read
        that named this holder, sent at ``s``, leaves the successor (who writes the key, then
        waits a term) no act before ``s + term_s``, whenever that read's answer came."""
        return self.fenced is None and moment < self._until

    def check_act(self, act: str, ended: float | None = None) -> None:
        """``hold()``'s promise enforced: ``act``, begun under ``hold()``, ended (at ``ended``,
        else now) while the lease held. If not, it may have overlapped a successor's: the
        process is fenced (``on_fenced`` exits it) and ``Fenced`` raised."""
        ended = self._clock() if ended is None else ended
        if self.held_through(ended):
            return
        self._fence(f"held no lease when {act} ended (it may have overlapped a successor)")
        raise Fenced(f"{self.key.decode()}: {self.holder} {self.fenced}")

    def hold(self, timeout_s: float | None = None) -> bool:
        """Waits until at least a quarter term of the lease is left; False if ``timeout_s``
        passed first. Raises ``Fenced`` once the process is fenced."""
        deadline = None if timeout_s is None else self._clock() + timeout_s
        with self._changed:
            while not self.valid(self.term_s / 4):
                if self.fenced is not None:
                    raise Fenced(f"{self.key.decode()}: {self.holder} {self.fenced}")
                left = None if deadline is None else deadline - self._clock()
                if left is not None and left <= 0:
                    return False
                self._changed.wait(min(self.term_s / 8, left) if left is not None else self.term_s / 8)
            return True


class Fences:
    """The supervisor's side: who holds each place. ``grant`` writes the key and returns when
    the predecessor can no longer act: at once if it is known to be gone (``wait`` False),
    else after a term."""

    def __init__(self, spec: LeaseSpec, write: Write | None = None, sleep: Callable[[float], None] = time.sleep,
                 clock: Callable[[], float] = time.monotonic):
        self.spec = spec
        self._write = write
        self._sleep, self._clock = sleep, clock

    def _put(self, role: str, holder: str) -> None:
        if self._write is None:
            self._write = gcs_kv()[1]
        self._write(lease_key(self.spec.run_id, role), holder.encode())

    def grant(self, places: list[tuple[str, str]], wait: bool) -> float:
        """``places``: (role, new holder). Returns the seconds waited."""
        for role, holder in places:
            self._put(role, holder)
        if not wait or not places:
            return 0.0
        t0 = self._clock()
        self._sleep(self.spec.term_s)
        return self._clock() - t0
