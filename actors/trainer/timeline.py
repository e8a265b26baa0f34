"""Where a trainer's dense model stands between steps: whether its last commit stands (the
answer to its vote), a new fleet and its rollback, a rejoin at the newest checkpoint, and the
audit log's record of each (``Trainer`` mixes it in)."""

from __future__ import annotations

import io
import json
import logging
import time

import torch

from core.records import FleetView, ResumePoint, Rollback

__all__ = ["DenseTimeline"]

logger = logging.getLogger(__name__)


class DenseTimeline:
    """Uses the trainer's ``model``, ``optimizer``, ``manager``, ``supervisor``, ``shards``,
    ``schedule``, ``generation``, ``audit``, ``rank``, ``initial_state`` and its tries
    (``pending_vote``, ``next_try``, ``committed_try``)."""

    def settle_vote(self) -> bool:
        """The answer to this trainer's last vote, sent without waiting: before its next lookup
        names the try committed, before a save applies it, before the run's end. Commit: it
        stands. Abort (a trainer whose sum broke voted first): this dense model holds a step the
        run did not commit, and it rejoins at the newest checkpoint. False: the run is over."""
        ref, self.pending_vote = self.pending_vote, None
        if ref is None:
            return True
        decision = self.supervisor.wait("commit_voted", ref)
        if decision.commit:
            self.next_try, self.committed_try = decision.next, decision.committed
            return True
        logger.warning("trainer %d committed %s, which another trainer's vote had decided aborted", self.rank,
                       decision.step)
        if self.audit is not None:  # its commit line names a try the run did not commit: cpr verify drops it
            step = decision.step
            self.audit.write(json.dumps({"t": round(time.time(), 6), "event": "aborted", "step": step.step,
                                         "rank": self.rank, "try": [step.generation, step.step, step.attempt]}) + "\n")
        self.next_try = None
        return self.rejoin(decision.step.step)

    def use_fleet(self, fleet: FleetView) -> None:
        """A new fleet (a recovery): its shards, and after a full recovery its rollback."""
        if fleet.generation != self.generation:
            self.generation = fleet.generation
            self.shards.shards = fleet.shards
            if fleet.rollback is not None:
                self.roll_back(fleet.rollback)

    def rejoin(self, committed: int) -> bool:
        """This trainer's dense model holds fewer steps than the others committed: it stalled
        while they trained on without it. A peer ahead would heal it in its next quorum, but
        if none is left (they died meanwhile) it would form a quorum alone and redo committed
        steps on its stale dense state: the dense model silently back where it stalled, while
        the shards skip those steps as applied. So it starts again as a replacement does: at
        the newest checkpoint, its first quorum deciding (healed by a live peer ahead, or
        every trainer holding the committed steps died and everything falls back to that
        checkpoint: ``fallback_to_checkpoint``). False: the run is over."""
        logger.warning("trainer %d holds %d steps, %d are committed: it rejoins as a replacement",
                       self.rank, self.manager.current_step(), committed)
        setup = self.supervisor.trainer_setup(self.rank)
        if setup.finished:
            return False
        start = setup.resume or ResumePoint(0, None)
        self.use_fleet(FleetView(setup.generation, setup.shards))
        self.roll_back(Rollback(setup.generation, start.step, start.dense), why="rejoin")
        self.resume, self.replacement, self.first_quorum = start, True, True
        self.started_s = time.perf_counter()
        return True

    def roll_back(self, rollback: Rollback, why: str = "rollback") -> None:
        """A full recovery's rollback: the checkpoint's dense state (step 0's without one) and step."""
        if rollback.dense is not None:
            self.load_dense(rollback.dense)
        else:
            self.model.load_state_dict(self.initial_state["model"])
            self.optimizer.load_state_dict(self.initial_state["optim"])
        m = self.schedule.microbatches_per_step
        self.manager.load_state_dict({"step": rollback.step, "batches_committed": rollback.step * m})
        self.audit_load(rollback.step, why)

    def audit_load(self, step: int, why: str, event: str = "load") -> None:
        """The dense state is now that of ``step`` committed steps: a resume or a rollback (a
        "load"), or a replacement healed from a live peer (a "heal", which redoes nothing)."""
        if self.audit is not None:
            self.audit.write(json.dumps({"t": round(time.time(), 6), "event": event, "step": step, "rank": self.rank,
                                         "why": why}) + "\n")

    def load_dense(self, blob: bytes) -> None:
        sd = torch.load(io.BytesIO(blob), weights_only=True)
        self.model.load_state_dict(sd["model"])
        self.optimizer.load_state_dict(sd["optim"])

    def dense_blob(self) -> bytes:
        buf = io.BytesIO()
        torch.save({"model": self.model.state_dict(), "optim": self.optimizer.state_dict()}, buf)
        return buf.getvalue()

