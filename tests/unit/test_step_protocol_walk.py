"""The step protocol walked with fakes (``core.step_protocol``, ``actors.shard_step``,
``actors.trainer.step``): for each party (trainer 0, trainer 1, shard 0 with its mirror, shard 1
without one, the supervisor's step ledger) and each state of a step (looked up, pushed, voted,
committed, applied), a death, a timeout or a late message is injected into the first try of
one step, and the walk goes on until ``STEPS`` steps are committed. Then its invariants hold:

* every step the ledger committed is applied exactly once, in order, on every shard and mirror
  of the final timeline, with the committed try's gradients (the rows equal, bit for bit, those
  of a fault-free run of the final timeline's committed tries; every shard's audit log applies
  each step once per timeline, naming the try the ledger committed);
* nothing is applied that the ledger did not commit;
* a try is decided once: every later vote of it (a late one, one after a supervisor restart)
  gets the same decision; a step commits at most once per timeline;
* every trainer's dense model holds the final timeline's committed tries, as many as the
  shards applied; after every recovery the shards hold the committed steps (applied, or the
  newest held complete to apply at its commit) and every trainer that picks up the new fleet
  is at the committed steps;
* every late message got the answer the protocol gives it (refused, stale, duplicate).

The parties are real: ``EmbeddingShard`` objects built without Ray (as in test_shard), a mirror
fed the way the primary's ``MirrorFeed`` feeds it, and the supervisor's ``StepRecords`` (its
ledger) journaling into an in-memory book, rebuilt from it on a supervisor restart. The
trainers are a compact driver of ``Trainer``'s protocol (``quorum``/``_start_try``,
``compute``, ``vote``, ``commit``, ``DenseTimeline.rejoin``), calling the shards and the ledger
exactly as it does; its dense model is the list of tries it committed. The driver runs the
trainers in lockstep (every lookup, then every push, the all-reduce, the votes, the commits),
so a fault is one deterministic interleaving, not a race.
"""

from __future__ import annotations

import glob
import inspect
import json
import os
from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import pytest

from actors.shard import EmbeddingShard
from actors.shard_chunks import merge_chunks
from actors.shard_mirror import MirrorMissed
from actors.supervisor.step_records import StepRecords
from core.checkpoint.store import CheckpointStore
from core.errors import StaleRequest
from core.plan import make_plan
from core.records import PushResult
from core.step_protocol import StepId, StepLedger, Vote

pytestmark = pytest.mark.timeout(120)

TABLE_ROWS = [50] * 26
DIM, M, ROWS = 4, 4, 4  # M microbatches per step, ROWS rows each
PLAN = make_plan("table_wise", TABLE_ROWS, 2)
STEPS = 5  # committed steps every walk reaches
CKPT = 1  # the checkpoint every walk saves (after step 0): a rollback goes back there
FAULT_STEP = 2  # the step whose first try the fault strikes (its "commit"/"apply" states: the next try's)
MAX_TRIES = 24
# Whether a mirror is told the try of each step it replicates (then its audit log names it too).
MIRROR_KEEPS_TRY = "try_" in inspect.signature(EmbeddingShard.replicate).parameters


@pytest.fixture(autouse=True)
def _no_ray(monkeypatch):
    # A mirror's promotion answers ``ready()``, which asks Ray's runtime context for the node.
    monkeypatch.setattr("ray.get_runtime_context", lambda: type("C", (), {"get_node_id": lambda self: "n"})())


# ---------------------------------------------------------------------------------- data

_ROWS = {}


def rows_of(mb: int) -> np.ndarray:
    if mb not in _ROWS:
        _ROWS[mb] = np.random.default_rng(mb).integers(0, 50, size=(ROWS, 26))
    return _ROWS[mb]


def grad_of(mb: int, try_: StepId, k: int) -> np.ndarray:
    """Microbatch ``mb``'s pooled gradient on shard ``k`` in try ``try_``: it differs from try to
    try (another try's dense model), so a gradient of the wrong try applied shows in the rows."""
    rng = np.random.default_rng([mb, try_.generation, try_.attempt, k])
    return rng.standard_normal((ROWS, len(PLAN.shards[k]) * DIM)).astype(np.float32)


def batch(chunk: tuple[int, ...], k: int):
    return PLAN.route(np.concatenate([rows_of(mb) for mb in chunk]), k)


def grads(chunk: tuple[int, ...], try_: StepId, k: int) -> np.ndarray:
    return np.concatenate([grad_of(mb, try_, k) for mb in chunk])


def step_mbs(step: int) -> tuple[int, ...]:
    return tuple(range(step * M, (step + 1) * M))


# ---------------------------------------------------------------------------------- the parties


class Dead(Exception):
    """A call to a shard process that died (Ray's RayActorError): ``ShardCallFailed``."""


class Lost(Exception):
    """A call whose request or answer did not arrive within the caller's deadline."""


class Handle:
    """A shard actor's handle: calls reach the object while its process lives."""

    def __init__(self, shard: EmbeddingShard, k: int):
        self.shard, self.k, self.alive = shard, k, True

    def call(self, method: str, *args, **kw):
        if not self.alive:
            raise Dead(f"shard {self.k} is dead")
        return getattr(self.shard, method)(*args, **kw)


class Feed:
    """The primary's ``MirrorFeed`` without Ray: ``replicate`` on the mirror, or (``late``: the
    mirror did not take the step within ``mirror_feed_s``) the mirror killed and False."""

    def __init__(self, walk: "Walk", mirror: Handle, name: str):
        self.walk, self.mirror, self.name = walk, mirror, name

    def send(self, step, lengths, indices, grad, *try_) -> bool:
        if self.walk.mirror_late and self.mirror.alive:
            self.walk.mirror_late = False
            self.walk.events.append(f"mirror {self.name} too late for step {step}: killed")
            self.kill()
            return False
        try:
            self.mirror.call("replicate", step, lengths, indices, grad, *try_)
        except (Dead, MirrorMissed):
            self.kill()
            return False
        return True

    def kill(self) -> None:
        self.mirror.alive = False


class Book:
    """The trainer book's file: every record as JSON, in order (``AppendLog``'s part here)."""

    path = "trainer_book.jsonl"

    def __init__(self):
        self.records: list[dict] = []

    def append(self, record: dict) -> None:
        self.records.append(json.loads(json.dumps(record)))


@dataclass
class Try:
    id: StepId | None = None
    chunk: tuple[int, ...] = ()
    error: str | None = None
    summed: bool = False
    ok: bool = False
    decision: object = None
    healed_from: int | None = None


@dataclass
class T:
    """A trainer as ``Trainer`` keeps it between steps; ``dense``: the tries its dense model
    committed, in order (a heal copies its peer's; a rollback cuts it)."""

    rank: int
    generation: int
    fleet: list
    dense: list = field(default_factory=list)
    next_try: StepId | None = None
    committed_try: StepId | None = None
    alive: bool = True
    replacement: bool = False
    cur: Try = field(default_factory=Try)

    @property
    def step(self) -> int:
        return len(self.dense)


@dataclass(frozen=True)
class Fault:
    party: str  # t0, t1, s0 (mirrored: its death promotes the mirror), s1 (a death rolls back), sup
    state: str  # lookup, push, vote, commit, apply
    kind: str  # death, timeout, late
    expect: str | None = None  # the answer a late message must get
    what: str = ""

    def __str__(self) -> str:
        return f"{self.party}-{self.state}-{self.kind}"


# ---------------------------------------------------------------------------------- the walk


class Walk:
    def __init__(self, tmp_path, fault: Fault | None):
        self.fault = fault
        self.uri, self.audit = str(tmp_path / "ckpt"), str(tmp_path / "audit")
        self.gen = 0
        self.book = Book()
        self.records = StepRecords(self.book, num_trainers=2)
        self.fleet = [Handle(self._new_shard(k), k) for k in (0, 1)]
        self.mirrors: list[Handle] = []  # every mirror ever attached (the last one is shard 0's now)
        self.spares = 0
        self.mirror_late = False
        self._attach_mirror()
        self.trainers = [T(r, 0, list(self.fleet)) for r in (0, 1)]
        self.joins: list[tuple[int, int]] = []  # (rank, commits after which its replacement joins)
        self.timeline: dict[int, StepId] = {}  # step -> its committed try, on the final timeline
        self.committed_ever: set[StepId] = set()
        self.first_decision: dict[StepId, bool] = {}
        self.rollbacks: list[tuple[int, int]] = []  # (generation, step)
        self.commits = 0
        self.n = 0  # tries so far (every trainer's try of one quorum is one)
        self.fault_try: int | None = None  # the try the fault strikes (its commit/apply states: the next)
        self.fired: set[str] = set()
        self.deferred: list[tuple[str, int, Callable[[], None]]] = []  # (phase, try, delivery)
        self.answers: list[tuple[str, str]] = []  # what each late message was answered
        self.events: list[str] = []
        self.saved = False

    # ---------------------------------------------------------------- the supervisor's side

    def _new_shard(self, k: int) -> EmbeddingShard:
        return EmbeddingShard(k, list(PLAN.shards[k]), DIM, learning_rate=0.1, eps=1e-8, seed=3,
                              microbatches_per_step=M, generation=self.gen, audit_dir=self.audit)

    def _attach_mirror(self) -> None:
        """``attach_mirror`` without Ray: a spare becomes shard 0's mirror, gets its rows as they
        stand (and its complete step, if any) under its lock, and every step from then on."""
        primary = self.fleet[0].shard
        self.spares += 1
        spare = EmbeddingShard(None, None, DIM, 0.1, 1e-8, 3, microbatches_per_step=M,
                               spare=f"walk-spare{self.spares}", audit_dir=self.audit)
        spare.become_mirror(0, list(PLAN.shards[0]))
        handle = Handle(spare, 0)
        with primary._lock:
            weights = [w.detach().cpu().numpy().copy() for w in primary.tbe.split_embedding_weights()]
            states = [s[0].detach().cpu().numpy().copy() for s in primary.tbe.split_optimizer_states()]
            spare.sync_base(0, primary.applied_step, weights, states)
            c = primary._complete
            if c is not None:  # the try too, where the mirror keeps it (its audit log names it)
                try_ = (primary._pending.try_of(c),) if MIRROR_KEEPS_TRY else ()
                spare.replicate(c, *merge_chunks(primary._pending.ordered(c)), *try_)
            primary._feed = Feed(self, handle, spare.spare)
        self.mirrors.append(handle)

    def mirror(self) -> Handle | None:
        return self.mirrors[-1] if self.mirrors and self.mirrors[-1].alive else None

    def decide(self, v: Vote):
        decision = self.records.decide(v)
        first = self.first_decision.setdefault(v.step, decision.commit)
        assert decision.commit == first, f"{v.step} decided {first}, then {decision.commit} (vote {v})"
        if decision.commit and v.step not in self.committed_ever:
            step = v.step.step
            assert step == len(self.timeline), f"{v.step} committed with {len(self.timeline)} steps committed"
            self.timeline[step] = v.step
            self.committed_ever.add(v.step)
            self.commits += 1
        return decision

    def restart_supervisor(self) -> None:
        """The supervisor process dies and restarts: its trainer book is replayed from the file."""
        doc = self.records.doc()
        records = StepRecords(self.book, num_trainers=2)
        records.load(json.loads(json.dumps(doc)), list(self.book.records), history_only=False)
        old, new = self.records.ledger, records.ledger
        assert (new.committed, new.committed_steps()) == (old.committed, old.committed_steps())
        self.records = records
        self.events.append("supervisor restarted")

    def kill_shard(self, k: int) -> None:
        self.fleet[k].alive = False
        self.events.append(f"shard {k} died")

    def recover(self) -> None:
        """The supervisor's recovery of the dead shards: a new generation; shard 0's mirror is
        promoted (it must hold the committed steps), else every shard goes back to the checkpoint
        with the ledger (a rollback). Then the shards must hold the committed steps."""
        dead = [h.k for h in self.fleet if not h.alive]
        if not dead:
            return
        self.gen += 1
        committed = self.records.ledger.committed_steps()
        fleet = list(self.fleet)
        rollback = 1 in dead
        if not rollback:
            mirror = self.mirror()
            try:
                if mirror is None:
                    raise MirrorMissed("no live mirror")
                mirror.shard.adopt(0, list(PLAN.shards[0]), self.gen, committed=committed)
                fleet[0] = mirror
                self.mirrors.pop()  # it is shard 0 now
                self.events.append(f"mirror promoted to shard 0 (generation {self.gen})")
            except MirrorMissed as err:
                self.events.append(f"mirror refused: {err}")
                rollback = True
        if rollback:
            for k in dead:
                fleet[k] = Handle(self._new_shard(k), k)
            self.fleet = fleet
            for h in fleet:  # (shard 0's load drops its mirror: a new one is attached below)
                h.shard.load_checkpoint(self.uri, [CKPT], "rollback")
            self.records.prune(CKPT)
            self.timeline = {s: t for s, t in self.timeline.items() if s < CKPT}
            self.rollbacks.append((self.gen, CKPT))
            self.events.append(f"rolled back to step {CKPT} (generation {self.gen})")
        self.fleet = fleet
        if self.mirror() is None:
            self._attach_mirror()
        # The shards hold the committed steps: applied, or the newest complete, applied at its commit.
        steps = self.records.ledger.committed_steps()
        steps = len(self.timeline) if steps is None else steps
        for h in self.fleet:
            f = h.shard.facts()
            held = f.applied_steps + (1 if f.complete_step == f.applied_steps else 0)
            assert f.applied_steps <= steps <= held, (
                f"after the recovery shard {h.k} holds {f.applied_steps} steps applied, step "
                f"{f.complete_step} complete; {steps} are committed")

    def await_shards(self, t: T) -> None:
        """``Trainer.commit``'s failed branch: the current fleet (its rollback), then a rejoin if
        its dense model is not at the committed steps."""
        if t.generation != self.gen:  # use_fleet: a new fleet, and the rollback it came with
            back = [s for g, s in self.rollbacks if g > t.generation]
            t.generation, t.fleet = self.gen, list(self.fleet)
            if back:
                t.dense = t.dense[: back[-1]]
        d = t.cur.decision
        committed = self.records.ledger.committed_steps()
        if d is not None and d.commit and committed is None:
            committed = d.step.step + 1
        if not t.replacement and committed is not None and t.step != committed:
            self.events.append(f"trainer {t.rank} rejoins ({t.step} steps, {committed} committed)")
            t.replacement, t.dense = True, t.dense[:CKPT]  # trainer_setup: the checkpoint, the current fleet
            t.generation, t.fleet = self.gen, list(self.fleet)

    def save(self) -> None:
        """Checkpoint ``CKPT``, as the first participant asks it after committing step CKPT - 1."""
        entries = []
        for h in self.fleet:
            h.shard.save_checkpoint(self.uri, CKPT, full=True)
            entries.append(h.shard.save_written(CKPT).entry)
        CheckpointStore(self.uri).commit(CKPT, entries)
        self.saved = True

    # ---------------------------------------------------------------- faults

    def hit(self, party: str, state: str, kind: str | None = None, later: bool = False) -> bool:
        """The fault strikes here: its party and state, in the fault try (``later``: the next)."""
        f = self.fault
        if f is None or str(f) in self.fired or (f.party, f.state) != (party, state):
            return False
        if kind is not None and f.kind != kind:
            return False
        if self.fault_try is None or self.n != self.fault_try + (1 if later else 0):
            return False
        self.fired.add(str(f))
        self.events.append(f"fault {f} in try {self.n}")
        return True

    def defer(self, phase: str, label: str, handle: Handle, method: str, args: tuple, kw: dict) -> None:
        """A message held back: delivered at the end of ``phase`` of the next try, its answer kept."""

        def deliver():
            try:
                answer = handle.call(method, *args, **kw)
                self.answers.append((label, "duplicate" if isinstance(answer, PushResult) and answer.duplicate
                                     else "stale" if isinstance(answer, PushResult) and answer.stale else "taken"))
            except StaleRequest:
                self.answers.append((label, "StaleRequest"))
            except Dead:
                self.answers.append((label, "dead"))

        self.deferred.append((phase, self.n + 1, deliver))

    def deliver(self, phase: str) -> None:
        for item in [d for d in self.deferred if d[:2] == (phase, self.n)]:
            self.deferred.remove(item)
            item[2]()

    def die(self, t: T) -> None:
        t.alive = False
        self.joins.append((t.rank, self.commits + 1))
        self.events.append(f"trainer {t.rank} died")

    # ---------------------------------------------------------------- one try

    def quorum(self) -> list[T]:
        """torchft's quorum: the live trainers and the replacements due; whoever is behind the
        furthest one heals from it; then each trainer's try (``Trainer._start_try``)."""
        for rank, after in list(self.joins):
            if self.commits >= after:
                self.joins.remove((rank, after))
                self.trainers[rank] = T(rank, self.gen, list(self.fleet), replacement=True)
        live = [t for t in self.trainers if t.alive]
        ahead = max((t for t in live if not t.replacement), key=lambda t: t.step, default=None)
        if ahead is None:
            raise AssertionError("every trainer died: the walk injects one fault")
        for t in live:
            t.cur = Try()
            if t.replacement or t.step < ahead.step:
                t.cur.healed_from = t.step
                t.dense, t.replacement = list(ahead.dense), False
        for t in live:
            known = t.next_try is not None and (t.next_try.generation, t.next_try.step) == (t.generation, t.step)
            if t.cur.healed_from is not None or not known:
                start = self.records.start_step(t.generation, t.step, t.cur.healed_from is not None)
                t.next_try, t.committed_try = start.step, start.committed
                assert start.heal_allowed, f"trainer {t.rank}'s heal to {t.step} refused"
            t.cur.id = t.next_try
        ids = {t.cur.id for t in live}
        assert len(ids) == 1, f"one quorum, several tries: {ids}"
        return live

    def run_try(self) -> None:
        quorum = self.quorum()
        step = quorum[0].step
        if step == FAULT_STEP and self.fault_try is None:
            self.fault_try = self.n
        for i, t in enumerate(quorum):
            t.cur.chunk = tuple(step * M + m for m in range(M) if m % len(quorum) == i)
        self.lookups(quorum, step)
        self.deliver("lookups")
        if self.hit("s0", "push", "death") or self.hit("s1", "push", "death"):
            self.kill_shard(int(self.fault.party[1]))
        if self.hit("sup", "lookup", "death"):
            self.restart_supervisor()
        self.pushes(quorum, step)
        self.deliver("pushes")
        if self.hit("s0", "vote", "death") or self.hit("s1", "vote", "death"):
            self.kill_shard(int(self.fault.party[1]))
        if self.hit("sup", "push", "death"):
            self.restart_supervisor()
        self.vote(quorum)
        if self.hit("s0", "commit", "death") or self.hit("s1", "commit", "death"):
            self.kill_shard(int(self.fault.party[1]))
        if self.hit("sup", "commit", "death"):
            self.restart_supervisor()
        if not self.saved and len(self.timeline) >= CKPT:
            self.save()  # the first participant's save after committing step CKPT - 1
        self.n += 1

    def lookups(self, quorum: list[T], step: int) -> None:
        """``Trainer.compute``'s lookup: one request to every shard (sent to all, then gathered),
        naming the try and the newest committed try."""
        if self.hit("s0", "lookup", "death") or self.hit("s1", "lookup", "death"):
            self.kill_shard(int(self.fault.party[1]))
        for t in quorum:
            for h in t.fleet:
                k = h.k
                if not t.alive:
                    break
                me = f"t{t.rank}"
                if k == 1 and (self.hit(me, "lookup", "death") or self.hit(me, "apply", "death", later=True)):
                    self.die(t)
                    break
                sb = batch(t.cur.chunk, k)
                args = (step, t.cur.chunk, sb.lengths, sb.indices)
                kw = {"attempt": t.cur.id, "commit": t.committed_try}
                if k == 1 and (self.hit(me, "lookup", "timeout") or self.hit(me, "commit", "timeout", later=True)):
                    t.cur.error = "lookup lost"
                    continue
                if k == 1 and (self.hit(me, "lookup", "late") or self.hit(me, "commit", "late", later=True)):
                    t.cur.error = "lookup timed out"
                    self.defer("lookups", f"{me}'s lookup of {t.cur.id}", h, "lookup", args, kw)
                    continue
                try:
                    h.call("lookup", *args, **kw)
                except Dead:
                    t.cur.error = f"shard {k} dead"
                    continue
                except StaleRequest as err:
                    t.cur.error = f"stale: {err}"
                    continue
                if self.hit(f"s{k}", "lookup", "timeout") or self.hit(f"s{k}", "lookup", "late"):
                    t.cur.error = f"shard {k}'s answer lost"  # reported: the supervisor kills it
                    self.kill_shard(k)
                if k == 0 and self.hit(me, "apply", "timeout", later=True):
                    t.cur.error = "the answer of shard 0 lost"
                if self.hit(f"s{k}", "apply", "death", later=True):
                    self.kill_shard(k)  # right after applying the committed step
        if self.hit("sup", "apply", "death", later=True):
            self.restart_supervisor()

    def pushes(self, quorum: list[T], step: int) -> None:
        if self.hit("s0", "push", "late"):
            self.mirror_late = True
        for t in quorum:
            if not t.alive or t.cur.error is not None:
                continue
            for h in t.fleet:
                k = h.k
                if k == 1 and self.hit(f"t{t.rank}", "push", "death"):
                    self.die(t)
                    break
                args = (step, t.cur.chunk, grads(t.cur.chunk, t.cur.id, k))
                kw = {"attempt": t.cur.id}
                if k == 1 and self.hit(f"t{t.rank}", "push", "timeout"):
                    t.cur.error = "push lost"
                    continue
                if k == 1 and self.hit(f"t{t.rank}", "push", "late"):
                    t.cur.error = "push timed out"
                    self.defer("pushes", f"t{t.rank}'s push of {t.cur.id}", h, "push_grads", args, kw)
                    continue
                if k == 1 and self.hit(f"t{t.rank}", "apply", "late"):
                    # The same push again after the step was applied (a retried message).
                    self.defer("lookups", f"t{t.rank}'s push of {t.cur.id}, again", h, "push_grads", args, kw)
                try:
                    result = h.call("push_grads", *args, **kw)
                except Dead:
                    t.cur.error = f"shard {k} dead"
                    continue
                if result.stale or result.duplicate:  # check_pushed: StaleStep
                    t.cur.error = f"push {result}"
                if result.applied and self.hit(f"s{k}", "push", "timeout"):
                    t.cur.error = f"shard {k}'s answer lost"  # to the push that completed the step
                    self.kill_shard(k)

    def vote(self, quorum: list[T]) -> None:
        """The all-reduce (it completes only if every trainer of the quorum reaches it; it sums
        the "failed here" flags), the votes at the ledger, then ``Trainer.commit``."""
        summed = all(t.alive for t in quorum)
        flags = sum(t.cur.error is not None for t in quorum)
        for t in quorum:
            if t.alive:
                t.cur.summed = summed
                t.cur.ok = summed and t.cur.error is None and flags == 0
        order = [t for t in quorum if t.alive]
        late = None
        for t in order:
            if self.hit(f"t{t.rank}", "vote", "late") or (t.rank == 0 and self.hit("sup", "vote", "late")):
                late = t
        if late is not None:
            order = [t for t in order if t is not late]
        for i, t in enumerate(order):
            if self.hit(f"t{t.rank}", "vote", "death"):
                self.die(t)
                continue
            if self.hit(f"t{t.rank}", "vote", "timeout"):
                self.die(t)  # the vote never reached the supervisor; the trainer's call raised
                continue
            if i == 1 and self.hit("sup", "vote", "death"):
                self.restart_supervisor()
            t.cur.decision = self.decide(Vote(t.cur.id, t.rank, t.cur.ok))
            if i == 1 and self.hit("sup", "vote", "timeout"):
                self.die(t)  # decided and journaled; its answer lost: the trainer's call raised
        self.commit([t for t in order if t.alive])
        if late is None:
            return
        late.cur.decision = self.decide(Vote(late.cur.id, late.rank, late.cur.ok))
        self.answers.append((f"t{late.rank}'s late vote", "commit" if late.cur.decision.commit else "abort"))
        self.commit([late])

    def commit(self, trainers: list[T]) -> None:
        failed = []
        for t in trainers:
            if self.hit(f"t{t.rank}", "commit", "death"):
                self.die(t)
                continue
            d = t.cur.decision
            if t.cur.ok and d.commit:
                t.dense.append(d.step)
                t.next_try, t.committed_try = d.next, d.committed
            else:
                if d is not None:
                    t.next_try, t.committed_try = d.next, d.committed
                failed.append(t)
        if failed:
            self.recover()
            for t in failed:
                self.await_shards(t)

    # ---------------------------------------------------------------- the whole walk

    def run(self) -> None:
        while (self.records.ledger.committed_steps() or 0) < STEPS or len(self.timeline) < STEPS:
            assert self.n < MAX_TRIES, f"{STEPS} steps not committed in {MAX_TRIES} tries: {self.events}"
            self.run_try()
            self.recover()  # a shard that died after its trainers' calls (they meet it at their next)
            if self.mirror() is None:
                self._attach_mirror()  # the mirror keeper replaces a mirror that was killed
        for phase in ("lookups", "pushes"):  # a late message whose moment never came: now
            for item in [d for d in self.deferred if d[0] == phase]:
                self.deferred.remove(item)
                item[2]()


# ---------------------------------------------------------------------------------- checks


def reference_rows(timeline: dict[int, StepId]) -> list:
    """The rows of a fault-free run of the final timeline's committed tries, one whole chunk each."""
    out = []
    for k in (0, 1):
        shard = EmbeddingShard(k, list(PLAN.shards[k]), DIM, learning_rate=0.1, eps=1e-8, seed=3,
                               microbatches_per_step=M)
        for step in range(STEPS):
            mbs = step_mbs(step)
            sb = batch(mbs, k)
            shard.lookup(step, mbs, sb.lengths, sb.indices)
            assert shard.push_grads(step, mbs, grads(mbs, timeline[step], k)).applied
        out.append(shard.get_rows())
    return out


def same_rows(a, b) -> bool:
    return all(np.array_equal(x[0], y[0]) and np.array_equal(x[1], y[1]) for x, y in zip(a, b))


def check_invariants(walk: Walk) -> None:
    timeline = walk.timeline
    assert sorted(timeline) == list(range(STEPS)) and walk.records.ledger.committed_steps() == STEPS
    final = [timeline[s] for s in range(STEPS)]
    assert not walk.deferred

    # Dense: every live trainer holds the final timeline's committed tries, once each, in order.
    for t in walk.trainers:
        assert t.alive and not t.replacement, f"trainer {t.rank} is not back: {walk.events}"
        assert t.dense == final, f"trainer {t.rank}'s dense model holds {t.dense}, the timeline {final}"

    # Sparse: every shard of the final fleet and shard 0's mirror applied each committed step once,
    # with its committed try's gradients (the rows of a clean run of the final timeline).
    reference = reference_rows(timeline)
    for h in walk.fleet:
        assert h.alive
        rows = h.shard.get_rows()  # commits the last step (the end of training)
        assert h.shard.applied_step == STEPS - 1
        log = [(s, tuple(sorted(mbs))) for s, mbs in h.shard.applied_log()]  # chunks by their first microbatch
        first = log[0][0] if log else STEPS
        assert log == [(s, step_mbs(s)) for s in range(first, STEPS)], f"shard {h.k} applied {log}"
        assert same_rows(rows, reference[h.k]), f"shard {h.k}'s rows are not those of the committed tries {final}"
    mirror = walk.mirror()
    assert mirror is not None
    mirror.shard.adopt(0, list(PLAN.shards[0]), walk.gen + 1, committed=STEPS)  # promoted: it applies what it holds
    assert same_rows(mirror.shard.get_rows(), reference[0]), "the mirror's rows differ from its primary's"
    assert mirror.shard.applied_step == STEPS - 1

    # Audit logs: per shard process and timeline, each step applied once, in order, naming a try
    # the ledger committed (a promoted mirror's steps came to it without their try); a mirror's
    # own log from its base (the steps in its primary's rows when it started).
    for path in sorted(glob.glob(os.path.join(walk.audit, "*.jsonl"))):
        expected, promoted = 0, False
        with open(path) as f:
            for record in map(json.loads, f):
                if record["event"] == "base":
                    expected = record["step"]
                elif record["event"] == "load":
                    promoted = promoted or record.get("why") == "replica"
                    expected = record["step"] if "step" in record else (record["chain"] or [0])[-1]
                elif record["event"] == "apply":
                    assert record["step"] == expected, f"{path}: step {record['step']} applied, {expected} expected"
                    expected += 1
                    if record["try"] is None:
                        assert promoted and not MIRROR_KEEPS_TRY, f"{path}: step {record['step']} applied, no try"
                    else:
                        try_ = StepId(record["try"][0], record["step"], record["try"][1])
                        assert try_ in walk.committed_ever, f"{path}: {try_} applied, never committed"


# ---------------------------------------------------------------------------------- the table


# Each party at each state of the fault step's first try (the "commit" and "apply" states of a
# step are reached in the next try: its lookups name the commit, and the shards apply it). A
# trainer sends a message at every state, so it has all three faults at each. A shard sends none
# of its own at vote, commit and apply (its timeouts and late answers are to requests, and a
# request it answers too late is reported and the shard killed as hung, like a death), so it
# has its death at every state, its timeout at lookup and push, and a late message where it
# sends one: its mirror feed. The supervisor's death is a restart from its book at every
# state; its answers are late or lost at the vote, the one request it decides.


def _trainer_cases(r: int) -> list[Fault]:
    p = f"t{r}"
    return [
        Fault(p, "lookup", "death", what="its lookup reached shard 0 only; the step is redone without it"),
        Fault(p, "lookup", "timeout", what="its lookup to shard 1 lost: the try aborts, redone by both"),
        Fault(p, "lookup", "late", "StaleRequest", "its lookup to shard 1 arrives after the redo's"),
        Fault(p, "push", "death", what="its push reached shard 0 only"),
        Fault(p, "push", "timeout", what="its push to shard 1 lost (shard 0 may hold the step complete)"),
        Fault(p, "push", "late", "stale", "its push to shard 1 arrives after the redo's pushes"),
        Fault(p, "vote", "death", what="dies after the all-reduce, before voting: the peer's vote commits"),
        Fault(p, "vote", "timeout", what="its vote never reaches the ledger; its call raises, it is replaced"),
        Fault(p, "vote", "late", "commit", "its vote arrives after the peer's vote and commit"),
        Fault(p, "commit", "death", what="dies after the decision, before its optimizer step"),
        Fault(p, "commit", "timeout", what="its next lookup (naming the commit) to shard 1 lost"),
        Fault(p, "commit", "late", "StaleRequest", "its next lookup (naming the commit) to shard 1: after the redo's"),
        Fault(p, "apply", "death", what="dies right after its next lookup applied the step on shard 0"),
        Fault(p, "apply", "timeout", what="shard 0 applied the step for its next lookup; the answer lost"),
        Fault(p, "apply", "late", "duplicate", "its push of the step again, after the step was applied"),
    ]


def _shard_cases(k: int) -> list[Fault]:
    how = "its mirror is promoted" if k == 0 else "everything rolls back to the checkpoint"
    cases = [
        Fault(f"s{k}", "lookup", "death", what=f"dies before the lookups; {how}"),
        Fault(f"s{k}", "lookup", "timeout", what=f"serves a lookup, its answer lost: killed as hung; {how}"),
        Fault(f"s{k}", "lookup", "late", what=f"answers a lookup after the caller's deadline: killed; {how}"),
        Fault(f"s{k}", "push", "death", what=f"dies after the lookups, before the pushes; {how}"),
        Fault(f"s{k}", "push", "timeout", what=f"the answer to the push completing the step lost: killed; {how}"),
        Fault(f"s{k}", "vote", "death", what=f"dies with the step complete, before the votes; {how}"),
        Fault(f"s{k}", "commit", "death", what=f"dies after the commit decision, before applying; {how}"),
        Fault(f"s{k}", "apply", "death", what=f"dies right after applying the committed step; {how}"),
    ]
    if k == 0:
        cases.append(Fault("s0", "push", "late", what="its mirror takes the step too late: killed, the step is redone"))
    return cases


SUPERVISOR_CASES = [
    Fault("sup", "lookup", "death", what="restarts from its book after the lookups"),
    Fault("sup", "push", "death", what="restarts after the pushes"),
    Fault("sup", "vote", "death", what="restarts between the first vote (journaled) and the second"),
    Fault("sup", "vote", "timeout", what="the decision's answer to the second voter lost: it raises, replaced"),
    Fault("sup", "vote", "late", "commit", "its answer to trainer 0 comes after trainer 1 voted and committed"),
    Fault("sup", "commit", "death", what="restarts after the commits"),
    Fault("sup", "apply", "death", what="restarts after the next step's lookups applied the step"),
]

CASES = [None, *_trainer_cases(0), *_trainer_cases(1), *_shard_cases(0), *_shard_cases(1), *SUPERVISOR_CASES]


@pytest.mark.parametrize("fault", CASES, ids=lambda f: str(f) if f else "no-fault")
def test_the_protocol_keeps_its_invariants_under_one_fault(tmp_path, fault):
    walk = Walk(tmp_path, fault)
    try:
        walk.run()
        if fault is not None:
            assert str(fault) in walk.fired, f"{fault} never struck: {walk.events}"
        if fault is not None and fault.expect is not None:
            assert [a for _, a in walk.answers] == [fault.expect], f"late message answered {walk.answers}"
        # After every recovery a trainer picking up the new fleet was at the committed steps:
        # none had to rejoin from the checkpoint.
        assert not [e for e in walk.events if "rejoins" in e], walk.events
        check_invariants(walk)
    finally:
        for m in walk.mirrors:  # ends the apply thread of every mirror still waiting
            m.shard._mirror = None


# ---------------------------------------------------------------------------------- defect classes


def _shard(k=0):
    return EmbeddingShard(k, list(PLAN.shards[k]), DIM, learning_rate=0.1, eps=1e-8, seed=3, microbatches_per_step=M)


def _complete(shard, step, try_, k=0):
    mbs = step_mbs(step)
    sb = batch(mbs, k)
    commit = None if step == 0 else StepId(try_.generation, step - 1, 0)
    shard.lookup(step, mbs, sb.lengths, sb.indices, attempt=try_, commit=commit)
    assert shard.push_grads(step, mbs, grads(mbs, try_, k), attempt=try_) == PushResult(applied=True)


def test_a_lookup_that_names_no_commit_of_the_complete_step_is_refused_and_applies_nothing():
    shard = _shard()
    _complete(shard, 0, StepId(0, 0, 0))
    nxt = step_mbs(1)
    sb = batch(nxt, 0)
    for commit in (None, StepId(0, 0, 1)):  # nothing named; an attempt that is not the one held complete
        with pytest.raises(StaleRequest):
            shard.lookup(1, nxt, sb.lengths, sb.indices, attempt=StepId(0, 1, 0), commit=commit)
        assert shard.applied_step == -1 and shard.commits_refused >= 1
    shard.lookup(1, nxt, sb.lengths, sb.indices, attempt=StepId(0, 1, 0), commit=StepId(0, 0, 0))
    assert shard.applied_step == 0
    shard.lookup(1, nxt, sb.lengths, sb.indices, attempt=StepId(0, 1, 0), commit=StepId(0, 0, 0))  # again: once
    assert list(shard.applied_microbatches) == [(0, step_mbs(0))]


def test_an_abandoned_try_is_stale_on_the_shard_and_the_newer_try_applies():
    shard = _shard()
    old, new = StepId(0, 0, 0), StepId(0, 0, 1)
    half = step_mbs(0)[:2]
    sb = batch(half, 0)
    shard.lookup(0, half, sb.lengths, sb.indices, attempt=old)
    _complete(shard, 0, new)  # the redo, one trainer taking the whole step
    with pytest.raises(StaleRequest):  # a late lookup of the abandoned try
        shard.lookup(0, half, sb.lengths, sb.indices, attempt=old)
    assert shard.push_grads(0, half, grads(half, old, 0), attempt=old) == PushResult(applied=False, stale=True)
    expected = _shard()
    _complete(expected, 0, new)
    assert same_rows(shard.get_rows(), expected.get_rows())


def test_a_late_vote_gets_the_decision_made_even_after_the_next_try_and_a_supervisor_restart():
    book = Book()
    records = StepRecords(book, num_trainers=2)
    first = StepId(0, 0, 0)
    assert not records.decide(Vote(first, 0, False)).commit  # trainer 0 could not sum: aborted
    nxt = records.start_step(0, 0, False).step
    assert nxt == StepId(0, 0, 1)
    assert records.decide(Vote(nxt, 0, True)).commit
    late = records.decide(Vote(first, 1, True))  # trainer 1's vote of the first try, after all that
    assert not late.commit and late.rejoin  # step 0 is committed (by attempt 1): that voter rejoins
    replayed = StepRecords(Book(), num_trainers=2)
    replayed.load(json.loads(json.dumps(records.doc())), list(book.records), history_only=False)
    assert not replayed.decide(Vote(first, 1, True)).commit
    assert replayed.decide(Vote(nxt, 1, False)).commit  # a late "failed" vote of a committed try: committed
    assert replayed.ledger.committed == nxt and replayed.ledger.committed_steps() == 1


def test_a_step_commits_once_per_timeline():
    ledger = StepLedger()
    assert ledger.vote(Vote(StepId(0, 0, 0), 0, True))[0].commit
    # A stalled trainer's redo of step 0 (a new attempt) cannot commit it again; it rejoins.
    d, _ = ledger.vote(Vote(StepId(0, 0, 1), 1, True))
    assert not d.commit and d.rejoin
    ledger.rolled_back(0)
    assert ledger.vote(Vote(StepId(1, 0, 0), 0, True))[0].commit  # the new timeline commits it again


def test_a_late_vote_of_the_abandoned_timeline_does_not_commit_after_the_rollback():
    """Step 1 (generation 0, after checkpoint 1) is decided committed by trainer 0's vote; shard 1
    dies and everything rolls back to checkpoint 1 (generation 1); trainer 1's vote of the same
    try, delayed behind the recovery, arrives only now. It must not commit step 1 again on the
    new timeline: the new generation's try of step 1 would be aborted (rejoin) and the run would
    fall back to the checkpoint once more. (Found by this walk: the rollback forgot the
    abandoned tries, and the late vote was decided anew.)"""
    records = StepRecords(Book(), num_trainers=2)
    assert records.decide(Vote(StepId(0, 0, 0), 0, True)).commit
    assert records.decide(Vote(StepId(0, 1, 0), 0, True)).commit
    records.prune(1)  # the rollback to checkpoint 1
    records.decide(Vote(StepId(0, 1, 0), 1, True))  # the late vote
    assert records.ledger.committed_steps() == 1 and records.ledger.committed is None
    start = records.start_step(1, 1, False)
    d = records.decide(Vote(start.step, 0, True))
    assert d.commit and not d.rejoin
