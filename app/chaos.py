"""Fault injection: kill a run's actors by SIGKILL of their process, one by one
(``cpr chaos kill shard:1``) or on a schedule of exponential inter-failure times
(``cpr chaos schedule`` or a run's ``faults:`` config), with the kill time recorded first.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import ray

from actors.client import SupervisorClient
from actors.faults import sigkill_together
from actors.supervisor.actor import supervisor_name
from app.rayenv import join_ray
from core.deadlines import Deadlines
from core.errors import ConfigError

__all__ = ["FaultSchedule", "kill_target", "kill_targets", "run_schedule", "find_supervisor", "write_run_info", "as_client"]

logger = logging.getLogger(__name__)

_TARGET_KINDS = {"shards": "shard:", "trainers": "trainer:", "supervisor": "supervisor", "all_trainers": "all_trainers",
                 "mirrors": "mirror:"}


def write_run_info(run_dir: Path, run_id: str, namespace: str, address: str, metrics_url: str | None = None,
                   train_cache: str | None = None) -> None:
    """What `cpr chaos --run RUN_DIR` needs to find a running job (and where its metrics are),
    and the training data cache `cpr verify` reads."""
    (Path(run_dir) / "run.json").write_text(
        json.dumps({"run_id": run_id, "namespace": namespace, "address": address, "pid": os.getpid(),
                    "metrics_url": metrics_url, "train_cache": train_cache})
    )


def as_client(supervisor, timeout_s: float = 30.0) -> SupervisorClient:
    """``supervisor`` as a client: a client already, or the actor's handle (tests hold one)."""
    if isinstance(supervisor, SupervisorClient):
        return supervisor
    return SupervisorClient(supervisor, Deadlines(timeout_s))


def find_supervisor(run_dir: str) -> SupervisorClient:
    """Connects to the run's Ray cluster (if not connected) and returns its supervisor."""
    path = Path(run_dir) / "run.json"
    if not path.exists():
        raise ConfigError(f"{run_dir}: no run.json; is a run going on in this run directory?")
    info = json.loads(path.read_text())
    if not ray.is_initialized():
        join_ray(os.environ.get("RAY_ADDRESS", info["address"]), info["namespace"], log_to_driver=False)
    try:
        return as_client(ray.get_actor(supervisor_name(info["run_id"]), namespace=info["namespace"]))
    except ValueError:
        raise ConfigError(f"run {info['run_id']} has no live supervisor; has it finished?") from None


def kill_target(supervisor, target: str, timeout_s: float = 30.0, trigger: str = "chaos", log_dir: str | None = None,
                killed: frozenset[tuple] | set[tuple] = frozenset()) -> dict:
    """SIGKILLs the process of ``target`` ("shard:1", "trainer:0", "supervisor") on its node.

    The kill is written to the run's fault log (``log_dir``, by default the one the supervisor
    names) and recorded with the supervisor first (a ``fault_injected`` event), so detection
    latency is measured from the kill. A (target, node, pid) in ``killed`` (this caller killed it
    already; the supervisor has not yet seen it die) is never signalled again. Returns what was killed.
    """
    landed = kill_targets(supervisor, [target], timeout_s, trigger, log_dir, killed)
    if not landed:
        raise ConfigError(f"{target} is already dead")
    return landed[0]


def kill_targets(supervisor, names: list[str], timeout_s: float = 30.0, trigger: str = "chaos",
                 log_dir: str | None = None, killed: frozenset[tuple] | set[tuple] = frozenset()) -> list[dict]:
    """``kill_target`` of several targets at once (every trainer, ``all_trainers``): all are
    recorded, then all signalled together (``actors.faults.sigkill_together``). Returns the
    kills that landed (a target that was already dead is left out)."""
    client = as_client(supervisor, timeout_s)
    targets = client.targets()
    for target in names:
        if target not in targets:
            raise ConfigError(f"unknown target {target!r}; this run has {sorted(targets)}")
        info = targets[target]
        if info.pid is None or (target, info.node_id, info.pid) in killed:
            raise ConfigError(f"{target} is being recovered; it has no process to kill yet")
    times = sigkill_together(client.handle, {t: targets[t] for t in names}, trigger,
                             log_dir or client.fault_log_dir(), timeout_s)
    landed = [t for t in names if times[t] is not None]
    # The console's line for each kill is the supervisor's fault_injected event ([chaos] killing ...).
    for t in landed:
        logger.info("killed %s (pid %d) at %.3f", t, targets[t].pid, times[t])
    return [{"target": t, "pid": targets[t].pid, "node_id": targets[t].node_id, "time": times[t]} for t in landed]


_KILL_ATTEMPTS = 10


@dataclass(frozen=True)
class FaultSchedule:
    """When and whom to kill: inter-failure times drawn from ``distribution`` with mean
    ``mtbf_s``, targets drawn uniformly from the allowed kinds, all from ``seed``."""

    targets: tuple[str, ...]
    mtbf_s: float
    distribution: str = "exponential"
    seed: int = 0
    max_failures: int = 3
    duration_s: float | None = None
    start_after_s: float = 0.0

    def __post_init__(self):
        bad = [t for t in self.targets if t not in _TARGET_KINDS]
        if bad or not self.targets:
            raise ConfigError(f"targets must be among {sorted(_TARGET_KINDS)}, got {list(self.targets)}")
        if self.mtbf_s <= 0:
            raise ConfigError(f"mtbf_s must be > 0, got {self.mtbf_s}")
        if self.distribution not in ("exponential", "fixed"):
            raise ConfigError(f"distribution must be exponential or fixed, got {self.distribution!r}")

    def plan(self, available: list[str]) -> list[tuple[float, str]]:
        """(seconds after start, target) for every planned kill; a pure function of the seed."""
        rng = np.random.default_rng(self.seed)
        kinds = [_TARGET_KINDS[t] for t in self.targets]
        if "all_trainers" in kinds:
            available = [*available, "all_trainers"]
        pool = sorted(a for a in available if any(a.startswith(k) for k in kinds))
        if not pool:
            raise ConfigError(f"no actor of kinds {list(self.targets)} in {sorted(available)}")
        out, t = [], self.start_after_s
        while len(out) < self.max_failures:
            t += rng.exponential(self.mtbf_s) if self.distribution == "exponential" else self.mtbf_s
            if self.duration_s is not None and t > self.duration_s:
                break
            out.append((t, pool[int(rng.integers(len(pool)))]))
        return out


def run_schedule(supervisor, schedule: FaultSchedule, stop: threading.Event, on_kill=None) -> list[dict]:
    """Kills per ``schedule`` until it is done or ``stop`` is set; returns the kills."""
    supervisor = as_client(supervisor)
    targets = supervisor.targets()
    log_dir = supervisor.fault_log_dir()
    start = time.monotonic()
    kills: list[dict] = []
    for at_s, target in schedule.plan(list(targets)):
        if stop.wait(max(0.0, at_s - (time.monotonic() - start))):
            break
        landed = _kill_retrying(supervisor, target, stop, log_dir, {(k["target"], k["node_id"], k["pid"]) for k in kills})
        if landed is None:
            break  # training is over, or the schedule was stopped
        kills.extend(landed)
        if landed and on_kill:
            on_kill(landed[-1])
    return kills


def _kill_retrying(supervisor: SupervisorClient, target: str, stop: threading.Event,
                   log_dir: str, killed: set[tuple]) -> list[dict] | None:
    """Kills ``target`` (every trainer for ``all_trainers``). A target that is being replaced
    has no process yet, so it is tried again for a few seconds and the schedule's kills all
    land. Returns the kills that landed; None if none did before training ended (a kill then
    would only disturb the shutdown) or ``stop`` was set."""
    landed: list[dict] = []
    for attempt in range(_KILL_ATTEMPTS):
        if supervisor.is_finished():
            return landed or None
        try:
            if target != "all_trainers":
                landed.append(kill_target(supervisor, target, trigger="schedule", log_dir=log_dir, killed=killed))
                return landed
            # Every trainer at once: Ray Train restarts the whole group from the checkpoint.
            names = [t for t in sorted(supervisor.targets()) if t.startswith("trainer:")]
            landed.extend(kill_targets(supervisor, [t for t in names if t not in {k["target"] for k in landed}],
                                       trigger="schedule", log_dir=log_dir, killed=killed))
            return landed
        except (ConfigError, ray.exceptions.RayError, TimeoutError) as err:
            # Being replaced, already dead from an earlier kill, or the run ending: the next try
            # finds the new process. Only giving up is worth a console line.
            logger.info("could not kill %s (attempt %d): %s", target, attempt + 1, err)
            if stop.wait(1.0):
                return landed or None
    logger.warning("gave up killing %s after %d attempts (it had no live process to kill)", target, _KILL_ATTEMPTS)
    return landed
