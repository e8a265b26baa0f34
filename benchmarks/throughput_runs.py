"""The runs behind benchmarks/throughput.py, each in a process of its own: the single-process
torchrec baseline, a ``cpr train`` run, a startup, a Ray head started as a user starts one, and
the checkpoint write rate."""

from __future__ import annotations

import contextlib
import json
import os
import resource
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from core.config import RunConfig
from core.data import NUM_DENSE, NUM_SPARSE
from core.store import MicrobatchStore

ROOT = Path(__file__).resolve().parents[1]
THROUGHPUT = ROOT / "benchmarks" / "throughput.py"
PHASES = ("quorum", "data", "lookup", "dense", "push", "allreduce", "commit")
SINGLE_PHASES = ("data", "lookup", "dense+update")


def single_process(cfg: RunConfig, train_cache: str, steps: int) -> dict:
    """Samples/s of a single-process torchrec DLRM on the same microbatches, torch on
    every core."""
    import torch
    from torchrec.modules.embedding_configs import EmbeddingBagConfig
    from torchrec.modules.fused_embedding_modules import FusedEmbeddingBagCollection
    from torchrec.optim import RowWiseAdagrad
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    from core.schedule import StepSchedule
    from core.model import torchrec_dense_model

    torch.set_num_threads(os.cpu_count() or 1)
    torch.manual_seed(cfg.seed)
    rows_per_table = cfg.model.rows_per_table
    dim = cfg.model.embedding_dim
    tables = [
        EmbeddingBagConfig(name=f"t{t}", embedding_dim=dim, num_embeddings=rows_per_table[t], feature_names=[f"f{t}"])
        for t in range(NUM_SPARSE)
    ]
    ebc = FusedEmbeddingBagCollection(
        tables=tables,
        optimizer_type=RowWiseAdagrad,
        optimizer_kwargs={"lr": cfg.embeddings.learning_rate, "eps": cfg.embeddings.eps},
        device=torch.device("cpu"),
    )
    model = torchrec_dense_model(NUM_DENSE, NUM_SPARSE, cfg.model.dense_arch, cfg.model.over_arch)
    opt = torch.optim.Adagrad(model.parameters(), lr=cfg.training.dense_learning_rate)
    data = MicrobatchStore(train_cache)
    tr = cfg.training
    schedule = StepSchedule.from_config(len(data), tr.microbatches_per_step, tr.epochs, steps, cfg.seed)
    keys = [f"f{t}" for t in range(NUM_SPARSE)]
    laps = dict.fromkeys(SINGLE_PHASES, 0.0)
    t0 = time.perf_counter()
    for step in range(schedule.total_steps):
        t1 = time.perf_counter()
        parts = [data.get(schedule.microbatch(step, m)) for m in range(tr.microbatches_per_step)]
        labels = torch.from_numpy(np.concatenate([p[0] for p in parts]))
        dense = torch.from_numpy(np.concatenate([p[1] for p in parts]))
        rows = np.concatenate([p[2] for p in parts]).astype(np.int64)  # mapped when the store was built
        batch = rows.shape[0]
        kjt = KeyedJaggedTensor.from_lengths_sync(
            keys=keys,
            values=torch.from_numpy(np.ascontiguousarray(rows.T).reshape(-1)),
            lengths=torch.ones(batch * NUM_SPARSE, dtype=torch.int64),
        )
        t2 = time.perf_counter()
        pooled = ebc(kjt).values().view(batch, NUM_SPARSE, dim)
        t3 = time.perf_counter()
        loss = torch.nn.functional.binary_cross_entropy_with_logits(model(dense, pooled), labels)
        opt.zero_grad()
        loss.backward()  # also the embeddings' fused row-wise Adagrad update
        opt.step()
        t4 = time.perf_counter()
        laps["data"] += t2 - t1
        laps["lookup"] += t3 - t2
        laps["dense+update"] += t4 - t3
    elapsed = time.perf_counter() - t0
    n = schedule.total_steps
    return {
        "samples_per_s": n * tr.microbatches_per_step * tr.microbatch_rows / elapsed,
        "phase_ms": {k: 1e3 * v / n for k, v in laps.items()},
        "threads": torch.get_num_threads(),
        "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),  # Linux: KiB
    }


def _env() -> dict:
    # This checkout's code, whatever the virtual environment's editable install points at.
    env = dict(os.environ, GLOO_SOCKET_IFNAME="lo", RAY_AUTH_MODE="token", PYTHONPATH=str(ROOT))
    env.pop("RAY_ADDRESS", None)
    return env


def _plain_env() -> dict:
    """The single process's environment: a user's, with none of the threading settings that
    cpr gives its workers (OMP_WAIT_POLICY=PASSIVE cost it a third of its speed)."""
    env = _env()
    for k in ("OMP_WAIT_POLICY", "OMP_NUM_THREADS", "MKL_NUM_THREADS", "GOMP_SPINCOUNT", "KMP_BLOCKTIME"):
        env.pop(k, None)
    return env


def single_process_run(config: str, steps: int, train_uri: str, sets: list[str]) -> dict:
    """(a), in a process of its own: this script with ``--single``."""
    cmd = [sys.executable, str(THROUGHPUT), "--single", config, "--steps", str(steps),
           "--train-uri", train_uri] + (["--set", *sets] if sets else [])  # this script's --set takes many
    done = subprocess.run(cmd, cwd=ROOT, env=_plain_env(), capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"the single process failed: {done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def cpr_overrides(steps: int, trainers: int, run_dir: Path) -> list[str]:
    return [f"run_dir={run_dir}", f"training.max_steps={steps}", f"training.num_trainers={trainers}",
            "checkpoint.every_steps=null", "checkpoint.every_s=null", "checkpoint.final=false", "faults=null"]


def product(config: str, steps: int, trainers: int, run_dir: Path, sets: list[str]) -> dict:
    """(b)/(c): ``python -m app train`` in a process of its own, as a user runs it; samples/s of
    its training phase and its per-phase ms a step, from its report."""
    cmd = [sys.executable, "-m", "app", "train", "--config", config, "--no-progress"]
    for kv in cpr_overrides(steps, trainers, run_dir) + list(sets):
        cmd += ["--set", kv]
    done = subprocess.run(cmd, cwd=ROOT, env=_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"cpr train failed ({done.returncode}): {done.stderr[-3000:]}")
    report = json.loads((run_dir / "report.json").read_text())
    if report["steps"] != steps:
        raise RuntimeError(f"the cpr run trained {report['steps']} steps, expected {steps}")
    return {
        "samples_per_s": report["samples_per_s"],
        "phase_ms": phase_ms(report, steps),
        "auc": report.get("auc"),
    }


def phase_ms(report: dict, steps: int, phases: tuple[str, ...] = PHASES) -> dict[str, float]:
    """ms a step in each of ``phases``, summed over a run report's progress records. Phase
    times are the saving trainer's (participant 0's); every trainer runs every step."""
    totals = dict.fromkeys(phases, 0.0)
    for p in report.get("progress") or []:
        for k in phases:
            totals[k] += (p.get("phase_s") or {}).get(k, 0.0)
    return {k: 1e3 * v / steps for k, v in totals.items()}


def startup_times(config: str, reps: int, runs_root: Path, label: str, address: str | None = None) -> list[float]:
    """Seconds from launching ``cpr train`` (a fresh process; its embedded Ray, or the Ray at
    ``address``) to its first step, read from the run's training_started event."""
    out = []
    for rep in range(reps):
        run_dir = runs_root / f"startup-{label}{rep}"
        env = _env()
        if address:
            env["RAY_ADDRESS"] = address
        t0 = time.time()
        sets = [f"run_dir={run_dir}", "faults=null", "training.max_steps=5", "checkpoint.every_steps=null",
                "checkpoint.final=false"]
        done = subprocess.run(
            [sys.executable, "-m", "app", "train", "--config", config, "--no-progress"] + [a for kv in sets for a in ("--set", kv)],
            cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
        )
        if done.returncode != 0:
            raise RuntimeError(f"cpr train failed ({done.returncode}): {done.stderr[-3000:]}")
        events = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]
        started = next(e for e in events if e["kind"] == "training_started")
        # Sent when step 0 begins, after the first quorum; its commit follows within ~0.1 s.
        out.append(started["wall_time"] - t0)
        print(f"startup ({label}) {rep}: {out[-1]:.1f}s", flush=True)
    return out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def running_ray(num_cpus: int, preload: bool = True):
    """A Ray head on 127.0.0.1 as a user starts one (``ray start --head``, token
    authentication, its workers preloading torch and the rest as docs/CLUSTER.md says, unless not
    ``preload``: a plain ``ray start``), owned by
    this process: stopped by its own process group at the end, never by ``ray stop``. Yields its
    address."""
    from app.rayenv import PRELOAD_MODULES

    env = _env()
    env.update(RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0")
    if preload:
        env.update(RAY_preload_python_modules=",".join(PRELOAD_MODULES), RAY_worker_maximum_startup_concurrency=str(num_cpus))
    ray_cli = str(Path(sys.executable).parent / "ray")
    subprocess.run([ray_cli, "get-auth-token", "--generate"], env=env, check=True, capture_output=True, timeout=60)
    port = _free_port()
    temp_dir = tempfile.mkdtemp(prefix="cpr-ray-", dir="/tmp")  # short: Ray's socket paths are limited
    head = subprocess.Popen(
        [ray_cli, "start", "--head", "--block", "--node-ip-address=127.0.0.1", f"--port={port}",
         "--include-dashboard=false", f"--num-cpus={num_cpus}", "--disable-usage-stats", f"--temp-dir={temp_dir}"],
        env=env, start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    try:
        address = f"127.0.0.1:{port}"
        deadline = time.monotonic() + 120
        while True:  # up once a driver can join it
            probe = subprocess.run([sys.executable, "-c", f"import ray; ray.init(address='{address}'); ray.shutdown()"],
                                   env=env, capture_output=True, timeout=120)
            if probe.returncode == 0:
                break
            if head.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"ray start did not come up: {probe.stderr[-2000:]!r}")
            time.sleep(1.0)
        yield address
    finally:
        stop_head(head)
        shutil.rmtree(temp_dir, ignore_errors=True)


def stop_head(head: subprocess.Popen, grace_s: float = 10.0) -> None:
    """Stops a ``ray start --head --block`` started in its own session: its own process group
    only, never ``ray stop`` (which stops every Ray on the machine). Its graceful stop waits on
    its children one by one (about 30 s here); what still runs after ``grace_s`` is killed."""
    os.killpg(head.pid, signal.SIGTERM)
    try:
        head.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        pass
    try:
        os.killpg(head.pid, signal.SIGKILL)
    except ProcessLookupError:  # the whole group is already gone
        pass
    head.wait(timeout=30)


def checkpoint_write_rate(shard_rows: int, dim: int, reps: int) -> dict:
    """MB/s of write_shard_file for one shard of this config vs a raw sequential write of
    the same bytes, both into the page cache of the same disk (no fsync, as in a run).
    The order alternates, and dirty pages are flushed before each write, so neither pays
    the other's writeback."""
    from core.checkpoint import ShardRows, write_shard_file

    rng = np.random.default_rng(0)
    data = ShardRows(
        tables=np.zeros(shard_rows, dtype=np.int32),
        rows=np.arange(shard_rows, dtype=np.int64),
        weights=rng.standard_normal((shard_rows, dim)).astype(np.float32),
        momentum=rng.random(shard_rows).astype(np.float32),
    )
    ours, raw = [], []
    with tempfile.TemporaryDirectory(dir=ROOT / "benchmarks") as tmp:
        entry = write_shard_file(tmp, 10_000, 0, data)
        payload = Path(tmp, f"ckpt-{10_000:012d}", "shard-0.arrow").read_bytes()

        def write_ours(rep: int) -> None:
            os.sync()
            t0 = time.perf_counter()
            write_shard_file(tmp, rep, 0, data)
            ours.append(entry.size_bytes / (time.perf_counter() - t0) / 1e6)

        def write_raw(rep: int) -> None:
            os.sync()
            t0 = time.perf_counter()
            with open(Path(tmp, f"raw-{rep}.bin"), "wb") as f:
                f.write(payload)
            raw.append(len(payload) / (time.perf_counter() - t0) / 1e6)

        for rep in range(reps):
            first, second = (write_ours, write_raw) if rep % 2 == 0 else (write_raw, write_ours)
            first(rep)
            second(rep)
    return {
        "file_mb": entry.size_bytes / 1e6,
        "checkpoint_mb_s": ours,
        "raw_mb_s": raw,
        "ratio": statistics.median(ours) / statistics.median(raw),
    }
