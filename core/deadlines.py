"""Nested timeouts: every blocking call on a failure path has a deadline, and a caller always
waits longer than the longest wait inside the method it calls, so that the slow party (a
mirror, the storage, a shard) is the one declared slow, not the healthy one waiting for it.

    shard call                T = embeddings.call_timeout_s: a trainer's lookup and push_grads,
                              the supervisor's save_checkpoint and save_written
      under the shard's lock  lock_wait_s = T/4 for the lease's confirmation, the previous save's
                              write and the snapshot buffer together (one deadline per call)
      a primary's mirror      mirror_feed_s = T/2 for the mirror's receipt of a step: a mirror
                              that does not answer is killed and the push answered (the step is
                              redone without it) by 3/4 T, before its trainer gives up at T
      its own write           written_s = T/2 (save_written): slow storage fails the save
    a recovery                supervisor_wait_s = 4 T (a respawn T, a load T, one retry of each)
    the save in flight        save_drain_s = 2 T (its background write and commit)
    a supervisor method       inner_s(method): what it waits for, at most (the table below)
    its caller                caller_s(method) = inner_s(method) + 2 T (a supervisor that Ray
                              restarts meanwhile answers the retried call once rebuilt)

    a trainer's peers         C = training.collective_timeout_s: their all-reduce
      its step's data         data_read_s = C/2: a read that hangs fails this trainer's step
                              (flagged in its vote) while its peers still wait in the all-reduce
    the next quorum           quorum_s = C + saving_s: the saving trainer (the quorum's first
                              participant) asks which save is due and saves after its commit,
                              before its next quorum (saving_s = caller_s of both, 7 T); a peer
                              gives up on the quorum only after that (before, C alone: a slow
                              background write drained by the save restarted the peer)

``SupervisorClient`` (``actors.client``) passes ``caller_s`` to every call; the supervisor's
methods bound their own waits by ``inner_s``; a shard is given T when it starts and bounds its
own waits as above (``nesting`` lists every pair; ``step_nesting`` a trainer's against its peers').
"""

from __future__ import annotations

import time
from dataclasses import dataclass

__all__ = ["Deadlines", "Deadline", "BLOCKING", "STARTING"]

# How many shard-call timeouts (T) each blocking supervisor method may wait, at most. Any
# method not listed answers from memory at once (counted as one T for its caller: the
# supervisor may be busy restarting).
BLOCKING = {
    "start": 1,  # every shard answers ready()
    "restore": 4 + 1,  # a rollback (4 T), after verifying the checkpoint it goes to (1 T)
    "trainer_setup": 4,  # the shards start
    "await_shards": 4,  # a recovery in flight, then a probe of every shard
    "fallback_to_checkpoint": 4 + 1,  # a liveness probe of the trainers (1 T), a rollback (4 T)
    "save_checkpoint": 2 + 1,  # the previous save drains (2 T), every shard snapshots (1 T)
    "await_final": 2 + 4 + 1,  # the final save drains (2 T), as await_shards (4 T), a failed save's backoff (T)
    "record_eval": 2,  # the final save drains
    "summary": 2 + 1 + 1,  # the last save drains, lost samples are counted (1 T), shards answer (1 T)
    "shutdown": 2,  # the last save drains
}


# Methods that wait for new shard processes to start: at least embeddings.start_timeout_s.
STARTING = frozenset({"start", "trainer_setup"})


@dataclass(frozen=True)
class Deadlines:
    shard_call_s: float
    shard_start_s: float = 0.0  # a new shard process's start (embeddings.start_timeout_s)
    collective_s: float = 0.0  # a trainer's wait for its peers' all-reduce (training.collective_timeout_s)

    @classmethod
    def of(cls, cfg) -> "Deadlines":
        """The deadlines of a run config."""
        return cls(cfg.embeddings.call_timeout_s, cfg.embeddings.start_timeout_s, cfg.training.collective_timeout_s)

    @property
    def supervisor_wait_s(self) -> float:
        """A recovery (respawn, load, one retry of each) as a waiter sees it."""
        return 4 * self.shard_call_s

    @property
    def survey_s(self) -> float:
        """A recovery's round of questions to the live processes (``actors.supervisor.survey``):
        each answers from memory in milliseconds (a shard once its call in progress ends); one
        that has not answered in 2 s (or a quarter shard call, if shorter) is slow, and the
        decision goes on without it: a recovery never waits a whole call for a stalled survivor."""
        return min(self.shard_call_s / 4, 2.0)

    @property
    def save_drain_s(self) -> float:
        """The save in flight: its shards' files, the dense state, the manifest."""
        return 2 * self.shard_call_s

    @property
    def lock_wait_s(self) -> float:
        """What one shard call may wait under the shard's lock, its mirror aside: the lease's
        confirmation, the previous save's write, the snapshot buffer. A trainer's call queued
        behind it still has most of T."""
        return self.shard_call_s / 4

    @property
    def mirror_feed_s(self) -> float:
        """A primary's wait for its mirror's receipt of a step: with ``lock_wait_s`` before it,
        the primary kills a mirror that does not answer and answers its trainer within T."""
        return self.shard_call_s / 2

    @property
    def written_s(self) -> float:
        """A shard's wait for its own background write, asked by the supervisor (which waits T)."""
        return self.shard_call_s / 2

    def nesting(self) -> tuple[tuple[str, float, str, float], ...]:
        """(a wait, its deadline, who waits for it, their deadline) for every nested wait of a
        shard call: each inner deadline must be the shorter."""
        t = self.shard_call_s
        return (
            ("a push's lease confirmation and mirror feed", self.lock_wait_s + self.mirror_feed_s,
             "the trainer's push_grads", t),
            ("a lookup's lease confirmation", self.lock_wait_s, "the trainer's lookup", t),
            ("a snapshot's waits for the lease, the previous write and the buffer", self.lock_wait_s,
             "the supervisor's save_checkpoint", t),
            ("a shard's wait for its own write", self.written_s, "the supervisor's save_written", t),
            ("one shard call", t, "a recovery's wait", self.supervisor_wait_s),
            ("a save's wait for its shards' files (save_written)", t, "the save in flight's drain", self.save_drain_s),
        )

    @property
    def data_read_s(self) -> float:
        """A trainer's wait for its step's microbatches (``Prefetcher.get``): a read that hangs
        fails its step, flagged in its vote, while its peers still wait in the all-reduce (C)."""
        return self.collective_s / 2

    @property
    def saving_s(self) -> float:
        """The longest the saving trainer (the quorum's first participant) waits between its
        commit and its next quorum: which save is due, then the save (the previous save's
        drain and the snapshot, ``inner_s``), each as its caller waits for it."""
        return self.caller_s("checkpoint_due") + self.caller_s("save_checkpoint")

    @property
    def quorum_s(self) -> float:
        """A trainer's wait for the next quorum (torchft's ``quorum_timeout``): the lighthouse
        forms none without the saving trainer while it heartbeats and the others are not more
        than half (two trainers: the other alone), so they wait out its save, then the
        collective timeout for a peer that is merely slow."""
        return self.collective_s + self.saving_s

    def step_nesting(self) -> tuple[tuple[str, float, str, float], ...]:
        """As ``nesting``, for a trainer's waits in a step against its peers' waits for it."""
        return (
            ("a trainer's read of its step's data", self.data_read_s, "its peers' all-reduce", self.collective_s),
            ("the previous save's drain", self.save_drain_s, "the save_checkpoint that waits for it",
             self.inner_s("save_checkpoint")),
            ("the supervisor's save_checkpoint", self.inner_s("save_checkpoint"), "the saving trainer's call",
             self.caller_s("save_checkpoint")),
            ("the saving trainer's checkpoint_due and save_checkpoint", self.saving_s, "its peers' next quorum",
             self.quorum_s),
        )

    def inner_s(self, method: str) -> float:
        """The longest a supervisor method waits before it answers (0: it answers at once)."""
        inner = BLOCKING.get(method, 0) * self.shard_call_s
        return max(inner, self.shard_start_s) if method in STARTING else inner

    def caller_s(self, method: str) -> float:
        """How long a caller waits for ``method``: longer than anything inside it, with room for
        a supervisor restart (a new process, its journal read, its shards found by name)."""
        return self.inner_s(method) + 2 * self.shard_call_s


class Deadline:
    """A point in time; ``remaining(cap)`` is what an inner wait may use of it."""

    def __init__(self, total_s: float):
        self.total_s = total_s
        self._end = time.monotonic() + total_s

    def remaining(self, cap: float | None = None) -> float:
        left = max(0.0, self._end - time.monotonic())
        return left if cap is None else min(left, cap)

    def expired(self) -> bool:
        return self.remaining() <= 0.0
