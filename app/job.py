"""The job driver: prepares data, connects to Ray (embedded on 127.0.0.1 or a cluster),
starts the supervisor and the Ray Train worker group, shows progress, writes the report.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import threading
import time
import uuid
from pathlib import Path

import yaml

from core.cache import build_cache
from core.config import RunConfig
from core.config import load_config
from core.errors import CheckpointNotFound, ConfigError, RunFailed
from app.logs import LOG_DIR, configure_driver_logging, link_ray_session_logs
from app.report import hosts_lost

__all__ = [
    "TrainingJob", "run_training", "resume_config", "prepare_data", "connect_ray", "keep_ray_on_loopback",
    "ray_system_config", "worker_env",
]

logger = logging.getLogger(__name__)

_LOOPBACK = "127.0.0.1"


def prepare_data(cfg: RunConfig) -> dict:
    """Generates synthetic data if configured and missing, then builds the microbatch caches."""
    from core.data import generate

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


def keep_ray_on_loopback() -> None:
    """Makes an embedded Ray use 127.0.0.1 as its node address, and with it Ray Train's
    MASTER_ADDR and torchft's store and manager addresses.

    Ray replaces a 127.0.0.1 node address with the machine's routable one unless it runs as
    a single-machine cluster. That flag is read from the environment when ray is imported,
    which may have happened already, so both the variable (for Ray's child processes) and
    the imported constant are set.
    """
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    from ray._private import ray_constants

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
    against 49k samples/s with 1 trainer)."""
    return {
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


def connect_ray(cfg: RunConfig, verbose: bool = False) -> bool:
    """Joins ``ray.address`` / RAY_ADDRESS, or starts an embedded Ray on 127.0.0.1 with
    token authentication. Returns True if this call started Ray (and must shut it down).

    The workers' output reaches the console only when ``verbose`` (Ray's ``log_to_driver``);
    it is in the run's log files either way (``app.logs``).
    """
    import ray
    import ray._private.worker

    if ray.is_initialized():
        return False
    address = cfg.ray.address or os.environ.get("RAY_ADDRESS")
    runtime_env = {"env_vars": worker_env()}
    quiet = {"log_to_driver": verbose, "logging_level": logging.INFO if verbose else logging.WARNING}
    # log_to_driver leaves out the workers' output, not the raylet's "a worker died" lines,
    # which the driver prints from its own thread: the switch Ray's debugger uses turns those
    # off too (they stay in the raylet's log, RUN_DIR/logs/ray/raylet.out).
    ray._private.worker._worker_logs_enabled = verbose
    if address:
        ray.init(address=address, namespace=cfg.ray.namespace, runtime_env=runtime_env, **quiet)
        return False
    os.environ.setdefault("RAY_AUTH_MODE", "token")
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    keep_ray_on_loopback()
    runtime_env["env_vars"]["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    runtime_env["env_vars"]["GLOO_SOCKET_IFNAME"] = os.environ["GLOO_SOCKET_IFNAME"]
    shard_like = cfg.embeddings.num_shards + cfg.embeddings.spares
    needed = cfg.training.num_trainers + int(shard_like * cfg.embeddings.num_cpus + 0.999) + 1
    ray.init(
        _node_ip_address=_LOOPBACK,
        num_cpus=cfg.ray.num_cpus or max(os.cpu_count() or 1, needed),
        namespace=cfg.ray.namespace,
        include_dashboard=False,
        runtime_env=runtime_env,
        _system_config=ray_system_config(),
        **({"_metrics_export_port": cfg.ray.metrics_export_port} if cfg.ray.metrics_export_port else {}),
        **quiet,
    )
    return True


def metrics_url() -> str | None:
    """This node's Prometheus endpoint, where Ray exports the run's metrics with its own."""
    import ray

    try:
        node = ray._private.worker.global_worker.node
        return f"http://{node.node_ip_address}:{node.metrics_export_port}/metrics"
    except AttributeError:  # a client connection has no local node
        return None


def format_event(e: dict) -> str | None:
    """One line for the events a person watching the run cares about, else None."""
    kind = e["kind"]
    if kind == "shard_recovered":
        detect = f"detected in {e['detection_s']:.2f}s, " if e.get("detection_s") is not None else ""
        spare = e.get("spare")
        how = f"spare {spare.rsplit('-', 1)[-1]} adopted" if spare else "new process"
        serving = f"; serving {e['serving_s']:.2f}s after the kill" if e.get("serving_s") is not None else ""
        return (
            f"[failure] {e['actor']} died ({e['cause']}); {detect}{e['recovery']} recovery from step "
            f"{e['restored_step']} in {e['recovery_s']:.2f}s ({how} in {e['reschedule_s']:.2f}s, load "
            f"{e['load_s']:.2f}s{serving}), {e['rows_reloaded']:,} rows reloaded"
        )
    if kind == "lost_samples_counted":
        return f"[failure] {e['actor']}: {e['lost_samples']:,.0f} samples' updates lost (steps {e['first_step']}..{e['failed_at_step']})"
    if kind == "state_changed" and e["state"] == "failed":
        return f"[stopped] {e['reason']}"
    if kind == "fault_injected":
        return f"[chaos] killing {e['target']} (pid {e['pid']}, {e['trigger']})"
    if kind == "trainer_healed":
        return f"[failure] trainer:{e['rank']} replaced by Ray Train; healed from a live peer in {e['heal_s']:.2f}s, training again from step {e['step']}"
    if kind == "all_trainers_failed":
        return f"[failure] every trainer died; dense state and shards fell back to checkpoint step {e['fallback_step']}"
    if kind == "trainer_group_restarted":
        return f"[failure] Ray Train's controller gave up ({e['reason']}); trainers started again (attempt {e['attempt']})"
    if kind == "supervisor_restarted":
        return f"[failure] supervisor restarted; rebuilt its state in {e['rebuilt_s']:.2f}s from step {e['last_checkpoint_step']}"
    if kind == "checkpoint_saved":
        what = "final, full" if e.get("final") else e.get("checkpoint_kind", "full")
        background = f", written in the background in {e['background_s']:.2f}s" if "background_s" in e else ""
        return (
            f"[checkpoint] step {e['step']} ({what}): {e['bytes'] / 1e6:,.1f} MB, held training "
            f"{e['duration_s']:.2f}s{background}"
        )
    if kind == "checkpoint_failed":
        return f"[checkpoint] step {e['step']} not saved ({e['error']}); abandoned, saving again at a later step"
    if kind == "host_lost":
        (h,) = hosts_lost([e])
        after = f" {h['declared_dead_s']:.2f}s after it stopped answering" if h["declared_dead_s"] is not None else ""
        return f"[failure] host {h['node_ip']} lost, with {', '.join(h['actors'])}; Ray declared its node dead{after}"
    if kind == "spare_moved":
        return f"[spares] the warm spare moved to host {e['to_ip']}, which holds no shard ({e['to'].rsplit('-', 1)[-1]})"
    if kind == "spare_lost":
        return f"[failure] warm spare {e['spare']} died ({e['cause']}); starting another"
    if kind == "checkpoint_fallback":
        return f"[checkpoint] step {e['step']} refused ({e['reason']}); using an older valid checkpoint"
    if kind == "interval_changed":
        return (
            f"[decision] checkpoint every {e['interval_steps']} steps ({e['interval_s']:.1f}s, {e['mode']} recovery "
            f"expected, MTBF {e['mtbf_s']:.0f}s): {e['reason']}"
        )
    if kind == "replacement_joined":
        return f"[failure] trainer:{e['rank']}'s replacement joined the live trainers at step {e['step']}"
    if kind == "recovery_error":
        return f"[failure] recovery attempt {e['attempt']} failed in {e['state']}: {e['error']}; trying again"
    return None


def _progress_loop(supervisor, stop: threading.Event, total_steps: int, show_bar: bool, header: str = "") -> None:
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    import ray

    seen = 0
    if header:
        Console(highlight=False).print(header, markup=False, soft_wrap=True)

    def new_events(print_line) -> None:
        nonlocal seen
        try:
            events = ray.get(supervisor.events_since.remote(seen), timeout=10)
        except Exception:  # the supervisor may be restarting; the next poll catches up
            return
        seen += len(events)
        for e in events:
            line = format_event(e)
            if line:
                print_line(line)

    if not show_bar:
        console = Console(highlight=False)

        def say(line: str) -> None:
            console.print(line, markup=False, soft_wrap=True)

        while not stop.wait(1.0):
            new_events(say)
        new_events(say)
        return

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
            new_events(lambda line: bar.console.print(line, highlight=False, markup=False, soft_wrap=True))
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
        new_events(lambda line: bar.console.print(line, highlight=False, markup=False, soft_wrap=True))


class BackgroundFit:
    """A training run's ``fit()`` on a thread; ``join()`` waits and re-raises its error."""

    def __init__(self, fit):
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(fit,), name="cpr-fit", daemon=True)
        self._thread.start()

    def _run(self, fit) -> None:
        try:
            fit()
        except BaseException as err:  # handed to the caller by join()
            self._error = err

    def is_alive(self) -> bool:
        return self._thread.is_alive()

    def join(self, timeout_s: float | None = None) -> None:
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            raise TimeoutError(f"training did not finish within {timeout_s}s")
        if self._error is not None:
            raise self._error


class TrainingJob:
    """One training run, in stages: ``start()`` (data, Ray, supervisor, shards), ``fit()``
    (the Ray Train worker group), ``finish()`` (report), ``close()``. Tests use the stages
    to look at live actors; users call ``run_training``.
    """

    def __init__(self, cfg: RunConfig, show_progress: bool = True, resume: bool = False, verbose: bool = False):
        self.cfg = cfg
        self.show_progress = show_progress
        self.resume = resume
        self.verbose = verbose
        self.metrics_url: str | None = None  # this node's Prometheus endpoint, known once Ray is up
        self.resumed: dict | None = None
        self.run_dir = Path(cfg.run_dir).resolve()
        self.run_id = uuid.uuid4().hex[:8]
        self.supervisor = None
        self.started: dict | None = None
        self._starting = None
        self.data: dict = {}
        self._started_ray = False
        self._t: dict[str, float] = {"start": time.perf_counter()}
        self._lighthouse = None  # prestarted by start() (app.lighthouse), used by fit()'s first attempt
        self._lighthouse_name = f"cpr-lighthouse-{self.run_id}"
        self.emulation = None  # app.emulation.Emulation of an emulated run, set by start()

    def _lighthouse_kwargs(self) -> dict:
        return {
            "bind": f"{_bind_host()}:0", "min_replicas": 1, "join_timeout_ms": 10_000,
            "heartbeat_timeout_ms": int(self.cfg.training.heartbeat_timeout_s * 1000),
        }

    def start(self, wait: bool = True) -> dict | None:
        """Data, Ray, the supervisor and its shards. ``wait=False`` returns while the shards
        start, so that ``fit()`` starts Ray Train's worker group meanwhile (trainers wait
        for the shards in ``trainer_setup``); a resumed run always waits (it restores first)."""
        import ray
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        from app.chaos import write_run_info
        from app.lighthouse import start_lighthouse
        from app.storage import check_every_node, expected_files

        from actors.supervisor import Supervisor, supervisor_name

        cfg = self.cfg
        if cfg.checkpoint.stored and not self.resume:
            from core.checkpoint import CheckpointStore

            existing = CheckpointStore(cfg.checkpoint_uri).list_committed()
            if existing:
                raise ConfigError(
                    f"{cfg.checkpoint_uri} already holds checkpoints of steps {existing[:3]}...; "
                    f"continue that run with `cpr train --resume {cfg.run_dir}` or choose a new run_dir"
                )
        self.run_dir.mkdir(parents=True, exist_ok=True)
        configure_driver_logging(self.run_dir, self.verbose)
        (self.run_dir / "config.yaml").write_text(yaml.safe_dump(cfg.model_dump(), sort_keys=False))
        # Ray Train's modules (and torch, 1.7 s) load for fit() while the data cache is built.
        # Bad data still fails before Ray starts.
        threading.Thread(target=_import_ray_train, name="import-ray-train", daemon=True).start()
        self.data = prepare_data(cfg)
        self._t["data"] = time.perf_counter()
        if cfg.emulation is not None and not self.resume:
            from app.emulation import Emulation

            self.emulation = Emulation.of(cfg, self._total_steps())
            self.cfg = cfg = self.emulation.configure(cfg)
            (self.run_dir / "config.yaml").write_text(yaml.safe_dump(cfg.model_dump(), sort_keys=False))
        self._started_ray = connect_ray(cfg, self.verbose)
        link_ray_session_logs(self.run_dir)
        if not self._started_ray:  # a cluster: every host must see the cache and the checkpoints
            caches = [self.data["train"].path, self.data["eval"].path]
            check_every_node(expected_files(caches, cfg.checkpoint_uri, self.run_id), cfg.embeddings.call_timeout_s)
        self._lighthouse = start_lighthouse(self._lighthouse_name, cfg.ray.namespace, self._lighthouse_kwargs())
        if self.resume:
            _kill_leftovers(self.run_dir, cfg.ray.namespace)
        # Pinned to this node (its state file lives in run_dir); restarted by Ray when it
        # dies, with calls in flight retried, so trainers never see it gone.
        self.supervisor = (
            ray.remote(Supervisor)
            .options(
                name=supervisor_name(self.run_id),
                namespace=cfg.ray.namespace,
                num_cpus=0,
                max_concurrency=16,
                max_restarts=-1,
                max_task_retries=-1,
                scheduling_strategy=NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False),
            )
            .remote(
                cfg.model_dump(), self.run_id, self.data["train"].path, self.data["eval"].path,
                self.data["train"].microbatches,
            )
        )
        self._starting = self.supervisor.start.remote()
        self.metrics_url = metrics_url()
        write_run_info(
            self.run_dir, self.run_id, cfg.ray.namespace, ray.get_runtime_context().gcs_address, self.metrics_url
        )
        if wait or self.resume:
            return self.await_start()
        return None

    def await_start(self) -> dict:
        """Waits until every shard answers (and, resuming, holds the checkpoint); raises
        what went wrong there."""
        import ray

        cfg = self.cfg
        if self.started is None:
            self.started = ray.get(self._starting, timeout=cfg.embeddings.call_timeout_s * 2)
            if self.resume:
                self.resumed = ray.get(self.supervisor.restore.remote(), timeout=cfg.embeddings.call_timeout_s * 2)
                if self.resumed is None:
                    raise CheckpointNotFound(f"--resume: no valid checkpoint under {cfg.checkpoint_uri}")
                logger.warning("resuming at step %d from %s", self.resumed["step"], cfg.checkpoint_uri)
        return self.started

    def fit(self) -> None:
        from ray.train import FailureConfig
        from ray.train import RunConfig as TrainRunConfig
        from ray.train import ScalingConfig
        from ray.train.torch import TorchTrainer
        from actors.supervisor import supervisor_name
        from app.raytrain import PrestartedLighthouseConfig
        from actors.trainer import train_loop

        cfg = self.cfg
        host = _bind_host()
        trainer_cls = _trainer_class()

        def make_trainer(attempt: int) -> TorchTrainer:
            return trainer_cls(
                train_loop_per_worker=train_loop,
                train_loop_config={
                    "config": cfg.model_dump(),
                    "supervisor": supervisor_name(self.run_id),
                    "run_id": self.run_id,
                    "lighthouse_host": host,
                    "log_dir": str(self.run_dir / LOG_DIR),
                },
                # Trainers on different hosts where the cluster has them: one host's loss
                # takes one trainer, and the others go on.
                scaling_config=ScalingConfig(
                    num_workers=cfg.training.num_trainers, use_gpu=False, placement_strategy="SPREAD"
                ),
                torch_config=PrestartedLighthouseConfig(
                    # The driver's lighthouse serves the first worker group; a group Ray Train
                    # starts again after its controller failed gets a new one.
                    lighthouse_name=self._lighthouse_name if attempt == 0 and self._lighthouse is not None else None,
                    lighthouse_namespace=cfg.ray.namespace,
                    lighthouse_kwargs=self._lighthouse_kwargs(),
                    backend="gloo",
                ),
                # A failure replaces only the dead trainer's replica group (TorchftConfig); the
                # whole group restarts only when every trainer died.
                run_config=TrainRunConfig(
                    name=f"cpr-{self.run_id}" + (f"-{attempt}" if attempt else ""),
                    storage_path=str(self.run_dir / "ray_train"),
                    failure_config=FailureConfig(max_failures=cfg.training.max_trainer_failures),
                ),
            )

        stop = threading.Event()
        threads = [
            threading.Thread(
                target=_progress_loop,
                args=(self.supervisor, stop, self._total_steps(), self.show_progress, self._header()),
                daemon=True,
            )
        ]
        if cfg.faults is not None and cfg.faults.max_failures > 0:
            threads.append(threading.Thread(target=self._inject_faults, args=(stop,), daemon=True))
        if self.emulation is not None:
            threads.append(threading.Thread(target=self.emulation.drive, args=(self.supervisor, stop), daemon=True))
        for t in threads:
            t.start()
        self._t["train"] = time.perf_counter()
        self._wall_train = time.time()
        # On the main thread, Ray Train installs a SIGINT handler that holds its controller's
        # handle, which keeps the controller, the torchft lighthouse and Ray Train's dataset
        # manager alive (and busy) after the run. Restoring the previous handler releases them.
        main = threading.current_thread() is threading.main_thread()
        sigint = signal.getsignal(signal.SIGINT) if main else None
        try:
            self._fit_with_restarts(make_trainer)
        finally:
            if main:
                signal.signal(signal.SIGINT, sigint)
            stop.set()
            for t in threads:
                t.join(timeout=10)
        self._t["end"] = time.perf_counter()
        self.await_start()  # a shard that never started ended the trainers: say why

    def _header(self) -> str:
        where = f"[run] {self.run_id} in {self.cfg.run_dir}: logs in {self.cfg.run_dir}/{LOG_DIR}/"
        if self.metrics_url:
            where += f", metrics at {self.metrics_url}"
        return where

    def _fit_with_restarts(self, make_trainer) -> None:
        """Ray Train's ``fit()``, started again when its controller gave up because a second
        trainer died while it replaced the first (Ray Train 2.60 raises a non-retryable
        ControllerError from ``replace_replica_group``; the worker group is gone then). The
        new group is the every-trainer-died case: it falls back to the last checkpoint.
        Counted against ``training.max_trainer_failures``."""
        import ray
        from ray.train import ControllerError

        budget = self.cfg.training.max_trainer_failures
        attempt = 0
        while True:
            try:
                make_trainer(attempt).fit()
                return
            except ControllerError as err:
                died = isinstance(err.controller_failure, ray.exceptions.RayActorError)
                status = ray.get(self.supervisor.status.remote(), timeout=self.cfg.embeddings.call_timeout_s)
                if not died or status["stop"] or 0 <= budget <= attempt:
                    raise
                attempt += 1
                reason = str(err.controller_failure).splitlines()[0][:200]
                logger.warning("Ray Train's controller stopped (%s); starting the trainers again (%d)", reason, attempt)
                ray.get(self.supervisor.record_event.remote("trainer_group_restarted", attempt=attempt, reason=reason),
                        timeout=self.cfg.embeddings.call_timeout_s)

    def _total_steps(self) -> int:
        from core.schedule import StepSchedule

        tr = self.cfg.training
        return StepSchedule.from_config(
            self.data["train"].microbatches, tr.microbatches_per_step, tr.epochs, tr.max_steps, self.cfg.seed
        ).total_steps

    def fit_in_background(self) -> "BackgroundFit":
        """Starts ``fit()`` on a thread, for callers that act on the run while it trains
        (chaos tests, benchmarks). ``join()`` re-raises what ``fit()`` raised."""
        return BackgroundFit(self.fit)

    def _inject_faults(self, stop: threading.Event) -> None:
        """The run's ``faults:`` schedule, counted from the first training step."""
        import ray

        from app.chaos import FaultSchedule, run_schedule

        f = self.cfg.faults
        schedule = FaultSchedule(
            tuple(f.targets), f.mtbf_s, f.distribution, f.seed, f.max_failures, None, f.start_after_s
        )
        while not stop.wait(0.5):
            try:
                if any(e["kind"] == "training_started" for e in ray.get(self.supervisor.events_since.remote(0), timeout=10)):
                    break
            except Exception:
                continue
        run_schedule(self.supervisor, schedule, stop)

    def request_stop(self) -> None:
        """Asks the trainers to stop at their next step (the run then counts as interrupted)."""
        import ray

        ray.get(self.supervisor.request_stop.remote("interrupted"), timeout=30)

    def finish(self, interrupted: bool = False) -> dict:
        """Collects the supervisor's summary and writes report.json, events.jsonl, summary.txt.
        Raises RunFailed (after writing them) when the run stopped on a budget."""
        import ray

        from app.report import build_report, write_report

        summary = ray.get(self.supervisor.summary.remote(), timeout=self.cfg.embeddings.call_timeout_s * 6)
        t = self._t
        t.setdefault("train", t.get("data", t["start"]))
        t.setdefault("end", time.perf_counter())
        self._wall_train = getattr(self, "_wall_train", time.time())
        # Event wall times say when the first step began and the last one ended; what lies
        # before is startup (shards, Ray Train worker group, quorum), what follows evaluation.
        walls = {e["kind"]: e["wall_time"] for e in summary["events"] if "wall_time" in e}
        fit_s = t["end"] - t["train"]
        train_begin_s = walls.get("training_started", self._wall_train) - self._wall_train
        train_end_s = walls.get("training_finished", self._wall_train + fit_s) - self._wall_train
        report = build_report(
            self.cfg,
            summary,
            self.data,
            wall={
                "data_prep_s": t["data"] - t["start"],
                "startup_s": t["train"] - t["data"] + train_begin_s,
                "training_s": train_end_s - train_begin_s,
                "evaluation_s": fit_s - train_end_s,
                "total_s": t["end"] - t["start"],
            },
        )
        report["interrupted"] = interrupted
        if self.emulation is not None:
            report["emulation"] = self.emulation.account(report)
        write_report(self.run_dir, report)
        state = summary["state"]
        if state["state"] == "failed":
            raise RunFailed(
                f"the run stopped: {state['reason']}. Its report is in {self.run_dir}/report.json; "
                f"continue it with `cpr train --resume {self.cfg.run_dir}`"
            )
        return report

    def close(self) -> None:
        import ray

        if self.supervisor is not None:
            try:
                ray.get(self.supervisor.shutdown.remote(), timeout=30)
            except Exception as err:  # still remove what we can
                logger.warning("supervisor shutdown failed: %s", err)
            # Also whatever the supervisor could not reach (half-started shards of a recovery).
            _kill_leftovers(self.run_dir, self.cfg.ray.namespace, self.run_id)
            ray.kill(self.supervisor, no_restart=True)
            self.supervisor = None
        if self._lighthouse is not None:
            ray.kill(self._lighthouse, no_restart=True)
            self._lighthouse = None
        if self._started_ray:
            ray.shutdown()
            self._started_ray = False


def _kill_leftovers(run_dir: Path, namespace: str, run_id: str | None = None) -> None:
    """Kills the detached shards of a run whose driver died (read from its run.json), or of
    this run at its end, and removes its trainers' shared-memory slabs on this node."""
    import json

    from actors.fleet import kill_run_shards

    if run_id is None:
        info = Path(run_dir) / "run.json"
        if not info.exists():
            return
        run_id = json.loads(info.read_text())["run_id"]
    for name in kill_run_shards(run_id, namespace):
        logger.warning("removed %s left behind", name)
    # Shared-memory slabs of its trainers that were killed, on every node (a trainer that
    # ends normally removes its own).
    from actors.shm import remove_run_files_everywhere

    remove_run_files_everywhere(run_id)


def _import_ray_train() -> None:
    """Imports what ``fit()`` needs from Ray Train (and with it torch), ahead of time."""
    try:
        import ray.train.torch  # noqa: F401
        import ray.train.v2.torch.torchft_config  # noqa: F401
    except Exception:  # fit() imports them again and raises there
        pass


def resume_config(run_dir: str) -> RunConfig:
    """The config a run was started with, saved in its run directory."""
    path = Path(run_dir) / "config.yaml"
    if not path.exists():
        raise ConfigError(f"--resume {run_dir}: no config.yaml there; is it a run directory?")
    return load_config(path)


def run_training(
    cfg: RunConfig, show_progress: bool = True, resume: bool = False, stop_grace_s: float = 25.0, verbose: bool = False
) -> dict:
    """Runs one training job end to end and returns the report (also written to run_dir).

    SIGINT or SIGTERM stops it cleanly: trainers stop at their next step, the report is
    written with ``"interrupted": true``, the shards are killed, and ``--resume`` continues
    from the last valid checkpoint. A second signal stops at once.
    """
    job = TrainingJob(cfg, show_progress, resume, verbose)
    interrupted = threading.Event()

    def on_signal(signum, frame):
        if interrupted.is_set():
            raise KeyboardInterrupt
        logger.warning("%s: stopping the run at the next step and writing its report", signal.Signals(signum).name)
        interrupted.set()

    handlers = {}
    if threading.current_thread() is threading.main_thread():
        handlers = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        job.start(wait=False)  # Ray Train's worker group starts while the shards do
        if not interrupted.is_set():
            # fit() on a thread: the main thread keeps the signals (Ray Train would otherwise
            # install its own SIGINT handler, which aborts without a report).
            training = job.fit_in_background()
            while training.is_alive() and not interrupted.wait(0.5):
                pass
            if interrupted.is_set():
                job.request_stop()
                try:
                    training.join(timeout_s=stop_grace_s)
                except TimeoutError:
                    logger.warning("trainers did not stop within %.0fs; writing the report anyway", stop_grace_s)
                except Exception as err:  # the run is being stopped; its report says so
                    logger.warning("training ended with %r while stopping", err)
            else:
                training.join()
        return job.finish(interrupted=interrupted.is_set())
    finally:
        job.close()
        for sig, handler in handlers.items():
            signal.signal(sig, handler)


def _trainer_class() -> type:
    """``TorchTrainer`` without the helper actors that cannot serve this run.

    - Ray Data's callback: trainers read the microbatch cache themselves and pass no
      ``datasets``, yet Ray Train 2.60 starts a DatasetManager actor (a process importing
      Ray Data, about 2 s of CPU) for every worker group and every replaced trainer.
    - The PlacementGroupCleaner, where Ray's state API does not answer (a Ray without a
      dashboard, such as the embedded one): it watches the controller through that API only,
      so there it can never clean anything and polls and fails every second for the whole run.
    On a 2-core machine each of these is CPU taken from the trainers' own start.
    """
    from ray.train.torch import TorchTrainer
    from ray.train.v2._internal.callbacks.datasets import DatasetsCallback
    from ray.train.v2._internal.callbacks.placement_group_callback import PlacementGroupCleanerCallback

    unused = (DatasetsCallback,) if _state_api_answers() else (DatasetsCallback, PlacementGroupCleanerCallback)

    class Trainer(TorchTrainer):
        def _create_default_callbacks(self):
            return [cb for cb in super()._create_default_callbacks() if not isinstance(cb, unused)]

    return Trainer


def _state_api_answers() -> bool:
    from ray.util.state import list_nodes

    try:
        list_nodes(limit=1, timeout=10)
        return True
    except Exception as err:  # no dashboard: its API server is not there
        logger.info("Ray's state API does not answer (%s); Ray Train runs without its PlacementGroupCleaner",
                    str(err).splitlines()[0][:120])
        return False


def _bind_host() -> str:
    import ray

    return ray.util.get_node_ip_address()
