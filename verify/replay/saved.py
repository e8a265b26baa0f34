"""What a checkpoint holds, read with pyarrow and torch alone: a shard file's rows (one
Arrow IPC file of columns ``table``, ``row``, ``weights`` (D floats), ``momentum``) and the
dense file (``torch.save`` of ``{"model": state_dict, "optim": Adagrad state_dict}``)."""

from __future__ import annotations

import io
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import torch

from verify.store import Store

__all__ = ["SavedRows", "saved_rows", "saved_dense"]


@dataclass
class SavedRows:
    tables: np.ndarray  # int64 [n]
    rows: np.ndarray  # int64 [n]
    weights: np.ndarray  # float32 [n, D]
    momentum: np.ndarray  # float32 [n]


def saved_rows(store: Store, step: int, shard: int, directory: str | None = None) -> SavedRows:
    """Shard ``shard``'s rows in checkpoint ``step`` (read from ``directory`` where given: a
    fenced copy)."""
    with store.fs.open_input_file(f"{directory or store._path(step)}/shard-{shard}.arrow") as f:
        reader = pa.ipc.open_file(f)
        batches = [reader.get_batch(i) for i in range(reader.num_record_batches)]
    if not batches:
        return SavedRows(np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros((0, 0), np.float32),
                         np.zeros(0, np.float32))

    def column(name: str) -> np.ndarray:
        return np.concatenate([b.column(name).to_numpy(zero_copy_only=False) for b in batches])

    weights = np.concatenate([np.asarray(b.column("weights").flatten().to_numpy(zero_copy_only=False))
                              .reshape(b.num_rows, -1) for b in batches])
    return SavedRows(column("table").astype(np.int64), column("row").astype(np.int64),
                     weights.astype(np.float32, copy=False), column("momentum").astype(np.float32, copy=False))


def saved_dense(store: Store, step: int, directory: str | None = None
                ) -> tuple[list[torch.Tensor], list[torch.Tensor], list[float]]:
    """(parameters, Adagrad sums, Adagrad step counts), each in the model's parameter order."""
    with store.fs.open_input_stream(f"{directory or store._path(step)}/dense.pt") as f:
        blob = torch.load(io.BytesIO(f.read()), weights_only=True)
    params = list(blob["model"].values())
    group = blob["optim"]["param_groups"][0]
    sums, steps = [], []
    for key in group["params"]:
        st = blob["optim"]["state"].get(key)
        sums.append(st["sum"] if st is not None else None)
        steps.append(float(st["step"]) if st is not None else 0.0)
    return params, sums, steps
