"""Hosts: where the run's actors go, which network interface a node's traffic uses, and
the loss of a whole host.

- ``placement`` spreads shards and spares over the alive nodes that have CPUs (soft node
  affinity to the node holding the fewest of them), so that one host's loss takes as few
  shards as possible and a spare never waits on the host it would replace.
- ``interface_for`` names the interface holding the node's IP: gloo (``GLOO_SOCKET_IFNAME``)
  must use it on a cluster, where the hostname may resolve to 127.0.0.1.
- ``HostWatch`` sees a host go: it probes the raylet port of every node holding one of the
  run's actors (a refused or timed-out connection is the first sign, since the actors'
  own deaths are only reported once Ray declares the node dead) and reports each node that
  Ray declares dead, with both times.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Iterable

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

import psutil  # noqa: E402 - Ray's vendored copy, on the path once ray is imported

__all__ = [
    "cpu_nodes", "other_nodes", "pinned", "pids_alive", "process_alive", "least_loaded", "placement", "interface_for",
    "HostWatch",
]

logger = logging.getLogger(__name__)


def cpu_nodes() -> list[str]:
    """Ids of the alive nodes that have CPUs to give (a head started with ``--num-cpus=0``
    runs the driver and the controllers only)."""
    return [n["NodeID"] for n in ray.nodes() if n.get("Alive") and n.get("Resources", {}).get("CPU", 0) > 0]


def other_nodes() -> list[str]:
    """Ids of the alive nodes other than this process's."""
    here = ray.get_runtime_context().get_node_id()
    return [n["NodeID"] for n in ray.nodes() if n.get("Alive") and n["NodeID"] != here]


def pinned(fn: Callable, node_id: str):
    """``fn`` as a Ray task that runs on node ``node_id`` and nowhere else, needing no CPU and
    never retried: the checks, probes and kills the run does on a given host."""
    return ray.remote(num_cpus=0, max_retries=0)(fn).options(
        scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False)
    )


def process_alive(pid: int) -> bool:
    """Whether ``pid`` is a live process on this host: a killed process stays a zombie until
    its parent reaps it, and a zombie still answers ``kill(pid, 0)``."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] not in (b"Z", b"X")
    except (OSError, IndexError):
        return True  # no /proc here: kill(pid, 0) is all there is


def pids_alive(processes: dict, timeout_s: float) -> dict:
    """For each key of ``processes`` (key -> (pid, node id)): True if that process runs, False
    if it or its node is gone (a node that is gone cannot run the probe: Ray refuses the task),
    None if the probe did not answer in time (cannot tell). Probed in parallel."""
    out, refs = {}, {}
    for key, (pid, node) in processes.items():
        try:
            refs[key] = pinned(process_alive, node).remote(pid)
        except (ray.exceptions.RayError, ValueError):
            out[key] = False
    ready, _ = ray.wait(list(refs.values()), num_returns=len(refs), timeout=timeout_s) if refs else ([], [])
    for key, ref in refs.items():
        if ref not in ready:
            out[key] = None
            continue
        try:
            out[key] = bool(ray.get(ref))
        except ray.exceptions.RayError:
            out[key] = False
    return out


def least_loaded(nodes: list[str], taken: list, avoid: set | frozenset = frozenset()) -> str | None:
    """The node of ``nodes`` (not in ``avoid``) that holds the fewest of ``taken``, ties by id."""
    usable = [node for node in nodes if node not in avoid]
    return min(usable, key=lambda node: (taken.count(node), node)) if usable else None


def placement(taken: list, avoid: set | frozenset = frozenset()) -> tuple[str | None, dict]:
    """``(node, actor options)`` that place one more shard-like actor on the alive node with
    CPUs holding the fewest of ``taken`` (node ids of the run's shards and spares), softly:
    Ray still places it elsewhere if that node cannot take it. Nodes in ``avoid`` (hosts that
    stopped answering but are not declared dead yet) are left out. No preference on one node."""
    nodes = cpu_nodes()
    least = least_loaded(nodes, taken, avoid)
    if len(nodes) <= 1 or least is None:
        return None, {}
    return least, {"scheduling_strategy": NodeAffinitySchedulingStrategy(least, soft=True)}


def interface_for(ip: str) -> str | None:
    """The network interface that holds address ``ip`` on this machine, or None."""
    for name, addresses in psutil.net_if_addrs().items():
        if any(a.family == socket.AF_INET and a.address == ip for a in addresses):
            return name
    return None


class HostWatch:
    """Polls Ray's node table every ``period_s`` and calls ``on_lost(info)`` once for each
    node that was alive and is declared dead. ``info``: node_id, node_ip, reason,
    ``declared_dead_at`` (when this watch saw Ray's verdict) and ``unreachable_since`` (the
    first failed probe of the node's raylet port, when one was seen before the verdict).

    Only nodes in ``watched()`` (the nodes of the run's actors) are probed: a probe is a TCP
    connect, refused at once by a host whose processes are gone, timed out by one that is
    cut off."""

    def __init__(self, watched: Callable[[], Iterable[str]], on_lost: Callable[[dict], None],
                 period_s: float = 0.25, probe_timeout_s: float = 0.2,
                 start_thread: Callable[..., threading.Thread] | None = None, tick: Callable[[], None] = lambda: None):
        self.start_thread = start_thread
        self.tick = tick
        self.watched = watched
        self.on_lost = on_lost
        self.period_s = period_s
        self.probe_timeout_s = probe_timeout_s
        self.alive: dict[str, dict] = {}  # node id -> its row of ray.nodes()
        self.unreachable_since: dict[str, float] = {}  # kept for a node declared dead: ``since``
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        with self._lock:
            if self._thread is None:
                if self.start_thread is not None:
                    self._thread = self.start_thread("host-watch", self._loop)
                else:
                    self._thread = threading.Thread(target=self._loop, name="host-watch", daemon=True)
                    self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def since(self, node_id: str | None) -> float | None:
        """When node ``node_id``'s raylet first failed a probe (before Ray's verdict), if it did:
        the best estimate of when an actor there died with its host."""
        with self._lock:
            return self.unreachable_since.get(node_id) if node_id else None

    def usable(self) -> list[str]:
        """Ids of the alive nodes with CPUs whose raylet answers, from the watch's last look at
        Ray's node table (``cpu_nodes`` without asking the GCS again)."""
        with self._lock:
            return [node for node, row in self.alive.items()
                    if row.get("Resources", {}).get("CPU", 0) > 0 and node not in self.unreachable_since]

    def suspects(self) -> set:
        """Alive nodes whose raylet does not answer: do not place anything there."""
        with self._lock:
            return set(self.unreachable_since) & set(self.alive)

    def _probe(self, node: dict) -> bool:
        try:
            with socket.create_connection((node["NodeManagerAddress"], node["NodeManagerPort"]),
                                          timeout=self.probe_timeout_s):
                return True
        except OSError:
            return False

    def poll(self) -> None:
        now = time.time()
        for info in self.observe(ray.nodes(), now):
            self.on_lost(info)
        with self._lock:
            alive = dict(self.alive)
        if len(alive) < 2:
            return  # one node: its loss is the run's, nothing to probe
        self.probed({node: self._probe(alive[node]) for node in set(self.watched()) & set(alive)}, now)

    def observe(self, rows: list[dict], now: float) -> list[dict]:
        """Takes Ray's node table (``ray.nodes()`` rows); returns the nodes seen alive before
        and declared dead now, once each."""
        lost = []
        with self._lock:
            for row in rows:
                node_id = row["NodeID"]
                if row.get("Alive"):
                    self.alive[node_id] = row
                elif self.alive.pop(node_id, None) is not None:
                    lost.append({
                        "node_id": node_id, "node_ip": row.get("NodeManagerAddress"),
                        "reason": (row.get("DeathReasonMessage") or "")[:200], "declared_dead_at": round(now, 3),
                        "unreachable_since": self.unreachable_since.get(node_id),
                    })
        return lost

    def probed(self, answered: dict[str, bool], now: float) -> None:
        """Takes the probes' outcomes (node id -> whether its raylet accepted a connection)."""
        with self._lock:
            for node_id, ok in answered.items():
                if ok:
                    self.unreachable_since.pop(node_id, None)
                else:
                    self.unreachable_since.setdefault(node_id, round(now, 3))

    def _loop(self) -> None:
        while not self._stop.wait(self.period_s):
            self.tick()
            try:
                self.poll()
            except (ray.exceptions.RayError, OSError, TimeoutError) as err:  # a GCS hiccup must not end the watch
                logger.warning("host watch: %r", err)
