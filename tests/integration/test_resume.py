"""Kill the driver mid-run, resume from the last valid checkpoint: the resumed run starts
exactly at the checkpoint's step and the final report counts every sample once."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from ray._common.test_utils import wait_for_condition

from core.checkpoint import CheckpointStore
from verify.replay.engine import replay_dir

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]

M, B = 4, 128


def _driver_env(ray_local) -> dict:
    env = dict(os.environ)
    env["RAY_ADDRESS"] = ray_local.get_runtime_context().gcs_address
    return env


def test_kill_driver_then_resume(ray_local, small_data, tmp_path):
    run_dir = tmp_path / "run"
    train = tmp_path / "train.tsv"  # a copy of its own: the resume is first tried on changed data
    shutil.copy2(small_data.train_path, train)
    config = {
        "run_dir": str(run_dir),
        "seed": 3,
        "data": {"train": [str(train)], "eval": [small_data.eval_path]},
        "model": {"embedding_dim": 8, "table_rows": 20_000, "dense_arch": [32, 8], "over_arch": [32, 1]},
        "training": {"num_trainers": 2, "microbatch_rows": B, "microbatches_per_step": M, "epochs": 1},
        "checkpoint": {"every_steps": 30, "keep_last": 2},
        # A shard failure in the first attempt: the resumed run's report must still count it.
        "faults": {"max_failures": 0, "at_steps": {"shard:1": [35]}},
        "audit_log": True,
    }
    cfg_path = tmp_path / "c.yaml"
    cfg_path.write_text(yaml.safe_dump(config))
    env = _driver_env(ray_local)
    cmd = [sys.executable, "-m", "app", "train", "--no-progress"]
    first_out = open(tmp_path / "first.out", "w")
    # -v: the workers' output is on the console too.
    first = subprocess.Popen(cmd + ["-v", "--config", str(cfg_path)], env=env, stdout=first_out, stderr=subprocess.STDOUT)
    store = CheckpointStore(str(run_dir / "checkpoints"))
    try:
        wait_for_condition(lambda: any(s >= 60 for s in store.list_committed()), timeout=240, retry_interval_ms=200)
    finally:
        first.send_signal(signal.SIGKILL)
        first.wait(timeout=30)
        first_out.close()
    first_run = json.loads((run_dir / "run.json").read_text())["run_id"]
    # Its trainers' slabs, left by the kill: usually, since the trainers die with the driver;
    # a trainer that outlived its shards for a moment dropped its own. One more, as a
    # killed trainer of another pid leaves it, so that the resume has one to remove.
    left = Path("/dev/shm") / f"cpr-{first_run}-s0-{2**22 + 1}-1-1"
    left.write_bytes(b"\0" * 4096)
    verbose = (tmp_path / "first.out").read_text()
    assert "(RayTrainWorker pid=" in verbose and "torchft" in verbose, verbose[-3000:]
    assert not (run_dir / "report.json").exists(), "the first run finished before it was killed"
    last = store.latest_valid()
    assert last is not None and last.step >= 60  # the schedule shifts after the shard failure

    # What the dead run left on disk is enough to draw it: cpr report rebuilds its summary
    # and plots from the events and progress the supervisor appended as it went.
    drawn = subprocess.run([sys.executable, "-m", "app", "report", str(run_dir)], env=env, capture_output=True,
                           text=True, timeout=120)
    assert drawn.returncode == 0, drawn.stderr[-3000:]
    summary = (run_dir / "summary.txt").read_text()
    assert "CRASHED" in summary, summary
    progress = [json.loads(line) for line in (run_dir / "progress.jsonl").read_text().splitlines() if line.strip()]
    assert max(p["step"] for p in progress) >= last.step - 10  # progress comes every 10 steps
    for png in ("timeline.png", "overhead.png"):
        assert (run_dir / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", png
    assert not (run_dir / "report.json").exists()

    # A fresh run into the same run_dir must not silently overwrite its checkpoints.
    refused = subprocess.run(cmd + ["--config", str(cfg_path)], env=env, capture_output=True, text=True, timeout=120)
    assert refused.returncode == 2 and "--resume" in refused.stderr

    # Other training data under the same name: refused before anything is built, naming the file.
    stores = sorted(p.name for p in (run_dir.parent / "cache").iterdir())
    original, st = train.read_bytes(), train.stat()
    train.write_bytes(original + original.splitlines(keepends=True)[0])
    changed = subprocess.run(cmd + ["--resume", str(run_dir)], env=env, capture_output=True, text=True, timeout=120)
    assert changed.returncode == 2, changed.stderr[-3000:]
    said = [line for line in changed.stderr.splitlines() if line.strip()]
    assert len(said) == 1 and said[0].startswith("error: --resume: the training data changed since checkpoint step "), said
    assert f"{train}: size {st.st_size} -> " in said[0]
    assert sorted(p.name for p in (run_dir.parent / "cache").iterdir()) == stores
    train.write_bytes(original)
    os.utime(train, ns=(st.st_atime_ns, st.st_mtime_ns))

    resumed = subprocess.run(cmd + ["--resume", str(run_dir)], env=env, capture_output=True, text=True, timeout=400)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    # Without -v the console is the product's own lines; everything else is in RUN_DIR/logs.
    console = [line for line in (resumed.stdout + resumed.stderr).splitlines() if line.strip()]
    assert len(console) <= 40, console
    for noise in ("pid=", "Successfully loaded", "Warning", "torchft", "PlacementGroupCleaner", "Traceback"):
        assert not [line for line in console if noise in line], (noise, console)
    # The killed run's trainers left shared-memory slabs; the resumed run removed them.
    assert not list(Path("/dev/shm").glob(f"cpr-{first_run}-*"))
    logs = run_dir / "logs"
    trainer_logs = "".join(f.read_text() for f in logs.glob("trainer-*.log"))
    assert "torchft.manager" in trainer_logs
    # fbgemm's import lines: in the shards' logs (trainers no longer import fbgemm).
    assert "Successfully loaded" in "".join(f.read_text() for f in logs.glob("shard-*.log"))
    assert list(logs.glob("shard-*.log")) and list(logs.glob("supervisor-*.log")) and (logs / "driver.log").exists()
    report = json.loads((run_dir / "report.json").read_text())
    events = {e["kind"]: e for e in report["events"]}
    total_steps = report["steps"]
    assert report["resumed_from_step"] == last.step
    assert events["resumed"]["step"] == last.step
    assert events["training_started"]["step"] == last.step
    assert total_steps == 234
    assert report["samples_trained"] == total_steps * M * B
    assert report["samples_this_run"] == (total_steps - last.step) * M * B
    assert report["auc"] > 0.72
    # The report covers both attempts: the first attempt's kill, failure and lost samples are
    # in it (before, --resume truncated the event files and overwrote the journal, so the
    # failure vanished while every step's samples still counted: PLS under-reported).
    assert report["attempts"] == 2
    [failure] = report["failures"]
    assert failure["actor"] == "shard:1" and failure["recovery"] == "partial" and failure["lost_samples"] > 0
    assert [k["target"] for k in report["faults_injected"]] == ["shard:1"], "the fault fired once, ever"
    assert report["pls"] == pytest.approx(failure["lost_samples"] / report["samples_trained"])
    kinds = [json.loads(line)["kind"] for line in (run_dir / "events.jsonl").read_text().splitlines()]
    assert kinds.index("shard_recovered") < kinds.index("attempt_started") < kinds.index("resumed")
    # The model the two attempts made is the one the replay recomputes: the second attempt's
    # tries of the steps it redid are its own, never merged with the first's of the same number.
    replayed = replay_dir(run_dir)
    assert (replayed.findings, replayed.gaps) == ([], []), (replayed.findings, replayed.gaps)
    assert replayed.steps >= total_steps and len(replayed.checkpoints) >= 2
