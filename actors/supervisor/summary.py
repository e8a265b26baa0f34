"""The run's summary for its report, from every part's books: failures (open ones closed at
the last step and counted), the committed steps' tally, trainer failures, the checkpoint
policy and estimates, and each shard's counters; the events and progress reports are read
from the run's files (the supervisor keeps only the last ones in memory)."""

from __future__ import annotations

import ray

from actors.supervisor.assembly import Parts
from actors.supervisor.machine import Failed, Finished
from core.codec import decode
from core.books import CheckpointPolicyView, RecoveryModes, RunSummary, StateView
from core.records import EvalResult, Progress, ShardState

__all__ = ["run_summary"]


def _state_view(state) -> StateView:
    if isinstance(state, Failed):
        return StateView(state.name, reason=state.reason)
    if isinstance(state, Finished):
        return StateView(state.name, how=state.how)
    return StateView(state.name)


def run_summary(p: Parts) -> RunSummary:
    cfg, ck = p.inputs.cfg, p.checkpoints
    ck.drain()
    evaluation = decode(EvalResult, p.eval.value)
    last = p.trainers.last_step_committed()
    final = evaluation.steps if evaluation is not None else (last + 1 if last is not None else 0)
    p.ledger.close_all(final)
    shards: tuple[ShardState, ...] = ()
    error = None
    try:
        _, handles = p.controller.fleet()
        shards = tuple(ray.get([s.state.remote() for s in handles], timeout=p.deadlines.shard_call_s))
    except (ray.exceptions.RayError, ray.exceptions.GetTimeoutError, AttributeError) as err:
        error = str(err).splitlines()[0][:300] if str(err) else type(err).__name__
    failures = p.ledger.records()
    step_time_s = p.trainers.step_time_s()
    interval = ck.interval_steps_in_use
    events, progress = p.events.all(), tuple(decode(Progress, r) for r in p.run_log.read_progress())
    with p.lock:
        return RunSummary(
            run_id=p.inputs.run_id, state=_state_view(p.controller.state_now()), events=events,
            progress=progress, failures=failures, eval=evaluation, shards=shards,
            shards_error=error, total_steps=p.inputs.schedule.total_steps, resumed_from_step=p.controller.resume_point(),
            last_checkpoint_step=ck.last_checkpoint_step,
            final_checkpoint_step=final if ck.full_checkpoint_of(final) else None,
            recovery_mode=RecoveryModes(cfg.recovery, tuple(sorted({f.recovery for f in failures})),
                                        tuple(f.decision for f in failures)),
            checkpoint_policy=CheckpointPolicyView(
                cfg.checkpoint.policy, interval, interval * step_time_s if interval and step_time_s else None,
                p.costs.inputs(p.inputs.plan.num_shards, cfg.checkpoint.pls_target),
            ),
            faults_injected=p.ledger.kills(), supervisor_restarts=p.books.header["supervisor_restarts"],
            attempts=p.books.header["attempt"], trainer_failures=tuple(p.trainers.failures()),
            committed=p.trainers.tally(), save_failures=ck.failures.view(),
        )
