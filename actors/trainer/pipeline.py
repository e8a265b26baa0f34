"""A trainer's data pipeline and timers: the next step's microbatches read and routed on a
background thread while this step computes, and the wall time of each phase of a step."""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from core.store import MicrobatchStore
from core.plan import ShardingPlan
from core.records import PhaseTimes
from core.schedule import StepSchedule

__all__ = ["Prefetcher", "PhaseTimer", "microbatch_loader"]


def microbatch_loader(train_file: MicrobatchStore, schedule: StepSchedule, plan: ShardingPlan):
    """What the prefetcher runs: a step's microbatches (labels, dense features, embedding rows,
    mapped when the store was built) and those rows split per shard."""

    def load(step: int, mine: list[int]):
        parts = [train_file.get(schedule.microbatch(step, m)) for m in mine]
        rows = np.concatenate([p[2] for p in parts]).astype(np.int64)
        routed = [plan.route(rows, k) for k in range(plan.num_shards)]
        return np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts]), rows, routed

    return load


class Prefetcher:
    """``get`` returns the microbatches loaded ahead if the guess (step and microbatches) was
    right, and loads them on the spot otherwise (a failed step, a new quorum)."""

    def __init__(self, load: Callable):
        self._load = load
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="cpr-prefetch")
        self._key = None
        self._future = None

    def ahead(self, step: int, mine: list[int]) -> None:
        if mine:
            self._key, self._future = (step, tuple(mine)), self._pool.submit(self._load, step, mine)

    def get(self, step: int, mine: list[int]):
        key, future = self._key, self._future
        self._key = self._future = None
        if key == (step, tuple(mine)):
            return future.result()
        if future is not None and not future.cancel():
            future.exception()  # a wrong guess still loading: one reader of the file at a time
        return self._load(step, mine)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


class PhaseTimer:
    """Wall time per phase of a step, summed between progress reports."""

    PHASES = ("quorum", "data", "lookup", "dense", "push", "allreduce", "commit", "checkpoint")

    def __init__(self):
        self.totals = dict.fromkeys(self.PHASES, 0.0)
        self._t = time.perf_counter()

    def start(self) -> None:
        self._t = time.perf_counter()

    def lap(self, phase: str) -> None:
        now = time.perf_counter()
        self.totals[phase] += now - self._t
        self._t = now

    def take(self) -> PhaseTimes:
        out = PhaseTimes(**{k: round(v, 4) for k, v in self.totals.items()})
        self.totals = dict.fromkeys(self.PHASES, 0.0)
        return out
