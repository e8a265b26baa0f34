"""Worker processes started before the actors that will take them: a run's processes start
together and, on a Ray that outlives the run, the next run finds them waiting.

Ray gives a new actor an idle worker process of its node when one was started for the same
runtime environment, else starts one (a Python interpreter, Ray's core worker, then the actor's
imports: 1-3 s of CPU each here, torch the most). A run needs two kinds: the job's environment
(supervisor, lighthouse, shards, spares, mirrors), the one Ray Train gives its controller (the
job's variables, those Ray Train propagates from the driver and its warning switch; the actors
the controller starts without an environment of their own inherit it: the worker group's
synchronization actor), and the trainers' (the job's
variables and those Ray Train propagates). The raylet's ``PrestartWorkers`` call starts idle workers of one
environment (Ray's own prestart at a raylet's start makes only the default one); with
``preload_python_modules`` set on the raylet (``ray start`` takes it as
``RAY_preload_python_modules``, a Ray started here from ``app.rayenv``) each imports torch and
the rest before it waits. A worker started here that dies is a process that died: the actor
that would have taken it gets a new one from Ray, as without this module.
"""

from __future__ import annotations

import json
import logging
import math

import ray
from ray._private.grpc_utils import init_grpc_channel
from ray._private.utils import get_runtime_env_info
from ray.core.generated import common_pb2, node_manager_pb2, node_manager_pb2_grpc
from ray.runtime_env import RuntimeEnv

from app.rayenv import TRAINER_CPUS
from core.config import RunConfig

__all__ = ["prestart", "run_processes", "train_env_vars"]

logger = logging.getLogger(__name__)

# Processes of a run in Ray Train's controller's environment: the controller and the worker
# group's synchronization actor.
TRAIN_HELPERS = 2
# Processes of a run in the job's environment besides its shards: the supervisor, the lighthouse.
JOB_HELPERS = 2


def train_env_vars(job_env: dict[str, str]) -> dict[str, str]:
    """The variables of Ray Train 2.60's controller, as it sets them from the driver's
    environment, which its trainers and synchronization actor inherit."""
    # import cost: Ray Train (0.9 s), which the driver loads on a thread (app.job) and runs use only from here
    from ray.train.v2._internal.constants import get_env_vars_to_propagate
    from ray.train.v2.api.data_parallel_trainer import (
        DEFAULT_RAY_WARN_BLOCKING_GET_INSIDE_ASYNC_VALUE, RAY_WARN_BLOCKING_GET_INSIDE_ASYNC_ENV_VAR)

    env = get_env_vars_to_propagate()
    env.setdefault(RAY_WARN_BLOCKING_GET_INSIDE_ASYNC_ENV_VAR, DEFAULT_RAY_WARN_BLOCKING_GET_INSIDE_ASYNC_VALUE)
    return {**job_env, **env}


def run_processes(cfg: RunConfig) -> dict[str, tuple[int, int]]:
    """What a run starts, by environment: ``{kind: (on the driver's node, on nodes with
    CPUs)}``; the actors without CPUs run on the driver's node."""
    emb = cfg.embeddings
    shard_like = emb.num_shards * (2 if cfg.recovery == "replica" else 1) + emb.spares
    return {"job": (JOB_HELPERS, shard_like), "controller": (TRAIN_HELPERS, 0),
            "trainer": (0, cfg.training.num_trainers)}


def _env_info(env_vars: dict[str, str], serialized: str):
    """The runtime environment ``env_vars`` as a raylet tells worker environments apart: by the
    exact string ``serialized``."""
    info = get_runtime_env_info(RuntimeEnv(env_vars=env_vars), is_job_runtime_env=False, serialize=False)
    info.serialized_runtime_env = serialized
    return info


def _serialized(job_env: dict[str, str], job_string: str) -> dict[str, str]:
    """Each kind's environment as Ray 2.60 writes it. An actor without an environment of its own
    has the job's, as the job's string says it. One with its own (the controller) has it as Python
    writes it where the job has none, else merged with the job's by Ray's core worker, in C++
    (compact, keys sorted); a child with its own (a trainer, under the controller) always so."""
    train = train_env_vars(job_env)
    compact = json.dumps({"env_vars": train}, separators=(",", ":"), sort_keys=True)
    return {"job": job_string if job_env else "",
            "controller": compact if job_env else RuntimeEnv(env_vars=train).serialize(),
            "trainer": compact}


def prestart(cfg: RunConfig, kinds: tuple[str, ...] = ("job", "controller", "trainer"), keep_alive_s: float = 600.0) -> int:
    """Starts idle workers for the run's processes of ``kinds`` (see ``run_processes``), on the
    driver's node and, for those with CPUs, on every node with CPUs in proportion to them.
    Returns how many were asked for; a raylet that refuses is logged, never raised (the actors
    then start their own, as they would without this)."""
    context = ray.get_runtime_context()
    job_env = dict((context.runtime_env or {}).get("env_vars") or {})
    envs = {"job": job_env, "controller": train_env_vars(job_env), "trainer": train_env_vars(job_env)}
    strings = _serialized(job_env, context.get_runtime_env_string())
    here = ray.get_runtime_context().get_node_id()
    nodes = [n for n in ray.nodes() if n.get("Alive")]
    cpus = {n["NodeID"]: n["Resources"].get("CPU", 0.0) for n in nodes}
    total_cpus = sum(cpus.values()) or 1.0
    asked = 0
    for node in nodes:
        counts = {}
        for kind in kinds:
            helpers, with_cpus = run_processes(cfg)[kind]
            share = math.ceil(with_cpus * cpus[node["NodeID"]] / total_cpus) if cpus[node["NodeID"]] >= min(
                cfg.embeddings.num_cpus, TRAINER_CPUS) else 0
            counts[kind] = share + (helpers if node["NodeID"] == here else 0)
        if not any(counts.values()):
            continue
        address = f"{node['NodeManagerAddress']}:{node['NodeManagerPort']}"
        try:
            stub = node_manager_pb2_grpc.NodeManagerServiceStub(init_grpc_channel(address))
            for kind, count in counts.items():
                if count:
                    # No string: Ray's default environment, sent as no runtime_env_info at all.
                    env = {"runtime_env_info": _env_info(envs[kind], strings[kind])} if strings[kind] else {}
                    stub.PrestartWorkers(node_manager_pb2.PrestartWorkersRequest(
                        language=common_pb2.Language.PYTHON, num_workers=count,
                        keep_alive_duration_secs=int(keep_alive_s), **env), timeout=10)
                    asked += count
        except Exception as err:  # noqa: BLE001 - a missed head start, not a failure of the run
            logger.info("no workers prestarted on %s (%s)", address, str(err).splitlines()[0][:200])
    return asked
