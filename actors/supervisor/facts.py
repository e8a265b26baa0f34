"""What a recovery decides from the answers the survivors gave in one round (``survey.py``
asks them): pure functions over typed answers and a view of the books, with table tests.

The books (commits reported in the background, the first step of each generation, the mirrors
the keeper built) are a cache. A recovery corrects them from what the processes confirm now:

- a mirror takes its dead primary's place only on its own word that it mirrors that shard,
  never missed a step and holds every step the trainers committed (the largest step count any
  trainer, shard or report confirms);
- the first step of each surviving generation is the one it says it applied first;
- a live trainer is ahead of a replacement's checkpoint only if it says so (its steps), or
  cannot answer in time (then it may be, and the replacement waits for it).

Every correction is a ``Finding``: ``lag`` where the books were behind (a report not yet
arrived), ``contradiction`` where they said something else; the supervisor records each as an
event, and ``cpr verify`` reports the contradictions. No decision compares two hosts' clocks:
steps, generations and process ids only.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from actors.supervisor.machine import ReplacementAtCheckpoint, replacement_at_checkpoint
from core.records import ShardFacts, TrainerFacts

__all__ = ["Survey", "BooksView", "Finding", "ShardLossDecision", "decide_shard_loss", "decide_replacement",
           "confirmed_steps"]


@dataclass(frozen=True)
class Survey:
    """The answers of one round. ``None``: asked, no answer within the deadline (the process may
    be alive and slow); absent: nothing to ask (no such process, or Ray says it is gone)."""

    shards: Mapping[int, ShardFacts | None]  # the serving shards asked, by shard id
    mirrors: Mapping[int, ShardFacts | None]  # the mirrors asked, by the shard the books say they mirror
    trainers: Mapping[int, TrainerFacts | None]  # the registered trainers asked, by rank


@dataclass(frozen=True)
class BooksView:
    """What the supervisor's books say, for the answers to confirm or correct."""

    generations: tuple[int, ...]  # the generation serving each shard
    first_steps: tuple[int | None, ...]  # the first step each serving generation's rows hold updates from
    committed_steps: int  # steps the trainers' commit reports say are committed
    mirrors: Mapping[int, str]  # shard -> the mirror the keeper made ready for it


@dataclass(frozen=True)
class Finding:
    """A place where the books and the processes disagreed, and which answer was taken."""

    kind: str  # "lag" (the books were behind) or "contradiction"
    subject: str  # "shard:1", "mirror:0", "trainer:1", "commits"
    detail: str


@dataclass(frozen=True)
class ShardLossDecision:
    """What the answers allow for the death of ``shard``: whether its mirror takes its place
    (and why, or why not), how many steps are confirmed committed (the steps a promoted
    mirror must hold), each serving shard's first step as confirmed, and the findings."""

    shard: int
    promote_mirror: bool
    mirror_reason: str
    committed_steps: int
    first_steps: tuple[int | None, ...]
    findings: tuple[Finding, ...]


def confirmed_steps(survey: Survey, books: BooksView) -> int:
    """Steps confirmed committed: what any trainer's dense model holds, what any shard applied
    (a shard applies a step only once the trainers committed it) and what the commit reports
    say (each report is of a real commit). A replacement that has not healed holds only its
    checkpoint's steps: it confirms no more than that, which is never more than the truth."""
    trainers = [f.steps for f in survey.trainers.values() if f is not None]
    shards = [f.applied_steps for f in survey.shards.values() if f is not None]
    return max([books.committed_steps, *trainers, *shards])


def decide_shard_loss(shard: int, survey: Survey, books: BooksView) -> ShardLossDecision:
    """The death of ``shard``: may its mirror take its place, and what do the survivors'
    answers correct in the books."""
    findings: list[Finding] = []
    committed = confirmed_steps(survey, books)
    # Only a trainer that trained or healed holds the run's steps (a replacement at its
    # checkpoint holds fewer); a shard that applied a step since it was created or loaded has
    # applied every committed step but the last. One loaded from a checkpoint that applied
    # nothing since (every trainer died before the next step) holds the checkpoint's steps,
    # and a promoted mirror that applied nothing since says no first step: neither bounds.
    held = [f.steps for f in survey.trainers.values() if f is not None and f.established]
    held += [f.applied_steps + 1 for f in survey.shards.values() if f is not None and f.first_step is not None]
    if held and books.committed_steps > max(held):
        findings.append(Finding("contradiction", "commits", f"the commit reports say {books.committed_steps} steps are "
                                f"committed, the trainers and shards hold at most {max(held)}"))
    elif committed > books.committed_steps:
        findings.append(Finding("lag", "commits", f"the commit reports say {books.committed_steps} steps are committed, "
                                f"the processes confirm {committed}"))
    firsts = list(books.first_steps)
    for k, answer in sorted(survey.shards.items()):
        if k == shard or answer is None:
            continue
        findings += _check_survivor(k, answer, books)
        if answer.first_step is not None:
            firsts[k] = answer.first_step
    promote, why = _mirror_verdict(shard, survey, books, committed, findings)
    return ShardLossDecision(shard, promote, why, committed, tuple(firsts), tuple(findings))


def _check_survivor(k: int, answer: ShardFacts, books: BooksView) -> list[Finding]:
    out = []
    if answer.shard_id != k or answer.generation != books.generations[k]:
        out.append(Finding("contradiction", f"shard:{k}", f"the books say generation {books.generations[k]} serves "
                           f"shard {k}; the process answering says shard {answer.shard_id} generation "
                           f"{answer.generation}"))
    book = books.first_steps[k]
    if answer.first_step is not None and book != answer.first_step:
        kind = "lag" if book is None else "contradiction"
        out.append(Finding(kind, f"shard:{k}", f"the books say generation {answer.generation}'s first step is {book}, "
                           f"it says {answer.first_step}"))
    return out


def _mirror_verdict(shard: int, survey: Survey, books: BooksView, committed: int,
                    findings: list[Finding]) -> tuple[bool, str]:
    """The mirror the books name takes the place only on its own confirmation."""
    name = books.mirrors.get(shard)
    if name is None:
        return False, f"shard {shard} has no mirror in sync (none was ready)"
    if shard not in survey.mirrors:
        # Its death may simply not have reached the books yet (it died a moment before).
        findings.append(Finding("lag", f"mirror:{shard}", f"the books name {name} as shard {shard}'s mirror; "
                                "its process is gone"))
        return False, f"its mirror {name} is gone"
    answer = survey.mirrors[shard]
    if answer is None:
        return False, f"its mirror {name} did not answer in time"
    if answer.mirror_of != shard or not answer.in_sync:
        # Out of sync: its primary kills it, and the books hear of it a moment later (a lag);
        # a mirror of another shard under this one's name is a contradiction.
        kind = "contradiction" if answer.mirror_of != shard else "lag"
        findings.append(Finding(kind, f"mirror:{shard}", f"the books say {name} mirrors shard {shard} in sync; it "
                                f"says mirror_of={answer.mirror_of}, in sync={answer.in_sync}"))
        return False, f"its mirror {name} is not in sync (mirror of {answer.mirror_of}, in sync {answer.in_sync})"
    if answer.held_steps < committed:
        return False, (f"its mirror {name} holds {answer.held_steps} steps, but {committed} are confirmed committed: "
                       "it missed a step")
    return True, f"its mirror {name} confirms it holds {answer.held_steps} steps ({committed} committed)"


def decide_replacement(step: int, rank: int, trainers: Mapping[int, TrainerFacts | None]) -> ReplacementAtCheckpoint:
    """A replacement trainer found nobody ahead in its quorum, at checkpoint ``step``. Its
    live peers say where they are: one that trained or healed since it started, with its
    steps; one that did not answer in time may be ahead (the replacement waits for it); a
    replacement still at its checkpoint holds nothing newer (``machine.replacement_at_checkpoint``)."""
    # replacement_at_checkpoint takes the last step each committed: steps - 1.
    live = {r: (None if f is None else f.steps - 1) for r, f in trainers.items()
            if r != rank and (f is None or f.established)}
    return replacement_at_checkpoint(step, live)
