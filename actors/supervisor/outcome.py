"""What the recovery executor hands back (an ``Outcome``, or why it could not finish), and
what a finished recovery leaves in the books: one failure record per shard death it
recovered, with the times, rows and chain of its recovery. Pure: the controller commits them
with the new fleet in the transition that persists both."""

from __future__ import annotations

from dataclasses import dataclass, field

from actors.supervisor.machine import EVERY_TRAINER_DIED, RESUME, RecoveringShards, RollbackRefused, RollingBack
from core.plan import ShardingPlan
from core.books import FailureRecord
from core.records import LoadResult, ShardInfo

__all__ = ["failure_records", "refusal", "rollback_events", "Outcome", "ShardsLost", "ChainMismatch"]


class ShardsLost(Exception):
    """Shards died, or did not answer in time and were killed, while a recovery used them."""

    def __init__(self, shards: list[int]):
        super().__init__(shards)
        self.shards = shards


class ChainMismatch(Exception):
    """A rollback would leave the shards on different states, or on another state than the
    dense model's: its chain does not end at its step, or a shard loaded another chain (its
    own file of the chain was corrupt: ``fallbacks`` names those files). The run never trains
    on a mix: it rolls back further, or stops."""

    def __init__(self, message: str, fallbacks: tuple = ()):
        super().__init__(message)
        self.fallbacks = fallbacks


@dataclass
class Outcome:
    handles: dict[int, tuple[object, ShardInfo]] = field(default_factory=dict)  # replaced shards
    loaded: dict[int, LoadResult] = field(default_factory=dict)
    reschedule_s: float = 0.0
    load_s: float = 0.0
    fenced: list[int] = field(default_factory=list)


def failure_records(done: RecoveringShards | RollingBack, out: Outcome, generation_after: int, now: float,
                    plan: ShardingPlan | None = None) -> list[FailureRecord]:
    """The failures ``done`` recovered. A partial recovery's record carries the chain its shard
    loaded (its own files may have sent it back further) and the rows it reloaded; a
    rollback's, the rollback's chain and every shard's rows. With ``plan``, each record names
    the rows its dead shard held (its lost samples are counted over them, whatever plan a
    later attempt resumes on)."""
    partial = isinstance(done, RecoveringShards)
    total_rows = sum(r.rows for r in out.loaded.values())
    total_bytes = sum(r.bytes for r in out.loaded.values())
    records = []
    for cause in done.causes:
        mine = out.loaded.get(cause.shard) if partial else None
        chain = tuple(mine.chain) if mine is not None else tuple(done.chain)
        killed = cause.killed_at
        if partial and cause.shard in done.mirrors:
            records.append(_replica_record(cause, done, out, generation_after, now))
            continue
        records.append(FailureRecord(
            actor=cause.actor, shard=cause.shard, generation=cause.generation, cause=cause.cause,
            detected_at=cause.detected_at, killed_at=killed, detection_s=cause.detection_s,
            first_step=cause.first_step, recovery="partial" if partial else "full", decision=done.decision,
            generation_after=generation_after, spare=done.spares.get(cause.shard),
            adoption_s=round(out.reschedule_s, 3), reschedule_s=round(out.reschedule_s, 3),
            load_s=round(out.load_s, 3), recovery_s=round(now - cause.detected_at, 3),
            serving_s=round(now - killed, 3) if killed is not None else None,
            restored_step=(chain[-1] if chain else 0) if partial else done.step, chain=chain,
            rows_reloaded=int(mine.rows if mine is not None else (0 if partial else total_rows)),
            bytes_reloaded=int(mine.bytes if mine is not None else (0 if partial else total_bytes)),
            failed_at_step=None, lost_samples=None if partial else 0.0,
            lost_steps_recomputed=0 if partial else None,
            slices=None if plan is None else tuple((s.table, s.row_start, s.row_end) for s in plan.shards[cause.shard]),
        ))
    return records


def _replica_record(cause, done: RecoveringShards, out: Outcome, generation_after: int, now: float) -> FailureRecord:
    """A shard whose mirror took its place: no chain, nothing reloaded, nothing lost."""
    killed, info = cause.killed_at, out.handles[cause.shard][1]
    return FailureRecord(
        actor=cause.actor, shard=cause.shard, generation=cause.generation, cause=cause.cause,
        detected_at=cause.detected_at, killed_at=killed, detection_s=cause.detection_s, first_step=cause.first_step,
        recovery="replica", decision=done.decision, generation_after=generation_after,
        spare=done.spares.get(cause.shard), adoption_s=round(out.reschedule_s, 3),
        reschedule_s=round(out.reschedule_s, 3), load_s=0.0, recovery_s=round(now - cause.detected_at, 3),
        serving_s=round(now - killed, 3) if killed is not None else None, restored_step=info.applied_steps,
        chain=(), rows_reloaded=0, bytes_reloaded=0, failed_at_step=None, lost_samples=0.0, lost_steps_recomputed=0,
    )


def rollback_events(done: RollingBack, out: Outcome) -> list[tuple[str, dict]]:
    """The events a finished rollback records: a resume, or every trainer's death, and the
    checkpoints it fenced."""
    extra = {"fenced": out.fenced, "rows_reloaded": sum(r.rows for r in out.loaded.values()),
             "load_s": round(out.load_s, 3)}
    events = []
    if done.why == RESUME:
        events.append(("resumed", {"step": done.step, "chain": list(done.chain),
                                   "bytes_loaded": sum(r.bytes for r in out.loaded.values()), **extra}))
    elif done.why == EVERY_TRAINER_DIED:
        ahead = done.trainers.ahead if done.trainers is not None else done.step
        if done.refused_from is not None:
            ahead = max(ahead, done.refused_from)
        events.append(("all_trainers_failed", {"fallback_step": done.step, "steps_lost": ahead - done.step, **extra}))
    if out.fenced:
        events.append(("checkpoints_fenced", {"steps": out.fenced, "rollback_step": done.step, "why": done.why}))
    return events


def refusal(err: ChainMismatch, full_upto) -> RollbackRefused:
    """The rollback that passes over the checkpoints a shard refused: to the newest full
    checkpoint before the oldest of them, alone (``full_upto``, once the refused ones are marked
    corrupt): like every rollback of everything, never through MFU/SSU incrementals, which hold
    only their prioritized rows."""
    chain = full_upto(min(fb.step for fb in err.fallbacks) - 1)
    reason = "; ".join(f"checkpoint {fb.step}: {fb.reason}" for fb in err.fallbacks)
    return RollbackRefused(chain[-1] if chain else 0, tuple(chain), reason[:300])
