"""How the preprocessing tasks run: ``RayDataEngine`` maps them over the cluster with Ray Data
(the product's path), ``LocalEngine`` runs them one after another in this process (the
one-process path the benchmark compares against, and unit tests without Ray).
"""

from __future__ import annotations

import base64
import functools
import json
import logging
import re
from collections.abc import Callable

import numpy as np

from core.data.criteo import NUM_SPARSE
from core import errors
from core.errors import CprError
from core.store import Vocabulary
from core.store.vocab import frequent_values

__all__ = ["LocalEngine", "RayDataEngine", "reported", "task_error"]


def _frequent_task(row: dict, count_files: list[str], min_count: int) -> dict:
    values = frequent_values(count_files, row["index"], min_count)
    return {"index": row["index"], "values": values.tobytes()}


def _vocabulary(results: list[dict]) -> Vocabulary:
    return Vocabulary([np.frombuffer(r["values"], dtype=np.uint32) for r in sorted(results, key=lambda r: r["index"])])


class LocalEngine:
    """Every task in this process, in order: data of one chunk (one task either way), the
    one-process comparison of ``benchmarks/data.py``, and unit tests without Ray."""

    name = "driver"

    def map(self, fn: Callable[[dict], dict], items: list[dict], what: str) -> list[dict]:
        return [fn(item) for item in items]

    def vocabulary(self, count_files: list[str], min_count: int, what: str) -> Vocabulary:
        task = functools.partial(_frequent_task, count_files=count_files, min_count=min_count)
        return _vocabulary(self.map(task, [{"index": f} for f in range(NUM_SPARSE)], what))


class RayDataEngine:
    """Each stage a Ray Data ``map`` over a dataset of task descriptions, one CPU per task,
    spread over the cluster (the vocabulary's counts too: one task per feature)."""

    name = "Ray Data"

    def __init__(self) -> None:
        import ray.data  # import cost: 0.6 s, only where data is preprocessed

        self._ray = ray
        ctx = ray.data.DataContext.get_current()
        ctx.enable_progress_bars = False
        ctx.print_on_execution_start = False
        # Ray Data reserves part of the cluster for each operator's outputs: on a small cluster that
        # leaves CPUs idle between tasks (12 tasks of 0.5 s on 2 CPUs: 4.4 s, without it 3.1 s).
        # Our tasks write their output to the store and return a few numbers.
        ctx.op_resource_reservation_enabled = False
        # Its console lines (a progress-bar notice, a task's error, which the driver raises
        # itself) stay out of the run's console; ray-data.log in the session keeps them.
        logging.getLogger("ray.data").setLevel(logging.CRITICAL)

    def map(self, fn: Callable[[dict], dict], items: list[dict], what: str) -> list[dict]:
        """``fn`` over ``items``, the results in the items' order. A task's own error (a
        malformed line...) is raised as it is."""
        ds = self._ray.data.from_items(items, override_num_blocks=max(1, len(items)))
        try:
            out = ds.map(reported(fn), num_cpus=1).take_all()
        except Exception as exc:  # noqa: BLE001 - unwrapped: a task's own error, or Ray Data's
            raise task_error(exc, what) from None
        return sorted(out, key=lambda s: s["index"])

    def vocabulary(self, count_files: list[str], min_count: int, what: str) -> Vocabulary:
        """One task per feature sums that feature's counts over every chunk's counts file."""
        task = functools.partial(_frequent_task, count_files=count_files, min_count=min_count)
        return _vocabulary(self.map(task, [{"index": f} for f in range(NUM_SPARSE)], what))


_MARK = re.compile(r"cpr-task-error<([A-Za-z0-9_=-]+)>")


def reported(fn: Callable[[dict], dict]) -> Callable[[dict], dict]:
    """``fn`` as a task whose CprError reaches the driver whole: Ray Data hands the driver its
    own exception, with the task's only as text, so the error travels in the message."""

    @functools.wraps(fn)
    def task(row: dict) -> dict:
        try:
            return fn(row)
        except CprError as err:
            doc = {"type": type(err).__name__, "args": [a if isinstance(a, (str, int, float)) else str(a) for a in err.args]}
            packed = base64.urlsafe_b64encode(json.dumps(doc).encode()).decode()
            raise RuntimeError(f"cpr-task-error<{packed}>") from None

    return task


def task_error(exc: BaseException, what: str) -> Exception:
    """The CprError a task raised (a DataFormatError names file and line), rebuilt from the
    message Ray Data passes on; anything else as a CprError with its reason."""
    found = _MARK.search(str(exc))
    if found:
        doc = json.loads(base64.urlsafe_b64decode(found.group(1)))
        cls = getattr(errors, doc["type"], None)
        if isinstance(cls, type) and issubclass(cls, CprError):
            try:
                return cls(*doc["args"])
            except TypeError:
                pass
        return CprError(*doc["args"])
    return CprError(f"preprocessing the {what} data failed: {type(exc).__name__}: {str(exc)[-2000:]}")
