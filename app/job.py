"""The job driver: prepares data, connects to Ray (embedded on 127.0.0.1 or a cluster),
starts the supervisor and the Ray Train worker group, shows progress, writes the report.
Whatever ends a run (its last step, a budget, an interrupt, a crash of the trainers or of a
supervisor thread), the report is written and a run that did not complete raises ``RunFailed``.
"""

from __future__ import annotations

import json
import logging
import shutil
import signal
import threading
import time
import uuid
from pathlib import Path

import ray
import yaml
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from actors.client import SupervisorClient
from actors.fleet import kill_run_shards
from actors.shm import remove_run_files_everywhere
from actors.supervisor.actor import Supervisor, supervisor_name
from app.chaos import FaultSchedule, run_schedule, write_run_info
from app.console import progress_loop
from app.dataprep import build_stores, local_inputs, one_task_each, resolve_data, with_table_rows
from app.emulation import Emulation
from app.lighthouse import start_lighthouse
from app.logs import LOG_DIR, configure_driver_logging, link_ray_session_logs, point_latest
from app.preflight import check_places, probe_writes
from app.rayenv import check_cluster_fits, choose_recovery, cluster_address, connect_ray, metrics_url
from app.report import build_report, rebuild_report, write_report
from app.resume import refuse_other_data
from app.storage import check_every_node, expected_files
from app.warm import prestart
from core.codec import encode
from core.config import RunConfig
from core.data.sources import shown
from core.deadlines import Deadlines
from core.errors import CheckpointNotFound, RunFailed
from core.journal import refuse_another_run
from core.books import RunSummary
from core.schedule import StepSchedule

__all__ = ["TrainingJob"]

logger = logging.getLogger(__name__)


class BackgroundFit:
    """A training run's ``fit()`` on a thread; ``join()`` waits and re-raises its error."""

    def __init__(self, fit):
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(fit,), name="cpr-fit", daemon=True)
        self._thread.start()

    def _run(self, fit) -> None:
        try:
            fit()
        except BaseException as err:  # noqa: BLE001 - handed to the caller by join()
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
        self.resumed: int | None = None  # the step a resumed run went back to
        self.run_dir = Path(cfg.run_dir).resolve()
        self.run_id = uuid.uuid4().hex[:8]
        self.supervisor = None  # the actor's handle
        self.client: SupervisorClient | None = None
        self.started = None
        self._starting = None
        self.data: dict = {}
        self._started_ray = False
        self._t: dict[str, float] = {"start": time.perf_counter()}
        self._wall_train = time.time()
        self._lighthouse = None  # prestarted by start() (app.lighthouse), used by fit()'s first attempt
        self._lighthouse_name = f"cpr-lighthouse-{self.run_id}"
        self.emulation = None  # app.emulation.Emulation of an emulated run, set by start()
        self._created_run_dir = False  # by start(): a new run's directory, removed if its input is refused
        self.refused = False  # start() refused the run's input (a CprError): close() removes what it made
        self._warm_next = False  # a cluster that outlives the run: close() leaves the next run's processes there

    def _lighthouse_kwargs(self) -> dict:
        return {"bind": f"{ray.util.get_node_ip_address()}:0", "min_replicas": 1, "join_timeout_ms": 10_000,
                "heartbeat_timeout_ms": int(self.cfg.training.heartbeat_timeout_s * 1000)}

    def start(self, wait: bool = True):
        """Data, Ray, the supervisor and its shards. ``wait=False`` returns while the shards
        start, so that ``fit()`` starts Ray Train's worker group meanwhile (trainers wait
        for the shards in ``trainer_setup``); a resumed run always waits (it restores first)."""
        cfg = self.cfg
        # Bad input writes nothing: the places the run writes, the checkpoints there and the
        # inputs are checked (synthetic data generated where configured) before run_dir is made.
        check_places(cfg)
        if not self.resume:
            refuse_another_run(self.run_dir, cfg.checkpoint_uri if cfg.checkpoint.stored else None)
        inputs = resolve_data(cfg)
        if self.resume:
            refuse_other_data(cfg, inputs)  # before a store of other data is built
        probe_writes(cfg)
        self.run_dir.parent.mkdir(parents=True, exist_ok=True)
        try:  # made here, or already there: only a run that made its directory may remove it (close)
            self.run_dir.mkdir()
            self._created_run_dir = True
        except FileExistsError:
            pass
        configure_driver_logging(self.run_dir, self.verbose)
        _write_config(self.run_dir, cfg)
        # Ray Train's modules (and torch: 3.0 s) load for fit() while Ray starts and the data is
        # preprocessed: data of one chunk per store (one task: the driver's) before Ray starts
        # where the run starts its Ray. Not a daemon: a run failing meanwhile must not exit with
        # torch half-imported (tracebacks); started after the checks above, so that bad input
        # exits at once.
        threading.Thread(target=_import_ray_train, name="import-ray-train", daemon=False).start()
        if early := one_task_each(cfg, inputs) and not cluster_address(cfg):
            self.data, self._t["data"] = build_stores(cfg, inputs), time.perf_counter()
        self._started_ray = connect_ray(cfg, self.verbose)
        check_cluster_fits(cfg, self._started_ray)
        # A cluster that outlives the run: close() leaves the next run's processes waiting there.
        self._warm_next = bool(cluster_address(cfg)) and cfg.ray.warm_pool_s > 0
        link_ray_session_logs(self.run_dir)
        if not self._started_ray:  # a cluster: every host must see the local paths the run shares
            check_every_node(expected_files(cfg.cache_dir, cfg.checkpoint_uri, self.run_id, local_inputs(inputs)),
                             cfg.embeddings.call_timeout_s)
        if not early:  # on Ray Data: the data time includes Ray's start
            self.data, self._t["data"] = build_stores(cfg, inputs), time.perf_counter()
        if self._started_ray:  # every process of the run starts now, together (a Ray of its own has none idle)
            prestart(cfg, keep_alive_s=60)
        self.cfg, self.recovery_choice = cfg, _ = choose_recovery(with_table_rows(cfg, self.data["table_rows"]))
        if cfg.emulation is not None and not self.resume:
            self.emulation = Emulation.of(cfg, self._total_steps())
            self.cfg = cfg = self.emulation.configure(cfg)
        _write_config(self.run_dir, cfg)
        self._lighthouse = start_lighthouse(self._lighthouse_name, cfg.ray.namespace, self._lighthouse_kwargs())
        if self.resume:
            _kill_leftovers(self.run_dir, cfg.ray.namespace)
        point_latest(self.run_dir)  # once its data was good: a run refused before is removed (close)
        self._create_supervisor()
        self._starting = self.client.start()
        self.metrics_url = metrics_url()
        write_run_info(self.run_dir, self.run_id, cfg.ray.namespace, ray.get_runtime_context().gcs_address,
                       self.metrics_url, train_cache=self.data["train"].uri)
        if wait or self.resume:
            return self.await_start()
        return None

    def _create_supervisor(self) -> None:
        """Pinned to this node (its journal lives in run_dir); restarted by Ray when it dies,
        with calls in flight retried, so trainers never see it gone."""
        cfg = self.cfg
        self.supervisor = (
            ray.remote(Supervisor)
            .options(
                name=supervisor_name(self.run_id), namespace=cfg.ray.namespace, num_cpus=0, max_concurrency=16,
                max_restarts=-1, max_task_retries=-1,
                scheduling_strategy=NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False),
            )
            .remote(cfg.model_dump(), self.run_id, self.data["train"].uri, self.data["eval"].uri,
                    self.data["train"].microbatches, self.resume)
        )
        self.client = SupervisorClient(self.supervisor, Deadlines.of(cfg))

    def await_start(self):
        """Waits until every shard answers (and, resuming, holds the checkpoint); raises
        what went wrong there."""
        if self.started is None:
            self.started = self.client.wait("start", self._starting)
            if self.resume:
                self.resumed = self.client.restore()
                if self.resumed is None:
                    raise CheckpointNotFound(f"--resume: no valid checkpoint under {shown(self.cfg.checkpoint_uri)}")
                logger.warning("resuming at step %d from %s", self.resumed, shown(self.cfg.checkpoint_uri))
        return self.started

    def fit(self) -> None:
        """The trainers' worker group until training ends, with the progress display, the
        run's fault schedule and the emulation's clock beside it."""
        from app.raytrain import TrainerGroup, fit_with_restarts  # import cost: Ray Train and torch, 3.0 s

        cfg = self.cfg
        group = TrainerGroup(cfg, self.run_id, self.run_dir, self._lighthouse_name if self._lighthouse else None,
                             self._lighthouse_kwargs())
        stop = threading.Event()
        header = f"[run] {self.run_id} in {cfg.run_dir}: logs in {cfg.run_dir}/{LOG_DIR}/" + (
            f", metrics at {self.metrics_url}" if self.metrics_url else "")
        jobs = [(progress_loop, (self.client, stop, self._total_steps(), self.show_progress, header))]
        if cfg.faults is not None and cfg.faults.max_failures > 0:
            jobs.append((self._inject_faults, (stop,)))
        if cfg.faults is not None and cfg.faults.hosts:  # a host cannot kill or cut off itself
            logger.warning("faults.hosts: carried out by `cpr chaos --run RUN_DIR hosts`, not by this run")
        if self.emulation is not None:
            jobs.append((self.emulation.drive, (self.client, stop)))
        threads = [threading.Thread(target=fn, args=args, daemon=True) for fn, args in jobs]
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
            fit_with_restarts(group, self.client)
        finally:
            if main:
                signal.signal(signal.SIGINT, sigint)
            stop.set()
            for t in threads:
                t.join(timeout=10)
        self._t["end"] = time.perf_counter()
        self.await_start()  # a shard that never started ended the trainers: say why

    def _total_steps(self) -> int:
        tr = self.cfg.training
        return StepSchedule.from_config(
            self.data["train"].microbatches, tr.microbatches_per_step, tr.epochs, tr.max_steps, self.cfg.seed
        ).total_steps

    def fit_in_background(self) -> BackgroundFit:
        """Starts ``fit()`` on a thread, for callers that act on the run while it trains
        (chaos tests, benchmarks). ``join()`` re-raises what ``fit()`` raised."""
        return BackgroundFit(self.fit)

    def _inject_faults(self, stop: threading.Event) -> None:
        """The run's ``faults:`` schedule, counted from the first training step."""
        f = self.cfg.faults
        schedule = FaultSchedule(tuple(f.targets), f.mtbf_s, f.distribution, f.seed, f.max_failures, None, f.start_after_s)
        while not stop.wait(0.5):
            try:
                if any(e["kind"] == "training_started" for e in self.client.events_since(0)):
                    break
            except (ray.exceptions.RayError, TimeoutError):
                continue
        run_schedule(self.client, schedule, stop)

    def request_stop(self) -> None:
        """Asks the trainers to stop at their next step (the run then counts as interrupted)."""
        self.client.request_stop("interrupted")

    def finish(self, interrupted: bool = False, training_error: BaseException | None = None) -> dict:
        """Collects the supervisor's summary and writes report.json, summary.txt and the plots.
        ``training_error``: what ended the trainers' worker group, if it failed (the run then
        fails with it). Raises RunFailed (after writing the report) when the run did not
        complete; when even the summary cannot be had, the report is rebuilt from the files."""
        try:
            if training_error is not None:
                self.client.fail_run(f"the trainers failed: {_one_line(training_error)}")
            summary = self.client.summary()
        except (ray.exceptions.RayError, TimeoutError) as err:
            logger.error("the supervisor's summary could not be had (%s); rebuilding the report from the files", err)
            report = rebuild_report(self.run_dir, [f"the supervisor did not answer: {_one_line(err)}"])
            write_report(self.run_dir, report)
            raise RunFailed(f"the run stopped and its supervisor did not answer ({_one_line(err)}); "
                            f"the report rebuilt from its files is in {self.run_dir}/report.json") from err
        report = build_report(self.cfg, _summary_for_report(summary), self.data, wall=self._wall(summary))
        report.update(interrupted=interrupted, attempts=summary.attempts, final_checkpoint_step=summary.final_checkpoint_step,
                      shards_error=summary.shards_error, recovery_chosen_at_start=getattr(self, "recovery_choice", None))
        if self.emulation is not None:
            report["emulation"] = self.emulation.account(report)
        write_report(self.run_dir, report)
        if summary.state.state == "failed":
            raise RunFailed(
                f"the run stopped: {summary.state.reason}. Its report is in {self.run_dir}/report.json; "
                f"continue it with `cpr train --resume {self.cfg.run_dir}`"
            )
        return report

    def _wall(self, summary: RunSummary) -> dict:
        """Where the wall time went. Event wall times say when the first step began and the
        last one ended; what lies before is startup (shards, Ray Train's worker group, the
        first quorum), what follows is evaluation."""
        t = self._t
        t.setdefault("train", t.get("data", t["start"]))
        t.setdefault("end", time.perf_counter())
        walls = {e["kind"]: e["wall_time"] for e in summary.events if "wall_time" in e}
        fit_s = t["end"] - t["train"]
        train_begin_s = walls.get("training_started", self._wall_train) - self._wall_train
        train_end_s = walls.get("training_finished", self._wall_train + fit_s) - self._wall_train
        return {
            "data_prep_s": t["data"] - t["start"], "startup_s": t["train"] - t["data"] + train_begin_s,
            "training_s": train_end_s - train_begin_s, "evaluation_s": max(0.0, fit_s - train_end_s),
            "total_s": t["end"] - t["start"],
        }

    def close(self) -> None:
        if self.supervisor is not None:
            try:
                self.client.shutdown()
            except (ray.exceptions.RayError, TimeoutError) as err:  # still remove what we can
                logger.warning("supervisor shutdown failed: %s", err)
            # Also whatever the supervisor could not reach (half-started shards of a recovery).
            _kill_leftovers(self.run_dir, self.cfg.ray.namespace, self.run_id)
            ray.kill(self.supervisor, no_restart=True)
            self.supervisor = None
        if self._lighthouse is not None:
            ray.kill(self._lighthouse, no_restart=True)
            self._lighthouse = None
        if self.refused and self._created_run_dir:  # bad input writes nothing: the error says it all
            shutil.rmtree(self.run_dir, ignore_errors=True)
        if self._started_ray:
            ray.shutdown()
            self._started_ray = False
        elif self._warm_next and not self.refused and ray.is_initialized():
            prestart(self.cfg, keep_alive_s=self.cfg.ray.warm_pool_s)


def _write_config(run_dir: Path, cfg: RunConfig) -> None:
    """The run's config.yaml, which --resume and cpr export read. data.verify_data is what one
    command asked for (--verify-data), not the run's: a resume reads every byte again only
    when it asks."""
    raw = cfg.model_dump()
    raw["data"]["verify_data"] = False
    (run_dir / "config.yaml").write_text(yaml.safe_dump(raw, sort_keys=False))


def _summary_for_report(summary: RunSummary) -> dict:
    """The summary as the report's JSON shapes it (each decision with the actor it was for)."""
    out = encode(summary)
    out["recovery_mode"]["decisions"] = [{"actor": f["actor"], **(f["decision"] or {})} for f in out["failures"]]
    return out


def _one_line(err: BaseException) -> str:
    return (str(err).strip().splitlines() or [type(err).__name__])[0][:300]


def _kill_leftovers(run_dir: Path, namespace: str, run_id: str | None = None) -> None:
    """Kills the detached shards of a run whose driver died (read from its run.json), or of
    this run at its end, and removes its trainers' shared-memory slabs on every node."""
    if run_id is None:
        info = Path(run_dir) / "run.json"
        if not info.exists():
            return
        run_id = json.loads(info.read_text())["run_id"]
    for name in kill_run_shards(run_id, namespace):
        logger.warning("removed %s left behind", name)
    remove_run_files_everywhere(run_id)


def _import_ray_train() -> None:
    """Imports what ``fit()`` needs from Ray Train (and with it torch), ahead of time."""
    try:
        import app.raytrain  # noqa: F401 - import cost: 3.0 s of Ray Train and torch, taken off the path to the first step
    except Exception:  # noqa: BLE001 - fit() imports it again and raises there
        pass
