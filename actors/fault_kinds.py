"""Faults other than kills (``faults.inject``): a process stalled by SIGSTOP and resumed by
SIGCONT after a while, and a checkpoint file damaged between saves. Each is written to the
fault log (``core.faultlog``) by the process that acts, before and after it acts."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import ray

from actors.nodes import pinned, process_alive
from core.checkpoint import CheckpointStore
from core.checkpoint.files import SLOW_WRITES_FILE, join, local_path, resolve, shard_file_name, step_dir_name
from core.faultlog import FaultLog
from core.records import Target

__all__ = ["stop_process", "stall_on_node", "damage_checkpoint", "fill_storage", "slow_storage", "FILL_LIMIT_BYTES"]

# fill_storage fills the free space of the checkpoint storage: only where there is little of it
# (a small tmpfs made for the test), never a real disk.
FILL_LIMIT_BYTES = 4 << 30


def _undo_later(*args: str) -> None:
    """Starts a process of its own (``python -m core.faultlog ARGS``) that undoes a fault when
    its time is up and logs that it did: it outlives the caller, a task or an actor's call."""
    subprocess.Popen(
        [sys.executable, "-m", "core.faultlog", *args],
        start_new_session=True, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )


def _local_root(uri: str, kind: str) -> str:
    """The local directory of the checkpoint storage ``uri`` (made if missing); a storage fault
    acts on a local filesystem only."""
    root = local_path(uri)
    if root is None:
        raise ValueError(f"{kind} needs checkpoints on a local filesystem, not {uri}")
    os.makedirs(root, exist_ok=True)
    return root


def stop_process(target: str, pid: int, seconds: float, trigger: str, log_dir: str) -> float | None:
    """Runs on the target's node: SIGSTOPs ``pid`` and starts a process of its own that
    SIGCONTs it ``seconds`` later. Returns when the stall began (None: no such process)."""
    if not process_alive(pid):
        return None
    log = FaultLog(log_dir)
    now = time.time()
    log.write("sending", "stall", target, pid, trigger, t=now, seconds=seconds)
    os.kill(pid, signal.SIGSTOP)
    log.write("sent", "stall", target, pid, trigger, stall_time=now, seconds=seconds)
    _undo_later("resume", str(pid), str(now + seconds), log_dir, target, trigger)
    return now


def stall_on_node(target: str, info: Target, seconds: float, trigger: str, log_dir: str,
                  timeout_s: float = 30.0) -> float | None:
    if info.node_id == ray.get_runtime_context().get_node_id():
        return stop_process(target, info.pid, seconds, trigger, log_dir)
    stopper = pinned(stop_process, info.node_id)
    return ray.get(stopper.remote(target, info.pid, seconds, trigger, log_dir), timeout=timeout_s)


def damage_checkpoint(uri: str, how: str, shard: int, trigger: str, log_dir: str) -> int | None:
    """Damages shard ``shard``'s file of the newest committed checkpoint under ``uri``:
    ``corrupt_checkpoint`` flips 64 bytes in its middle, ``truncate_checkpoint`` cuts it to
    half. Returns the checkpoint's step (None: nothing committed yet)."""
    steps = CheckpointStore(uri).list_committed()
    log = FaultLog(log_dir)
    target = f"shard:{shard}"
    if not steps:
        log.write("aborted", how, target, None, trigger, error="no committed checkpoint yet")
        return None
    step = steps[-1]
    fs, root = resolve(uri)
    path = join(root, step_dir_name(step), shard_file_name(shard))
    log.write("sending", how, target, None, trigger, step=step, file=shard_file_name(shard))
    with fs.open_input_stream(path) as f:
        data = bytearray(f.read())
    if how == "truncate_checkpoint":
        data = data[: len(data) // 2]
    else:
        middle = len(data) // 2
        data[middle: middle + 64] = bytes(b ^ 0xFF for b in data[middle: middle + 64])
    with fs.open_output_stream(path) as f:
        f.write(bytes(data))
    log.write("sent", how, target, None, trigger, step=step, file=shard_file_name(shard))
    return step


def fill_storage(uri: str, seconds: float, trigger: str, log_dir: str) -> int:
    """Fills the free space of the local filesystem that holds the checkpoints under ``uri``
    with a filler file, and starts a process of its own that deletes it ``seconds`` later.
    Returns the bytes written. Refuses a remote store, and a filesystem with more than
    ``FILL_LIMIT_BYTES`` free."""
    root = _local_root(uri, "fill_storage")
    stat = os.statvfs(root)
    free = stat.f_bavail * stat.f_frsize
    if free > FILL_LIMIT_BYTES:
        raise ValueError(f"fill_storage would fill {free / 2**30:.1f} GiB under {root}; it fills only a filesystem "
                         f"with at most {FILL_LIMIT_BYTES / 2**30:.0f} GiB free (a small tmpfs)")
    log = FaultLog(log_dir)
    path = os.path.join(root, f".cpr-fill-{os.getpid()}")
    now = time.time()
    log.write("sending", "fill_storage", "storage", None, trigger, t=now, file=path, seconds=seconds)
    written, chunk = 0, b"\0" * (1 << 20)
    with open(path, "wb") as f:
        while True:
            try:
                f.write(chunk)
                f.flush()
                written += len(chunk)
            except OSError:
                break  # ENOSPC: full
    log.write("sent", "fill_storage", "storage", None, trigger, file=path, seconds=seconds, bytes=written)
    _undo_later("free", path, str(now + seconds), log_dir, trigger)
    return written


def slow_storage(uri: str, seconds: float, delay_s: float, trigger: str, log_dir: str) -> None:
    """Makes every file written to the checkpoint storage under ``uri`` take ``delay_s`` longer
    for ``seconds`` (``core.checkpoint.files.pause_if_slow``), and starts a process of its own
    that removes the fault's file afterwards. A local filesystem only."""
    root = _local_root(uri, "slow_storage")
    path = os.path.join(root, SLOW_WRITES_FILE)
    log = FaultLog(log_dir)
    now = time.time()
    log.write("sending", "slow_storage", "storage", None, trigger, t=now, file=path, seconds=seconds, delay_s=delay_s)
    with open(path + ".tmp", "w") as f:
        json.dump({"until": now + seconds, "delay_s": delay_s}, f)
    os.replace(path + ".tmp", path)  # whole, for a writer that reads it meanwhile
    log.write("sent", "slow_storage", "storage", None, trigger, file=path, seconds=seconds, delay_s=delay_s)
    _undo_later("free", path, str(now + seconds), log_dir, trigger)
