"""The checkpoint coordinator: when the next save is due, the two-phase asynchronous save
itself, the chains recoveries restore from, and the timeline after a rollback (newer
checkpoints fenced, the schedule restarted).

A save (after CheckFreq, FAST'21): at the step boundary every shard copies the rows it is
to save into memory and training goes on (the only part on the training path); on a guarded
background thread each shard writes and hashes its file, the coordinator writes the dense
state and, once every part is durable, commits the manifest (phase one). The rows a shard's
MFU/SSU policy selected count as saved only once the shard hears that the manifest
committed (phase two), so a save that never commits (a shard or the supervisor died
mid-write, a rollback came first) loses no row from later incrementals and leaves no
manifest: it never looks like a checkpoint. A failed save is tried again after a backoff while
training goes on, within ``budgets.max_failed_saves`` in a row (``save_failures``).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

import ray

from actors.supervisor.costs import SharedCosts
from actors.supervisor.hooks import RunHooks
from actors.supervisor.restore_targets import RestoreTargets
from actors.supervisor.save_failures import FailedSaves
from actors.supervisor.save_schedule import SaveSchedule
from actors.supervisor.save_job import SAVE_ERRORS, Abandoned, SaveJob, reason as one_line
from core.checkpoint import DATA_POSITION_FILE, DENSE_FILE, FULL, INCREMENTAL, CheckpointStore, DataPosition, write_blob
from core.checkpoint.removal_log import RemovalLog
from core.config import RunConfig
from core.deadlines import Deadline, Deadlines
from core.errors import CheckpointCorrupt, CheckpointNotFound, ConfigError
from core.plan import ShardingPlan, plan_to_json
from core.records import SaveRequest, SaveResult, WrittenPart
from policies import FailurePolicy, IntervalController

__all__ = ["CheckpointCoordinator"]

logger = logging.getLogger(__name__)

_SCHEDULE_FIELDS = (
    "save_index", "last_full_step", "last_checkpoint_step", "next_checkpoint_step", "interval_steps_in_use",
    "in_flight_step",
)


class CheckpointCoordinator(SaveSchedule):
    def __init__(
        self,
        cfg: RunConfig,
        plan: ShardingPlan,
        costs: SharedCosts,
        record_event: Callable[..., dict],
        step_time_s: Callable[[], float | None],
        hooks: RunHooks,
        start_thread: Callable[..., threading.Thread],
        keep: Callable[[], set[int]] = set,
        clock: Callable[[], float] = time.time,
        *,
        policy: FailurePolicy,
        fail: Callable[[str], None],
        audit_dir: str | None = None,
    ):
        self.cfg = cfg
        ck = cfg.checkpoint
        # Restores chosen and not yet done (and lost samples still to count): kept from retention.
        self.targets = RestoreTargets(lambda: self.store)
        # With an audit log, what retention removes is hashed and recorded first, and what a rollback
        # fences is kept aside, for cpr verify (--replay).
        self.store = CheckpointStore(
            cfg.checkpoint_uri, keep_last=ck.keep_last, keep=lambda: set(keep()) | self.targets.protected(),
            audit_removal=RemovalLog(audit_dir) if audit_dir is not None else None, keep_fenced=audit_dir is not None,
        ) if ck.stored else None
        self.costs = costs
        self.plan = plan  # recorded in every manifest: which rows each shard file holds
        self.controller = IntervalController(cfg.recovery, costs, plan.num_shards, ck.pls_target)
        self.record_event = record_event
        self.step_time_s = step_time_s
        self.hooks = hooks
        self.start_thread = start_thread
        self.clock = clock
        self.save_index = 0
        self.last_full_step: int | None = None
        self.last_checkpoint_step = 0
        self.next_checkpoint_step: int | None = None
        self.interval_steps_in_use: int | None = None
        self.in_flight_step: int | None = None  # a save snapshotted, not yet committed or abandoned
        # A save and a rollback's fencing exclude each other: a save that began before the
        # rollback must not commit a checkpoint of the abandoned timeline after the fence.
        self._timeline = threading.Lock()
        self._epoch = 0  # bumped by every rollback: a save snapshotted before it never commits
        self._in_flight: SaveJob | None = None
        self._final_attempts: dict[int, int] = {}  # step -> final saves begun (snapshotted or tried)
        self.failures = FailedSaves(policy, fail)  # under the timeline lock

    # ------------------------------------------------------------------ persisted schedule

    def doc(self) -> dict:
        return {**{f: getattr(self, f) for f in _SCHEDULE_FIELDS}, **self.failures.doc()}

    def load(self, doc: dict) -> None:
        """The schedule a restarted supervisor continues. A save that was in flight when the
        previous one died never commits (its writer thread died with it): the next save is
        due at once."""
        for f in _SCHEDULE_FIELDS:
            setattr(self, f, doc.get(f))
        self.failures.load(doc)
        if self.in_flight_step is not None and self.next_checkpoint_step is not None:
            self.next_checkpoint_step = min(self.next_checkpoint_step, self.in_flight_step + 1)
        self.in_flight_step = None
        self._reconcile()

    def _reconcile(self) -> None:
        """A save that committed after the journal's last write (the supervisor died between its
        manifest and its event) is the schedule's newest: the next incremental builds on the
        newest full there is, and the save index goes on from it."""
        for info in self.store.committed_after(self.last_checkpoint_step or 0) if self.store is not None else ():
            self.last_checkpoint_step = info.step
            self.save_index = max(self.save_index or 0, int(info.meta.get("save_index", 0)) + 1)
            if info.kind == FULL:
                self.last_full_step = info.step

    def start(self, step: int = 0) -> None:
        self.last_checkpoint_step = step
        self.next_checkpoint_step = self.after(step)

    # ------------------------------------------------------------------ chains

    def chain_candidates(self) -> tuple[int, ...]:
        """The newest restorable state of one shard (a full checkpoint, then its incrementals),
        from the manifests alone: a partial recovery's shard reads and verifies its own files
        of it (and falls back past a corrupt one), nobody else's."""
        return tuple(self.store.chain_candidates()) if self.store is not None else ()

    def consistent_chain(self) -> tuple[int, ...]:
        """The newest state every shard and the dense model share: the newest valid full
        checkpoint, alone (verified in full once per step). An MFU/SSU incremental saves only
        its prioritized rows, so a chain through incrementals holds rows last saved at
        different steps; that suits partial recovery of one shard, not a rollback of
        everything (full recovery, every trainer dead, --resume)."""
        return tuple(self.store.verified_chain()[:1]) if self.store is not None else ()

    def chain_upto(self, step: int) -> tuple[int, ...]:
        return tuple(self.store.verified_chain(step)) if self.store is not None else ()

    def full_upto(self, step: int) -> tuple[int, ...]:
        """The newest valid full checkpoint at or before ``step``, alone (a rollback's chain)."""
        return self.chain_upto(step)[:1]

    def refuse(self, fallbacks) -> None:
        """Checkpoints a shard found corrupt while loading (``CheckpointFallback``s): no chain
        the supervisor chooses uses them from now on. One that was gone (removed) is not
        corrupt: a step fenced and committed again since must stay usable."""
        for fb in fallbacks:
            if self.store is not None and not fb.removed:
                self.store.mark_corrupt(fb.step, fb.reason)

    def next_due(self) -> int | None:
        """The step count at which the next save is due (None: saves are off)."""
        return self.next_checkpoint_step

    def read_dense(self, step: int) -> bytes | None:
        """The dense state saved with checkpoint ``step`` (None at step 0: the initial state)."""
        return self.store.read_blob(step, DENSE_FILE) if step > 0 and self.store is not None else None

    def final_attempts(self, step: int) -> int:
        """How many final saves of ``step`` began (the budget of a final save that keeps failing)."""
        return self._final_attempts.get(step, 0)

    def full_checkpoint_of(self, step: int) -> bool:
        """Whether a full checkpoint of ``step`` is committed (one fenced since it was listed, or
        whose manifest does not parse, is not)."""
        if self.store is None or step not in self.store.list_committed():
            return False
        try:
            return self.store.info(step).kind == FULL
        except (CheckpointNotFound, CheckpointCorrupt):
            return False

    # ------------------------------------------------------------------ saves

    def save(self, request: SaveRequest, shards: list, run_id: str, position: DataPosition) -> SaveResult:
        """Phase one of a consistent checkpoint after ``request.step`` committed steps, if one
        is due (``final``: the run's last step, saved in full whatever the schedule and the
        policy): every shard copies the rows to save into memory and the call returns; a
        guarded background thread writes the dense state, waits for every shard's file and
        commits the manifest. Only the copies hold the training path (``hold_s``). It answers
        within ``Deadlines.inner_s("save_checkpoint")``, which its trainer's peers wait out in
        their next quorum (``Deadlines.quorum_s``)."""
        deadlines = Deadlines(self.cfg.embeddings.call_timeout_s)
        deadline = Deadline(deadlines.inner_s("save_checkpoint"))
        job = self._in_flight
        # One save at a time: the previous one commits (or not) first, within its deadline.
        waited_s = self.drain(self._time_left(job)) if job is not None else 0.0
        if job is not None and job.thread is not None and job.thread.is_alive():
            result = self._still_writing(job, request.step, waited_s, deadline.remaining())
            self.failures.stop_if_over_budget()
            return result
        # The snapshot keeps its T. A timeline held longer (a commit, a rollback's fencing, a
        # count of lost samples reading a chain's files): the save stays due, asked again.
        if not self._timeline.acquire(timeout=max(0.0, deadline.remaining() - deadlines.shard_call_s)):
            return SaveResult(False, self.next_checkpoint_step, waited_s)
        try:
            result = self._snapshot(request, shards, run_id, position)
        finally:
            self._timeline.release()
        self.failures.stop_if_over_budget()
        return SaveResult(result.saved, result.next_step, result.duration_s + waited_s)

    def _time_left(self, job: SaveJob) -> float:
        drain_s = Deadlines(self.cfg.embeddings.call_timeout_s).save_drain_s
        return max(0.0, job.started + drain_s - time.monotonic())

    def _still_writing(self, job: SaveJob, step: int, waited_s: float, timeout_s: float) -> SaveResult:
        """The save in flight outlived its deadline (storage that hangs rather than fails): it is
        abandoned (it never commits) and counted as failed once, and each save due while it still
        writes fails too, after the backoff (``budgets.max_failed_saves``), without waiting for
        it: training goes on, no second save writes beside it. One that is committing (it holds
        the timeline past ``timeout_s``) is not abandoned: the save due is asked again."""
        if not self._timeline.acquire(timeout=max(0.0, timeout_s)):
            return SaveResult(False, self.next_checkpoint_step, waited_s)
        try:
            due = self.next_checkpoint_step is not None and step >= self.next_checkpoint_step
            if job.overdue and not due:
                return SaveResult(False, self.next_checkpoint_step, waited_s)
            failed = job.request.step if not job.overdue else step
            job.overdue, job.epoch, self.in_flight_step = True, -1, None
            err = TimeoutError(f"the save of step {job.request.step} still writes after "
                               f"{time.monotonic() - job.started:.1f}s: the storage does not answer")
            retry = self._failed(failed, err, self.after(step))
        finally:
            self._timeline.release()
        self.record_event("checkpoint_failed", step=failed, phase="write", error=str(err), **retry)
        return SaveResult(False, self.next_checkpoint_step, waited_s)

    def drain(self, timeout_s: float | None = None) -> float:
        """Waits for the save in flight, if any, to commit or be abandoned; returns the wait."""
        job = self._in_flight
        if job is None or job.thread is None or not job.thread.is_alive():
            return 0.0
        t0 = time.perf_counter()
        job.thread.join(timeout_s if timeout_s is not None else Deadlines(self.cfg.embeddings.call_timeout_s).save_drain_s)
        return time.perf_counter() - t0

    def _snapshot(self, request: SaveRequest, shards: list, run_id: str, position: DataPosition) -> SaveResult:
        step, final = request.step, request.final
        if self.store is None:
            raise ConfigError("checkpoint: every_steps, every_s, auto_interval or final must be set to save checkpoints")
        if not final and (self.next_checkpoint_step is None or step < self.next_checkpoint_step):
            return SaveResult(False, self.next_checkpoint_step)
        committed = self.store.list_committed()
        if step in committed or self.in_flight_step == step:
            # A call retried after a supervisor restart, or a second trainer saving the final
            # checkpoint: the save happened, or is being written.
            return SaveResult(False, self.next_checkpoint_step)
        if final:
            self._final_attempts[step] = self._final_attempts.get(step, 0) + 1
        t0 = time.perf_counter()
        uri = self.cfg.checkpoint_uri
        # After a supervisor restart a shard may still hold the rows of a save whose commit
        # it never heard of: it counts them as saved only if that checkpoint committed.
        confirmed = self.last_checkpoint_step if self.last_checkpoint_step in committed else None
        refs = [s.save_checkpoint.remote(uri, step, self.save_index, confirmed, final) for s in shards]
        try:
            snapshots = ray.get(refs, timeout=self.cfg.embeddings.call_timeout_s)
        except (ray.exceptions.RayError, ray.exceptions.GetTimeoutError) as err:
            # A shard died or lags behind (just recovered): this checkpoint will not exist;
            # the trainers ask again after a backoff.
            retry = self._failed(step, err, self.after(step))
            self.record_event("checkpoint_failed", step=step, phase="snapshot", error=one_line(err), **retry)
            return SaveResult(False, retry["retry_step"] or step + 1, time.perf_counter() - t0)
        hold_s = time.perf_counter() - t0
        if not all(r.full for r in snapshots) and self.last_full_step is None:
            raise RuntimeError(f"incremental save at step {step} without a full checkpoint before it")
        self.next_checkpoint_step = self.after(step)
        self.in_flight_step = step
        job = SaveJob(request, list(shards), snapshots, run_id, position, hold_s, self._epoch, time.monotonic())
        self._in_flight = job
        job.thread = self.start_thread("save-pipeline", self._write_and_commit, job)
        return SaveResult(True, self.next_checkpoint_step, hold_s)

    def _write_and_commit(self, job: SaveJob) -> None:
        """Phase one, in the background: the dense state and the data position are written,
        every shard's file is waited for; then phase two commits the manifest (only if every
        part is durable and no rollback moved the timeline meanwhile) and tells the shards,
        which clear the MFU/SSU counts of the rows saved. A failure abandons the save: no
        manifest, so it never looks like a checkpoint, and the next one is due after a backoff."""
        step = job.request.step
        t0 = time.perf_counter()
        try:
            self.hooks.at_point("thread.save-pipeline")
            written = self._write_parts(job)
            with self._timeline:
                if job.epoch != self._epoch:
                    raise Abandoned("a rollback moved the timeline after its snapshot")
                self._commit(job, written, time.perf_counter() - t0)
        except (*SAVE_ERRORS, Abandoned) as err:
            with self._timeline:
                self.in_flight_step = None
                # A save that a rollback abandoned is no failure of the storage; the rollback
                # restarted the schedule.
                retry = self._failed(step, err, self.next_checkpoint_step) if job.epoch == self._epoch else {}
            self._discard(step)
            if job.overdue:
                return  # counted when it was abandoned
            self.record_event("checkpoint_failed", step=step, phase="write", error=one_line(err),
                              background_s=round(time.perf_counter() - t0, 4), **retry)
            self.failures.stop_if_over_budget()
        finally:
            job.request = SaveRequest(step, b"", job.request.final)  # the dense bytes are written or given up

    def _discard(self, step: int) -> None:
        """What the failed save of ``step`` wrote goes (a full disk must not stay full of it)."""
        try:
            self.store.discard(step)
        except OSError as err:
            logger.warning("the files of the failed save of step %d could not be removed: %s", step, err)

    def _failed(self, step: int, err: BaseException, due: int | None) -> dict:
        """A save of ``step`` failed (under the timeline lock; ``due``: the next save's step by the
        schedule): the next one comes after a backoff. Returns the event's fields."""
        retry = self.failures.failed(step, due, one_line(err))
        if self.next_checkpoint_step is not None:
            self.next_checkpoint_step = retry["retry_step"]
        return retry

    def _write_parts(self, job: SaveJob) -> list[WrittenPart]:
        step, uri, timeout = job.request.step, self.cfg.checkpoint_uri, self.cfg.embeddings.call_timeout_s
        self.hooks.at_point("save.snapshotted")
        refs = [s.save_written.options(concurrency_group="save").remote(step) for s in job.shards]
        job.dense_entry = write_blob(uri, step, DENSE_FILE, job.request.dense)
        job.position_entry = write_blob(uri, step, DATA_POSITION_FILE, job.position.to_json())
        written = ray.get(refs, timeout=timeout)
        self.hooks.at_point("save.files_written")
        return written

    def _commit(self, job: SaveJob, written: list[WrittenPart], elapsed_s: float) -> None:
        step, timeout = job.request.step, self.cfg.embeddings.call_timeout_s
        full = all(r.full for r in job.snapshots)
        info = self.store.commit(
            step, [job.dense_entry, job.position_entry] + [w.entry for w in written],
            kind=FULL if full else INCREMENTAL, base_step=None if full else self.last_full_step,
            meta={"run_id": job.run_id, "save_index": self.save_index, "policy": self.cfg.checkpoint.policy,
                  "plan": plan_to_json(self.plan)},
        )
        # Phase two: the shards may now count the rows they wrote as saved. A shard that died
        # meanwhile is being recovered anyway.
        ray.wait([s.confirm_save.remote(step) for s in job.shards], num_returns=len(job.shards), timeout=timeout)
        self.costs.observe_save(job.hold_s)
        self.save_index += 1
        if full:
            self.last_full_step = step
        self.last_checkpoint_step = step
        self.in_flight_step = None
        self.failures.committed()
        self.record_event(
            "checkpoint_saved", step=step, checkpoint_kind=info.kind, final=job.request.final,
            duration_s=round(job.hold_s, 4), hold_s=round(job.hold_s, 4), background_s=round(elapsed_s, 4),
            bytes=info.total_bytes, rows=sum(r.rows for r in job.snapshots),
            tracked_rows=[r.tracked_rows for r in job.snapshots],
            shard_snapshot_s=[round(r.snapshot_s, 4) for r in job.snapshots],
            shard_write_s=[round(w.write_s, 4) for w in written], next_step=self.next_checkpoint_step,
        )

    # ------------------------------------------------------------------ after a rollback

    def timeline(self) -> threading.Lock:
        """Held while nothing may commit or fence (saves and rollbacks take it too)."""
        return self._timeline

    def restart_timeline(self, step: int, chain: list[int]) -> list[int]:
        """Everything was rolled back to ``step``: checkpoints newer than it belong to an
        abandoned timeline and are fenced (deleted, manifest first, so never loaded), and the
        save schedule starts again from ``step``. A save in flight finishes first (if it
        commits, it is fenced with the rest). Idempotent. Returns the fenced steps."""
        self.drain()
        with self._timeline:
            self._epoch += 1
            fenced = self.store.fence_after(step) if self.store is not None else []
            if chain:
                self.save_index = int(self.store.info(chain[0]).meta.get("save_index", 0)) + 1
                self.last_full_step = chain[0]
            else:
                self.save_index, self.last_full_step = 0, None
            self.start(step)
            return fenced
