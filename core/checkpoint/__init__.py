"""Checkpoint files of sharded DLRM training on any ``pyarrow.fs`` storage URI.

Shard actors write their own Arrow IPC shard files; the coordinator commits a manifest
(sizes and checksums, written last) that makes a checkpoint exist, then applies retention.
"""

from core.checkpoint.files import (
    CHECKSUM_ALGO,
    DATA_POSITION_FILE,
    DENSE_FILE,
    FULL,
    INCREMENTAL,
    MANIFEST_FILE,
    CheckpointInfo,
    FileEntry,
    local_path,
    shard_file_name,
    step_dir_name,
    write_blob,
    write_shard_file,
)
from core.checkpoint.position import DataPosition, newest_position, other_data, read_position
from core.checkpoint.rows import ShardRows, merge_shard_rows, warm_up
from core.checkpoint.shard_restore import NO_CHECKPOINT_YET, ROLLBACK_TO_START, ShardRestore, restore_shard
from core.checkpoint.store import CheckpointStore

__all__ = [
    "CHECKSUM_ALGO",
    "DATA_POSITION_FILE",
    "DENSE_FILE",
    "FULL",
    "INCREMENTAL",
    "MANIFEST_FILE",
    "NO_CHECKPOINT_YET",
    "ROLLBACK_TO_START",
    "CheckpointInfo",
    "CheckpointStore",
    "DataPosition",
    "FileEntry",
    "ShardRestore",
    "ShardRows",
    "local_path",
    "merge_shard_rows",
    "newest_position",
    "other_data",
    "read_position",
    "restore_shard",
    "shard_file_name",
    "step_dir_name",
    "warm_up",
    "write_blob",
    "write_shard_file",
]
