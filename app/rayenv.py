"""How the driver reaches Ray: an embedded Ray on 127.0.0.1 with token authentication, or a
cluster (``ray.address`` / ``RAY_ADDRESS``), with the workers' environment and the system
settings the run needs, and where this node exports the run's metrics."""

from __future__ import annotations

import logging
import os

import ray
import ray._private.worker
from ray._common.constants import HEAD_NODE_RESOURCE_NAME
from ray._private import ray_constants

from core.config import RunConfig
from core.errors import ConfigError, CprError
from core.memory import memory_estimate, memory_shortfall
from policies import CostInputs, RecoveryMode, decide_recovery

__all__ = ["cluster_address", "connect_ray", "join_ray", "check_cluster_fits", "resources_needed", "keep_ray_on_loopback", "worker_env", "ray_system_config", "embedded_system_config", "PRELOAD_MODULES", "metrics_url", "LOOPBACK"]

LOOPBACK = "127.0.0.1"


def keep_ray_on_loopback() -> None:
    """Makes an embedded Ray use 127.0.0.1 as its node address, and with it Ray Train's
    MASTER_ADDR and torchft's store and manager addresses.

    Ray replaces a 127.0.0.1 node address with the machine's routable one unless it runs as
    a single-machine cluster. That flag is read from the environment when ray is imported,
    which may have happened already, so both the variable (for Ray's child processes) and
    the imported constant are set.
    """
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    ray_constants.ENABLE_RAY_CLUSTER = False


def worker_env() -> dict[str, str]:
    """Environment of the run's Ray workers (gloo's interface is each trainer's own, from its
    node's IP: ``actors.trainer.use_node_interface``): torchft's Rust logs (a few lines per
    quorum, every step) at warnings unless RUST_LOG asks for more; Ray Train's controller
    polling its workers every 0.5 s instead of 2 s, so that it starts a dead trainer's
    replacement (and notices the end of training) sooner. A poll that is late is not a
    failure: Ray Train waits 10 minutes before it gives up on one.
    OpenMP threads that sleep when idle instead of spinning: a trainer's compute threads would
    otherwise spin on the cores while the shards serve its lookups (measured on 2 cores: 38k
    against 49k samples/s with 1 trainer).
    The driver's standard AWS variables (credentials, region, endpoint), so that every worker
    reads and writes ``s3://`` URIs as the driver does (pyarrow reads them from the environment)."""
    return {
        **{k: v for k, v in os.environ.items() if k.startswith("AWS_")},
        "OMP_WAIT_POLICY": os.environ.get("OMP_WAIT_POLICY", "PASSIVE"),
        "RUST_LOG": os.environ.get("RUST_LOG", "warn"),
        "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": os.environ.get("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "0.5"),
    }


# Objects up to this size travel inside Ray's task messages instead of through the shared-
# memory object store. A step's pooled embeddings and their gradients are 0.1-1 MB per shard
# call (Ray's default cut is 100 KB): inline, a 200-step test run trained 22 % faster here and
# used 27 % less CPU (most of it the raylet's object-store traffic). Larger arrays still go
# through the object store, zero-copy.
INLINE_OBJECT_BYTES = 1 << 20


def ray_system_config() -> dict:
    """Ray system settings of an embedded Ray (``ray start`` takes them as RAY_<name>
    environment variables; cluster.yaml sets them)."""
    return {"max_direct_call_object_size": INLINE_OBJECT_BYTES}


# Imported by every worker the raylet starts, before it takes work, on a cluster started with
# RAY_preload_python_modules set to them (docs/CLUSTER.md): what shards (torch, fbgemm's kernels)
# and trainers (Ray Train's torch backend, torchft) import. A module that is not there is skipped
# by Ray (logged in the worker's log). An embedded Ray does not preload (ARCHITECTURE.md#startup).
PRELOAD_MODULES = ("torch", "fbgemm_gpu", "torchft", "ray.train.torch")


def embedded_system_config(num_cpus: int) -> dict:
    """Settings of a Ray started here: none of Ray's own idle workers at the first driver
    (``num_cpus`` of them, for Ray's default environment only: app.warm starts the run's own, as
    many as it needs, in each of its three environments), and those started at once, not two at
    a time on two cores: the run's processes start together."""
    return {"prestart_worker_first_driver": False, "worker_maximum_startup_concurrency": num_cpus}


def join_ray(address: str, namespace: str, **kwargs) -> None:
    """``ray.init`` of a running cluster. A head on 127.0.0.1 (an embedded Ray, or `ray start
    --head --node-ip-address=127.0.0.1`) has this driver on its machine, finding the local raylet
    at 127.0.0.1: Ray would look for it at the machine's routable address and wait forever."""
    if address.split("://")[-1].rsplit(":", 1)[0] in (LOOPBACK, "localhost"):
        keep_ray_on_loopback()
        kwargs["_node_ip_address"] = LOOPBACK
    ray.init(address=address, namespace=namespace, **kwargs)


def cluster_address(cfg: RunConfig) -> str | None:
    """The Ray cluster the run joins (``ray.address``, else ``RAY_ADDRESS``); None: it starts its own."""
    return cfg.ray.address or os.environ.get("RAY_ADDRESS") or None


def connect_ray(cfg: RunConfig, verbose: bool = False) -> bool:
    """Joins ``ray.address`` / RAY_ADDRESS, or starts an embedded Ray on 127.0.0.1 with
    token authentication. Returns True if this call started Ray (and must shut it down).

    The workers' output reaches the console only when ``verbose`` (Ray's ``log_to_driver``);
    it is in the run's log files either way (``app.logs``).
    """
    if ray.is_initialized():
        return False
    address = cluster_address(cfg)
    runtime_env = {"env_vars": worker_env()}
    quiet = {"log_to_driver": verbose, "logging_level": logging.INFO if verbose else logging.WARNING}
    # log_to_driver leaves out the workers' output, not the raylet's "a worker died" lines,
    # which the driver prints from its own thread: the switch Ray's debugger uses turns those
    # off too (they stay in the raylet's log, RUN_DIR/logs/ray/raylet.out).
    ray._private.worker._worker_logs_enabled = verbose
    if address:
        join_ray(address, cfg.ray.namespace, runtime_env=runtime_env, **quiet)
        return False
    # RAY_AUTH_MODE is read when ray is imported: the cpr command sets it before (app.cli.run);
    # left unset, Ray itself turns token authentication on for the Ray it starts here.
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    keep_ray_on_loopback()
    # The workers' variables in the environment the raylet (started by ray.init) and so its workers
    # inherit, not in a job runtime_env: workers started for Ray's default environment (app.warm)
    # can then take any of the run's actors outside Ray Train. The driver's own is left as it was.
    saved = {k: os.environ.get(k) for k in runtime_env["env_vars"]}
    os.environ.update(runtime_env["env_vars"])
    # One CPU of headroom: a trainer's replacement may be placed before Ray frees its predecessor's.
    needed = int(resources_needed(cfg)["CPU"] + 0.999) + 1
    num_cpus = cfg.ray.num_cpus or max(os.cpu_count() or 1, needed)
    try:
        ray.init(
            _node_ip_address=LOOPBACK,
            num_cpus=num_cpus,
            namespace=cfg.ray.namespace,
            include_dashboard=False,
            _system_config={**ray_system_config(), **embedded_system_config(num_cpus)},
            **({"_metrics_export_port": cfg.ray.metrics_export_port} if cfg.ray.metrics_export_port else {}),
            **quiet,
        )
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    return True


TRAINER_CPUS = 1.0  # Ray Train's default resources_per_worker


def resources_needed(cfg: RunConfig) -> dict[str, float]:
    """The Ray resources the run holds at once: every shard, warm spare and mirror (``recovery:
    replica``: one per shard) at ``embeddings.num_cpus`` and ``num_gpus`` each, and every trainer
    (one CPU); the supervisor, the lighthouse and Ray Train's controller take none."""
    emb = cfg.embeddings
    shard_like = emb.num_shards * (2 if cfg.recovery == "replica" else 1) + emb.spares
    return {"CPU": shard_like * emb.num_cpus + cfg.training.num_trainers * TRAINER_CPUS,
            "GPU": shard_like * emb.num_gpus}


def check_cluster_fits(cfg: RunConfig, started_here: bool = False) -> None:
    """Raises ConfigError, before anything is placed, when the connected cluster cannot hold
    the run: its shards, spares and trainers would otherwise wait for resources that never come
    (Ray Train retries a worker group it cannot place), its largest shard would not fit in the
    largest node's memory or the model in the cluster's (``core.memory.memory_shortfall``: a
    resume on fewer shards makes shards larger), or its leases would outlast Ray's verdict on a
    silent host (``_check_lease``). ``started_here``: this process started the
    Ray (its GCS took this process's settings), so they are read here, not by a task on the head
    (``node_death_s``)."""
    _check_lease(cfg, node_death_s(HEAD_PROBE_TIMEOUT_S, started_here))
    need = resources_needed(cfg)
    nodes = [n["Resources"] for n in ray.nodes() if n.get("Alive")]
    have = {r: sum(n.get(r, 0.0) for n in nodes) for r in need}
    emb = cfg.embeddings
    short = [f"{need[r]:g} {r}s and the cluster has {have.get(r, 0.0):g}" for r in ("CPU", "GPU")
             if need[r] > have.get(r, 0.0) + 1e-9]
    biggest = max((n.get("CPU", 0.0) for n in nodes), default=0.0)
    if max(emb.num_cpus, TRAINER_CPUS) > biggest + 1e-9:
        short.append(f"one process needs {max(emb.num_cpus, TRAINER_CPUS):g} CPUs and the largest node has {biggest:g}")
    if not short:
        if (why := memory_shortfall(memory_estimate(cfg), [n.get("memory", 0.0) for n in nodes])) is not None:
            raise ConfigError(why)
        return
    raise ConfigError(
        f"the cluster is too small for this config: it needs {'; '.join(short)} "
        f"({emb.num_shards} shards + {emb.spares} spares"
        + (f" + {emb.num_shards} mirrors" if cfg.recovery == "replica" else "")
        + f" at embeddings.num_cpus={emb.num_cpus:g}"
        + (f", num_gpus={emb.num_gpus:g}" if emb.num_gpus else "")
        + f", {cfg.training.num_trainers} trainers at 1 CPU). Lower training.num_trainers, embeddings.spares, "
        "embeddings.num_shards or embeddings.num_cpus, or give Ray more (ray start --num-cpus, more nodes)"
    )


def choose_recovery(cfg: RunConfig) -> tuple[RunConfig, str | None]:
    """``recovery: auto`` with mirrors or without, decided once, before any shard starts (a
    mirror must exist before its shard dies): the cost model weighs replica recovery (its share
    of every step, ``checkpoint.replica_step_frac``) against full and partial, and only where the
    mirrors' memory (``core.memory``) and processes fit the connected cluster. Returns the config
    (``recovery: replica`` when chosen) and the decision's reason (None unless auto)."""
    if cfg.recovery != "auto":
        return cfg, None
    ck, nodes = cfg.checkpoint, [n["Resources"] for n in ray.nodes() if n.get("Alive")]
    replica = cfg.model_copy(update={"recovery": "replica"})
    need = resources_needed(replica)
    memory = sum(n.get("memory", 0.0) for n in nodes)
    fits = memory_estimate(cfg, mirrors=True).total_bytes <= memory and all(
        need[r] <= sum(n.get(r, 0.0) for n in nodes) + 1e-9 for r in need)
    decision = decide_recovery(RecoveryMode.AUTO, CostInputs(
        mtbf_s=ck.mtbf_s, save_cost_s=ck.save_cost_s, load_cost_s=ck.load_cost_s,
        reschedule_cost_s=ck.reschedule_cost_s, num_shards=cfg.embeddings.num_shards, pls_target=ck.pls_target,
        replica_step_frac=ck.replica_step_frac if fits else None))
    return (replica if decision.mode is RecoveryMode.REPLICA else cfg), decision.reason


# A task on the head may have to start a worker process there first (1-2 s here, more on a
# loaded machine); an answer this late means the head itself is in trouble.
HEAD_PROBE_TIMEOUT_S = 60.0


def _health_checks() -> tuple[int, int]:
    """``(health_check_period_ms, health_check_failure_threshold)`` as this process's Ray reads
    them: its ``RAY_`` environment, overridden by the cluster's system config (``_system_config``)."""
    cfg = ray._raylet.Config
    return cfg.health_check_period_ms(), cfg.health_check_failure_threshold()


def node_death_s(timeout_s: float, started_here: bool = False) -> float:
    """How long the cluster's GCS waits for a silent node before it declares it dead:
    ``health_check_period_ms`` x ``health_check_failure_threshold`` as the GCS reads them.

    The GCS reads its own environment (``ray start``'s on the head, where cluster.yaml sets
    them), which no API reports: Ray's ``get_system_config`` holds only ``_system_config``.
    A task on the head node, started by the head's raylet from the same ``ray start``, reads
    both as the GCS does. The driver's own reading could differ (its ``RAY_`` variables change
    nothing in the cluster), except where ``started_here``: this process started the Ray, and its
    GCS took this process's settings, so they are read here, without a task (a worker process to
    start: a second on the path to the first step)."""
    if started_here:
        period_ms, threshold = _health_checks()
        return period_ms * threshold / 1000.0
    probe = ray.remote(num_cpus=0, max_retries=0, resources={HEAD_NODE_RESOURCE_NAME: 0.001})(_health_checks)
    ref = probe.remote()
    try:
        period_ms, threshold = ray.get(ref, timeout=timeout_s)
    except ray.exceptions.GetTimeoutError:
        ray.cancel(ref, force=True)
        raise CprError(f"the cluster's head did not report its health-check settings within {timeout_s:g} s: "
                       "cannot check ray.lease_s against the time it takes to declare a silent host dead") from None
    return period_ms * threshold / 1000.0


def _check_lease(cfg: RunConfig, death_s: float) -> None:
    """A cut-off process must stop acting (``actors.lease``) before Ray declares its host dead
    (after ``death_s``) and the run replaces it."""
    if cfg.ray.lease_s >= death_s:
        raise ConfigError(
            f"ray.lease_s={cfg.ray.lease_s:g} must be below the {death_s:g} s this cluster takes to declare a silent "
            f"host dead (health_check_period_ms x health_check_failure_threshold on its head): a process cut off "
            f"from the cluster could act after its replacement started. Allowed: 0.05 <= ray.lease_s < {death_s:g}"
        )


def metrics_url() -> str | None:
    """This node's Prometheus endpoint, where Ray exports the run's metrics with its own."""
    try:
        node = ray._private.worker.global_worker.node
        return f"http://{node.node_ip_address}:{node.metrics_export_port}/metrics"
    except AttributeError:  # a client connection has no local node
        return None
