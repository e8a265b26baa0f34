"""The trainers as a Ray Train worker group: ``TorchTrainer`` with the torchft backend (each
trainer its own replica group) using the driver's prestarted lighthouse (``app.lighthouse``),
without the helper actors that cannot serve the run, and ``fit`` started again when Ray Train's
controller gives up after a second trainer death. Importing Ray Train imports torch (3.0 s
here), so the driver loads this module on a thread while it prepares the data.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import ray
from ray.train import ControllerError, FailureConfig, ScalingConfig
from ray.train import RunConfig as TrainRunConfig
from ray.train.torch import TorchTrainer
from ray.train.v2._internal.callbacks.datasets import DatasetsCallback
from ray.train.v2._internal.callbacks.placement_group_callback import PlacementGroupCleanerCallback
from ray.train.v2._internal.execution.scaling_policy import FixedScalingPolicy
from ray.train.v2._internal.exceptions import WorkerGroupStartupFailedError, WorkerGroupStartupTimeoutError
from ray.train.v2.api.exceptions import WorkerGroupError
from ray.train.v2.torch.torchft_config import TorchftConfig, _TorchftBackend
from ray.util.state import list_nodes

from actors.client import SupervisorClient
from actors.supervisor.actor import supervisor_name
from actors.trainer import train_loop
from app.lighthouse import start_lighthouse
from core.config import RunConfig
from core.errors import CprError
from core.logs import LOG_DIR
from policies import Budget, FailurePolicy

__all__ = ["PrestartedLighthouseConfig", "TrainerGroup", "TrainersFailed", "fit_with_restarts", "trainer_class"]


class TrainersFailed(CprError):
    """The trainers failed past ``budgets.max_trainer_failures``; the message says how."""

logger = logging.getLogger(__name__)

# Ray Train tries to start a worker group it cannot place again and again (60 s each, no limit by
# default). The run checks the cluster's size before it starts (app.rayenv.check_cluster_fits);
# past that, a group that cannot be placed this many times in a row ends the run with the reason.
WORKER_GROUP_START_TRIES = 5


class PrestartedLighthouseConfig(TorchftConfig):
    """``TorchftConfig`` whose backend uses the named lighthouse actor if it is alive, else
    starts cpr's (``app.lighthouse``), never Ray Train's own."""

    def __init__(self, lighthouse_name: str | None, lighthouse_namespace: str, **kwargs):
        self.lighthouse_name = lighthouse_name
        self.lighthouse_namespace = lighthouse_namespace
        super().__init__(**kwargs)

    @property
    def backend_cls(self):
        return _PrestartedLighthouseBackend


# Starting a lighthouse: a new process on the controller's node (0.4 s of CPU here, more on a
# loaded machine); past this, the controller's node is in trouble and the group's start fails.
LIGHTHOUSE_START_TIMEOUT_S = 60.0


class _PrestartedLighthouseBackend(_TorchftBackend):
    """Ray Train's torchft backend with cpr's lighthouse. Ray Train 2.60's own
    ``LighthouseServerActor`` asks for one CPU (an actor's default) on the controller's node
    (hard node affinity): on a head without CPUs (``ray start --head --num-cpus=0``, as a
    cluster keeps its head to the driver and the controllers) it can never be placed, and a
    worker group started again after the controller gave up failed at once with
    ``ActorUnschedulableError`` ("The node specified via NodeAffinitySchedulingStrategy doesn't
    exist any more or is infeasible"). cpr's lighthouse needs no CPU; the controller runs on the
    driver's node, so it is placed there, as the first group's."""

    def _maybe_create_lighthouse_actor(self, backend_config: PrestartedLighthouseConfig) -> str:
        if self.lighthouse_actor is None:
            address = self._prestarted(backend_config)
            if address is not None:
                return address
            # As Ray Train's: the OS picks a free port unless the config says where to bind.
            kwargs = {"bind": "[::]:0"} | backend_config.lighthouse_kwargs
            self.lighthouse_actor = start_lighthouse(None, backend_config.lighthouse_namespace, kwargs)
        # Read each time, as Ray Train's backend does: the address of the lighthouse now.
        return ray.get(self.lighthouse_actor.address.remote(), timeout=LIGHTHOUSE_START_TIMEOUT_S)

    def _prestarted(self, backend_config: PrestartedLighthouseConfig) -> str | None:
        if not backend_config.lighthouse_name:
            return None
        try:
            actor = ray.get_actor(backend_config.lighthouse_name, namespace=backend_config.lighthouse_namespace)
            address = ray.get(actor.address.remote(), timeout=LIGHTHOUSE_START_TIMEOUT_S)
        except (ValueError, ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError) as err:
            logger.warning("the prestarted lighthouse is not available (%s); starting one", err)
            return None
        self.lighthouse_actor = actor
        logger.info("using the prestarted torchft lighthouse at %s", address)
        return address


# ----------------------------------------------------------------------------- the worker group


@dataclass(frozen=True)
class TrainerGroup:
    """What the trainers' worker group needs: the run's config and names, and the lighthouse
    the driver started (used by the first group; a group started again gets a new one)."""

    cfg: RunConfig
    run_id: str
    run_dir: Path
    lighthouse_name: str | None
    lighthouse_kwargs: dict


def make_torch_trainer(group: TrainerGroup, attempt: int) -> TorchTrainer:
    cfg = group.cfg
    return trainer_class()(
        train_loop_per_worker=train_loop,
        train_loop_config={
            "config": cfg.model_dump(), "supervisor": supervisor_name(group.run_id), "run_id": group.run_id,
            "lighthouse_host": ray.util.get_node_ip_address(), "log_dir": str(group.run_dir / LOG_DIR),
        },
        # Trainers on different hosts where the cluster has them: one host's loss takes one
        # trainer, and the others go on.
        scaling_config=ScalingConfig(num_workers=cfg.training.num_trainers, use_gpu=False, placement_strategy="SPREAD"),
        torch_config=PrestartedLighthouseConfig(
            lighthouse_name=group.lighthouse_name if attempt == 0 else None, lighthouse_namespace=cfg.ray.namespace,
            lighthouse_kwargs=group.lighthouse_kwargs, backend="gloo",
        ),
        # A failure replaces only the dead trainer's replica group (TorchftConfig); the whole
        # group restarts only when every trainer died.
        run_config=TrainRunConfig(
            name=f"cpr-{group.run_id}" + (f"-{attempt}" if attempt else ""),
            storage_path=str(group.run_dir / "ray_train"),
            failure_config=FailureConfig(max_failures=cfg.budgets.max_trainer_failures,
                                         controller_failure_limit=WORKER_GROUP_START_TRIES - 1),
        ),
    )


def fit_with_restarts(group: TrainerGroup, supervisor: SupervisorClient) -> None:
    """Ray Train's ``fit()``, started again when its controller gave up because a second
    trainer died while it replaced the first (Ray Train 2.60 raises a non-retryable
    ControllerError from ``replace_replica_group``; the worker group is gone then). The new
    group is the every-trainer-died case: it falls back to the last checkpoint. Restarts count
    against ``budgets.max_trainer_failures``; Ray Train's own giving up (its
    ``WorkerGroupError`` past ``max_failures``) raises ``TrainersFailed`` naming that budget."""
    policy = FailurePolicy(group.cfg.budgets.limits())
    attempt = 0
    while True:
        try:
            make_torch_trainer(group, attempt).fit()
            return
        except ControllerError as err:
            if isinstance(err.controller_failure, (WorkerGroupStartupTimeoutError, WorkerGroupStartupFailedError)):
                raise TrainersFailed(
                    f"Ray Train could not start the {group.cfg.training.num_trainers} trainers "
                    f"{WORKER_GROUP_START_TRIES} times in a row ({str(err.controller_failure).splitlines()[0][:200]}); "
                    "the cluster lacks the CPUs for them now: free them, or lower training.num_trainers"
                ) from err
            restartable = isinstance(err.controller_failure, ray.exceptions.RayActorError) or _port_taken(err)
            if not restartable or supervisor.status().stop:
                raise
            attempt += 1
            reason = str(err.controller_failure).splitlines()[0][:200]
            over = policy.exceeded(Budget.TRAINER_FAILURES, attempt, f"Ray Train's controller stopped: {reason}")
            if over is not None:
                raise TrainersFailed(over) from err
            logger.warning("Ray Train's controller stopped (%s); starting the trainers again (%d)", reason, attempt)
            supervisor.record_group_restarted(attempt, reason)
        except WorkerGroupError as err:
            limit = group.cfg.budgets.max_trainer_failures
            detail = f"Ray Train gave up on the trainers: {str(err).splitlines()[0][:200]}"
            raise TrainersFailed(policy.check(Budget.TRAINER_FAILURES, limit + 1).message(detail)) from err


def _port_taken(err: ControllerError) -> bool:
    """A worker group whose process group could not listen on the port Ray Train had picked for
    it (another process of this host took it between the pick and the bind: EADDRINUSE): a race
    of the start, not of the run; the group is started again (seen once in the suite on 2 cores)."""
    text = str(err.controller_failure)
    return "EADDRINUSE" in text or "Address already in use" in text


class FixedGroupPolicy(FixedScalingPolicy):
    """Ray Train's fixed scaling policy without its autoscaling coordinator: Ray Train 2.60
    starts that actor (a process importing Ray Data: 2-3 s here, on the path from the
    controller's start to the trainers') to share an autoscaling cluster's capacity between Ray
    Data and Ray Train; a run reads no Ray Dataset, and the trainers it cannot place are demand
    the cluster's autoscaler sees either way."""

    def after_controller_start(self, train_run_context) -> None:
        pass

    def _maybe_send_resource_request(self) -> None:
        pass

    def _send_resource_request(self) -> None:
        pass


def trainer_class() -> type:
    """``TorchTrainer`` without the helper actors that cannot serve this run.

    - Ray Data's callback: trainers read the microbatch cache themselves and pass no
      ``datasets``, yet Ray Train 2.60 starts a DatasetManager actor (a process importing
      Ray Data, about 2 s of CPU) for every worker group and every replaced trainer.
    - Ray Train's autoscaling coordinator (``FixedGroupPolicy``).
    - The PlacementGroupCleaner, where Ray's state API does not answer (a Ray without a
      dashboard, such as the embedded one): it watches the controller through that API only,
      so there it can never clean anything and polls and fails every second for the whole run.
    On a 2-core machine each of these is CPU taken from the trainers' own start.
    """
    unused = (DatasetsCallback,) if _state_api_answers() else (DatasetsCallback, PlacementGroupCleanerCallback)

    class Trainer(TorchTrainer):
        def _create_default_callbacks(self):
            return [cb for cb in super()._create_default_callbacks() if not isinstance(cb, unused)]

        def _initialize_and_run_controller(self, **controller_init_kwargs):
            controller_init_kwargs["scaling_policy"] = FixedGroupPolicy(self.scaling_config)
            return super()._initialize_and_run_controller(**controller_init_kwargs)

    return Trainer


def _state_api_answers() -> bool:
    try:
        list_nodes(limit=1, timeout=10)
        return True
    except Exception as err:  # noqa: BLE001 - no dashboard: its API server is not there
        logger.info("Ray's state API does not answer (%s); Ray Train runs without its PlacementGroupCleaner",
                    str(err).splitlines()[0][:120])
        return False
