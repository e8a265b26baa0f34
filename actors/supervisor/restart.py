"""Recovering the supervisor's books from what it persisted and what is alive (in the manner
of Ray Serve's ``recover_current_state_from_replica_actor_names``): a supervisor that Ray
restarted reloads every part from the journal, finds its shards and spares by name and runs
the state in flight again; a resumed run (a new attempt) keeps the history of the earlier
attempts (failures, kills, events, commits) so its report covers every attempt."""

from __future__ import annotations

import time

import ray

from actors.supervisor.assembly import Parts
from core.journal import BOOK_FILE, AppendLog
from core.records import ShardInfo
from policies import Budget

__all__ = ["rebuild", "continue_history"]


def _load_history(p: Parts, doc: dict) -> None:
    """The parts whose records span attempts. The event log cuts ``events.jsonl`` back to
    where it was at the journal's last write: an event appended for a change that never
    reached the journal goes, as the change did."""
    p.events.load(doc["events"])
    p.ledger.load(doc["ledger"])
    p.costs.restore(doc["costs"])
    if p.faults is not None and "faults" in doc:
        p.faults.load(doc["faults"])


def rebuild(p: Parts, doc: dict) -> None:
    """The same attempt, in a new supervisor process: everything continues."""
    t0 = time.time()
    restarts = doc["supervisor_restarts"] + 1
    this_attempt = doc.get("attempt_restarts", 0) + 1  # what the budget counts
    p.books.header.update(attempt=doc["attempt"], supervisor_restarts=restarts, attempt_restarts=this_attempt)
    _load_history(p, doc)
    p.controller.load(doc["controller"])
    p.trainers.load(doc["trainers"], AppendLog.iter(p.inputs.run_dir / BOOK_FILE))
    p.spares.load(doc["spares"])
    if "mirrors" in doc:
        p.mirrors.load(doc["mirrors"])
    p.checkpoints.load(doc["checkpoints"])
    p.eval.value = doc.get("eval")
    missing = p.controller.reacquire(lambda name: _answering(p, name))
    p.books.persist()
    kill = next((k for k in reversed(p.ledger.kills()) if k.target == "supervisor"), None)
    p.events.record(
        "supervisor_restarted", rebuilt_s=round(time.time() - t0, 3), state=p.controller.state_now().name,
        detection_s=round(t0 - kill.time, 3) if kill else None, restarts=restarts,
        shards_found=p.inputs.plan.num_shards - len(missing), last_checkpoint_step=p.checkpoints.last_checkpoint_step,
    )
    over = p.policy.exceeded(Budget.SUPERVISOR_RESTARTS, this_attempt,
                             f"the supervisor was restarted {this_attempt} times in this attempt")
    if over is not None:
        p.controller.fail(over)
    if p.controller.has_started():
        p.mirrors.readopt()  # before the missing shards are recovered: a mirror may take their place
    p.controller.recover_missing(missing)
    p.ledger.recount_open_counts()  # counts that were in flight when the previous supervisor died
    p.spares.readopt(p.trainers.has_started())
    if p.controller.has_started():
        p.hosts.start()
    p.controller.wake()


def continue_history(p: Parts, doc: dict) -> None:
    """``--resume``: a new attempt of the run in the same directory. The earlier attempts'
    failures, kills, events, commits and cost estimates carry over; their actors are gone."""
    p.books.header.update(attempt=doc["attempt"] + 1, supervisor_restarts=doc["supervisor_restarts"],
                          attempt_restarts=0)
    _load_history(p, doc)
    p.controller.continue_from(doc["controller"])
    p.trainers.load(doc["trainers"], AppendLog.iter(p.inputs.run_dir / BOOK_FILE), history_only=True)
    last = p.trainers.last_step_committed()
    p.ledger.begin_attempt(None if last is None else last + 1)
    p.trainers.begin_attempt()
    p.checkpoints.failures.carry(doc.get("checkpoints") or {})
    p.events.record("attempt_started", attempt=doc["attempt"] + 1, previous_run_id=doc["run_id"],
                    previous_state=doc["controller"]["state"]["state"])


def _answering(p: Parts, name: str) -> tuple[object, ShardInfo] | None:
    handle = p.fleet.find_name(name)
    if handle is None:
        return None
    try:
        return handle, ray.get(handle.ready.remote(), timeout=p.deadlines.shard_call_s)
    except (ray.exceptions.RayError, ray.exceptions.GetTimeoutError):
        return None
