"""A shard's death, asked then acted on: the survivors answer one round of questions
(``survey.py``), a pure function decides from their answers and the books (``facts.py``),
and the controller transitions once, with the books corrected by the same journal write.
The chains a recovery may load are kept from retention from the moment they are read."""

from __future__ import annotations

import logging
from functools import partial

from actors.supervisor.events import EventLog
from actors.supervisor.facts import BooksView, ShardLossDecision, decide_shard_loss
from actors.supervisor.machine import RECOVERING, RollingBack, ShardDied
from core.books import DeathCause
from policies import RecoveryDecision, RecoveryMode

__all__ = ["ShardDeaths"]

logger = logging.getLogger(__name__)


class ShardDeaths:
    """``controller``: the RecoveryController (its lock, state, served fleet, transition);
    ``parts``: its Collaborators."""

    def __init__(self, controller, parts, events: EventLog):
        self._c, self._p, self._events = controller, parts, events
        self._deciding: set[tuple[int, int]] = set()  # (shard, generation) of deaths being decided

    def on_death(self, k: int, generation: int, cause: str, detected: float, exited: bool = False) -> None:
        """Shard ``k`` generation ``generation`` is gone: decide its recovery and transition. A
        second report of the same death meanwhile is dropped. Its mirror (replica) takes its
        place only on its own confirmation, never in a rollback."""
        c = self._c
        with c.changed:
            if not c.is_current(k, generation) or (k, generation) in self._deciding:
                return
            self._deciding.add((k, generation))
            info = c.served.infos[k]
            node, pid = (info.node_id, info.pid) if info is not None else (None, None)
            c.served.deaths.append((node, f"shard:{k}", detected))  # a host's loss names it
            kill = self._p.ledger.kill_of(f"shard:{k}", pid)  # matched by its process, not by comparing clocks
            killed_at = kill.time if kill is not None else self._p.host_down_since(node)
            self._p.observe.observe_failure(detected)
            decision = self._p.decide()
            death = DeathCause(
                actor=f"shard:{k}", shard=k, generation=generation, cause=cause, detected_at=round(detected, 3),
                killed_at=killed_at, detection_s=round(detected - killed_at, 3) if killed_at is not None else None,
                first_step=c.served.first_steps[k], exited=exited,
            )
        try:
            self._decide(k, generation, death, decision)
        finally:
            with c.changed:
                self._deciding.discard((k, generation))

    def _decide(self, k: int, generation: int, death: DeathCause, decision: RecoveryDecision) -> None:
        c, partial_mode = self._c, decision.mode in (RecoveryMode.PARTIAL, RecoveryMode.REPLICA)
        with c.changed:
            skip = set(c.state.targets) if isinstance(c.state, RECOVERING) else set()
        survey = self._p.survey(skip | {k})  # outside the lock: one round, one deadline
        chain = tuple(self._p.partial_chain()) if partial_mode else ()
        consistent = () if partial_mode else tuple(self._p.consistent_chain())
        owner = f"death of shard {k} generation {generation}"
        self._p.protect(owner, chain + consistent)  # kept until the recovery is done
        kept = False
        with c.changed:
            if c.is_current(k, generation):
                loss = decide_shard_loss(k, survey, self._books_view())
                replica = decision.mode == RecoveryMode.REPLICA and not isinstance(c.state, RollingBack)
                mirror = self._p.mirrors.candidate(k, self._p.suspects()) if replica and loss.promote_mirror else None
                spare = mirror or self._p.spares.candidate(self._p.suspects())
                event = ShardDied(k, generation, c.served.gens[k], c.served.next_gens[k], death, partial_mode, decision,
                                  chain, consistent, spare, mirror is not None, loss.committed_steps,
                                  loss.mirror_reason if replica else "")
                changed = c.transition(event, corrections=partial(self._correct, loss))
                kept = changed and isinstance(c.state, RECOVERING)  # a budget may have ended the run instead
                if kept:
                    c.keep_restore_targets(owner)
        if not kept:
            self._p.release(owner)

    def _books_view(self) -> BooksView:
        s = self._c.served
        return BooksView(tuple(s.gens), tuple(s.first_steps), self._p.committed_steps(), self._p.mirrors.ready())

    def _correct(self, loss: ShardLossDecision) -> None:
        """The books take what the survivors confirmed; each disagreement is an event (part of
        the transition: journaled with it)."""
        firsts = self._c.served.first_steps
        for k, first in enumerate(loss.first_steps):
            if k != loss.shard and first is not None:
                firsts[k] = first
        for f in loss.findings:
            self._events.append("books_corrected", finding=f.kind, subject=f.subject, detail=f.detail)
