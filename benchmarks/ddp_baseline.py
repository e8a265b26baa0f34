"""Baseline (b) for trainer failures: data-parallel DLRM with Ray Train's checkpoint-and-restart.

This is the classic way to make data-parallel DLRM training survive a dead worker, and the
mechanism ReCoVer (and cpr's method (a)) is compared against:

- every Ray Train worker holds the whole model: the 26 embedding tables, on the same fbgemm
  kernel as cpr's shards (``SplitTableBatchedEmbeddingBagsCodegen`` with the fused
  ``EXACT_ROWWISE_ADAGRAD``, HOST/CPU), and the dense arches in
  ``torch.nn.parallel.DistributedDataParallel`` (gloo, CPU); no embedding shards, no torchft.
  The fused kernel updates inside its backward, so each step's ids and pooled-embedding
  gradients are all-gathered and every replica applies the same update, the one a cpr shard
  applies for the step (``benchmarks/trainer_failures_ddp_worker.py`` says how);
- saves of the kind cpr makes: every ``checkpoint_every`` steps rank 0 copies the state at the
  step boundary and a thread writes it; once durable it is registered with Ray Train
  (``ray.train.report`` with a ``Checkpoint`` naming the file);
- when any worker dies, Ray Train's ``FailureConfig`` tears down the *whole* worker group,
  starts a new one, and every worker resumes from the last registered save
  (``ray.train.get_checkpoint()``). The steps trained since that save are redone, and the
  group restart (new processes, imports, process group, DDP's initial broadcast, the load) is
  paid on every failure.

It trains on the same data as cpr, in the same order: the microbatch cache that cpr's driver
builds (``app.dataprep.prepare_data``) and cpr's ``StepSchedule`` (a step is
``microbatches_per_step`` microbatches, permuted per epoch by the run's seed). Each worker takes
an even share of the rows of every step, so the global batch is the same whatever the number
of workers, and a restart from step ``s`` replays exactly the data of steps ``s, s+1, ...``.

The kill schedule is the one of cpr's method (a) in ``trainer_failures.py``: ``kills`` times,
wait until the worker group trains (a step completed in the current attempt), wait
``healthy_s`` more, then SIGKILL worker ``i % num_workers`` by its pid.

    RAY_AUTH_MODE=token GLOO_SOCKET_IFNAME=lo .venv/bin/python benchmarks/ddp_baseline.py --rows 60000
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

# Ray Train V2 (the controller actor, FailureConfig restarts of the worker group); it is the
# default in Ray 2.60, set anyway before ray.train is first imported.
os.environ.setdefault("RAY_TRAIN_V2_ENABLED", "1")

import core.config  # noqa: E402
from benchmarks import trainer_failures_ddp_worker as worker  # noqa: E402

__all__ = ["run_ddp", "main"]


def _trainer_class():
    """cpr's TorchTrainer without the helper actors this run does not use (app.raytrain), so
    that both methods pay the same per-group start; plain TorchTrainer if that is not there."""
    try:
        from app.raytrain import trainer_class as cpr_trainer_class

        return cpr_trainer_class()
    except Exception:
        from ray.train.torch import TorchTrainer

        return TorchTrainer


def _group_training(workdir: Path, n: int, attempt: int) -> bool:
    """Every rank of ``attempt`` completed a step in it."""
    for r in range(n):
        s = worker.read_json(workdir / "status" / f"rank{r}.json")
        if s is None or s["attempt"] != attempt or s["step"] <= s["start_step"]:
            return False
    return True


def _kill_on_schedule(thread: threading.Thread, workdir: Path, n: int, kills: int, healthy_s: float,
                      total_steps: int) -> list[dict]:
    """``kills`` times: wait until attempt i trains, ``healthy_s`` more, SIGKILL rank ``i % n``."""
    killed: list[dict] = []
    for i in range(kills):
        while thread.is_alive() and not _group_training(workdir, n, i):
            time.sleep(0.05)
        if not thread.is_alive():
            break
        time.sleep(healthy_s)
        target = worker.read_json(workdir / "status" / f"rank{i % n}.json")
        if not thread.is_alive() or target is None or target["step"] >= total_steps:
            break
        try:
            os.kill(target["pid"], signal.SIGKILL)
        except ProcessLookupError:
            break
        killed.append({"rank": i % n, "pid": target["pid"], "attempt": target["attempt"], "step": target["step"],
                       "time": time.time()})
    return killed


def _restarts(starts: list[dict], killed: list[dict]) -> list[dict]:
    """One record per restart of the group: what it cost, measured from the kill before it."""
    out = []
    for a in sorted({s["attempt"] for s in starts} - {0}):
        this = [s for s in starts if s["attempt"] == a]
        kill = killed[a - 1] if a - 1 < len(killed) else None
        rec = {
            "attempt": a,
            "redone_steps": max((s["prev_step"] - s["start_step"] for s in this if s["prev_step"] is not None),
                                default=0),
            "from_step": min(s["start_step"] for s in this),
            "load_s": max(s["load_s"] for s in this),
            "injected": kill is not None,
        }
        if kill is not None:
            # kill -> every worker of the new group loaded and ready to train again; less the
            # load, the group restart (Ray Train's detection and teardown, new processes and
            # imports, the tables built, the process group, DDP's first broadcast).
            rec["ready_s"] = max(s["time"] for s in this) - kill["time"]
            rec["restart_s"] = rec["ready_s"] - rec["load_s"]
            rec["entered_s"] = max(s["entered"] for s in this) - kill["time"]  # kill -> new loops entered
        out.append(rec)
    return out


def _fit(trainer) -> tuple[threading.Thread, dict]:
    outcome: dict = {}

    def fit() -> None:
        try:
            outcome["result"] = trainer.fit()
        except BaseException as err:  # re-raised on the driver's thread
            outcome["error"] = err
        finally:
            outcome["end"] = time.time()

    thread = threading.Thread(target=fit, name="ddp-fit", daemon=True)
    thread.start()
    return thread, outcome


def _prepare_workdir(workdir: Path) -> Path:
    workdir = Path(workdir).resolve()
    if workdir.exists():
        for name in ("status", "starts.jsonl", "saves", "tmp", *[p.name for p in workdir.glob("final*.json")]):
            p = workdir / name
            shutil.rmtree(p) if p.is_dir() else p.unlink(missing_ok=True)
    (workdir / "status").mkdir(parents=True, exist_ok=True)
    return workdir


def run_ddp(cfg: core.config.RunConfig, kills: int, healthy_s: float, checkpoint_every: int, workdir: Path) -> dict:
    """Trains ``cfg``'s DLRM data-parallel on Ray Train, SIGKILLing a worker ``kills`` times (each
    ``healthy_s`` after the group trains again); Ray Train restarts the whole group from the last
    save (every ``checkpoint_every`` steps). Needs Ray connected (``app.rayenv.connect_ray``).
    Returns throughput, restarts and their measured costs, replica agreement and AUC."""
    import ray
    import ray.cloudpickle
    from ray.train import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig

    from app.dataprep import prepare_data
    from core.schedule import StepSchedule

    # Ship the worker's code by value, whatever the workers' sys.path.
    ray.cloudpickle.register_pickle_by_value(worker)
    workdir = _prepare_workdir(workdir)
    tr = cfg.training
    n = tr.num_trainers
    data = prepare_data(cfg)  # the same microbatch caches cpr's driver builds (reused if built)
    total_steps = StepSchedule.from_config(
        data["train"].microbatches, tr.microbatches_per_step, tr.epochs, tr.max_steps, cfg.seed
    ).total_steps
    trainer = _trainer_class()(
        train_loop_per_worker=worker.train_loop,
        train_loop_config={"config": cfg.model_dump(), "workdir": str(workdir), "train_cache": data["train"].uri,
                           "eval_cache": data["eval"].uri, "checkpoint_every": checkpoint_every},
        scaling_config=ScalingConfig(num_workers=n, use_gpu=False),
        torch_config=TorchConfig(backend="gloo"),
        run_config=RunConfig(name=f"ddp-{uuid.uuid4().hex[:8]}", storage_path=str(workdir / "ray_train"),
                             failure_config=FailureConfig(max_failures=kills + 2),
                             checkpoint_config=CheckpointConfig(num_to_keep=2)),
    )
    fit_start = time.time()
    thread, outcome = _fit(trainer)
    killed = _kill_on_schedule(thread, workdir, n, kills, healthy_s, total_steps)
    thread.join()
    if "error" in outcome:
        raise outcome["error"]
    return _summarize(workdir, n, total_steps, tr.microbatches_per_step * tr.microbatch_rows, killed,
                      fit_start, outcome["end"], checkpoint_every)


def _summarize(workdir: Path, n: int, total_steps: int, global_rows: int, killed: list[dict], fit_start: float,
               fit_end: float, checkpoint_every: int) -> dict:
    finals = [worker.read_json(workdir / f"final{r}.json") for r in range(n)]
    if any(f is None for f in finals):
        raise RuntimeError(f"DDP run ended without every rank's final record in {workdir}")
    final = finals[0]
    starts = worker.read_starts(workdir)
    restarts = _restarts(starts, killed)
    # When the first group was ready to train (every rank built its model and DDP).
    first_start = max((s["time"] for s in starts if s["attempt"] == 0), default=fit_start)
    from_first_step_s = final["train_end"] - first_start
    return {
        "effective_samples_per_s": total_steps * global_rows / from_first_step_s,
        "training_s": from_first_step_s,  # as cpr's report: from the first step, startup excluded
        "steps": total_steps,
        "samples_per_step": global_rows,
        "trainer_kills": len(killed),
        "restarts": len(restarts),
        "lost_steps": int(sum(r["redone_steps"] for r in restarts)),
        "restarts_detail": restarts,
        "kills": killed,
        "replicas_identical": len({f["fingerprint"] for f in finals}) == 1,
        "fingerprints": [f["fingerprint"] for f in finals],
        "auc": final["auc"],
        "log_loss": final["log_loss"],
        "startup_s": first_start - fit_start,
        "evaluation_s": final["eval_s"],
        "fit_s": fit_end - fit_start,
        "save_snapshot_s": final.get("snapshot_s", []),
        "save_write_s": final.get("write_s", []),
        "checkpoint_every": checkpoint_every,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=str(ROOT / "configs/local.yaml"))
    parser.add_argument("--rows", type=int, default=60_000)
    parser.add_argument("--kills", type=int, default=2)
    parser.add_argument("--healthy-s", type=float, default=1.0)
    parser.add_argument("--checkpoint-every", type=int, default=5)
    parser.add_argument("--keep", action="store_true", help="keep the temporary directory (data, checkpoints)")
    args = parser.parse_args()

    import ray

    from app.rayenv import connect_ray
    from core.config import load_config
    from core.data import generate

    base = load_config(args.config)
    root = Path(tempfile.mkdtemp(prefix="cpr-bench-ddp-"))
    started = False
    try:
        data = generate(str(root / "data"), args.rows, args.rows // 10, seed=0)
        started = connect_ray(base)
        for kills in (0, args.kills):
            name = f"ddp-kills{kills}"
            cfg = base.model_copy(update={
                "run_dir": str(root / name),
                "data": base.data.model_copy(update={"train": [data.train_path], "eval": [data.eval_path],
                                                     "cache_dir": str(root / "cache"), "generate": None}),
                "checkpoint": base.checkpoint.model_copy(update={"every_steps": args.checkpoint_every}),
                "faults": None,
            })
            r = run_ddp(cfg, kills, args.healthy_s, args.checkpoint_every, root / name)
            print(f"kills={kills}: " + json.dumps(r, indent=1), flush=True)
    finally:
        if started or ray.is_initialized():
            ray.shutdown()
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
