"""The named points where a run's ``faults.at_points`` can kill a process or raise an error
(like torchft's ``EventInjector.fail_at``): places in the supervisor's work, and one pass of
each of its background threads (``thread.<name>``), whose crash must end the run as Failed."""

from __future__ import annotations

__all__ = ["WORK_POINTS", "THREADS", "POINTS"]

WORK_POINTS = {
    "save.snapshotted": "every shard copied its rows to save; their files are being written",
    "save.files_written": "every shard file of a checkpoint is written, the manifest is not",
    "recovery.spawned": "a recovery's new shard actors answer, nothing is loaded yet",
    "recovery.loaded": "a recovery's shards are loaded, the fleet is not committed yet",
    "rollback.spawned": "a rollback's respawned shards answer, nothing is loaded yet",
    "rollback.loaded": "a rollback loaded every shard, checkpoints are not fenced yet",
}

# The supervisor's background threads; each calls its point on every pass.
THREADS = ("shard-watch", "recovery-executor", "spare-keeper", "host-watch", "save-pipeline", "lost-samples")

POINTS = tuple(WORK_POINTS) + tuple(f"thread.{name}" for name in THREADS)
