"""What a trainer process confirms when a recovery asks (``actors.supervisor.survey``): the
supervisor runs ``trainer_facts`` on the trainer's Ray Train worker actor, whose main thread
answers while the training thread steps. The trainer loop says who is answering."""

from __future__ import annotations

import os
import threading

from core.records import TrainerFacts

__all__ = ["answer_for", "trainer_facts"]

_lock = threading.Lock()
_trainer = None  # the process's actors.trainer.step.Trainer, once it exists


def answer_for(trainer) -> None:
    """``trainer`` (None: none) answers from now on."""
    global _trainer
    with _lock:
        _trainer = trainer


def trainer_facts() -> TrainerFacts | None:
    """Run on the worker: the steps its dense model holds and whether it trained or healed
    (None: this worker runs no trainer yet)."""
    with _lock:
        t = _trainer
    if t is None:
        return None
    # A replacement is established once it healed from a peer or took part in a step.
    return TrainerFacts(rank=t.rank, pid=os.getpid(), steps=int(t.manager.current_step()), established=not t.replacement)
