"""What a new user does first: `cpr train` from a plain shell (no Ray or gloo variables, no
dev.sh), with a config that names no run_dir, under a random kill. The run gets a directory
of its own, `runs/latest` points to it, and the console says each kill once."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]


def plain_env() -> dict[str, str]:
    """The environment of a fresh login shell: nothing that dev.sh or the suite's Ray set."""
    return {k: v for k, v in os.environ.items() if not k.startswith(("RAY_", "GLOO_", "CPR_"))}


def test_cpr_train_from_a_plain_shell_in_a_run_dir_of_its_own(small_data, tmp_path):
    config = {
        "seed": 1,
        "data": {"train": [small_data.train_path], "eval": [small_data.eval_path],
                 "cache_dir": str(tmp_path.parent / "cache")},
        "model": {"embedding_dim": 8, "table_rows": 20_000, "dense_arch": [32, 8], "over_arch": [32, 1]},
        "embeddings": {"num_shards": 2},
        "training": {"num_trainers": 1, "microbatch_rows": 128, "microbatches_per_step": 4, "max_steps": 60},
        "checkpoint": {"every_steps": 20},
        # One kill by the driver's schedule (the path whose console said each kill twice).
        "faults": {"targets": ["shards"], "max_failures": 1, "mtbf_s": 1.0, "distribution": "fixed"},
    }
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(config))
    cpr = str(Path(sys.executable).parent / "cpr")
    done = subprocess.run([cpr, "train", "--no-progress", "--config", "c.yaml"], cwd=tmp_path, env=plain_env(),
                          capture_output=True, text=True, timeout=280)
    console = (done.stdout + done.stderr).splitlines()
    assert done.returncode == 0, "\n".join(console[-60:])

    runs = tmp_path / "runs"
    [run_dir] = [p for p in runs.iterdir() if p.name not in ("latest", "cache")]  # cache: the default data.cache_dir
    assert (runs / "latest").resolve() == run_dir.resolve()
    report = json.loads((runs / "latest" / "report.json").read_text())
    assert report["steps"] == 60 and len(report["faults_injected"]) == 1
    assert f"report: {Path('runs') / run_dir.name}/report.json" in console

    [kill] = report["faults_injected"]
    assert [line for line in console if kill["target"] in line and ("killing" in line or "killed" in line)] == [
        f"[chaos] killing {kill['target']} (pid {kill['pid']}, schedule)"
    ], console
    for noise in ("could not kill", "-0.0", "Traceback", "AuthenticationError"):
        assert not [line for line in console if noise in line], (noise, console)
