"""Fault injection: SIGKILL of an actor's process on its node (the kill recorded first), and
the hook that fires a run's configured faults at named points of the supervisor's work
(``faults.at_points``, like torchft's ``EventInjector.fail_at``: a kill, or an unexpected
error) and after training steps (``faults.at_steps``). Used by ``cpr chaos``, by a run's
``faults:`` schedule, and by the supervisor; a run without faults has no such hook at all.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from collections.abc import Callable

import numpy as np
import ray

from actors.fault_kinds import damage_checkpoint, fill_storage, slow_storage, stall_on_node
from actors.nodes import pinned, process_alive
from actors.supervisor.hooks import RunHooks
from core.config import FaultsConfig
from core.config_failures import FaultSpec
from core.books import KillRecord
from core.faultlog import FaultLog
from core.records import Target

__all__ = ["sigkill_on_node", "sigkill_together", "kill_process", "kill_processes", "InjectedFault", "FaultInjector", "Killer"]

logger = logging.getLogger(__name__)


def kill_process(supervisor, target: str, pid: int, trigger: str, log_dir: str) -> float | None:
    """Runs on the target's node: writes the kill to the fault log (``core.faultlog``),
    records it with the supervisor, SIGKILLs ``pid`` and logs that the signal went. The time
    is taken right before the kill, so detection latency starts there. None if ``pid`` is
    already dead (a zombie included); a recorded kill whose signal then finds no process is
    withdrawn from the supervisor's books and logged as aborted."""
    return kill_processes(supervisor, [(target, pid)], trigger, log_dir)[0]


def kill_processes(supervisor, victims: list[tuple[str, int]], trigger: str, log_dir: str) -> list[float | None]:
    """``kill_process`` of several processes on this node at once (``all_trainers``): every
    kill is written and recorded first, then all are signalled together, so that none of them
    sees another's death (and exits, or is restarted by Ray Train) before its own signal. One
    kill time (or None) per victim; the first error of a recording is raised once every kill
    was sent or withdrawn."""
    log = FaultLog(log_dir)
    recorded: list[KillRecord | None] = [None] * len(victims)
    first_error: BaseException | None = None
    for i, (target, pid) in enumerate(victims):
        if not process_alive(pid):
            continue  # already dead (e.g. being recovered): nothing to record
        now = time.time()
        record = KillRecord(target, now, pid, trigger)
        log.write("sending", "kill", target, pid, trigger, t=now)
        try:
            ray.get(supervisor.record_kill.remote(record), timeout=30)
            recorded[i] = record
        except BaseException as err:  # noqa: BLE001 - raised below, once the others are sent
            log.write("aborted", "kill", target, pid, trigger, kill_time=now, error=repr(err))
            first_error = first_error or err
    times: list[float | None] = [None] * len(victims)
    for i, record in enumerate(recorded):
        if record is None:
            continue
        try:
            if not process_alive(record.pid):  # it died while the kill was recorded: a zombie takes a signal
                raise ProcessLookupError(f"process {record.pid} died before the signal")
            os.kill(record.pid, signal.SIGKILL)
        except ProcessLookupError as err:
            log.write("aborted", "kill", record.target, record.pid, trigger, kill_time=record.time, error=repr(err))
            try:
                ray.get(supervisor.withdraw_kill.remote(record), timeout=30)
            except Exception as withdraw_err:  # noqa: BLE001 - the kill did not happen either way
                logger.warning("could not withdraw the kill of %s from the books: %s", record.target, withdraw_err)
            continue
        times[i] = record.time
    for i, record in enumerate(recorded):
        if times[i] is not None:
            log.write("sent", "kill", record.target, record.pid, trigger, kill_time=record.time)
    if first_error is not None:
        raise first_error
    return times


def sigkill_on_node(supervisor, target: str, info: Target, trigger: str, log_dir: str,
                    timeout_s: float = 30.0) -> float | None:
    """SIGKILLs ``info.pid`` on ``info.node_id``; returns the kill time."""
    return sigkill_together(supervisor, {target: info}, trigger, log_dir, timeout_s)[target]


def sigkill_together(supervisor, targets: dict[str, Target], trigger: str, log_dir: str,
                     timeout_s: float = 30.0) -> dict[str, float | None]:
    """SIGKILLs the process of every target at once (``kill_processes`` on each node, the
    nodes in parallel); returns each target's kill time (None: it had no live process). On
    this node from this process: a task may first need a new worker process (1-3 s on a busy
    node), and a kill tied to a training step would land many steps late."""
    here = ray.get_runtime_context().get_node_id()
    by_node: dict[str, list[tuple[str, int]]] = {}
    for target, info in targets.items():
        by_node.setdefault(info.node_id, []).append((target, info.pid))
    refs = {node: pinned(kill_processes, node).remote(supervisor, victims, trigger, log_dir)
            for node, victims in by_node.items() if node != here}
    out: dict[str, float | None] = {}
    if here in by_node:
        out.update(zip((t for t, _ in by_node[here]), kill_processes(supervisor, by_node[here], trigger, log_dir)))
    for node, ref in refs.items():
        out.update(zip((t for t, _ in by_node[node]), ray.get(ref, timeout=timeout_s)))
    return out


# A stall after a step waits this long for a target with no process (a shard being recovered,
# a mirror being built: seconds without a warm spare), polling at _TARGET_POLL_S.
_TARGET_WAIT_S = 30.0
_TARGET_POLL_S = 0.5
_SEEN_POLL_S = 0.02  # a kill at a point polls this often until the supervisor saw the death


class InjectedFault(RuntimeError):
    """An error raised on purpose at a named point (``faults.at_points[].error``): to the code
    around it, an unexpected exception like any bug."""


class Killer:
    """Kills a run's actor from inside the supervisor: itself by its own pid, ``all_trainers``
    as each trainer, anything else on its node (``sigkill_on_node``); and injects the faults
    that are not kills (``inject``)."""

    def __init__(self, targets: Callable[[], dict[str, Target]], record_kill: Callable[[KillRecord], None],
                 timeout_s: float, log_dir: str, checkpoint_uri: str,
                 seen_dead: Callable[[str, int], bool] = lambda target, pid: True):
        self.targets = targets
        self.seen_dead = seen_dead  # whether the supervisor has taken note of that process's death
        self.record_kill = record_kill
        self.timeout_s = timeout_s
        self.log_dir = log_dir
        self.checkpoint_uri = checkpoint_uri

    def inject(self, spec: FaultSpec, trigger: str) -> None:
        """A stall of ``spec.target``, or damage to its newest checkpoint file. A fault that
        cannot be injected (its target is being replaced) is logged as aborted, not raised:
        the run is not at fault."""
        try:
            if spec.kind == "stall":
                # After a step (its own thread) a target being replaced, or a mirror being built,
                # is waited for; at a point the supervisor's work must go on at once.
                info = self._process_of(spec.target, _TARGET_WAIT_S if spec.at is None else 0.0)
                stall_on_node(spec.target, info, spec.seconds, trigger, self.log_dir, self.timeout_s)
            elif spec.kind == "fill_storage":
                fill_storage(self.checkpoint_uri, spec.seconds, trigger, self.log_dir)
            elif spec.kind == "slow_storage":
                slow_storage(self.checkpoint_uri, spec.seconds, spec.delay_s, trigger, self.log_dir)
            else:
                damage_checkpoint(self.checkpoint_uri, spec.kind, int(spec.target.split(":")[1]), trigger, self.log_dir)
        except Exception as err:  # noqa: BLE001 - see the docstring
            logger.warning("injected %s of %s failed: %s", spec.kind, spec.target, err)
            FaultLog(self.log_dir).write("aborted", spec.kind, spec.target or "storage", None, trigger, error=repr(err))

    def _process_of(self, target: str, wait_s: float) -> Target:
        """``target``'s process, polled for up to ``wait_s`` while it has none (LookupError after)."""
        deadline = time.monotonic() + wait_s
        while True:
            info = self.targets().get(target)
            if info is not None and info.pid is not None:
                return info
            if time.monotonic() >= deadline:
                raise LookupError(f"{target} has no process now" + (f" (waited {wait_s:.0f} s)" if wait_s else ""))
            time.sleep(_TARGET_POLL_S)

    def __call__(self, target: str, trigger: str, until_seen: bool = False) -> None:
        """Kills ``target``; ``until_seen``: returns only once the supervisor has taken note of
        each death (within the call timeout), so that a kill at a point of the supervisor's own
        work lands during that work however fast the rest of it would go (a recovery that
        adopted a warm spare in 10 ms finished before the death it was meant to meet)."""
        if target == "supervisor":
            # Its own kill: only the "sending" line can be written (the sender dies with it).
            now = time.time()
            FaultLog(self.log_dir).write("sending", "kill", "supervisor", os.getpid(), trigger, t=now)
            self.record_kill(KillRecord("supervisor", now, os.getpid(), trigger))
            os.kill(os.getpid(), signal.SIGKILL)
        me = ray.get_runtime_context().current_actor
        targets = self.targets()
        names = sorted(t for t in targets if t.startswith("trainer:")) if target == "all_trainers" else [target]
        victims = {n: targets[n] for n in names if n in targets and targets[n].pid is not None}
        try:
            sigkill_together(me, victims, trigger, self.log_dir, timeout_s=self.timeout_s)
        except Exception as err:  # noqa: BLE001 - a target already gone is not an error of the run
            logger.warning("injected kill of %s failed: %s", sorted(victims), err)
            return
        deadline = time.monotonic() + self.timeout_s
        for name, info in victims.items() if until_seen else ():
            while not self.seen_dead(name, info.pid) and time.monotonic() < deadline:
                time.sleep(_SEEN_POLL_S)


class FaultInjector(RunHooks):
    """Fires each configured fault once, ever: claimed (and journaled) before it fires, so
    concurrent triggers (every trainer reports the same commit) and a restarted supervisor
    never repeat it."""

    def __init__(self, faults: FaultsConfig, lock: threading.RLock, persist: Callable[[], None],
                 kill: Callable[..., None], start_thread: Callable[..., threading.Thread],
                 num_shards: int, num_trainers: int, inject: Callable[[FaultSpec, str], None] | None = None):
        self.faults = faults
        self._lock = lock
        self._persist = persist
        self._kill = kill
        self._inject = inject
        self._start_thread = start_thread
        self._counts = {"shard": num_shards, "trainer": num_trainers}
        self._fired: list[str] = []
        self._steps_done = 0

    def _claim(self, key: str) -> bool:
        with self._lock:
            if key in self._fired:
                return False
            self._fired.append(key)
            self._persist()
            return True

    def at_point(self, point: str) -> None:
        for spec in self.faults.at_points:
            if spec.at != point or self._steps_done < spec.after_step:
                continue
            action = spec.kill or f"error {spec.error}"
            if not self._claim(f"{point}->{action}"):
                continue
            if spec.error is not None:
                raise InjectedFault(f"{spec.error} (injected at {point})")
            # At a point of the supervisor's work, the work goes on once the death is noted; a
            # thread's tick may be the thread that notes it.
            self._kill(spec.kill, f"at {point}", not point.startswith("thread."))
        for i, fault in enumerate(self.faults.inject):
            if fault.at != point or self._steps_done < fault.after_step or self._inject is None:
                continue
            if self._claim(f"inject {i}: {fault.kind} {fault.target}"):
                self._inject(fault, f"at {point}")  # here, before the work goes on: it meets the fault

    def after_commit(self, step: int) -> None:
        """``faults.at_steps``: kill a target once ``step`` committed."""
        with self._lock:
            self._steps_done = max(self._steps_done, step + 1)
        for kind, steps in self.faults.at_steps.items():
            if step not in steps or not self._claim(f"step {step}->{kind}"):
                continue
            target = kind
            if kind in self._counts:
                target = f"{kind}:{int(np.random.default_rng([self.faults.seed, step]).integers(self._counts[kind]))}"
            self._start_thread("fault-at-step", self._kill, target, f"at step {step}")
        for i, spec in enumerate(self.faults.inject):
            if spec.at is not None or spec.after_step != step or self._inject is None:
                continue
            if not self._claim(f"inject {i}: {spec.kind} {spec.target}"):
                continue
            self._start_thread("fault-inject", self._inject, spec, f"at step {step}")

    def doc(self) -> list[str]:
        return list(self._fired)

    def load(self, fired: list[str]) -> None:
        self._fired = list(fired)
