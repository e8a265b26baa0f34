"""The embedding tables as the checker computes them: every table whole, in one fbgemm
table-batched kernel with exact row-wise Adagrad (one momentum float per row), on the CPU.

A step's update is one backward of the kernel over all M microbatches of the step, their
rows in microbatch-id order: the kernel sums a row's gradients in batch order, so this is
the order that gives a shard's bits whichever trainers computed which microbatch. A
shard of the run holds slices of these tables (``[table, row_start, row_end)``, from its
audit log's "open" line); ``rows_of`` and ``put`` read and write the rows of a slice."""

from __future__ import annotations

import hashlib

import numpy as np
import torch

__all__ = ["Tables", "initial_rows", "dense_digest"]


def initial_rows(seed: int, table: int, start: int, end: int, dim: int) -> torch.Tensor:
    """Rows ``start..end`` of ``table`` before training: DLRM's uniform(+-sqrt(1/n)), drawn per
    slice from a generator seeded by (seed, table, start), with n = the slice's end (the run's
    documented initialization; a slice gets the same rows whichever shard holds it)."""
    gen = torch.Generator().manual_seed(seed * 1_000_003 + table * 7919 + start)
    bound = float(np.sqrt(1.0 / max(end, 1)))
    return torch.empty((end - start, dim)).uniform_(-bound, bound, generator=gen)


class Tables:
    def __init__(self, rows: list[int], dim: int, lr: float, eps: float):
        # import cost: fbgemm_gpu 1.9 s (2-core, cold); only the replay loads it.
        from fbgemm_gpu.split_embedding_configs import EmbOptimType
        from fbgemm_gpu.split_table_batched_embeddings_ops_common import EmbeddingLocation
        from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
            ComputeDevice, SplitTableBatchedEmbeddingBagsCodegen)

        self.rows, self.dim = list(rows), dim
        self.kernel = SplitTableBatchedEmbeddingBagsCodegen(
            embedding_specs=[(n, dim, EmbeddingLocation.HOST, ComputeDevice.CPU) for n in self.rows],
            optimizer=EmbOptimType.EXACT_ROWWISE_ADAGRAD, learning_rate=lr, eps=eps, device=torch.device("cpu"))
        self.weights = [w for w in self.kernel.split_embedding_weights()]
        self.momentum = [s[0] for s in self.kernel.split_optimizer_states()]

    def initialize(self, seed: int, table: int, start: int, end: int) -> None:
        with torch.no_grad():
            self.weights[table][start:end].copy_(initial_rows(seed, table, start, end, self.dim))
            self.momentum[table][start:end].zero_()

    def lookup(self, ids: np.ndarray) -> torch.Tensor:
        """The pooled embeddings [B, F, D] of one id per feature (``ids`` int64 [B, F])."""
        with torch.no_grad():
            return self._forward(ids).reshape(len(ids), len(self.rows), self.dim)

    def step(self, ids: np.ndarray, grad: np.ndarray) -> None:
        """Applies one step: ``ids`` int64 [B, F] and the gradient of the pooled embeddings
        [B, F, D], rows in microbatch-id order."""
        pooled = self._forward(ids)
        pooled.backward(torch.from_numpy(np.ascontiguousarray(grad.reshape(len(ids), -1))))

    def _forward(self, ids: np.ndarray) -> torch.Tensor:
        batch, features = ids.shape
        indices = torch.from_numpy(np.ascontiguousarray(ids.T).reshape(-1))  # table-major, one id a bag
        offsets = torch.arange(batch * features + 1, dtype=torch.int64)
        return self.kernel(indices, offsets)

    def rows_of(self, table: int, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(weights [n, D], momentum [n]) of these rows of ``table``, copied."""
        return self.weights[table][rows].numpy().copy(), self.momentum[table][rows].numpy().copy()

    def put(self, table: int, rows: np.ndarray, weights: np.ndarray, momentum: np.ndarray) -> None:
        with torch.no_grad():
            index = torch.from_numpy(np.ascontiguousarray(rows, dtype=np.int64))
            self.weights[table][index] = torch.from_numpy(np.ascontiguousarray(weights, dtype=np.float32))
            self.momentum[table][index] = torch.from_numpy(np.ascontiguousarray(momentum, dtype=np.float32))

    def snapshot(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return [(w.clone(), m.clone()) for w, m in zip(self.weights, self.momentum)]

    def digest(self, slices: list[tuple[int, int, int]], ids: np.ndarray) -> str:
        """What a shard holding ``slices`` records of a step whose ids were ``ids`` [B, F] (its
        audit "apply" line's ``rows``): blake2b (8 bytes, hex) over, slice by slice in table
        order, the step's rows of the slice in row order, each as its D float32 weights then
        its float32 momentum."""
        h = hashlib.blake2b(digest_size=8)
        for table, start, end in sorted(slices):
            col = ids[:, table]
            rows = np.unique(col[(col >= start) & (col < end)])
            w, m = self.rows_of(table, rows)
            h.update(np.ascontiguousarray(np.concatenate([w, m[:, None]], axis=1), dtype="<f4").tobytes())
        return h.hexdigest()


def dense_digest(params: list[torch.Tensor], sums: list[torch.Tensor]) -> str:
    """What a trainer's audited commit records of its dense state (``dense``): blake2b (8 bytes,
    hex) over every parameter's float32 values in order, then every Adagrad sum's."""
    h = hashlib.blake2b(digest_size=8)
    for t in [*params, *sums]:
        h.update(np.ascontiguousarray(t.detach().float().numpy(), dtype="<f4").tobytes())
    return h.hexdigest()
