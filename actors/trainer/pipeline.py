"""A trainer's data pipeline and timers: the next step's microbatches read and routed on a
background thread while this step computes, and the wall time of each phase of a step."""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor, wait

import numpy as np

from core.store import MicrobatchStore
from core.plan import ShardingPlan
from core.records import PhaseTimes
from core.schedule import StepSchedule

__all__ = ["Prefetcher", "PhaseTimer", "DataReadTimeout", "microbatch_loader"]


class DataReadTimeout(TimeoutError):
    """A step's microbatches were not read within the deadline (a store that hangs): this
    trainer's step fails and is redone; no shard is at fault."""


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
    right, and loads them otherwise (a failed step, a new quorum), within ``timeout_s``
    (``Deadlines.data_read_s``): a read that hangs fails the step before the peers' all-reduce
    gives up on this trainer. Every read runs on the one pool thread: one reader of the file
    at a time (a wrong guess still loading finishes first, inside the deadline)."""

    def __init__(self, load: Callable, timeout_s: float):
        self._load = load
        self.timeout_s = timeout_s
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="cpr-prefetch")
        self._key = None
        self._future = None

    def ahead(self, step: int, mine: list[int]) -> None:
        if mine:
            self._key, self._future = (step, tuple(mine)), self._pool.submit(self._load, step, mine)

    def get(self, step: int, mine: list[int]):
        """The microbatches ``mine`` of ``step``; raises ``DataReadTimeout`` after ``timeout_s``
        (the read goes on, or hangs, on the pool thread: the next read waits behind it)."""
        key, future = self._key, self._future
        self._key = self._future = None
        if key != (step, tuple(mine)):
            if future is not None:
                future.cancel()  # a wrong guess not started yet
            future = self._pool.submit(self._load, step, mine)
        if not wait([future], timeout=self.timeout_s).done:
            future.cancel()
            raise DataReadTimeout(f"step {step}: microbatches {list(mine)} not read within {self.timeout_s}s")
        return future.result()

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
