"""The DLRM reference's Criteo Kaggle model end to end, on synthetic data of its size.

The model is ``configs/criteo_kaggle.yaml`` as shipped (the 26 Kaggle cardinalities with the
four largest capped at 5M rows, D = 16, 2 table-wise shards, 2 trainers, 8,192 samples a
step); only the data paths (the synthetic files here), the run directory, the step count,
the checkpoint interval and the faults are set. The data is ``core.data.datagen.generate``
with each column's values drawn (Zipf) over that column's Kaggle cardinality, so every table
is touched the way Criteo touches it; the generator's hidden click model gives the AUC
ceiling. Each run is a process of its own (``python -m app train``, embedded Ray):

- ``single``: the single-process torchrec baseline on the same microbatches and model
  (``benchmarks/throughput.py --single``: its own process, no Ray, every core);
- ``steady``: cpr on the same steps, no faults and no checkpoints (the pair's ratio);
- ``partial``: ``--steps`` steps with a checkpoint every ``--save-every`` steps; a trainer is
  SIGKILLed at one step and heals from its peer; a shard at a later step and comes back
  alone from its last checkpoint;
- ``replica``: the same with ``recovery: replica`` (each shard's mirror takes its place).

Recorded per run: samples/s and ms a step per phase (participant 0's timers), peak RSS of every
process of the run (sampled each second: the driver, the shards, mirrors and spares, the
trainers, the supervisor) beside what ``core.memory`` estimated for the config, the bytes
and overhead of each checkpoint, kill to serving of each failure, and the AUC on the held-out
split against the generator's ceiling. Writes benchmarks/results/kaggle.json; the table and
the plot (docs/images/kaggle.png) come from ``benchmarks/kaggle_render.py`` (its ``render`` is
benchmarks/render_docs.py's).

    .venv/bin/python benchmarks/kaggle.py                     # about 45 minutes, 7 GB in /tmp
    .venv/bin/python benchmarks/kaggle.py --steps 60 --baseline-steps 20 --out /tmp/kaggle-small.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
os.environ.setdefault("RAY_AUTH_MODE", "token")

from benchmarks.kaggle_render import plot, render  # noqa: E402
from benchmarks.meta import run_metadata  # noqa: E402
from benchmarks.throughput_runs import PHASES, _env, phase_ms, single_process_run  # noqa: E402

CONFIG = "configs/criteo_kaggle.yaml"
# Each column's distinct values in Criteo Kaggle's train.txt (the uncapped table_rows of the config).
KAGGLE_CARDINALITIES = [1460, 583, 10131227, 2202608, 305, 24, 12517, 633, 3, 93145, 5683, 8351593, 3194,
                        27, 14992, 5461306, 10, 5652, 2173, 4, 7046547, 18, 15, 286181, 105, 142572]


# The DLRM reference's Kaggle arches, every table at its full cardinality (--reference).
REFERENCE = ["model.max_ind_range=null", "model.dense_arch=[512,256,64,16]", "model.over_arch=[512,256,1]"]


def make_data(workdir: Path, train_rows: int, eval_rows: int) -> dict:
    """The synthetic train and held-out files (reused while their size and seed are the same)."""
    from core.data.datagen import generate

    out = workdir / "data"
    summary = out / "datagen.json"
    if summary.exists():
        old = json.loads(summary.read_text())
        if (old["train_rows"], old["eval_rows"]) == (train_rows, eval_rows):
            return {**old, "seconds": None, "reused": True}
    shutil.rmtree(out, ignore_errors=True)
    t0 = time.perf_counter()
    s = generate(str(out), train_rows, eval_rows, fmt="tsv", seed=0, vocab_rows=KAGGLE_CARDINALITIES)
    return {"train_path": s.train_path, "eval_path": s.eval_path, "train_rows": s.train_rows,
            "eval_rows": s.eval_rows, "ceiling_auc": s.ceiling_auc, "seconds": round(time.perf_counter() - t0, 1),
            "reused": False}


def base_sets(data: dict, workdir: Path) -> list[str]:
    return [f"data.train=[{data['train_path']}]", f"data.eval=[{data['eval_path']}]",
            f"data.cache_dir={workdir / 'cache'}"]


class RssSampler:
    """Peak RSS of a process and of all its descendants (with ``every_ray_process``, of every
    ``ray::`` process on the machine too), by role, sampled from /proc every ``period_s``."""

    def __init__(self, pid: int, period_s: float = 1.0, every_ray_process: bool = False):
        self._root, self._period, self._everywhere = pid, period_s, every_ray_process
        self.peak: dict[int, tuple[str, int]] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    @staticmethod
    def _read(pid: int) -> tuple[int, list[str], int] | None:
        """(parent pid, argv, RSS bytes) of ``pid``; None if it is gone."""
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
            fields = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines()
                          if ":" in line)
        except OSError:
            return None
        rss = int(fields.get("VmRSS", "0 kB").split()[0]) * 1024
        return int(fields["PPid"]), [a for a in argv if a], rss

    def _role(self, pid: int, argv: list[str]) -> str:
        if argv[1:4] == ["-m", "app", "train"]:
            return "driver"
        name = argv[0] if argv else "?"
        if name.startswith("ray::"):
            return name[5:].split(".")[0].split(":")[-1]  # a spare: "cpr-shard-...-spare0:EmbeddingShard"
        return os.path.basename(name.split()[0])

    def _run(self) -> None:
        while not self._stop.wait(self._period):
            procs = {}
            for entry in os.listdir("/proc"):
                if entry.isdigit() and (info := self._read(int(entry))) is not None:
                    procs[int(entry)] = info
            mine, grew = {self._root}, True
            while grew:  # the root's descendants
                more = {pid for pid, (ppid, _, _) in procs.items() if ppid in mine} - mine
                mine |= more
                grew = bool(more)
            if self._everywhere:
                mine |= {pid for pid, (_, argv, _) in procs.items() if argv and argv[0].startswith("ray::")}
            for pid in mine & procs.keys():
                _, argv, rss = procs[pid]
                if rss > self.peak.get(pid, ("", 0))[1]:
                    self.peak[pid] = (self._role(pid, argv), rss)

    def stop(self) -> dict:
        """{role: {"processes", "max_mb", "sum_mb"}} of the peaks."""
        self._stop.set()
        self._thread.join()
        out: dict[str, dict] = {}
        for role, rss in self.peak.values():
            r = out.setdefault(role, {"processes": 0, "max_mb": 0.0, "sum_mb": 0.0})
            r["processes"] += 1
            r["max_mb"] = round(max(r["max_mb"], rss / 2**20), 1)
            r["sum_mb"] = round(r["sum_mb"] + rss / 2**20, 1)
        return out


def cpr_run(name: str, steps: int, run_dir: Path, sets: list[str], cluster=None) -> dict:
    """``python -m app train`` on the Kaggle config (on host 0 of ``cluster``, a namespace
    cluster, if given); its report's figures, its processes' RSS."""
    shutil.rmtree(run_dir, ignore_errors=True)
    cmd = [sys.executable, "-m", "app", "train", "--config", str(ROOT / CONFIG), "--no-progress"]
    if cluster is not None:
        cmd = [str(cluster.script), "exec", "0", "--", *cmd]
    for kv in [f"run_dir={run_dir}", f"training.max_steps={steps}", *sets]:
        cmd += ["--set", kv]
    t0 = time.perf_counter()
    env = _env() if cluster is None else {**cluster.env, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    sampler = RssSampler(proc.pid, every_ray_process=cluster is not None)
    _, err = proc.communicate()
    rss = sampler.stop()
    if proc.returncode != 0:
        raise RuntimeError(f"{name}: cpr train failed ({proc.returncode}): {err[-3000:]}")
    report = json.loads((run_dir / "report.json").read_text())
    if report["steps"] != steps:
        raise RuntimeError(f"{name}: the run trained {report['steps']} steps, expected {steps}")
    samples = report["samples_this_run"]
    out = {
        "name": name, "steps": steps, "samples_per_s": report["samples_per_s"],
        "step_ms": 1e3 * report["wall_time_s"]["training_s"] / steps,
        "phase_ms": {k: round(v, 2) for k, v in phase_ms(report, steps, PHASES + ("checkpoint",)).items()},
        "wall_time_s": report["wall_time_s"], "process_s": round(time.perf_counter() - t0, 1),
        "auc": report.get("auc"), "ceiling_auc": report.get("ceiling_auc"), "log_loss": report.get("log_loss"),
        "samples": samples, "lost_samples": report["lost_samples"], "pls": report["pls"],
        "rss": rss, "checkpoints": checkpoint_sizes(run_dir),
        "checkpoints_saved": report["checkpoints_saved"], "overhead_s": report["overhead_s"],
        "overhead_pct_of_wall": report["overhead_pct_of_wall"], "save_split_s": report["save_split_s"],
        "mirrors": report.get("mirrors"),
        "failures": [{k: f.get(k) for k in ("actor", "restored_step", "recovery", "detection_s", "adoption_s", "load_s",
                                             "serving_s", "lost_samples", "bytes_reloaded", "spare")}
                     for f in report["failures"]],
        "trainer_failures": report["trainer_failures"],
        "faults_injected": report["faults_injected"],
        "steps_with_fewer_trainers": report["steps_with_fewer_trainers"],
    }
    shutil.rmtree(run_dir / "checkpoints", ignore_errors=True)  # 1.8 GB each
    return out


@contextlib.contextmanager
def namespace_cluster(hosts: int):
    """A ``hosts``-host namespace cluster of this machine (``scripts/local_cluster.sh``, as root),
    torn down after; None for one host."""
    if hosts <= 1:
        yield None
        return
    from app.host_chaos import Cluster

    directory = tempfile.mkdtemp(prefix="cprk-", dir="/tmp")  # short: Ray's socket paths
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "GLOO_SOCKET_IFNAME")}
    env |= {"CPR_CLUSTER_HOSTS": str(hosts), "CPR_WORKER_CPUS": "8", "CPR_CLUSTER_OWNER": str(os.getpid()),
            "CPR_PYTHON": sys.executable}
    cluster = Cluster(directory, env)
    try:
        cluster("up", timeout_s=600)
        yield cluster
    finally:
        cluster("down", timeout_s=300, check=False)
        shutil.rmtree(directory, ignore_errors=True)


def checkpoint_sizes(run_dir: Path) -> list[dict]:
    """Bytes of each checkpoint still on disk (``keep_last`` of them), by its directory."""
    out = []
    root = run_dir / "checkpoints"
    for d in sorted(root.iterdir()) if root.exists() else []:
        if d.is_dir():
            out.append({"name": d.name, "bytes": sum(f.stat().st_size for f in d.rglob("*") if f.is_file())})
    return out


def config(sets: list[str]):
    """The Kaggle config with ``sets`` (KEY=VALUE, as ``cpr train --set``)."""
    import yaml

    from core.config import load_config

    return load_config(ROOT / CONFIG, {k: yaml.safe_load(v) for k, v in (kv.split("=", 1) for kv in sets)})


def estimate(sets: list[str], mirrors: bool) -> dict:
    from core.memory import memory_estimate

    e = memory_estimate(config(sets), mirrors=mirrors)
    mb = 2**20
    return {"rows": e.embedding_rows, "total_mb": round(e.total_bytes / mb, 1),
            "shards_mb": [round((s.weights_bytes + s.optimizer_bytes) / mb, 1) for s in e.shards],
            "shards_at_save_mb": [round(s.total_bytes / mb, 1) for s in e.shards],
            "mirror_mb": [round(s.mirror_bytes / mb, 1) for s in e.shards],
            "dense_params": e.dense_params}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=2000, help="steps of the runs with failures")
    parser.add_argument("--baseline-steps", type=int, default=300, help="steps of the single process and steady")
    parser.add_argument("--save-every", type=int, default=500, help="steps between checkpoints of the fault runs")
    parser.add_argument("--eval-rows", type=int, default=500_000)
    parser.add_argument("--runs", nargs="+", default=["single", "steady", "partial", "replica"],
                        choices=["single", "steady", "partial", "replica"])
    parser.add_argument("--reference", action="store_true",
                        help="the DLRM reference's own arches (13-512-256-64-16, 512-256-1) and no cap on the tables")
    parser.add_argument("--hosts", type=int, default=1,
                        help="1: this host; 2-9: the cpr runs on a namespace cluster of that many hosts (as root)")
    parser.add_argument("--workdir", default="/tmp/cpr-bench-kaggle")
    parser.add_argument("--out", default=str(ROOT / "benchmarks/results/kaggle.json"))
    parser.add_argument("--plot", default=str(ROOT / "docs/images/kaggle.png"))
    args = parser.parse_args()
    workdir = Path(args.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    samples_per_step = 8192
    data = make_data(workdir, args.steps * samples_per_step, args.eval_rows)
    print(f"data: {data['train_rows']:,} + {data['eval_rows']:,} rows, ceiling AUC {data['ceiling_auc']:.4f}", flush=True)
    sets = base_sets(data, workdir) + (REFERENCE if args.reference else [])
    result = {"meta": run_metadata(), "config": CONFIG, "reference": args.reference, "hosts": args.hosts,
              "data": data, "samples_per_step": samples_per_step, "estimate": estimate(sets, False),
              "estimate_replica": estimate(sets, True), "runs": {}}
    out = Path(args.out)
    result["file"], result["save_every"] = out.name, args.save_every
    quiet = ["checkpoint.every_s=null", "checkpoint.every_steps=null", "checkpoint.final=false", "faults=null"]
    kill_trainer, kill_shard = int(args.steps * 0.3), int(args.steps * 0.7) + 3
    faulty = ["checkpoint.every_s=null", f"checkpoint.every_steps={args.save_every}", "checkpoint.final=false",
              "faults.max_failures=0", f"faults.at_steps={{trainer: [{kill_trainer}], shard: [{kill_shard}]}}",
              "faults.seed=1"]
    with namespace_cluster(args.hosts) as cluster:
        run_all(args, result, out, workdir, sets, quiet, faulty, samples_per_step, cluster)
    runs = result["runs"]
    if "single" in runs and "steady" in runs:
        result["ratio_steady_to_single"] = round(runs["steady"]["samples_per_s"] / runs["single"]["samples_per_s"], 3)
    out.write_text(json.dumps(result, indent=2))
    plot(result, Path(args.plot))
    print(render(result))


def run_all(args, result: dict, out: Path, workdir: Path, sets: list[str], quiet: list[str], faulty: list[str],
            samples_per_step: int, cluster) -> None:
    for name in args.runs:
        if name == "single":
            from app.dataengines import LocalEngine
            from app.dataprep import prepare_data

            cfg = config(sets + [f"training.max_steps={args.baseline_steps}"])
            prepared = prepare_data(cfg.model_copy(update={"run_dir": str(workdir / "prep")}), LocalEngine())
            r = single_process_run(CONFIG, args.baseline_steps, prepared["train"].uri, sets)
            r["step_ms"] = 1e3 * samples_per_step / r["samples_per_s"]
        elif name == "steady":
            r = cpr_run(name, args.baseline_steps, workdir / name, sets + quiet, cluster)
        else:
            r = cpr_run(name, args.steps, workdir / name, sets + faulty + [f"recovery={name}"], cluster)
        result["runs"][name] = r
        print(f"{name}: {r['samples_per_s']:,.0f} samples/s, {r['step_ms']:.1f} ms a step", flush=True)
        out.write_text(json.dumps(result, indent=2))  # what is measured so far survives a later failure


if __name__ == "__main__":
    main()
