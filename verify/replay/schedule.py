"""The run's step schedule, recomputed by the checker: which stored microbatch is position
``m`` of step ``s``, and which positions a trainer of a quorum of ``live`` runs.

Epoch ``e`` orders the store's ``N`` microbatches by ``default_rng([seed, e]).permutation(N)``
and cuts that order into ``N // M`` steps of ``M`` consecutive positions (a remainder of fewer
than ``M`` microbatches is not trained on in that epoch). A step's microbatches are the same
whoever is alive; trainer ``r`` of ``live`` runs positions ``r, r + live, r + 2 live, ...``.
The run lasts ``max(1, floor(epochs * (N // M)))`` steps, at most ``max_steps``.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import numpy as np

__all__ = ["Schedule"]

# The defaults of the run config (core/config.py: TrainingConfig.microbatches_per_step, .epochs,
# .max_steps, RunConfig.seed). A run's config.yaml is the whole validated config, every key
# written; these serve only a config written by hand without them.
DEFAULT_MICROBATCHES_PER_STEP = 4
DEFAULT_EPOCHS = 1.0
DEFAULT_MAX_STEPS = None
DEFAULT_SEED = 0


@functools.lru_cache(maxsize=2)
def _epoch_order(seed: int, epoch: int, n: int) -> np.ndarray:
    """Store microbatch indices in the order epoch ``epoch`` visits them (read-only). Two are
    kept: a walk over consecutive steps crosses one epoch's end at a time, and an order is 8
    bytes a microbatch (70 MB for the 8.8 M microbatches of Criteo 1TB at 512 rows)."""
    order = np.random.default_rng([seed, epoch]).permutation(n)
    order.flags.writeable = False
    return order


@dataclass(frozen=True)
class Schedule:
    """The schedule of a run over a store of ``num_microbatches`` microbatches."""

    num_microbatches: int
    microbatches_per_step: int
    total_steps: int
    seed: int

    @classmethod
    def of(cls, num_microbatches: int, microbatches_per_step: int, epochs: float, max_steps: int | None,
           seed: int) -> Schedule:
        """The schedule of ``epochs`` passes (a fraction allowed) over the store, cut at
        ``max_steps`` (None: no cut)."""
        if microbatches_per_step < 1:
            raise ValueError(f"microbatches_per_step={microbatches_per_step}: a step needs at least one microbatch")
        steps_per_epoch = num_microbatches // microbatches_per_step
        if steps_per_epoch == 0:
            raise ValueError(f"the store holds {num_microbatches} microbatches, not one step's "
                             f"{microbatches_per_step}")
        total = max(1, math.floor(epochs * steps_per_epoch))
        if max_steps is not None and max_steps < total:
            total = max_steps
        return cls(num_microbatches, microbatches_per_step, total, seed)

    @classmethod
    def for_run(cls, config: dict, num_microbatches: int) -> Schedule:
        """The schedule of the run whose config (the plain dict of its ``config.yaml``) this is,
        over its training store of ``num_microbatches`` microbatches. A key the config lacks
        takes the product's default (see ``DEFAULT_*`` above)."""
        training = config.get("training") or {}
        m = training.get("microbatches_per_step", DEFAULT_MICROBATCHES_PER_STEP)
        epochs = training.get("epochs", DEFAULT_EPOCHS)
        max_steps = training.get("max_steps", DEFAULT_MAX_STEPS)
        seed = config.get("seed", DEFAULT_SEED)
        return cls.of(num_microbatches, int(m), float(epochs), None if max_steps is None else int(max_steps), int(seed))

    @property
    def steps_per_epoch(self) -> int:
        return self.num_microbatches // self.microbatches_per_step

    def _step_slots(self, step: int) -> tuple[np.ndarray, int]:
        epoch, index = divmod(step, self.steps_per_epoch)
        first = index * self.microbatches_per_step
        return _epoch_order(self.seed, epoch, self.num_microbatches), first

    def microbatches(self, step: int) -> list[int]:
        """The store microbatch indices of ``step``, positions ``0 .. M-1`` in order."""
        order, first = self._step_slots(step)
        return [int(i) for i in order[first:first + self.microbatches_per_step]]

    def microbatch(self, step: int, m: int) -> int:
        """The store microbatch index at position ``m`` of ``step``."""
        if not 0 <= m < self.microbatches_per_step:
            raise IndexError(f"position {m} of a step of {self.microbatches_per_step} microbatches")
        order, first = self._step_slots(step)
        return int(order[first + m])

    def positions_of(self, rank: int, live: int) -> list[int]:
        """The positions of a step that trainer ``rank`` of a quorum of ``live`` runs: every
        ``live``-th from ``rank`` (none for a rank outside the quorum)."""
        if live < 1:
            raise ValueError(f"a quorum of {live} trainers")
        if not 0 <= rank < live:
            return []
        return list(range(rank, self.microbatches_per_step, live))

    def assignment(self, step: int, rank: int, live: int) -> list[int]:
        """``positions_of(rank, live)``: the same for every step (``step`` is for callers that
        name it)."""
        return self.positions_of(rank, live)
