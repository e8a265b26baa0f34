"""The embedding-shard fleet: named, detached shard actors, adopted or spawned by generation,
warm spares that a recovery adopts instead of starting a process, and the watchers that see
a shard's (or a spare's) death from Ray's own signal.

A shard's name carries its generation (``cpr-shard-<run>-<k>-g<gen>``). The supervisor
reserves a generation in its journal before it spawns, so a restarted supervisor adopts the
actor under the reserved name if it answers, or kills it and reserves the next: a name is
never used twice.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import ray

from actors.lease import Fences, shard_place
from actors.nodes import placement
from actors.shard import EmbeddingShard
from core.errors import ShardUnavailable
from core.logs import LOG_DIR
from core.records import ShardInfo

__all__ = ["ShardFleet", "shard_name", "spare_name", "spare_target", "mirror_name", "kill_run_shards"]

logger = logging.getLogger(__name__)


# Ray's ActorDiedError for an actor whose process exited (not one whose node was lost or that
# was killed by ``ray.kill``, which may still run somewhere cut off).
_WORKER_EXITED = "because its worker process has died"


def _exited(err: Exception, handle) -> bool:
    """Ray's word that the actor's process is gone (its raylet saw it exit), not only that it
    cannot be reached: only then may a successor act without waiting (actors.lease). The
    failed call's error may come before the cause is known; a new call's error carries it."""
    if not isinstance(err, ray.exceptions.ActorDiedError):
        return False
    if _WORKER_EXITED in str(err):
        return True
    try:
        ray.get(handle.__ray_ready__.remote(), timeout=1.0)
    except ray.exceptions.ActorDiedError as again:
        return _WORKER_EXITED in str(again)
    except ray.exceptions.RayError:
        pass
    return False


def shard_name(run_id: str, shard: int, generation: int) -> str:
    return f"cpr-shard-{run_id}-{shard}-g{generation}"


def spare_name(run_id: str, n: int) -> str:
    """A warm spare's name; it keeps it when adopted (Ray cannot rename an actor), so the
    supervisor journals which name serves each shard. Same prefix as the shards, so that
    ``kill_run_shards`` removes spares too."""
    return f"cpr-shard-{run_id}-spare{n}"


def mirror_name(run_id: str, n: int) -> str:
    """A replica-recovery mirror's name (``actors.supervisor.mirrors``); it keeps it when promoted."""
    return f"cpr-shard-{run_id}-mirror{n}"


def spare_target(name: str) -> str:
    """The chaos target (``spare:<n>``) of the spare named ``name`` (``spare_name``)."""
    return f"spare:{name.rsplit('spare', 1)[1]}"


def kill_run_shards(run_id: str, namespace: str) -> list[str]:
    """Kills every shard actor of run ``run_id`` still registered, whatever its generation
    (half-started ones of an unfinished recovery too); returns their names."""
    prefix = f"cpr-shard-{run_id}-"
    killed = []
    for a in ray.util.list_named_actors(all_namespaces=True):
        if a["namespace"] == namespace and a["name"].startswith(prefix):
            try:
                ray.kill(ray.get_actor(a["name"], namespace=namespace), no_restart=True)
                killed.append(a["name"])
            except (ValueError, ray.exceptions.RayError):
                pass  # gone meanwhile
    return killed


def _plain_thread(name: str, fn: Callable, *args) -> threading.Thread:
    thread = threading.Thread(target=fn, args=args, name=name, daemon=True)
    thread.start()
    return thread


class ShardFleet:
    """Creates, finds and watches the shards of one run. ``on_death(k, gen, cause, t, exited)``
    is called from the watcher thread when a watched shard's process is gone. With ``fences``
    (actors.lease) every new shard actor is granted its place before it starts, and holds a
    lease on it. The watcher runs
    under ``start_thread`` (the supervisor's guard) and calls ``tick()`` on every pass."""

    def __init__(
        self,
        cfg,
        plan,
        run_id: str,
        audit_dir: str | None,
        on_death: Callable[[int, int, str, float, bool], None],
        on_spare_death: Callable[[str, str, float], None] | None = None,
        occupied: Callable[[set], list] | None = None,
        avoid: Callable[[], set] | None = None,
        start_thread: Callable[..., threading.Thread] | None = None,
        tick: Callable[[], None] = lambda: None,
        fences: Fences | None = None,
    ):
        self.fences = fences
        self.start_thread = start_thread or (lambda name, fn, *a: _plain_thread(name, fn, *a))
        self.tick = tick
        self.cfg = cfg
        self.plan = plan
        self.run_id = run_id
        self.audit_dir = audit_dir
        self.log_dir = str(Path(cfg.run_dir).resolve() / LOG_DIR)
        self.on_death = on_death
        self.on_spare_death = on_spare_death
        # Node ids of the run's shards (but those given) and spares: where new ones go.
        self.occupied = occupied or (lambda exclude: [])
        self.avoid = avoid or set  # nodes not to place on (actors.nodes.HostWatch.suspects)
        self.timeout_s = cfg.embeddings.call_timeout_s
        self.start_timeout_s = max(cfg.embeddings.start_timeout_s, self.timeout_s)
        self._watch: dict[Any, tuple[int | str, int | None, Any]] = {}  # ref -> (shard or spare name, generation, handle)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # ------------------------------------------------------------------ actors

    def _options(self, name: str, **extra) -> dict:
        emb = self.cfg.embeddings
        # Detached: the shards outlive a supervisor restart; shutdown() and the driver's
        # cleanup remove them.
        return dict(name=name, namespace=self.cfg.ray.namespace, lifetime="detached", num_cpus=emb.num_cpus,
                    num_gpus=emb.num_gpus, max_restarts=0, **extra)

    def _args(self) -> dict:
        emb, ck = self.cfg.embeddings, self.cfg.checkpoint
        return dict(
            dim=self.cfg.model.embedding_dim,
            learning_rate=emb.learning_rate,
            eps=emb.eps,
            seed=self.cfg.seed,
            microbatches_per_step=self.cfg.training.microbatches_per_step,
            threads=emb.threads,
            priority={"policy": ck.policy, "r": ck.r, "sample_rate": ck.sample_rate, "full_every": ck.full_every},
            audit_dir=self.audit_dir,
            log_dir=self.log_dir,
            lease=self.fences.spec if self.fences is not None else None,
            call_timeout_s=emb.call_timeout_s,  # its own waits are shorter (core.deadlines)
        )

    @staticmethod
    def _actor_class():
        # The extra concurrency groups run watch(), save_written() and attach_mirror() beside the compute.
        return ray.remote(concurrency_groups={"watch": 1, "save": 1, "mirror": 1})(EmbeddingShard)

    def _place(self, taken: list) -> dict:
        """Actor options for one more shard-like actor (``actors.nodes.placement``, avoiding
        hosts that stopped answering); its node joins ``taken``."""
        node, extra = placement(taken, self.avoid())
        taken.append(node)
        return extra

    def spawn(self, k: int, generation: int, taken: list | None = None):
        """Starts shard ``k`` under ``generation``; with ``taken`` (node ids of the run's other
        shards and spares) it goes, softly, to the node holding the fewest of them, and its
        node is appended to ``taken``."""
        self._grant({k: generation}, wait=False)
        return self._spawn(k, generation, taken)

    def _spawn(self, k: int, generation: int, taken: list | None):
        """``spawn`` of a place already granted."""
        extra = self._place(taken) if taken is not None else {}
        return self._actor_class().options(**self._options(shard_name(self.run_id, k, generation), **extra)).remote(
            shard_id=k, slices=list(self.plan.shards[k]), generation=generation, **self._args()
        )

    def spawn_spare(self, name: str, taken: list, idle: bool = False):
        """Starts the warm spare ``name`` (``spare_name``): a shard process with its imports
        done and no tables, placed like a shard (``spawn``), so that a host's loss does not
        take a shard and the spare that would replace it. ``idle``: it imports at idle
        priority (``EmbeddingShard``)."""
        return self._actor_class().options(**self._options(name, **self._place(taken))).remote(
            shard_id=None, slices=None, spare=name, idle_warmup=idle, ready_rows=self._common_shape(),
            spare_tables=self.cfg.embeddings.spare_tables, **self._args()
        )

    def spawn_mirror(self, name: str, taken: list, primary_node: str | None):
        """Starts ``name``, a shard process that becomes a mirror (``become_mirror``), placed like
        a spare but never, while another node has room, on its primary's node."""
        node, extra = placement(taken, self.avoid() | {primary_node})
        taken.append(node)
        return self._actor_class().options(**self._options(name, **extra)).remote(
            shard_id=None, slices=None, spare=name, ready_rows=self._common_shape(),
            spare_tables=self.cfg.embeddings.spare_tables, **self._args()
        )

    def _common_shape(self) -> list[int]:
        """Rows per slice of the shape most shards have (the first such shard's): the tables a
        spare allocates ahead (``embeddings.spare_tables``)."""
        shapes = [tuple(s.num_rows for s in slices) for slices in self.plan.shards]
        return list(max(shapes, key=lambda shape: (shapes.count(shape), -shapes.index(shape))))

    def find_name(self, name: str):
        try:
            return ray.get_actor(name, namespace=self.cfg.ray.namespace)
        except ValueError:
            return None

    def find(self, k: int, generation: int):
        return self.find_name(shard_name(self.run_id, k, generation))

    def _grant(self, targets: dict[int, int], wait: bool) -> float:
        if self.fences is None:
            return 0.0
        return self.fences.grant([shard_place(k, g) for k, g in targets.items()], wait)

    def adopt_or_spawn(self, targets: dict[int, int], spares: dict[int, str] | None = None,
                       predecessors_exited: bool = False, committed: int | None = None) -> tuple[dict, list[int]]:
        """The live actor of each shard ``k`` under generation ``targets[k]``: the warm spare
        ``spares[k]`` made shard ``k`` (``adopt``, which allocates its tables), or the actor a
        half-finished recovery already created if it answers, else a new one (all at once,
        so several respawns cost one). Returns ``({k: (handle, ready info)}, lost)``: a shard
        in ``lost`` has an actor that does not answer (or a spare gone or taken); it is
        killed, and the caller must reserve a new generation (without the spare). New
        processes are placed (``spawn``) among the nodes of the shards that are not replaced.
        The places are granted first (``actors.lease``): unless every predecessor's process is
        known to have exited, this waits out their leases."""
        spares = spares or {}
        waited = self._grant(targets, wait=not predecessors_exited)
        if waited:
            logger.info("waited %.2fs for the leases of shards %s' predecessors", waited, sorted(targets))
        taken = self.occupied(targets)
        handles, refs = {}, {}
        for k, g in targets.items():
            if k in spares:
                handles[k] = self.find_name(spares[k])
                if handles[k] is not None:
                    refs[k] = handles[k].adopt.remote(k, list(self.plan.shards[k]), g, committed)
            else:
                handles[k] = self.find(k, g) or self._spawn(k, g, taken)
                refs[k] = handles[k].ready.remote()
        # A new process needs its start time; an adopted spare is a call to a started process.
        wait_s = self.start_timeout_s if set(targets) - set(spares) else self.timeout_s
        ray.wait(list(refs.values()), num_returns=len(refs), timeout=wait_s)
        out, lost = {}, [k for k in targets if k not in refs]
        for k, ref in refs.items():
            try:
                out[k] = (handles[k], ray.get(ref, timeout=0.01))
            except (ray.exceptions.RayError, ray.exceptions.GetTimeoutError) as err:
                logger.warning("shard %d generation %d is not usable (%s); killing it", k, targets[k], type(err).__name__)
                self.kill(handles[k])
                lost.append(k)
        return out, lost

    def ready(self, handles: list) -> list[ShardInfo]:
        try:
            return ray.get([h.ready.remote() for h in handles], timeout=self.start_timeout_s)
        except ray.exceptions.GetTimeoutError:
            raise ShardUnavailable(
                f"{len(handles)} shard(s) did not start within embeddings.start_timeout_s={self.start_timeout_s}s"
            ) from None

    @staticmethod
    def kill(handle) -> None:
        if handle is None:
            return
        try:
            ray.kill(handle, no_restart=True)
        except (ValueError, ray.exceptions.RayError):
            pass

    # ------------------------------------------------------------------ watching

    def watch(self, k: int | str, generation: int | None, handle) -> None:
        """Keeps a ``watch()`` call pending on the shard (``k`` an int) or on the spare named
        ``k``: it fails the moment the process dies."""
        ref = handle.watch.options(concurrency_group="watch").remote()
        with self._lock:
            self._watch[ref] = (k, generation, handle)
            if self._thread is None:
                self._thread = self.start_thread("shard-watch", self._loop)

    def stop(self) -> None:
        self._stop.set()

    def _loop(self) -> None:
        while not self._stop.is_set():
            self.tick()
            with self._lock:
                refs = list(self._watch)
            if not refs:
                self._stop.wait(0.2)
                continue
            ready, _ = ray.wait(refs, num_returns=1, timeout=0.2)
            for ref in ready:
                with self._lock:
                    k, gen, handle = self._watch.pop(ref)
                exited = False
                try:
                    ray.get(ref)
                    cause = "watch returned"
                except ray.exceptions.RayActorError as err:
                    cause = type(err).__name__
                    exited = _exited(err, handle)
                except ray.exceptions.RayError as err:  # any other failure of the call: the shard is gone too
                    cause = repr(err)
                if self._stop.is_set():
                    continue
                if isinstance(k, str):
                    if self.on_spare_death is not None:
                        self.on_spare_death(k, cause, time.time())
                else:
                    self.on_death(k, gen, cause, time.time(), exited)
