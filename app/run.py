"""``cpr train``'s run: one training job end to end, with the signals that stop it cleanly
and the report written whatever ends it (app.job.TrainingJob does the work)."""

from __future__ import annotations

import logging
import signal
import threading

from app.job import TrainingJob
from core.config import RunConfig
from core.errors import CheckpointNotFound, ConfigError, CprError

__all__ = ["run_training"]

logger = logging.getLogger(__name__)


def run_training(
    cfg: RunConfig, show_progress: bool = True, resume: bool = False, stop_grace_s: float = 25.0, verbose: bool = False
) -> dict:
    """Runs one training job end to end and returns the report (also written to run_dir).

    SIGINT or SIGTERM stops it cleanly: trainers stop at their next step, the report is
    written with ``"interrupted": true``, the shards are killed, and ``--resume`` continues
    from the last valid checkpoint. A second signal stops at once. Training that fails (the
    trainers past their budget, a supervisor thread crashing) still writes its report.
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
        try:
            job.start(wait=False)  # Ray Train's worker group starts while the shards do
        except CprError:
            job.refused = True
            raise
        error = None if interrupted.is_set() else _train(job, interrupted, stop_grace_s)
        return job.finish(interrupted=interrupted.is_set(), training_error=error)
    finally:
        job.close()
        for sig, handler in handlers.items():
            signal.signal(sig, handler)


def _train(job: TrainingJob, interrupted: threading.Event, stop_grace_s: float) -> BaseException | None:
    """fit() on a thread: the main thread keeps the signals (Ray Train would otherwise install
    its own SIGINT handler, which aborts without a report). Returns the error that ended the
    trainers, if one did (not while stopping: the report then says interrupted)."""
    training = job.fit_in_background()
    while training.is_alive() and not interrupted.wait(0.5):
        pass
    if interrupted.is_set():
        job.request_stop()
        try:
            training.join(timeout_s=stop_grace_s)
        except TimeoutError:
            logger.warning("trainers did not stop within %.0fs; writing the report anyway", stop_grace_s)
        except Exception as err:  # noqa: BLE001 - the run is being stopped; its report says so
            logger.warning("training ended with %r while stopping", err)
        return None
    try:
        training.join()
    except (CheckpointNotFound, ConfigError):
        raise  # a shard that never started, a resume without a checkpoint: the user's error, no run to report
    except Exception as err:  # noqa: BLE001 - the report is written with it, and RunFailed says why
        logger.error("training failed: %r", err)
        return err
    return None
