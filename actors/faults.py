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

__all__ = ["sigkill_on_node", "kill_process", "InjectedFault", "FaultInjector", "Killer"]

logger = logging.getLogger(__name__)


def kill_process(supervisor, target: str, pid: int, trigger: str, log_dir: str) -> float | None:
    """Runs on the target's node: writes the kill to the fault log (``core.faultlog``),
    records it with the supervisor, SIGKILLs ``pid`` and logs that the signal went. The time
    is taken right before the kill, so detection latency starts there. None if ``pid`` is
    already dead (a zombie included); a recorded kill whose signal then finds no process is
    withdrawn from the supervisor's books and logged as aborted."""
    if not process_alive(pid):
        return None  # already dead (e.g. being recovered): nothing to record
    log = FaultLog(log_dir)
    now = time.time()
    record = KillRecord(target, now, pid, trigger)
    log.write("sending", "kill", target, pid, trigger, t=now)
    recorded = False
    try:
        ray.get(supervisor.record_kill.remote(record), timeout=30)
        recorded = True
        if not process_alive(pid):  # it died while the kill was recorded: a zombie takes a signal without error
            raise ProcessLookupError(f"process {pid} died before the signal")
        os.kill(pid, signal.SIGKILL)
    except BaseException as err:
        log.write("aborted", "kill", target, pid, trigger, kill_time=now, error=repr(err))
        if recorded:
            try:
                ray.get(supervisor.withdraw_kill.remote(record), timeout=30)
            except Exception as withdraw_err:  # noqa: BLE001 - the original error is the one to tell
                logger.warning("could not withdraw the kill of %s from the books: %s", target, withdraw_err)
        if isinstance(err, ProcessLookupError):
            return None  # it died between the check and the signal
        raise
    log.write("sent", "kill", target, pid, trigger, kill_time=now)
    return now


def sigkill_on_node(supervisor, target: str, info: Target, trigger: str, log_dir: str,
                    timeout_s: float = 30.0) -> float | None:
    """SIGKILLs ``info.pid`` on ``info.node_id``; returns the kill time. From this process
    when the target runs on this node: a task may first need a new worker process (1-3 s on a
    busy node), and a kill tied to a training step would land many steps late."""
    if info.node_id == ray.get_runtime_context().get_node_id():
        return kill_process(supervisor, target, info.pid, trigger, log_dir)
    killer = pinned(kill_process, info.node_id)
    return ray.get(killer.remote(supervisor, target, info.pid, trigger, log_dir), timeout=timeout_s)


class InjectedFault(RuntimeError):
    """An error raised on purpose at a named point (``faults.at_points[].error``): to the code
    around it, an unexpected exception like any bug."""


class Killer:
    """Kills a run's actor from inside the supervisor: itself by its own pid, ``all_trainers``
    as each trainer, anything else on its node (``sigkill_on_node``); and injects the faults
    that are not kills (``inject``)."""

    def __init__(self, targets: Callable[[], dict[str, Target]], record_kill: Callable[[KillRecord], None],
                 timeout_s: float, log_dir: str, checkpoint_uri: str):
        self.targets = targets
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
                info = self.targets().get(spec.target)
                if info is None or info.pid is None:
                    raise LookupError(f"{spec.target} has no process now")
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

    def __call__(self, target: str, trigger: str) -> None:
        if target == "supervisor":
            # Its own kill: only the "sending" line can be written (the sender dies with it).
            now = time.time()
            FaultLog(self.log_dir).write("sending", "kill", "supervisor", os.getpid(), trigger, t=now)
            self.record_kill(KillRecord("supervisor", now, os.getpid(), trigger))
            os.kill(os.getpid(), signal.SIGKILL)
        me = ray.get_runtime_context().current_actor
        targets = self.targets()
        names = sorted(t for t in targets if t.startswith("trainer:")) if target == "all_trainers" else [target]
        for name in names:
            if name in targets and targets[name].pid is not None:
                try:
                    sigkill_on_node(me, name, targets[name], trigger, self.log_dir, timeout_s=self.timeout_s)
                except Exception as err:  # noqa: BLE001 - a target already gone is not an error of the run
                    logger.warning("injected kill of %s failed: %s", name, err)


class FaultInjector(RunHooks):
    """Fires each configured fault once, ever: claimed (and journaled) before it fires, so
    concurrent triggers (every trainer reports the same commit) and a restarted supervisor
    never repeat it."""

    def __init__(self, faults: FaultsConfig, lock: threading.RLock, persist: Callable[[], None],
                 kill: Callable[[str, str], None], start_thread: Callable[..., threading.Thread],
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
            self._kill(spec.kill, f"at {point}")
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
