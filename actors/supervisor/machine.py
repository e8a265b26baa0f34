"""The supervisor's recovery state machine, as pure data and one transition function.

States carry their data; ``transition(state, event, ...)`` returns the next state and the
reason, or None when the event changes nothing. No Ray, no I/O: the recovery controller
persists the result (write-ahead) before its executor acts on it, so a restarted supervisor
finds the intent in its journal and finishes it.

    Running ──shard died (partial)──> RecoveringShards ──done──> Running
    Running ──shard died (full) / every trainer died / resume / dense refused──> RollingBack ──done──> Running
    RecoveringShards ──another shard died──> RecoveringShards (merged)
    RecoveringShards ──every trainer died──> RollingBack (the rollback respawns them too)
    RollingBack ──shard died──> RollingBack (merged)
    any ──budget exceeded / invariant broken / thread crashed──> Failed;  any ──done / stop──> Finished
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from core.codec import decode, encode
from core.books import DeathCause
from policies import Budget, FailurePolicy, RecoveryDecision

__all__ = [
    "Running", "RecoveringShards", "RollingBack", "Finished", "Failed", "State", "RECOVERING", "TERMINAL",
    "TrainersCause", "ShardDied", "RespawnRetry", "WorkDone", "TrainersAllDied", "ResumeRequested", "StopRequested",
    "RollbackRefused", "DenseRefused", "NoChainForShard",
    "Fail", "Transition", "transition", "state_to_dict", "state_from_dict", "FULL_RECOVERY", "EVERY_TRAINER_DIED",
    "RESUME", "ReplacementAtCheckpoint", "replacement_at_checkpoint",
]

FULL_RECOVERY = "full recovery"
EVERY_TRAINER_DIED = "every trainer died"
RESUME = "resume"


# ----------------------------------------------------------------------------- states


@dataclass(frozen=True)
class Running:
    """Trainers step; shards answer."""

    name = "running"


@dataclass(frozen=True)
class RecoveringShards:
    """Respawn ``targets`` (shard -> generation reserved for its new actor) and load each from
    ``chain`` (partial recovery). ``causes`` holds one record per death being recovered."""

    targets: dict[int, int]
    chain: tuple[int, ...]
    causes: tuple[DeathCause, ...]
    decision: RecoveryDecision | None
    spares: dict[int, str] = field(default_factory=dict)  # shard -> warm spare adopted as its new actor
    mirrors: tuple[int, ...] = ()  # shards whose ``spares`` entry is their mirror: promoted, nothing loaded
    # Steps the survivors confirmed committed when the deaths were decided: a mirror holding
    # fewer is refused at its promotion (it missed a step).
    committed_steps: int | None = None
    name = "recovering_shards"


@dataclass(frozen=True)
class TrainersCause:
    """Every trainer died: the replacement ``reported_by`` found the shards ``ahead`` of the
    checkpoint step it restarted from (so that many steps are redone)."""

    ahead: int
    reported_by: int


@dataclass(frozen=True)
class RollingBack:
    """Every shard (respawning ``targets`` first) and the dense model go back to ``step``,
    restored from ``chain`` (empty: the initial state of step 0). ``why`` is one of
    FULL_RECOVERY, EVERY_TRAINER_DIED, RESUME; ``trainers`` says who reported that every
    trainer died, and how far ahead they had been."""

    step: int
    why: str
    chain: tuple[int, ...]
    targets: dict[int, int] = field(default_factory=dict)
    causes: tuple[DeathCause, ...] = ()
    decision: RecoveryDecision | None = None
    spares: dict[int, str] = field(default_factory=dict)
    trainers: TrainersCause | None = None
    # The step first asked for, when a shard refused a file of its chain and the rollback went
    # further back: the dense model, at that step, must follow (trainers get a rollback).
    refused_from: int | None = None
    name = "rolling_back"


@dataclass(frozen=True)
class Finished:
    """Training is over (``how``: completed or interrupted); nothing more is recovered."""

    how: str = "completed"
    name = "finished"


@dataclass(frozen=True)
class Failed:
    """The run stopped on a budget or an unrecoverable error; ``--resume`` continues it."""

    reason: str
    name = "failed"


State = Running | RecoveringShards | RollingBack | Finished | Failed
RECOVERING = (RecoveringShards, RollingBack)  # states the executor carries out
TERMINAL = (Finished, Failed)  # nothing is recovered after these
_STATES = {c.name: c for c in (Running, RecoveringShards, RollingBack, Finished, Failed)}


def state_to_dict(state: State) -> dict:
    return {"state": state.name, **encode(state)}


def state_from_dict(d: dict) -> State:
    d = dict(d)
    return decode(_STATES[d.pop("state")], d)


# ----------------------------------------------------------------------------- events


@dataclass(frozen=True)
class ShardDied:
    """Shard ``shard`` of generation ``generation`` is gone. The supervisor fills in the
    recovery decision and the chains it read from the store (this function does no I/O)."""

    shard: int
    generation: int
    committed_generation: int  # the shard's generation in the live fleet
    next_generation: int  # the lowest generation never reserved for this shard
    cause: DeathCause
    partial: bool  # the recovery decision: partial (respawn alone) or full (roll back)
    decision: RecoveryDecision | None
    chain: tuple[int, ...]  # newest restorable chain (full + incrementals), for partial recovery
    consistent_chain: tuple[int, ...]  # the newest full checkpoint alone, for a rollback
    spare: str | None = None  # a warm spare to adopt as the shard's new actor (None: start one)
    mirror: bool = False  # ``spare`` is the shard's mirror (recovery: replica): promoted, nothing loaded
    committed_steps: int | None = None  # steps the survivors confirmed committed (actors.supervisor.facts)
    mirror_reason: str = ""  # recovery: replica: why its mirror may, or may not, take its place


@dataclass(frozen=True)
class RespawnRetry:
    """The actor under ``targets[shard]`` (or its spare) could not be adopted: start a new
    process under ``next_generation``."""

    shard: int
    next_generation: int


@dataclass(frozen=True)
class WorkDone:
    """The executor finished ``state``; ignored if the state moved on meanwhile."""

    state: State


@dataclass(frozen=True)
class TrainersAllDied:
    step: int
    chain: tuple[int, ...]
    cause: TrainersCause


@dataclass(frozen=True)
class RollbackRefused:
    """A shard found a file of the rollback's chain corrupt: go back to ``step`` on ``chain``
    (the newest chain that passes over it) instead, dense model included."""

    step: int
    chain: tuple[int, ...]
    reason: str


@dataclass(frozen=True)
class DenseRefused:
    """The dense state of checkpoint ``refused`` (the one a rollback went to, or is going to)
    cannot be read: everything goes back to ``step`` on ``chain`` instead, dense model included."""

    refused: int
    step: int
    chain: tuple[int, ...]
    reason: str


@dataclass(frozen=True)
class NoChainForShard:
    """A shard being recovered found no valid chain of its own files though checkpoints exist:
    everything (dense model included) goes back to ``step`` on ``chain`` instead."""

    shard: int
    step: int
    chain: tuple[int, ...]
    reason: str


@dataclass(frozen=True)
class ResumeRequested:
    step: int
    chain: tuple[int, ...]


@dataclass(frozen=True)
class StopRequested:
    how: str  # "completed" or "interrupted"


@dataclass(frozen=True)
class Fail:
    """Stop the run: a budget ran out, an invariant does not hold, or a thread crashed."""

    reason: str


@dataclass(frozen=True)
class Transition:
    state: State
    reason: str


def transition(
    state: State, event, shard_recoveries: int = 0, policy: FailurePolicy | None = None
) -> Transition | None:
    """The one place recovery logic decides what comes next. ``shard_recoveries``: shard
    deaths recovered or being recovered so far, checked against ``policy``'s budget."""
    if isinstance(state, (Finished, Failed)):
        return None  # terminal: nothing is recovered after the end
    if isinstance(event, StopRequested):
        return Transition(Finished(event.how), f"training {event.how}")
    if isinstance(event, Fail):
        return Transition(Failed(event.reason), event.reason)
    if isinstance(event, ShardDied):
        return _on_shard_died(state, event, shard_recoveries, policy)
    if isinstance(event, RespawnRetry):
        return _on_respawn_retry(state, event)
    if isinstance(event, WorkDone):
        if event.state == state and isinstance(state, RECOVERING):
            return Transition(Running(), f"{state.name} done")
        return None
    if isinstance(event, TrainersAllDied):
        return _on_trainers_died(state, event)
    if isinstance(event, RollbackRefused):
        if not isinstance(state, RollingBack) or event.step >= state.step:
            return None
        first = state.step if state.refused_from is None else state.refused_from
        return Transition(replace(state, step=event.step, chain=tuple(event.chain), refused_from=first),
                          f"rollback to step {state.step} refused ({event.reason}): roll back to step {event.step}")
    if isinstance(event, NoChainForShard):
        if not isinstance(state, RecoveringShards):
            return None
        return Transition(
            RollingBack(event.step, FULL_RECOVERY, tuple(event.chain), dict(state.targets), state.causes,
                        state.decision, dict(state.spares)),
            f"shard {event.shard} has no valid checkpoint chain ({event.reason}): roll everything back to step "
            f"{event.step}",
        )
    if isinstance(event, DenseRefused):
        if isinstance(state, RollingBack):
            return transition(state, RollbackRefused(event.step, event.chain, event.reason))
        if not isinstance(state, Running) or event.step >= event.refused:
            return None
        return Transition(RollingBack(event.step, FULL_RECOVERY, tuple(event.chain), refused_from=event.refused),
                          f"the dense state of checkpoint {event.refused} cannot be read ({event.reason}): "
                          f"roll back to step {event.step}")
    if isinstance(event, ResumeRequested):
        return Transition(
            RollingBack(event.step, RESUME, tuple(event.chain)), f"--resume from checkpoint step {event.step}"
        )
    raise TypeError(f"unknown event {event!r}")


def _on_respawn_retry(state: State, e: RespawnRetry) -> Transition | None:
    if not (isinstance(state, RECOVERING) and e.shard in state.targets):
        return None
    targets = {**state.targets, e.shard: e.next_generation}
    spares = {k: v for k, v in state.spares.items() if k != e.shard}
    if e.shard in getattr(state, "mirrors", ()):
        return Transition(
            replace(state, targets=targets, spares=spares, mirrors=tuple(k for k in state.mirrors if k != e.shard)),
            f"shard {e.shard}: its mirror could not take its place (dead, or it missed a step); recovering it "
            f"from checkpoint chain {list(state.chain)} as generation {e.next_generation}",
        )
    return Transition(
        replace(state, targets=targets, spares=spares),
        f"shard {e.shard}: its half-started actor did not answer; respawning as generation {e.next_generation}",
    )


def _on_trainers_died(state: State, e: TrainersAllDied) -> Transition:
    recovering = isinstance(state, RECOVERING)
    pending = dict(state.targets) if recovering else {}
    return Transition(
        RollingBack(e.step, EVERY_TRAINER_DIED, tuple(e.chain), pending, state.causes if recovering else (),
                    spares=dict(state.spares) if recovering else {}, trainers=e.cause),
        f"every trainer died: roll back to checkpoint step {e.step}"
        + (f", respawning shards {sorted(pending)} on the way" if pending else ""),
    )


def _on_shard_died(state: State, e: ShardDied, recoveries: int, policy: FailurePolicy | None) -> Transition | None:
    pending = state.targets if isinstance(state, RECOVERING) else {}
    if e.shard in pending:
        return None  # its replacement is already being made; a death of the old actor changes nothing
    if e.generation != e.committed_generation:
        return None  # a stale signal from an actor that was already replaced
    over = policy.exceeded(Budget.SHARD_RECOVERIES, recoveries + 1, f"shard {e.shard} died") if policy else None
    if over is not None:
        return Transition(Failed(over), over)
    targets = {**pending, e.shard: e.next_generation}
    spares = {**(state.spares if isinstance(state, RECOVERING) else {})}
    if e.spare is not None:
        spares[e.shard] = e.spare
    who = f"shard {e.shard} (generation {e.generation}) died: {e.cause.cause}"
    onto = f" onto {'its mirror' if e.mirror else 'spare'} {e.spare}" if e.spare else ""
    why = e.decision.reason if e.decision is not None else ""
    if isinstance(state, RollingBack):
        return Transition(
            replace(state, targets=targets, causes=state.causes + (e.cause,), spares=spares),
            f"{who}; replaced{onto} as part of the rollback to step {state.step}",
        )
    causes = (state.causes if isinstance(state, RecoveringShards) else ()) + (e.cause,)
    if e.partial:
        mirrors = (state.mirrors if isinstance(state, RecoveringShards) else ()) + ((e.shard,) if e.mirror else ())
        known = [c for c in (getattr(state, "committed_steps", None), e.committed_steps) if c is not None]
        committed = max(known) if known else None
        if isinstance(state, RecoveringShards):
            return Transition(
                replace(state, targets=targets, causes=causes, spares=spares, mirrors=mirrors, committed_steps=committed),
                f"{who} during the recovery of shards {sorted(state.targets)}; recovering them together{onto}",
            )
        if e.mirror:
            return Transition(RecoveringShards(targets, tuple(e.chain), causes, e.decision, spares, mirrors, committed),
                              f"{who}; replica recovery{onto}, nothing lost (chain {list(e.chain)} if it cannot): "
                              f"{e.mirror_reason}")
        if e.decision is not None and e.decision.mode.value == "replica":
            why = f"replica recovery without a mirror in sync ({e.mirror_reason or 'none was ready'}): the checkpoint instead"
        return Transition(
            RecoveringShards(targets, tuple(e.chain), causes, e.decision, spares, mirrors, committed),
            f"{who}; partial recovery{onto} from chain {list(e.chain)}: {why}",
        )
    step = e.consistent_chain[-1] if e.consistent_chain else 0
    return Transition(
        RollingBack(step, FULL_RECOVERY, tuple(e.consistent_chain), targets, causes, e.decision, spares),
        f"{who}; {why or 'full recovery'}: roll back to step {step}{onto}",
    )


# ----------------------------------------------------------------------------- replacements


@dataclass(frozen=True)
class ReplacementAtCheckpoint:
    """What a replacement trainer does when its first quorum put nobody ahead of it, at the
    checkpoint step it started from: ``heal`` (live trainers are ahead: fail this step and
    heal from them in a later quorum), ``join`` (live trainers are at that step, or behind
    it: the timeline is there already, nothing to roll back) or ``roll back`` (every trainer
    died: shards go back to that checkpoint too)."""

    action: str
    ranks: tuple[int, ...]
    reason: str


def replacement_at_checkpoint(step: int, live_committed: dict[int, int | None]) -> ReplacementAtCheckpoint:
    """``live_committed``: each live trainer that committed a step since it started, with the
    last step it committed (None: not known). A trainer that committed ``step`` or later is
    ahead. A live trainer exactly at ``step`` has the state of the checkpoint of ``step``
    (checkpoints newer than a rollback are fenced, so it is on the same timeline): asking
    it to heal the replacement would find nobody ahead again, every quorum, forever."""
    if not live_committed:
        return ReplacementAtCheckpoint("roll back", (), f"no live trainer: every trainer died; roll back to step {step}")
    ahead = tuple(sorted(r for r, c in live_committed.items() if c is None or c >= step))
    if ahead:
        return ReplacementAtCheckpoint("heal", ahead, f"trainer(s) {list(ahead)} are alive and ahead of step {step}")
    return ReplacementAtCheckpoint(
        "join", tuple(sorted(live_committed)),
        f"trainer(s) {sorted(live_committed)} are alive at step {step} or behind it: nothing to roll back",
    )
