"""The step schedule: which cached microbatch is microbatch ``m`` of step ``s``.

Microbatch ids are stable across failures: a step always consumes the same M microbatches,
whichever trainers are alive, and the live trainers split them by position (ReCoVer).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

__all__ = ["StepSchedule"]


@dataclass(frozen=True)
class StepSchedule:
    """Which cached microbatch is microbatch ``m`` of step ``s``: a per-epoch permutation."""

    num_microbatches: int
    microbatches_per_step: int
    total_steps: int
    seed: int

    @property
    def steps_per_epoch(self) -> int:
        return self.num_microbatches // self.microbatches_per_step

    @classmethod
    def from_config(cls, num_microbatches: int, m: int, epochs: float, max_steps: int | None, seed: int):
        per_epoch = num_microbatches // m
        if per_epoch < 1:
            raise ValueError(
                f"the training data holds {num_microbatches} microbatches, fewer than "
                f"microbatches_per_step={m}: lower training.microbatch_rows or add data"
            )
        total = max(1, math.floor(epochs * per_epoch))
        if max_steps is not None:
            total = min(total, max_steps)
        return cls(num_microbatches, m, total, seed)

    def microbatch(self, step: int, m: int) -> int:
        epoch, pos = divmod(step, self.steps_per_epoch)
        perm = np.random.default_rng([self.seed, epoch]).permutation(self.num_microbatches)
        return int(perm[pos * self.microbatches_per_step + m])

    def assignment(self, step: int, rank: int, live: int) -> list[int]:
        """Microbatch positions 0..M-1 of ``step`` that participant ``rank`` of ``live`` runs."""
        return [m for m in range(self.microbatches_per_step) if m % live == rank]
