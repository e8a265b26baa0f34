"""One round of questions to the run's live processes, with one deadline: every serving shard
and mirror (``EmbeddingShard.facts``) and every trainer (``actors.trainer.facts.trainer_facts``,
run on its Ray Train worker actor) says where it stands. A recovery decides from these answers
(``facts.py``), not from the books the supervisor keeps from background reports."""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping

import ray

from actors.supervisor.facts import Survey
from actors.trainer.facts import trainer_facts

__all__ = ["Surveyor"]

logger = logging.getLogger(__name__)


class Surveyor:
    """``shards()``: shard -> handle of the actor serving it (those being replaced left out);
    ``mirrors()``: shard -> handle of its mirror (None: the named actor is gone); ``trainers()``:
    rank -> its worker actor (None: not known). ``deadline_s`` bounds the whole round."""

    def __init__(self, shards: Callable[[], Mapping[int, object]], mirrors: Callable[[], Mapping[int, object]],
                 trainers: Callable[[], Mapping[int, object]], deadline_s: float, wait=ray.wait, get=ray.get):
        self._shards, self._mirrors, self._trainers = shards, mirrors, trainers
        self.deadline_s = deadline_s
        self._wait, self._get = wait, get

    def ask(self, skip: set | frozenset = frozenset(), trainers_only: bool = False) -> Survey:
        """Every question at once (shards in ``skip`` are not asked: dead, or being replaced);
        answers that do not come within the deadline are None, and processes that Ray says are
        gone are left out."""
        questions: dict[tuple[str, int], object] = {}
        gone: set[tuple[str, int]] = set()
        if not trainers_only:
            for k, handle in self._shards().items():
                if k not in skip and handle is not None:
                    questions[("shard", k)] = handle.facts.remote()
            for k, handle in self._mirrors().items():
                if handle is None:
                    gone.add(("mirror", k))
                else:
                    questions[("mirror", k)] = handle.facts.remote()
        unknown: set[int] = set()
        for rank, worker in self._trainers().items():
            if worker is None:
                unknown.add(rank)
            else:
                questions[("trainer", rank)] = worker.execute.remote(trainer_facts)
        refs = list(questions.values())
        ready, _ = self._wait(refs, num_returns=len(refs), timeout=self.deadline_s) if refs else ([], [])
        answers = {key: self._answer(key, ref, set(ready)) for key, ref in questions.items()}
        out: dict[str, dict] = {"shard": {}, "mirror": {}, "trainer": {r: None for r in unknown}}
        for (kind, k), (alive, value) in answers.items():
            if alive and not (kind == "trainer" and value is False):
                out[kind][k] = value
        return Survey(shards=out["shard"], mirrors=out["mirror"], trainers=out["trainer"])

    def _answer(self, key: tuple[str, int], ref, ready: set) -> tuple[bool, object]:
        """(still alive, its answer): (True, None) for no answer in time, (False, None) for a
        process Ray says is gone; a worker that runs no trainer answers (True, False)."""
        if ref not in ready:
            logger.warning("%s:%d did not answer the recovery's questions within %.2fs", *key, self.deadline_s)
            return True, None
        try:
            value = self._get(ref, timeout=0)
        except ray.exceptions.RayActorError:
            return False, None
        except ray.exceptions.RayError as err:
            logger.warning("%s:%d could not answer the recovery's questions: %s", *key, type(err).__name__)
            return True, None
        return True, (False if value is None and key[0] == "trainer" else value)
