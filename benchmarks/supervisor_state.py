"""The supervisor's state over a long run: its memory, what each journal write costs and how
long its calls take, per 1,000-step window, over 10,000 steps (issue 39: all three flat).

A real Supervisor actor on embedded Ray, with its two real shards (tiny tables: what grows
here is the supervisor's history, not the model), driven by this process as the run's two
trainers would drive it: every step both shards look up and get the step's gradient, both
ranks report their commit, rank 0 its progress, and the status is polled; a checkpoint is
saved every 50 steps, and shard 1 is SIGKILLed at three steps (each a partial recovery from
the last checkpoint, which this driver waits out as a trainer does, in ``await_shards``). A
real actor, not the parts in this process: the call latency is then what a trainer sees, and
the memory is the supervisor process's own (its RSS from /proc).

Per window: the supervisor's RSS at its end, beside a control's (an actor that does nothing
with the same commit, progress and status calls: what Ray's own per-call memory does); the
journal writes in it (read from the journal file as it grows: one line per write, a snapshot
on a new file) and their bytes; the median and p99 latency of ``status``, of
``record_commit`` (awaited here) and of ``save_checkpoint``.

    .venv/bin/python benchmarks/supervisor_state.py            # about 5 minutes, under the Ray lock
    .venv/bin/python benchmarks/supervisor_state.py --steps 2000 --out /tmp/s.json   # a quick look

Writes benchmarks/results/supervisor_state.json (``--out``); docs/RESULTS.md renders it.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("RAY_AUTH_MODE", "token")
os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")

from benchmarks.meta import run_metadata  # noqa: E402

OUT = ROOT / "benchmarks" / "results" / "supervisor_state.json"
B, M = 8, 2  # microbatch rows, microbatches a step


def _config(run_dir: Path, save_every: int):
    from core.config import config_from_dict

    return config_from_dict({
        "run_dir": str(run_dir), "seed": 0,
        # No data is read: the driver makes the lookups; the lost samples' count finds no store and says so.
        "data": {"train": [str(run_dir / "none")], "eval": [str(run_dir / "none")],
                 "cache_dir": str(run_dir / "cache")},
        "model": {"embedding_dim": 4, "table_rows": 64, "dense_arch": [8, 4], "over_arch": [8, 1]},
        "embeddings": {"num_shards": 2, "spares": 0},
        "training": {"num_trainers": 2, "microbatch_rows": B, "microbatches_per_step": M},
        "checkpoint": {"every_steps": save_every, "keep_last": 2},
        "recovery": "partial",
    })


class JournalTail:
    """The journal's writes as the file shows them: each appended line is a write, a new file
    (a snapshot, atomically renamed in) starts with one. The old file is read to its end
    through the descriptor kept open, so no write is missed at a compaction. (A journal that
    replaces one document at every write, the format before, shows only the writes a poll
    finds: their bytes are right, their count is a lower bound.)"""

    def __init__(self, path: Path):
        self.path = path
        self._f = None
        self._inode = None
        self._partial = b""

    def poll(self) -> list[int]:
        """The bytes of each write since the last poll."""
        sizes = self._read()
        try:
            inode = os.stat(self.path).st_ino
        except FileNotFoundError:
            return sizes
        if inode != self._inode:
            if self._f is not None:
                self._f.close()
            self._f, self._inode, self._partial = open(self.path, "rb"), inode, b""
            sizes += self._read()
            if self._partial and _whole_json(self._partial):  # a journal of one document, no newline: format 2
                sizes.append(len(self._partial))
                self._partial = b""
        return sizes

    def _read(self) -> list[int]:
        if self._f is None:
            return []
        data = self._partial + self._f.read()
        *lines, self._partial = data.split(b"\n")
        return [len(line) + 1 for line in lines]


def _whole_json(data: bytes) -> bool:
    try:
        json.loads(data)
    except ValueError:
        return False
    return True


def _rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


def _ms(xs: list[float]) -> dict:
    if not xs:
        return {"median": None, "p99": None, "n": 0}
    xs = sorted(xs)
    p99 = xs[min(len(xs) - 1, int(0.99 * len(xs)))]
    return {"median": round(1000 * statistics.median(xs), 3), "p99": round(1000 * p99, 3), "n": len(xs)}


class Control:
    """Takes the supervisor's per-step calls and does nothing with them."""

    def record_commit(self, commit) -> None:
        pass

    def record_progress(self, progress) -> None:
        pass

    def status(self):
        from core.records import RunStatus

        return RunStatus(False, "running", None)

    def pid(self) -> int:
        return os.getpid()


class Driver:
    """The run's two trainers, as far as the supervisor can tell."""

    def __init__(self, ray, client, plan, supervisor, control):
        import numpy as np

        self.ray, self.client, self.supervisor, self.control = ray, client, supervisor, control
        rows = np.random.default_rng(0).integers(0, 64, size=(B * M, 26))
        self.batches = [plan.route(rows, k) for k in range(plan.num_shards)]
        self.grads = [np.ones((B * M, len(plan.shards[k]) * 4), dtype=np.float32) for k in range(plan.num_shards)]
        self.seq = {0: 0, 1: 0}
        self.generation, self.shards = 0, list(ray.get(supervisor.shard_handles.remote(), timeout=60))
        self.lat: dict[str, list[float]] = {"status": [], "commit": [], "save": []}

    def shard_step(self, step: int) -> float | None:
        """Both shards' part of ``step``; after a shard death, the new fleet from
        ``await_shards`` (returns how long that took) and the step again."""
        mbs = (M * step, M * step + 1)
        waited = None
        while True:
            try:
                refs = [s.lookup.remote(step, mbs, b.lengths, b.indices) for s, b in zip(self.shards, self.batches)]
                self.ray.get(refs, timeout=60)
                refs = [s.push_grads.remote(step, mbs, g) for s, g in zip(self.shards, self.grads)]
                self.ray.get(refs, timeout=60)
                return waited
            except self.ray.exceptions.RayActorError:
                t0 = time.perf_counter()
                view = self.client.await_shards(self.generation, step)
                self.generation, self.shards = view.generation, list(view.shards)
                waited = time.perf_counter() - t0

    def report(self, step: int, total_steps: int) -> None:
        from core.records import CommitRecord, Progress

        now, refs = time.time(), []
        progress = Progress(step + 1, total_steps, 0.5, 1e4, 2, time=now)
        for rank in (0, 1):
            self.seq[rank] += 1
            commit = CommitRecord(step, rank, (M * step + rank,), M, 2, now, self.generation, 1000 + rank,
                                  self.seq[rank])
            refs.append(self.supervisor.record_commit.remote(commit))
            self.control.record_commit.remote(commit)
        self.supervisor.record_progress.remote(progress)
        self.control.record_progress.remote(progress)
        t0 = time.perf_counter()
        self.ray.get(refs, timeout=60)
        self.lat["commit"].append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        self.client.status()
        self.lat["status"].append(time.perf_counter() - t0)
        self.ray.get(self.control.status.remote(), timeout=60)

    def save(self, step: int) -> None:
        from core.records import SaveRequest

        t0 = time.perf_counter()
        self.client.save_checkpoint(SaveRequest(step, b"dense" * 200))
        self.lat["save"].append(time.perf_counter() - t0)


def run(steps: int, window: int, save_every: int, kills: list[int], run_dir: Path) -> dict:
    import ray

    from actors.client import SupervisorClient
    from actors.supervisor.actor import Supervisor
    from app.chaos import kill_target
    from app.rayenv import keep_ray_on_loopback, ray_system_config, worker_env
    from core.deadlines import Deadlines
    from core.journal import STATE_FILE
    from core.plan import make_plan
    from core.records import TrainerStart

    cfg = _config(run_dir, save_every)
    keep_ray_on_loopback()
    ray.init(_node_ip_address="127.0.0.1", num_cpus=4, namespace="cpr-bench-state", include_dashboard=False,
             runtime_env={"env_vars": worker_env()}, _system_config=ray_system_config())
    try:
        supervisor = ray.remote(Supervisor).options(name="cpr-bench-supervisor", num_cpus=0, max_concurrency=16).remote(
            cfg.model_dump(), "benchstate", str(run_dir / "cache" / "train"), str(run_dir / "cache" / "eval"),
            M * (steps + 100))
        client = SupervisorClient(supervisor, Deadlines.of(cfg))
        client.wait("start", supervisor.start.remote())
        for rank in (0, 1):
            client.register_trainer(TrainerStart(rank, 1000 + rank, ray.get_runtime_context().get_node_id()))
        ray.get(supervisor.record_training_started.remote(0, 2, time.time()), timeout=60)
        pid = client.targets()["supervisor"].pid
        control = ray.remote(Control).options(num_cpus=0, max_concurrency=16).remote()
        control_pid = ray.get(control.pid.remote(), timeout=60)
        driver = Driver(ray, client, make_plan(cfg.embeddings.sharding, cfg.model.rows_per_table, 2), supervisor,
                        control)
        tail, windows, recoveries, writes = JournalTail(run_dir / STATE_FILE), [], [], []
        t_window = time.perf_counter()
        for step in range(steps):
            if step in kills:
                kill_target(supervisor, "shard:1")
            waited = driver.shard_step(step)
            if waited is not None:
                recoveries.append({"step": step, "await_shards_s": round(waited, 3)})
            driver.report(step, steps)
            if (step + 1) % save_every == 0:
                driver.save(step + 1)
            writes += tail.poll()
            if (step + 1) % window == 0:
                windows.append({
                    "steps": [step + 1 - window, step], "wall_s": round(time.perf_counter() - t_window, 2),
                    "rss_mb": round(_rss_mb(pid), 1), "control_rss_mb": round(_rss_mb(control_pid), 1),
                    "journal_writes": len(writes),
                    "journal_bytes_per_write": round(statistics.mean(writes), 1) if writes else None,
                    "journal_bytes_max": max(writes, default=None),
                    **{f"{k}_ms": _ms(v) for k, v in driver.lat.items()},
                })
                print(json.dumps(windows[-1]), flush=True)
                writes, driver.lat = [], {k: [] for k in driver.lat}
                t_window = time.perf_counter()
        t0 = time.perf_counter()
        summary = client.summary()
        summary_s = time.perf_counter() - t0
        files = {name: (run_dir / name).stat().st_size for name in
                 (STATE_FILE, "events.jsonl", "progress.jsonl", "trainer_book.jsonl")}
        client.shutdown()
        return {"windows": windows, "recoveries": recoveries, "summary_s": round(summary_s, 3),
                "summary": {"events": len(summary.events), "progress": len(summary.progress),
                            "failures": len(summary.failures),
                            "state": summary.state.state},
                "files_bytes": files}
    finally:
        ray.shutdown()


def render(result: dict) -> str:
    """The per-window table (docs/RESULTS.md, through benchmarks/render_docs.py)."""
    p = result["params"]
    lines = [
        "# The supervisor's state over a long run",
        "",
        f"A real supervisor and its 2 shards, {p['steps']:,} steps driven as 2 trainers drive them (commit reports, "
        f"progress, a status poll every step), a checkpoint every {p['save_every']} steps, shard 1 killed at steps "
        f"{', '.join(map(str, p['kills']))} (partial recoveries). Per {p['window']:,}-step window: the supervisor "
        "process's RSS at its end (and a control's: an actor that does nothing with the same commit, progress and "
        "status calls, what Ray's own per-call memory does), the journal's writes and their mean (max) bytes, and "
        "call latency as the caller sees it, median / p99.",
        "",
        "| steps | RSS | control RSS | journal writes | bytes a write (max) | status | record_commit "
        "| save_checkpoint |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]

    def lat(x: dict) -> str:
        return f"{x['median']:.2f} / {x['p99']:.2f} ms" if x["n"] else "-"

    for w in result["windows"]:
        control = f"{w['control_rss_mb']:.1f} MB" if "control_rss_mb" in w else "-"
        per_write = (f"{w['journal_bytes_per_write']:,.0f} ({w['journal_bytes_max']:,})" if w["journal_writes"]
                     else "-")
        lines.append(
            f"| {w['steps'][0]:,}-{w['steps'][1]:,} | {w['rss_mb']:.1f} MB | {control} | "
            f"{w['journal_writes']:,} | {per_write} | "
            f"{lat(w['status_ms'])} | {lat(w['commit_ms'])} | {lat(w['save_ms'])} |"
        )
    s, files = result["summary"], result["files_bytes"]
    lines += [
        "",
        f"At the end the run's summary (every event and progress report, read from the files: {s['events']:,} events, "
        f"{s['progress']:,} progress reports) took {result['summary_s']:.2f} s; on disk the journal held "
        f"{files['supervisor_state.json'] / 1e3:,.0f} kB, events.jsonl {files['events.jsonl'] / 1e3:,.0f} kB, "
        f"progress.jsonl {files['progress.jsonl'] / 1e3:,.0f} kB, trainer_book.jsonl "
        f"{files['trainer_book.jsonl'] / 1e6:,.1f} MB.",
    ]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=10_000)
    ap.add_argument("--window", type=int, default=1_000)
    ap.add_argument("--save-every", type=int, default=50)
    ap.add_argument("--kills", type=int, nargs="*", default=[2_500, 5_000, 7_500], help="steps shard 1 is killed at")
    ap.add_argument("--run-dir", type=Path, default=None, help="default: a new directory under /tmp, removed after")
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="cpr-state-") as tmp:
        run_dir = args.run_dir or Path(tmp) / "run"
        run_dir.mkdir(parents=True, exist_ok=True)
        measured = run(args.steps, args.window, args.save_every, [k for k in args.kills if k < args.steps], run_dir)
    result = {"meta": run_metadata(), "params": {"steps": args.steps, "window": args.window,
                                                 "save_every": args.save_every, "kills": args.kills}, **measured}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(render(result))


if __name__ == "__main__":
    main()
