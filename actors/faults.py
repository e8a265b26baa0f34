"""Fault injection by SIGKILL of an actor's process on its node, with the kill recorded first.

Used by ``cpr chaos``, by a run's ``faults:`` schedule, and by the supervisor for kills at
named points (``faults.at_points``, like torchft's ``EventInjector.fail_at``) and at training
steps (``faults.at_steps``).
"""

from __future__ import annotations

import os
import signal
import time

__all__ = ["POINTS", "sigkill_on_node", "kill_process"]

# The named points where the supervisor can inject a kill (faults.at_points).
POINTS = (
    "save.snapshotted",  # every shard copied its rows to save; their files are being written
    "save.files_written",  # every shard file of a checkpoint is written, the manifest is not
    "recovery.spawned",  # a recovery's new shard actors answer, nothing is loaded yet
    "recovery.loaded",  # a recovery's shards are loaded, the fleet is not committed yet
    "rollback.loaded",  # a rollback loaded every shard, checkpoints are not fenced yet
)


def kill_process(supervisor, target: str, pid: int, trigger: str) -> float | None:
    """Runs on the target's node: records the kill with the supervisor, then SIGKILLs ``pid``.
    The time is taken right before the kill, so detection latency starts there."""
    import ray

    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return None  # already dead (e.g. being recovered): nothing to record
    now = time.time()
    ray.get(supervisor.record_kill.remote(target, now, pid, trigger), timeout=30)
    os.kill(pid, signal.SIGKILL)
    return now


def sigkill_on_node(supervisor, target: str, info: dict, trigger: str, timeout_s: float = 30.0) -> float | None:
    """SIGKILLs ``info['pid']`` on ``info['node_id']``; returns the kill time. From this process
    when the target runs on this node: a task may first need a new worker process (1-3 s on a
    busy node), and a kill tied to a training step would land many steps late."""
    import ray

    from actors.nodes import pinned

    if info["node_id"] == ray.get_runtime_context().get_node_id():
        return kill_process(supervisor, target, info["pid"], trigger)
    killer = pinned(kill_process, info["node_id"])
    return ray.get(killer.remote(supervisor, target, info["pid"], trigger), timeout=timeout_s)
