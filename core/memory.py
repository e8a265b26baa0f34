"""What a run's model costs in memory: each embedding shard's rows, their row-wise Adagrad
state and the copy a full checkpoint save makes of them, and the trainers' dense part.
Used to size a config to a machine before it runs (configs/criteo_kaggle.yaml).
"""

from __future__ import annotations

from dataclasses import dataclass

from core.config import RunConfig
from core.data import NUM_DENSE, NUM_SPARSE
from core.plan import make_plan

__all__ = ["ShardMemory", "MemoryEstimate", "memory_estimate", "memory_shortfall", "dense_parameters"]

_FLOAT_BYTES = 4
# fbgemm's EXACT_ROWWISE_ADAGRAD keeps one float32 per row (its momentum), not one per weight.
_ROWWISE_STATE_BYTES = _FLOAT_BYTES
# A full save (EmbeddingShard.save_checkpoint) builds ShardRows: a copy of every weight and
# momentum plus an int64 row id and an int32 table id per row ...
_SAVED_ROW_OVERHEAD_BYTES = _ROWWISE_STATE_BYTES + 8 + 4
# ... from int64 scratch held until the file is written: the selected shard rows, their slice
# index, their local and their global row ids, and the int32 table ids before concatenation.
_SAVE_SCRATCH_BYTES = 8 + 8 + 8 + 8 + 4
# torch.optim.Adagrad on the dense part: a gradient and a state sum the size of every parameter.
_DENSE_COPIES = 3


@dataclass(frozen=True)
class ShardMemory:
    """One embedding shard: ``rows`` of ``embedding_dim`` floats."""

    shard: int
    rows: int
    weights_bytes: int  # rows x D x 4
    optimizer_bytes: int  # rows x 4 (row-wise Adagrad)
    checkpoint_copy_bytes: int  # held while a full save of this shard is written
    mirror_bytes: int = 0  # its mirror's rows and Adagrad state (recovery: replica), in another process

    @property
    def total_bytes(self) -> int:
        return self.weights_bytes + self.optimizer_bytes + self.checkpoint_copy_bytes + self.mirror_bytes


@dataclass(frozen=True)
class MemoryEstimate:
    """Peak bytes of the model state of a run, as its config sizes it (not the processes'
    own overhead: Python, torch, Ray). Every shard saves at the same step, so the checkpoint
    copies count together."""

    embedding_dim: int
    table_rows: tuple[int, ...]
    shards: tuple[ShardMemory, ...]
    dense_params: int
    num_trainers: int

    @property
    def embedding_rows(self) -> int:
        return sum(self.table_rows)

    @property
    def weights_bytes(self) -> int:
        return sum(s.weights_bytes for s in self.shards)

    @property
    def optimizer_bytes(self) -> int:
        return sum(s.optimizer_bytes for s in self.shards)

    @property
    def checkpoint_copy_bytes(self) -> int:
        return sum(s.checkpoint_copy_bytes for s in self.shards)

    @property
    def mirror_bytes(self) -> int:
        return sum(s.mirror_bytes for s in self.shards)

    @property
    def dense_bytes(self) -> int:
        """Parameters, gradients and Adagrad state of the dense arches, in every trainer."""
        return self.dense_params * _FLOAT_BYTES * _DENSE_COPIES * self.num_trainers

    @property
    def total_bytes(self) -> int:
        return self.weights_bytes + self.optimizer_bytes + self.checkpoint_copy_bytes + self.mirror_bytes + self.dense_bytes

    def describe(self) -> str:
        gib = 1 << 30
        lines = [
            f"{len(self.table_rows)} tables, {self.embedding_rows:,} rows of D={self.embedding_dim}: "
            f"weights {self.weights_bytes / gib:.2f} GiB, row-wise Adagrad {self.optimizer_bytes / gib:.2f} GiB, "
            f"checkpoint copy {self.checkpoint_copy_bytes / gib:.2f} GiB"
            + (f", mirrors {self.mirror_bytes / gib:.2f} GiB" if self.mirror_bytes else ""),
            f"dense: {self.dense_params:,} parameters x {self.num_trainers} trainer(s): "
            f"{self.dense_bytes / gib:.3f} GiB",
        ]
        lines += [
            f"shard {s.shard}: {s.rows:,} rows, {s.total_bytes / gib:.2f} GiB at a save" for s in self.shards
        ]
        lines.append(f"total {self.total_bytes / gib:.2f} GiB")
        return "\n".join(lines)


def dense_parameters(num_dense: int, num_sparse: int, dense_arch: list[int], over_arch: list[int]) -> int:
    """Weights and biases of DLRM's DenseArch (``num_dense`` -> dense_arch) and OverArch
    (D + F(F+1)/2 interaction features -> over_arch), as core.model builds them."""
    dim = dense_arch[-1]
    params = 0
    for width_in, width_out in zip([num_dense, *dense_arch], dense_arch):
        params += width_in * width_out + width_out
    over_in = dim + num_sparse * (num_sparse + 1) // 2
    for width_in, width_out in zip([over_in, *over_arch], over_arch):
        params += width_in * width_out + width_out
    return params


def memory_estimate(cfg: RunConfig, mirrors: bool | None = None) -> MemoryEstimate:
    """The peak memory of ``cfg``'s model state, shard by shard as its sharding plan splits the
    tables; with ``mirrors`` (default: ``recovery: replica``) every shard's rows and Adagrad state
    once more, in its mirror."""
    mirrors = cfg.recovery == "replica" if mirrors is None else mirrors
    dim = cfg.model.embedding_dim
    table_rows = cfg.model.rows_per_table
    plan = make_plan(cfg.embeddings.sharding, table_rows, cfg.embeddings.num_shards)
    shards = []
    for k in range(plan.num_shards):
        rows = plan.shard_rows(k)
        weights = rows * dim * _FLOAT_BYTES
        shards.append(
            ShardMemory(
                shard=k,
                rows=rows,
                weights_bytes=weights,
                optimizer_bytes=rows * _ROWWISE_STATE_BYTES,
                checkpoint_copy_bytes=weights + rows * (_SAVED_ROW_OVERHEAD_BYTES + _SAVE_SCRATCH_BYTES),
                mirror_bytes=weights + rows * _ROWWISE_STATE_BYTES if mirrors else 0,
            )
        )
    return MemoryEstimate(
        embedding_dim=dim,
        table_rows=tuple(table_rows),
        shards=tuple(shards),
        dense_params=dense_parameters(NUM_DENSE, NUM_SPARSE, cfg.model.dense_arch, cfg.model.over_arch),
        num_trainers=cfg.training.num_trainers,
    )


def memory_shortfall(estimate: MemoryEstimate, node_memory: list[float]) -> str | None:
    """Why a cluster whose nodes give Ray ``node_memory`` bytes each cannot hold the model as
    ``estimate`` sizes it (its largest shard on the largest node, everything on all of them), or
    None. A resume on fewer shards makes each shard larger: this says so before anything is
    placed, rather than a shard killed for memory once it loads."""
    gib = 1 << 30
    largest = max(estimate.shards, key=lambda s: s.total_bytes - s.mirror_bytes)
    shard_bytes = largest.total_bytes - largest.mirror_bytes  # its mirror lives in another process
    roomiest, have = max(node_memory, default=0.0), sum(node_memory)
    if shard_bytes <= roomiest and estimate.total_bytes <= have:
        return None
    return (f"the cluster's memory is too small for this config: shard {largest.shard} holds "
            f"{shard_bytes / gib:.2f} GiB at a save and the largest node gives Ray {roomiest / gib:.2f} GiB; "
            f"the model needs {estimate.total_bytes / gib:.2f} GiB in all and the cluster gives {have / gib:.2f} GiB. "
            "Raise embeddings.num_shards, lower model.table_rows or model.embedding_dim, or give Ray more "
            "memory (more nodes, ray start --memory)")
