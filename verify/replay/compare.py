"""The replay's state against a checkpoint's: embedding rows and their Adagrad momentum, dense
parameters and their Adagrad sums. Equal bits pass; otherwise a difference passes only
within ``Tolerance`` (docs/CHAOS.md derives it), and the finding names the checkpoint, the
shard or tensor, how many values differ, the first row and the largest difference."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

__all__ = ["Tolerance", "rows_problems", "dense_problems"]


@dataclass(frozen=True)
class Tolerance:
    """|run - replay| <= atol + rtol * |replay|, per value. The default is exact: the run
    sums every gradient in an order the replay repeats, whatever the number of trainers
    (docs/CHAOS.md); a tolerance is for comparing a run of another build."""

    rtol: float = 0.0
    atol: float = 0.0


def _off(run: np.ndarray, replay: np.ndarray, tol: Tolerance) -> np.ndarray:
    """Where ``run`` parts from ``replay`` beyond the tolerance (per row: any of its values)."""
    diff = np.abs(run.astype(np.float64) - replay.astype(np.float64))
    bad = ~(diff <= tol.atol + tol.rtol * np.abs(replay.astype(np.float64)))  # NaN is bad
    return bad.reshape(len(bad), -1).any(axis=1) if bad.ndim > 1 else bad


def rows_problems(step: int, shard: int, saved, tables, tol: Tolerance, seen) -> list[str]:
    """``seen.exact`` is set False where a value differs at all, within the tolerance or not."""
    out = []
    for table in np.unique(saved.tables):
        at = saved.tables == table
        rows = saved.rows[at]
        if rows.size and (rows.min() < 0 or rows.max() >= tables.rows[int(table)]):
            out.append(f"checkpoint {step} shard {shard} table {table}: rows outside the table")
            continue
        weights, momentum = tables.rows_of(int(table), rows)
        w_run, m_run = saved.weights[at], saved.momentum[at]
        if w_run.shape != weights.shape:
            out.append(f"checkpoint {step} shard {shard} table {table}: rows of {w_run.shape[1]} floats, "
                       f"the model's have {weights.shape[1]}")
            continue
        if np.array_equal(w_run, weights) and np.array_equal(m_run, momentum):
            continue
        seen.exact = False
        bad = _off(w_run, weights, tol) | _off(m_run, momentum, tol)
        if bad.any():
            first = int(np.flatnonzero(bad)[0])
            out.append(
                f"checkpoint {step} shard {shard} table {int(table)}: {int(bad.sum())} of {len(rows)} saved rows "
                f"differ from the replay, first row {int(rows[first])} (max |weight diff| "
                f"{float(np.abs(w_run[bad] - weights[bad]).max()):.3g}, max |momentum diff| "
                f"{float(np.abs(m_run[bad] - momentum[bad]).max()):.3g})")
    return out


def dense_problems(step: int, model, optimizer, params, sums, steps, tol: Tolerance, seen) -> list[str]:
    mine = list(model.parameters())
    if len(params) != len(mine) or any(tuple(p.shape) != tuple(q.shape) for p, q in zip(params, mine)):
        return [f"checkpoint {step} dense: {len(params)} tensors of shapes {[tuple(p.shape) for p in params]}, "
                f"the model's are {[tuple(q.shape) for q in mine]}"]
    out = []
    for i, (p, q) in enumerate(zip(params, mine)):
        st = optimizer.state.get(q, {})
        s_mine = st.get("sum", torch.zeros_like(q))
        n_mine = float(st.get("step", torch.tensor(0.0)))
        for what, run, replay in (("parameter", p, q), ("Adagrad sum", sums[i], s_mine)):
            run = torch.zeros_like(q) if run is None else run
            a, b = run.detach().float().numpy(), replay.detach().float().numpy()
            if np.array_equal(a, b):
                continue
            seen.exact = False
            bad = _off(a.reshape(-1), b.reshape(-1), tol)
            if bad.any():
                out.append(f"checkpoint {step} dense tensor {i} {what}: {int(bad.sum())} of {bad.size} values differ "
                           f"from the replay (max |diff| {float(np.abs(a - b).max()):.3g})")
        if steps[i] != n_mine and not (steps[i] == 0 and n_mine == 0):
            out.append(f"checkpoint {step} dense tensor {i}: Adagrad counted {steps[i]:g} steps, the replay {n_mine:g}")
    return out
