"""A training step as a protocol every trainer follows, in the manner of torchft's Manager
(``start_quorum``, ``should_commit``: "the optimizer must only be stepped if this returns
True"). A step ``s`` is M microbatches with stable ids; the live trainers split them by
position over the quorum.

  ``quorum``   torchft's synchronous quorum: a replacement heals inside it from the peer
               furthest ahead. A replacement's first quorum that formed decides: healed
               (it trains), nobody ahead (every trainer died: fall back to the checkpoint
               with the shards), or a live trainer ahead outside this quorum (fail the step,
               back off, decide again in a later quorum).
  ``compute``  this trainer's share: lookups on the shards, dense forward and backward,
               embedding gradients back to the shards (they apply the step once all M arrived).
  ``vote``     one SUM all-reduce of the dense gradient with two more numbers: a "failed
               here" flag, which makes the commit unanimous, and the microbatch count.
  ``commit``   ``should_commit``: the optimizer steps and the commit is recorded; otherwise
               the step failed on every trainer: record it, fetch the current fleet (after a
               full recovery with the checkpoint's dense state and step) and redo the step.
"""

from __future__ import annotations

import json
import logging
import os
import time
import uuid
from dataclasses import dataclass, field

import torch

from actors.client import SupervisorClient
from actors.trainer.collective import sum_over_trainers
from actors.trainer.grads import MicrobatchGrads, dense_digest
from actors.trainer.pipeline import DataReadTimeout, PhaseTimer, Prefetcher
from actors.trainer.shards import ShardCallFailed, ShardClient, StaleStep
from actors.trainer.timeline import DenseTimeline
from core.config import RunConfig
from core.errors import StaleRequest, StaleLease, TrainerConflict
from core.records import CommitRecord, Progress, ResumePoint, SaveRequest, StepFailure
from core.schedule import StepSchedule
from core.step_protocol import Decision, StepId, Vote

__all__ = ["Trainer", "Attempt", "RestartFromCheckpoint", "HealRefused"]

logger = logging.getLogger(__name__)


class RestartFromCheckpoint(RuntimeError):
    """Raised by a trainer so that Ray Train restarts the whole group from the newest checkpoint."""


class HealRefused(RuntimeError):
    """torchft healed this trainer's dense model to a step the run has not committed since its
    last rollback (a peer still on the abandoned timeline): the step fails and it rejoins."""


@dataclass
class Attempt:
    """One try at step ``step`` on this trainer."""

    step: int
    participant: int | None = None
    error: Exception | None = None
    mine: list[int] = field(default_factory=list)
    chunk: tuple[int, ...] = ()
    committed: bool = False
    broken_quorum: int | None = None
    total: int = 0  # the step's microbatch count as the all-reduce summed it
    id: StepId | None = None  # (generation, step, attempt): what its lookups, pushes and vote name
    vote: Vote | None = None  # its vote when its sum completed with no failure: sent with the commit report
    summed: bool = False  # the all-reduce completed here: this trainer holds the step's dense gradient
    decision: Decision | None = None


@dataclass
class Trainer(DenseTimeline):
    """A trainer process's state across steps (built by ``actors.trainer.loop``); where its
    dense model stands between steps (a rollback, a rejoin) is ``DenseTimeline``'s."""

    rank: int
    cfg: RunConfig
    supervisor: SupervisorClient
    shards: ShardClient
    schedule: StepSchedule
    model: torch.nn.Module
    optimizer: object
    manager: object  # torchft Manager
    pg: object  # its process group
    prefetch: Prefetcher
    generation: int
    next_checkpoint: int | None
    resume: ResumePoint | None
    replacement: bool
    initial_state: dict
    audit: object | None = None  # the audit log file, when the run keeps one
    lease: object | None = None  # its place in the run (actors.lease.Lease), when the run keeps leases
    phases: PhaseTimer = field(default_factory=PhaseTimer)
    started_s: float = field(default_factory=time.perf_counter)
    first_quorum: bool = True
    last_participant: int | None = None
    conflicts: int = 0
    reports: int = 0
    next_try: StepId | None = None  # this trainer's next try, as the step ledger told it
    try_quorum: int | None = None  # the quorum in which it was told
    pending_vote: object = None  # the answer to its last vote, not waited for yet (settle_vote)
    committed_try: StepId | None = None  # the newest committed try: its lookups tell the shards to apply it
    process: str = field(default_factory=lambda: uuid.uuid4().hex[:12])  # pids repeat across hosts
    loss_sum: float = 0.0
    loss_rows: int = 0
    steps_since: int = 0
    t_last: float = field(default_factory=time.perf_counter)
    _grads: MicrobatchGrads | None = None

    @property
    def params(self) -> list:
        return list(self.model.parameters())

    @property
    def grads(self) -> MicrobatchGrads:
        """The step's dense gradient, one slot per microbatch position (``grads``)."""
        if self._grads is None:
            self._grads = MicrobatchGrads(self.params, self.schedule.microbatches_per_step)
        return self._grads

    # ------------------------------------------------------------------ the protocol

    def quorum(self) -> Attempt:
        """Joins this step's quorum; a replacement's first formed quorum decides what it does.
        Every heal (the dense model moved to another step inside the quorum, a replacement's or
        a live trainer's) is recorded at the supervisor, which refuses one past the steps the
        run committed since its last rollback; then the try this trainer starts is known."""
        self.phases.start()
        if self.lease is not None:
            self.lease.hold()  # a trainer replaced meanwhile (its host cut off and back) exits here
        before = self.manager.current_step()
        self.manager.start_quorum()
        self.manager.wait_quorum()
        self.phases.lap("quorum")
        attempt = Attempt(self.manager.current_step(), self.manager.participating_rank())
        self.optimizer.zero_grad(set_to_none=False)
        self.grads.clear()
        # Only a quorum that formed decides anything: one whose group failed to connect (a
        # peer died meanwhile), or whose heal failed, left this trainer at its start step
        # without healing it: it neither computes nor pushes, and breaks the group at once (vote).
        healthy = self.manager.errored() is None
        healed_from = before if healthy and attempt.step != before else None
        if self.first_quorum and healthy:
            self.first_quorum = False
            if self.replacement and self.resume is not None and attempt.step == self.resume.step:
                self._decide_at_checkpoint(attempt)
        self._start_try(attempt, healed_from)
        if self.replacement and attempt.participant is not None and healthy and attempt.error is None:
            self.supervisor.record_trainer_healed(self.rank, attempt.step, time.perf_counter() - self.started_s,
                                                  time.time())
            self.replacement = False
            self.audit_load(attempt.step, "heal", event="heal")
        elif healed_from is not None and attempt.error is None:
            self.audit_load(attempt.step, "heal", event="heal")
        if self.last_participant is None and attempt.participant == 0:
            self.supervisor.record_training_started(attempt.step, self.manager.num_participants(), time.time())
        return attempt

    def _start_try(self, attempt: Attempt, healed_from: int | None) -> None:
        """The try's identity: the one the last decision named, or, when this trainer did not
        vote on the previous try in this quorum (its first step, a heal, a rollback, a new fleet,
        a quorum that changed: a peer may have tried the step without it), the one the
        supervisor's step ledger says, with the newest committed try."""
        step = self.manager.current_step()  # a rollback in _decide_at_checkpoint moved it
        known = (self.next_try is not None and self.try_quorum == self.manager._quorum_id
                 and (self.next_try.generation, self.next_try.step) == (self.generation, step))
        if healed_from is not None or not known:
            start = self.supervisor.start_step(self.rank, self.generation, step, healed_from)
            self.next_try, self.committed_try = start.step, start.committed
            self.try_quorum = self.manager._quorum_id
            if not start.heal_allowed and attempt.error is None:
                attempt.error = HealRefused(f"healed from step {healed_from} to {step}, which the run has not "
                                            f"committed since its last rollback")
        attempt.id = self.next_try

    def _decide_at_checkpoint(self, attempt: Attempt) -> None:
        """Nobody was ahead to heal from: every trainer died (the shards go back to the same
        checkpoint as the dense state; the supervisor does it once), or the live ones are at
        this very step (nothing to roll back)."""
        try:
            fleet = self.supervisor.fallback_to_checkpoint(attempt.step, self.rank)
            if fleet.rollback is not None and fleet.rollback.step > attempt.step:
                # The others finished every step: this late replacement takes the final state
                # (it has nothing left to train; rank 0 evaluates with it).
                self.roll_back(fleet.rollback)
                attempt.error = RuntimeError(f"caught up with the final checkpoint of step {fleet.rollback.step}")
                return
            if fleet.rollback is not None and fleet.rollback.step != attempt.step:
                # A shard refused its file of checkpoint `attempt.step`, and the shards went
                # further back. Trainers that rolled back one by one would heal one another
                # forward again (torchft heals to the highest step): the group restarts instead,
                # and every new trainer starts at the shards' step.
                raise RestartFromCheckpoint(
                    f"checkpoint {attempt.step} was refused; the trainers restart from checkpoint {fleet.rollback.step}"
                )
            self.use_fleet(fleet)
        except TrainerConflict as err:
            # A quorum of replacements only, while a live trainer is ahead: this step fails
            # everywhere and a later quorum with that trainer heals this one. Back off first:
            # the live trainer may still be leaving a broken group, and a tight loop of failed
            # quorums would spend the step's redo budget (and the CPU it needs) before it comes.
            self.first_quorum, attempt.error = True, err
            self.conflicts += 1
            time.sleep(min(4.0, 0.25 * 2**self.conflicts))

    def compute(self, attempt: Attempt) -> None:
        """This trainer's microbatches of the step, through the model and back to the shards.
        Nothing is looked up or pushed on a dense model that is not the quorum's (a failed heal)."""
        participants = self.manager.num_participants()
        if attempt.error is None and self.manager.errored() is not None:
            attempt.error = getattr(self.manager.errored(), "original_exception", self.manager.errored())
        if attempt.participant is None or not self.manager.is_participating() or attempt.error is not None:
            return
        attempt.mine = self.schedule.assignment(attempt.step, attempt.participant, participants)
        if not attempt.mine:
            return
        step, m = attempt.step, self.schedule.microbatches_per_step
        try:
            labels, dense, rows, routed = self.prefetch.get(step, attempt.mine)
        except DataReadTimeout as err:  # the store did not answer: no shard at fault, the step is redone
            attempt.error = err
            return
        attempt.chunk = tuple(step * m + i for i in attempt.mine)
        self.phases.lap("data")
        try:
            looked_up = self.shards.lookup(rows, step, attempt.chunk, routed, attempt=attempt.id,
                                           commit=self.committed_try)
            self.phases.lap("lookup")
            pooled_grad, loss_total = self.grads.backward(self.model, self.params, attempt.mine, looked_up, dense,
                                                          labels, self.cfg.training.microbatch_rows)
            self.phases.lap("dense")
            if step + 1 < self.schedule.total_steps:
                # The next step's data while this one's gradients apply and its trainers vote
                # (the same quorum expected): there this process mostly waits. Beside the dense
                # compute it slowed every step down by the data loading's share of the GIL.
                self.prefetch.ahead(step + 1, self.schedule.assignment(step + 1, attempt.participant, participants))
            self.shards.push_grads(step, attempt.chunk, pooled_grad, attempt=attempt.id)
            self.phases.lap("push")
            self.loss_sum += loss_total
            self.loss_rows += len(labels)
        except ShardCallFailed as err:
            self.supervisor.report_shard_failure(err.shard, self.generation, err.reason, step)
            attempt.error = err
        except (StaleStep, StaleLease, StaleRequest) as err:  # no shard at fault: the step is redone
            attempt.error = err

    def vote(self, attempt: Attempt) -> torch.Tensor:
        """The step's all-reduce: the dense gradient, a "failed here" flag and the microbatch
        count, summed over the quorum's trainers; then this trainer's vote at the supervisor's
        step ledger, whose first vote of the try decides it for every trainer (one that walked
        away from the sum cannot contradict one that committed). The group's collective is
        called directly, not through ``manager.allreduce``: a wait this trainer walks away from
        must not report its late error into a later step. A trainer that cannot take part (its
        quorum or heal failed) votes at once, naming the broken group: its peers stop waiting."""
        self.phases.start()
        flat = self.grads.set_extra(attempt.error is not None, len(attempt.mine))
        quorum_id = self.manager._quorum_id  # torchft 0.2 keeps the quorum id only privately
        if self.manager.errored() is None:
            if not self.manager.is_participating():
                flat.zero_()
            failure = sum_over_trainers(self.pg, flat, lambda: self.supervisor.group_broken(quorum_id, attempt.step))
            if failure is not None:
                self.manager.report_error(failure)
                attempt.broken_quorum = quorum_id
            else:
                attempt.summed = True
        elif self.manager.num_participants() > 1:
            attempt.broken_quorum = quorum_id
        self.phases.lap("allreduce")
        attempt.total = int(round(flat[-1].item()))
        ok = attempt.summed and attempt.error is None and flat[-2].item() == 0
        if attempt.id is not None:
            vote = Vote(attempt.id, self.rank, ok, attempt.broken_quorum)
            if ok:
                # Everyone's share is in the sum: the try commits unless a trainer whose sum broke
                # voted first. Sent with the commit report, not waited for (a round trip every
                # step): answered before anything names this try committed (``settle_vote``).
                attempt.vote = vote
            else:
                attempt.decision = self.supervisor.decide_step(vote)
        if attempt.error is not None:
            self.manager.report_error(attempt.error)
        elif self.manager.errored() is None and not ok:
            attempt.error = ShardCallFailed(-1, "a peer trainer's step failed")
            self.manager.report_error(attempt.error)
        elif attempt.decision is not None and not attempt.decision.commit:
            attempt.error = RuntimeError(f"{attempt.id} was decided aborted by another trainer's vote")
            self.manager.report_error(attempt.error)
        return flat

    def commit(self, attempt: Attempt, flat: torch.Tensor) -> bool:
        """Steps the optimizer if the try was decided committed and this trainer holds its sum;
        else records the failure and picks up the current fleet before the step is redone, or
        rejoins if its dense model is not at the run's committed steps (a commit it could not
        follow, a stall, a heal past a rollback). False: stop."""
        decision = attempt.decision
        if self.manager.should_commit() and (decision is None or decision.commit):
            self.grads.sum_into(self.params)
            self.optimizer.step()
            self.steps_since += 1
            attempt.committed = True
            record = CommitRecord(
                attempt.step, self.rank, attempt.chunk, attempt.total, self.manager.num_participants(), time.time(),
                self.generation, os.getpid(), self._next_report(), self.process,
            )
            self.try_quorum = self.manager._quorum_id
            if attempt.vote is not None:
                # The vote and the commit report in one call: the book counts the report only if
                # the try is decided committed. Its answer holds these once it says commit.
                self.pending_vote = self.supervisor.commit_voted(attempt.vote, record)
                self.next_try, self.committed_try = StepId(attempt.id.generation, attempt.step + 1, 0), attempt.id
            else:
                if decision is not None:
                    self.next_try, self.committed_try = decision.next, decision.committed
                self.supervisor.record_commit(record)
            self._audit_commit(attempt)
            return True
        if decision is not None:
            self.next_try, self.committed_try, self.try_quorum = decision.next, decision.committed, self.manager._quorum_id
        self.supervisor.record_step_failed(StepFailure(
            attempt.step, self.rank, time.time(), str(attempt.error or self.manager.errored()), attempt.broken_quorum,
            os.getpid(), self._next_report(), self.process,
        ))
        fleet = self.supervisor.await_shards(self.generation, attempt.step)
        if fleet.stop:
            return False
        self.next_checkpoint = fleet.next_checkpoint
        self.use_fleet(fleet)
        # Checked after a rollback too: one that stalled across it while the others redid steps
        # from it, and died, holds the rollback's step; the shards hold theirs. A try decided
        # committed that this trainer could not follow (its sum abandoned) leaves it one behind.
        committed = fleet.committed_steps
        if decision is not None and decision.commit and committed is None:
            committed = decision.step.step + 1
        if not self.replacement and committed is not None and self.manager.current_step() != committed:
            return self.rejoin(committed)
        return True

    def _next_report(self) -> int:
        """This process's next report number: a report Ray delivers twice (a call retried
        across a supervisor restart) counts once."""
        self.reports += 1
        return self.reports

    def _audit_commit(self, attempt: Attempt) -> None:
        if self.audit is not None:
            self.audit.write(json.dumps({
                "t": round(time.time(), 6), "event": "commit", "step": attempt.step, "rank": self.rank,
                "quorum": self.manager._quorum_id, "microbatches": list(attempt.chunk), "total": attempt.total,
                "try": [attempt.id.generation, attempt.id.step, attempt.id.attempt] if attempt.id else None,
                "dense": dense_digest(self.params, [self.optimizer.state[i]["sum"] for i in range(len(self.params))]),
            }) + "\n")

    def save_and_report(self, attempt: Attempt) -> None:
        """After the step: the save, if one is due (the saving trainer is the quorum's first
        participant), and progress every ``training.progress_every_steps``."""
        done, total = self.manager.current_step(), self.schedule.total_steps
        if attempt.participant == 0 and self.last_participant != 0 and self.next_checkpoint is not None:
            # Just became the saving trainer (e.g. the previous one died): ask what is due.
            self.next_checkpoint = self.supervisor.checkpoint_due()
        self.last_participant = attempt.participant
        due = self.next_checkpoint is not None and self.next_checkpoint <= done < total
        # The run's last state is saved in full whatever the policy: what `cpr export` and
        # `cpr train --resume` of a finished run read.
        final = attempt.committed and done == total and self.cfg.checkpoint.final
        if attempt.participant == 0 and (due or final) and self.settle_vote():
            self.phases.start()
            saved = self.supervisor.save_checkpoint(SaveRequest(done, self.dense_blob(), final))
            if due:
                self.next_checkpoint = saved.next_step
            self.phases.lap("checkpoint")
        every = self.cfg.training.progress_every_steps
        if attempt.committed and attempt.participant == 0 and (done % every == 0 or done == total):
            now = time.perf_counter()
            samples_per_step = self.schedule.microbatches_per_step * self.cfg.training.microbatch_rows
            self.supervisor.record_progress(Progress(
                step=done, total_steps=total, loss=self.loss_sum / max(self.loss_rows, 1),
                samples_per_s=self.steps_since * samples_per_step / max(now - self.t_last, 1e-9),
                trainers=self.manager.num_participants(), phase_s=self.phases.take(), time=round(time.time(), 3),
            ))
            self.loss_sum, self.loss_rows, self.steps_since, self.t_last = 0.0, 0, 0, now
