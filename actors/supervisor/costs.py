"""The run's online cost model (``policies.OnlineCostModel``: MTBF, save, load and reschedule
estimates) as a part of the supervisor. The recovery controller and the checkpoint coordinator
observe it from different threads, so every call is serialized here, and observed times are
clamped to the model's clock (it refuses a time earlier than the latest it saw)."""

from __future__ import annotations

import threading

from policies import CostInputs, OnlineCostModel

__all__ = ["SharedCosts"]


class SharedCosts:
    def __init__(self, model: OnlineCostModel):
        self._model = model
        self._lock = threading.Lock()

    def observe_failure(self, t_s: float) -> None:
        with self._lock:
            self._model.observe_failure(max(t_s, self._model.clock_s))

    def observe_time(self, t_s: float) -> None:
        with self._lock:
            self._model.observe_time(max(t_s, self._model.clock_s))

    def observe_save(self, duration_s: float) -> None:
        with self._lock:
            self._model.observe_save(duration_s)

    def observe_load(self, duration_s: float) -> None:
        with self._lock:
            self._model.observe_load(duration_s)

    def observe_reschedule(self, duration_s: float) -> None:
        with self._lock:
            self._model.observe_reschedule(duration_s)

    def inputs(self, num_shards: int, pls_target: float) -> CostInputs:
        with self._lock:
            return self._model.inputs(num_shards, pls_target)

    def mtbf_s(self) -> float:
        with self._lock:
            return self._model.mtbf_s

    def doc(self) -> dict:
        with self._lock:
            return self._model.state()

    def restore(self, state: dict) -> None:
        with self._lock:
            self._model.restore(state)
