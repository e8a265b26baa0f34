"""The run's Prometheus metrics, through ``ray.util.metrics``: Ray's metrics agent on each
node exports them (prefixed ``ray_``) with Ray's own, on the node's metrics export port.

The supervisor sees every progress record and every event of the run, so it is the one
process that records them; each series carries the run id. A supervisor that Ray restarts
starts its counters again from zero in a new process (a new ``WorkerId`` label): sum a
counter over it to get the run's total.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from ray.util.metrics import Counter, Gauge, Histogram

from actors.supervisor.hooks import RunHooks
from core.records import Progress

__all__ = ["RunMetrics", "MetricsHook"]

logger = logging.getLogger(__name__)

_SECONDS_BUCKETS = [0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0]


class RunMetrics:
    """Records progress and events as metrics; never raises into the run."""

    def __init__(self, run_id: str, samples_per_step: int):
        self.samples_per_step = samples_per_step
        self.tags = {"run_id": run_id}
        run = ("run_id",)
        self.step = Gauge("cpr_step", "Last committed training step.", tag_keys=run)
        self.total_steps = Gauge("cpr_total_steps", "Steps the run trains in all.", tag_keys=run)
        self.samples_per_s = Gauge("cpr_samples_per_second", "Training samples per second (last progress interval).", tag_keys=run)
        self.loss = Gauge("cpr_loss", "Mean training log loss of the last progress interval.", tag_keys=run)
        self.trainers = Gauge("cpr_trainers", "Trainers in the last committed step's quorum.", tag_keys=run)
        self.failures = Counter(
            "cpr_failures_total", "Failures: kind=shard (with recovery partial/full) or trainer / all_trainers / host.",
            tag_keys=run + ("kind", "recovery"),
        )
        self.detection_s = Histogram(
            "cpr_detection_seconds", "Seconds from a failure to its detection.", _SECONDS_BUCKETS, tag_keys=run + ("kind",)
        )
        self.recovery_s = Histogram(
            "cpr_recovery_seconds", "Seconds until the failed actor serves again (shard: respawn + load; trainer: "
            "kill to rejoined).", _SECONDS_BUCKETS, tag_keys=run + ("kind",),
        )
        self.lost_samples = Counter("cpr_lost_samples_total", "Samples whose embedding updates were lost.", tag_keys=run)
        self.pls = Gauge("cpr_pls", "Portion of lost samples: lost samples over samples trained so far.", tag_keys=run)
        self.checkpoint_s = Histogram(
            "cpr_checkpoint_seconds", "Seconds a committed checkpoint took.", _SECONDS_BUCKETS, tag_keys=run + ("kind",)
        )
        self.checkpoint_bytes = Counter("cpr_checkpoint_bytes_total", "Bytes of committed checkpoints.", tag_keys=run + ("kind",))
        self.checkpoints = Counter("cpr_checkpoints_total", "Committed checkpoints.", tag_keys=run + ("kind",))
        self.tracked_rows = Gauge(
            "cpr_tracked_rows", "Rows MFU/SSU tracked as candidates at a shard's last save.", tag_keys=run + ("shard",)
        )
        self._lost_total = 0.0
        self._last_step = 0

    def _tags(self, **extra: object) -> dict[str, str]:
        return {**self.tags, **{k: str(v) for k, v in extra.items()}}

    def progress(self, record: Progress) -> None:
        try:
            self._last_step = int(record.step)
            self.step.set(record.step, tags=self.tags)
            self.total_steps.set(record.total_steps, tags=self.tags)
            self.samples_per_s.set(record.samples_per_s, tags=self.tags)
            self.loss.set(record.loss, tags=self.tags)
            self.trainers.set(record.trainers, tags=self.tags)
            self._set_pls()
        except Exception:  # metrics must never stop training
            logger.exception("recording progress metrics failed")

    def trainer_detected(self, detection_s: float) -> None:
        """A trainer failure was acted on by the survivors ``detection_s`` after it happened:
        recorded then, not at the heal, which may never come before the run ends."""
        try:
            self.detection_s.observe(detection_s, tags=self._tags(kind="trainer"))
        except Exception:  # metrics must never stop training
            logger.exception("recording a trainer detection failed")

    def event(self, e: dict, trainer_failure: dict | None = None) -> None:
        """``trainer_failure``: for ``trainer_healed``, the failure's record (its rejoin
        time) when the kill is known."""
        try:
            self._event(e, trainer_failure)
        except Exception:  # metrics must never stop training
            logger.exception("recording metrics of %s failed", e.get("kind"))

    def _event(self, e: dict, trainer_failure: dict | None) -> None:
        kind = e["kind"]
        if kind == "shard_recovered":
            self.failures.inc(1, tags=self._tags(kind="shard", recovery=e["recovery"]))
            if e.get("detection_s") is not None:
                self.detection_s.observe(e["detection_s"], tags=self._tags(kind="shard"))
            self.recovery_s.observe(e["recovery_s"], tags=self._tags(kind="shard"))
        elif kind == "trainer_started" and e.get("starts", 1) > 1:
            # A rank's process started again: its previous one died, whatever killed it.
            self.failures.inc(1, tags=self._tags(kind="trainer", recovery="replace"))
        elif kind == "trainer_healed" and trainer_failure is not None:
            if trainer_failure.get("rejoined_s") is not None:
                self.recovery_s.observe(trainer_failure["rejoined_s"], tags=self._tags(kind="trainer"))
        elif kind == "host_lost":
            self.failures.inc(1, tags=self._tags(kind="host", recovery="replace"))
            if e.get("unreachable_since") is not None:  # until Ray declared it dead
                self.detection_s.observe(e["declared_dead_at"] - e["unreachable_since"], tags=self._tags(kind="host"))
        elif kind == "all_trainers_failed":
            self.failures.inc(1, tags=self._tags(kind="all_trainers", recovery="checkpoint"))
        elif kind == "lost_samples_counted":
            lost = float(e["lost_samples"] or 0.0)
            self._lost_total += lost
            if lost > 0:  # Ray's Counter.inc refuses 0; a recovery that lost nothing adds nothing
                self.lost_samples.inc(lost, tags=self.tags)
            self._set_pls()
        elif kind == "checkpoint_saved":
            tags = self._tags(kind=e["checkpoint_kind"])
            self.checkpoint_s.observe(e["duration_s"], tags=tags)
            self.checkpoint_bytes.inc(e["bytes"], tags=tags)
            self.checkpoints.inc(1, tags=tags)
            for k, rows in enumerate(e.get("tracked_rows") or []):
                self.tracked_rows.set(rows, tags=self._tags(shard=k))

    def _set_pls(self) -> None:
        trained = self._last_step * self.samples_per_step
        if trained:
            self.pls.set(self._lost_total / trained, tags=self.tags)


class MetricsHook(RunHooks):
    """The run's Prometheus metrics (``actors.metrics``). ``trainer_failure_of(event)``: the
    trainer failure a ``trainer_healed`` event ended, for its recovery time."""

    def __init__(self, metrics: RunMetrics, trainer_failure_of: Callable[[dict], dict | None]):
        self.metrics = metrics
        self.trainer_failure_of = trainer_failure_of

    def on_event(self, event: dict) -> None:
        healed = self.trainer_failure_of(event) if event["kind"] == "trainer_healed" else None
        self.metrics.event(event, healed)

    def on_progress(self, record: Progress) -> None:
        self.metrics.progress(record)

    def on_trainer_detected(self, detection_s: float) -> None:
        self.metrics.trainer_detected(detection_s)
