"""The job driver: prepares data, connects to Ray (embedded on 127.0.0.1 or a cluster),
starts the supervisor and the Ray Train worker group, shows progress, writes the report.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
import uuid
from pathlib import Path

from app.cache import build_cache
from app.config import RunConfig
from app.errors import ConfigError

__all__ = ["run_training", "prepare_data", "connect_ray"]

logger = logging.getLogger(__name__)

_LOOPBACK = "127.0.0.1"


def prepare_data(cfg: RunConfig) -> dict:
    """Generates synthetic data if configured and missing, then builds the microbatch caches."""
    from app.data import generate

    missing = [p for p in cfg.data.train + cfg.data.eval if not Path(p).exists()]
    ceiling_auc = None
    if missing:
        gen = cfg.data.generate
        if gen is None:
            raise ConfigError(f"data files not found: {missing} (set data.generate to create synthetic data)")
        out_dir = Path(cfg.data.train[0]).parent
        logger.info("generating %d + %d synthetic rows into %s", gen.train_rows, gen.eval_rows, out_dir)
        summary = generate(
            str(out_dir), gen.train_rows, gen.eval_rows, fmt=gen.format, seed=gen.seed, vocab_rows=gen.vocab_rows
        )
        produced = {summary.train_path, summary.eval_path}
        if not all(str(Path(p)) in {str(Path(q)) for q in produced} for p in cfg.data.train + cfg.data.eval):
            raise ConfigError(
                f"data.generate wrote {sorted(produced)} but data.train/data.eval name {cfg.data.train + cfg.data.eval}"
            )
    datagen_json = Path(cfg.data.train[0]).parent / "datagen.json"
    if datagen_json.exists():
        ceiling_auc = json.loads(datagen_json.read_text()).get("ceiling_auc")
    tr = cfg.training
    train = build_cache(cfg.data.train, cfg.cache_dir, "train", tr.microbatch_rows, cfg.data.skip_bad_lines)
    evaluation = build_cache(
        cfg.data.eval, cfg.cache_dir, "eval", tr.microbatch_rows, cfg.data.skip_bad_lines, keep_tail=True
    )
    return {"train": train, "eval": evaluation, "ceiling_auc": ceiling_auc}


def connect_ray(cfg: RunConfig) -> bool:
    """Joins ``ray.address`` / RAY_ADDRESS, or starts an embedded Ray on 127.0.0.1 with
    token authentication. Returns True if this call started Ray (and must shut it down).
    """
    import ray

    if ray.is_initialized():
        return False
    address = cfg.ray.address or os.environ.get("RAY_ADDRESS")
    runtime_env = {"env_vars": {"GLOO_SOCKET_IFNAME": os.environ.get("GLOO_SOCKET_IFNAME", "lo")}}
    if address:
        ray.init(address=address, namespace=cfg.ray.namespace, runtime_env=runtime_env, log_to_driver=True)
        return False
    os.environ.setdefault("RAY_AUTH_MODE", "token")
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    needed = cfg.training.num_trainers + int(cfg.embeddings.num_shards * cfg.embeddings.num_cpus + 0.999) + 1
    ray.init(
        _node_ip_address=_LOOPBACK,
        num_cpus=cfg.ray.num_cpus or max(os.cpu_count() or 1, needed),
        namespace=cfg.ray.namespace,
        include_dashboard=False,
        runtime_env=runtime_env,
    )
    return True


def _progress_loop(supervisor, stop: threading.Event, total_steps: int) -> None:
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    import ray

    columns = (
        TextColumn("[bold]train"),
        BarColumn(),
        TextColumn("step {task.completed}/{task.total}"),
        TextColumn("{task.fields[rate]} samples/s  loss {task.fields[loss]}  trainers {task.fields[trainers]}"),
        TimeElapsedColumn(),
    )
    with Progress(*columns, transient=False) as bar:
        task = bar.add_task("train", total=total_steps, rate="-", loss="-", trainers="-")
        while not stop.wait(1.0):
            try:
                p = ray.get(supervisor.progress.remote(), timeout=10)
            except Exception:  # the supervisor may be restarting; the next poll retries
                continue
            if p:
                bar.update(
                    task,
                    completed=p["step"],
                    rate=f"{p['samples_per_s']:,.0f}",
                    loss=f"{p['loss']:.4f}",
                    trainers=p["trainers"],
                )


def run_training(cfg: RunConfig, show_progress: bool = True) -> dict:
    """Runs one training job end to end and returns the report (also written to run_dir)."""
    import ray
    from ray.train import RunConfig as TrainRunConfig
    from ray.train import ScalingConfig
    from ray.train.torch import TorchTrainer
    from ray.train.v2.torch.torchft_config import TorchftConfig

    from actors.supervisor import Supervisor, supervisor_name
    from actors.trainer import train_loop

    t_start = time.perf_counter()
    run_dir = Path(cfg.run_dir).resolve()
    run_dir.mkdir(parents=True, exist_ok=True)
    data = prepare_data(cfg)
    t_data = time.perf_counter()
    started_ray = connect_ray(cfg)
    run_id = uuid.uuid4().hex[:8]
    try:
        supervisor = (
            ray.remote(Supervisor)
            .options(name=supervisor_name(run_id), namespace=cfg.ray.namespace, num_cpus=0, max_concurrency=8)
            .remote(cfg.model_dump(), run_id, data["train"].path, data["eval"].path, data["train"].microbatches)
        )
        started = ray.get(supervisor.start.remote(), timeout=cfg.embeddings.call_timeout_s * 2)
        trainer = TorchTrainer(
            train_loop_per_worker=train_loop,
            train_loop_config={"config": cfg.model_dump(), "supervisor": supervisor_name(run_id)},
            scaling_config=ScalingConfig(num_workers=cfg.training.num_trainers, use_gpu=False),
            torch_config=TorchftConfig(
                lighthouse_kwargs={"bind": f"{_bind_host()}:0", "min_replicas": 1, "join_timeout_ms": 10_000},
                backend="gloo",
            ),
            run_config=TrainRunConfig(name=f"cpr-{run_id}", storage_path=str(run_dir / "ray_train")),
        )
        stop = threading.Event()
        progress = None
        if show_progress:
            progress = threading.Thread(
                target=_progress_loop, args=(supervisor, stop, started["total_steps"]), daemon=True
            )
            progress.start()
        t_train = time.perf_counter()
        try:
            trainer.fit()
        finally:
            stop.set()
            if progress:
                progress.join(timeout=5)
        t_end = time.perf_counter()
        summary = ray.get(supervisor.summary.remote(), timeout=cfg.embeddings.call_timeout_s)
    finally:
        if started_ray:
            ray.shutdown()
    from app.report import build_report, write_report

    report = build_report(
        cfg,
        summary,
        data,
        wall={
            "data_prep_s": t_data - t_start,
            "startup_s": t_train - t_data,
            "training_s": t_end - t_train - (summary["eval"] or {}).get("eval_s", 0.0),
            "evaluation_s": (summary["eval"] or {}).get("eval_s", 0.0),
            "total_s": t_end - t_start,
        },
    )
    write_report(run_dir, report)
    return report


def _bind_host() -> str:
    import ray

    return ray.util.get_node_ip_address()
