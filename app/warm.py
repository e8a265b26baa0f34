"""Worker processes started before the actors that will take them: a run's processes start
together and, on a Ray that outlives the run, the next run finds them waiting.

Ray gives a new actor an idle worker process of its node when one was started for the same
runtime environment, else starts one (a Python interpreter, Ray's core worker, then the actor's
imports: 1-3 s of CPU each here, torch the most). A run's actors come in three environments: the
job's (supervisor, lighthouse, shards, spares, mirrors); the one Ray Train gives its controller
(the job's variables, those Ray Train propagates from the driver and its warning switch), which
the synchronization actor the controller starts inherits; and the trainers', the same variables
merged by Ray's core worker, and so written otherwise (``_serialized``). The raylet's
``PrestartWorkers`` call starts idle workers of one environment (Ray's own prestart makes only
the default one); on a cluster whose nodes set ``RAY_preload_python_modules``
(``app.rayenv.PRELOAD_MODULES``) each imports torch and the rest before it waits. A worker
started here that dies is a process that died: the actor that would have taken it gets a new
one from Ray, as without this module.
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

__all__ = ["prestart", "run_processes", "shares", "train_env_vars"]

logger = logging.getLogger(__name__)

# Processes of a run in Ray Train's controller's environment: the controller and the worker
# group's synchronization actor.
TRAIN_HELPERS = 2
# Processes of a run in the job's environment besides its shards: the supervisor, the lighthouse.
JOB_HELPERS = 2
# A raylet answers a PrestartWorkers call at once (it starts the processes after); one that
# does not within this is unreachable, and the run goes on without its idle workers.
PRESTART_TIMEOUT_S = 3.0


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


def run_processes(cfg: RunConfig) -> dict[str, tuple[int, int, float]]:
    """What a run starts, by environment: ``{kind: (on the driver's node, on nodes with CPUs,
    the CPUs one of those takes)}``; the actors without CPUs run on the driver's node."""
    emb = cfg.embeddings
    shard_like = emb.num_shards * (2 if cfg.recovery == "replica" else 1) + emb.spares
    return {"job": (JOB_HELPERS, shard_like, emb.num_cpus), "controller": (TRAIN_HELPERS, 0, 0.0),
            "trainer": (0, cfg.training.num_trainers, TRAINER_CPUS)}


def shares(count: int, cpus: dict[str, float], each: float) -> dict[str, int]:
    """``count`` processes of ``each`` CPUs over the nodes that can hold one, in proportion to
    their CPUs (largest remainders first): as many in all as the run starts, not one a node."""
    fit = {node: c for node, c in cpus.items() if c >= each and c > 0}
    total = sum(fit.values())
    if not count or not total:
        return {}
    exact = {node: count * c / total for node, c in fit.items()}
    out = {node: int(x) for node, x in exact.items()}
    for node in sorted(exact, key=lambda n: exact[n] - out[n], reverse=True)[:count - sum(out.values())]:
        out[node] += 1
    return {node: n for node, n in out.items() if n}


def _env_info(serialized: str):
    """The runtime environment ``serialized`` (its URIs with it), kept as that exact string: a
    raylet tells worker environments apart by it."""
    info = get_runtime_env_info(RuntimeEnv.deserialize(serialized), is_job_runtime_env=False, serialize=False)
    info.serialized_runtime_env = serialized
    return info


def _serialized(job_string: str, train: dict[str, str]) -> dict[str, str]:
    """Each kind's environment as Ray 2.60 writes it. An actor without an environment of its own
    has the job's, as the job's string says it (none: Ray's default, ""). One with its own (the
    controller) has it as Python writes it where the job has none, else merged with the job's by
    Ray's core worker, in C++: the job's fields kept, the variables merged, compact, keys sorted,
    text as it is; a child with its own (a trainer, under the controller) always so."""
    job = json.loads(job_string) if job_string else {}
    merged = {**job, "env_vars": {**(job.get("env_vars") or {}), **train}}
    compact = json.dumps(merged, separators=(",", ":"), sort_keys=True, ensure_ascii=False)
    return {"job": job_string, "controller": compact if job else RuntimeEnv(env_vars=train).serialize(),
            "trainer": compact}


def prestart(cfg: RunConfig, keep_alive_s: float) -> int:
    """Starts idle workers for the run's processes (``run_processes``): those without CPUs on
    the driver's node, the others on the nodes with CPUs in proportion to them. Returns how
    many were asked for. Never raises: a raylet that cannot be asked is logged, and the actors
    then start their own processes, as they would without this."""
    try:
        context = ray.get_runtime_context()
        job_env = dict((context.runtime_env or {}).get("env_vars") or {})
        strings = _serialized(context.get_runtime_env_string() if context.runtime_env else "", train_env_vars(job_env))
        here = context.get_node_id()
        nodes = {n["NodeID"]: n for n in ray.nodes() if n.get("Alive")}
    except Exception as err:  # noqa: BLE001 - a missed head start, not a failure of the run
        logger.info("no workers prestarted (%s)", str(err).splitlines()[0][:200])
        return 0
    cpus = {node: n["Resources"].get("CPU", 0.0) for node, n in nodes.items()}
    counts: dict[str, dict[str, int]] = {node: {} for node in nodes}
    for kind, (helpers, with_cpus, each) in run_processes(cfg).items():
        for node, n in shares(with_cpus, cpus, each).items():
            counts[node][kind] = counts[node].get(kind, 0) + n
        if helpers and here in counts:
            counts[here][kind] = counts[here].get(kind, 0) + helpers
    asked, calls = 0, []
    for node, kinds in counts.items():
        address = f"{nodes[node]['NodeManagerAddress']}:{nodes[node]['NodeManagerPort']}"
        try:
            stub = node_manager_pb2_grpc.NodeManagerServiceStub(init_grpc_channel(address))
            for kind, count in kinds.items():
                # No string: Ray's default environment, sent as no runtime_env_info at all.
                env = {"runtime_env_info": _env_info(strings[kind])} if strings[kind] else {}
                calls.append((address, stub.PrestartWorkers.future(node_manager_pb2.PrestartWorkersRequest(
                    language=common_pb2.Language.PYTHON, num_workers=count,
                    keep_alive_duration_secs=math.ceil(keep_alive_s), **env), timeout=PRESTART_TIMEOUT_S)))
                asked += count
        except Exception as err:  # noqa: BLE001 - as below
            logger.info("no workers prestarted on %s (%s)", address, str(err).splitlines()[0][:200])
    for address, call in calls:  # all at once: an unreachable raylet costs one timeout, not one a node
        try:
            call.result()
        except Exception as err:  # noqa: BLE001 - a missed head start, not a failure of the run
            logger.info("no workers prestarted on %s (%s)", address, str(err).splitlines()[0][:200])
    return asked
