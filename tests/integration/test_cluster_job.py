"""A real Ray head (`ray start --head` on 127.0.0.1), a job submitted through Ray's Jobs
API, as `ray job submit` does; the job succeeds and writes its report."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import shutil
import sys
import tempfile
from pathlib import Path

import pytest
from ray._common.test_utils import wait_for_condition

from benchmarks.throughput_runs import stop_head

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]

ROOT = Path(__file__).resolve().parents[2]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _too_small_is_told_before_training(gcs_port: int, small_data, tmp_path: Path) -> None:
    """The head has 6 CPUs; 2 shards, 1 spare and 6 trainers need 9. `cpr train` from a plain
    shell says so in one error, before training, naming the settings that change it (Ray Train
    would otherwise wait for a worker group it cannot place, and retry)."""
    from tests.integration.test_front_door import plain_env

    argv = [str(Path(sys.executable).parent / "cpr"), "train", "--no-progress", "--config", str(ROOT / "configs/local.yaml"),
            "--set", f"ray.address=127.0.0.1:{gcs_port}", "--set", "training.num_trainers=6",
            "--set", f"run_dir={tmp_path / 'too-small'}", "--set", f"data.train=[{small_data.train_path}]",
            "--set", f"data.eval=[{small_data.eval_path}]", "--set", f"data.cache_dir={tmp_path / 'cache'}"]
    told = subprocess.run(argv, env=plain_env(), capture_output=True, text=True, timeout=120)
    assert told.returncode == 2, (told.stdout + told.stderr)[-3000:]
    # One error, no traceback. (Ray itself may log a line while connecting; once seen, of
    # unknown content: the whole stderr is shown when this fails.)
    errors = [ln for ln in told.stderr.splitlines() if ln.startswith("error:")]
    assert len(errors) == 1 and "Traceback" not in told.stderr, told.stderr[-3000:]
    [line] = errors
    assert line.startswith("error: the cluster is too small for this config: it needs 9 CPUs and the cluster has 6"), line
    for setting in ("training.num_trainers", "embeddings.spares", "embeddings.num_cpus"):
        assert setting in line, line
    assert not (tmp_path / "too-small" / "events.jsonl").exists()  # nothing started


def test_ray_job_submit_to_a_started_head(tmp_path, small_data):
    from ray.job_submission import JobStatus, JobSubmissionClient

    gcs_port, dash_port, agent_port = _free_port(), _free_port(), _free_port()
    env = dict(os.environ)
    env.update(RAY_AUTH_MODE="token", RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0", GLOO_SOCKET_IFNAME="lo",
               RAY_max_direct_call_object_size="1048576")  # as the README's `ray start`
    env.pop("RAY_ADDRESS", None)
    env["PATH"] = f"{Path(sys.executable).parent}:{env['PATH']}"
    # Short: Ray's unix sockets live under it and their paths are limited to 107 bytes.
    temp_dir = tempfile.mkdtemp(prefix="cpr-ray-", dir="/tmp")
    # As the README says: `ray start` with token auth needs a token (only ray.init makes one).
    # On a fresh machine the head would otherwise fail to start.
    ray_cli = str(Path(sys.executable).parent / "ray")
    subprocess.run([ray_cli, "get-auth-token", "--generate"], env=env, check=True, capture_output=True, timeout=60)
    # --block keeps `ray start` in the foreground, owning its processes: stopping its
    # process group stops this head only, not the suite's shared Ray (as `ray stop` would).
    head_log = open(tmp_path / "head.log", "wb")
    head = subprocess.Popen(
        [
            ray_cli, "start", "--head", "--block",
            "--node-ip-address=127.0.0.1", f"--port={gcs_port}", "--dashboard-host=127.0.0.1",
            f"--dashboard-port={dash_port}", "--num-cpus=6", "--disable-usage-stats",
            # Not Ray's default 52365: the suite's own Ray (started by an earlier test) holds it,
            # and a job agent without its port leaves the Jobs API with "No available agent".
            f"--dashboard-agent-listen-port={agent_port}",
            f"--temp-dir={temp_dir}",
        ],
        env=env, start_new_session=True, stdout=head_log, stderr=subprocess.STDOUT,
    )
    try:
        address = f"http://127.0.0.1:{dash_port}"

        def _up() -> bool:
            if head.poll() is not None:
                pytest.fail(f"ray start exited with {head.returncode}: {(tmp_path / 'head.log').read_text()[-2000:]}")
            try:
                JobSubmissionClient(address).list_jobs()
                return True
            except Exception:
                return False

        wait_for_condition(_up, timeout=120, retry_interval_ms=500)
        _too_small_is_told_before_training(gcs_port, small_data, tmp_path)
        client = JobSubmissionClient(address)
        run_dir = tmp_path / "run"
        overrides = [
            f"--set run_dir={run_dir}",
            f"--set data.train=[{small_data.train_path}]",
            f"--set data.eval=[{small_data.eval_path}]",
            f"--set data.cache_dir={tmp_path / 'cache'}",
            f"--set checkpoint.storage={tmp_path / 'ckpt'}",
            "--set training.max_steps=40",
            "--set model.table_rows=20000",
        ]
        submitted: list[str] = []

        def _submit() -> bool:
            # The Jobs API answers before the head's job agent is up ("No available agent to
            # submit job, please try again later"): as a user would, submit again.
            try:
                submitted.append(client.submit_job(
                    entrypoint="python -m app train --config configs/cluster.yaml --no-progress " + " ".join(overrides),
                    runtime_env={"working_dir": str(ROOT), "excludes": [".venv", "/runs", "/data", ".git"]},
                ))
                return True
            except RuntimeError as err:
                if "No available agent" in str(err):
                    return False
                raise

        wait_for_condition(_submit, timeout=120, retry_interval_ms=1000)
        job_id = submitted[0]
        terminal = {JobStatus.SUCCEEDED, JobStatus.FAILED, JobStatus.STOPPED}
        wait_for_condition(lambda: client.get_job_status(job_id) in terminal, timeout=420, retry_interval_ms=1000)
        logs = client.get_job_logs(job_id)
        assert client.get_job_status(job_id) == JobStatus.SUCCEEDED, logs[-3000:]
        report = json.loads((run_dir / "report.json").read_text())
        assert report["steps"] == 40
        assert report["samples_trained"] == 40 * 4 * 512
        assert "held-out AUC" in logs
        assert any(e["kind"] == "checkpoint_saved" and e["step"] == 25 for e in report["events"])
    finally:
        stop_head(head)  # this head's own process group only
        head_log.close()
        shutil.rmtree(temp_dir, ignore_errors=True)
