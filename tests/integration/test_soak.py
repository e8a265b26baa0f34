"""A short soak in the suite: eleven SIGKILLs of every kind in one run (two shards, both
trainers one at a time, every trainer at once, the supervisor twice, a shard in the middle
of a save, the supervisor in the middle of a recovery), tied to training steps and named
points so the run sees all of them on a machine of any speed. The run is checked by ``cpr
verify``, the soak's checker, from the files other processes wrote: every kill in the
injector's own log is in the report and no other, each shard and the dense optimizer
applied every step of the final timeline exactly once with its M microbatches (a
rolled-back step exactly once more), every checkpoint verifies, the lost samples recount,
nothing is left behind. ``benchmarks/soak.py`` runs the long, random version."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.integration.checks import verified
from verify import verify_run

from .small_runs import small_run_config, train_to_report

pytestmark = [pytest.mark.integration, pytest.mark.timeout(500)]

M, STEPS = 4, 185
# 75 steps between trainer:1's kill and every trainer's: its replacement (7-15 s to start)
# is back by then on a slower machine too, so both kills land on live processes.
KILLS = {
    "shard:0": [15],
    "trainer:1": [30],
    "supervisor": [45, 150],
    "shard:1": [60],
    "all_trainers": [105],
    "trainer:0": [135],
    "shard": [165],
}
POINTS = [{"at": "save.files_written", "kill": "shard:1"}, {"at": "recovery.spawned", "kill": "supervisor"}]


@pytest.fixture(scope="module")
def soak(ray_local, small_data, tmp_path_factory):
    """The short soak, run once: (config, report)."""
    tmp_path = tmp_path_factory.mktemp("soak")
    cfg = small_run_config(
        tmp_path, small_data, seed=5, steps=STEPS, microbatches=M, call_timeout_s=30, collective_timeout_s=30,
        checkpoint={"policy": "mfu", "r": 0.2, "full_every": 3, "every_steps": 10, "keep_last": 1000},
        faults={"seed": 3, "at_steps": KILLS, "at_points": POINTS},
    )
    report = train_to_report(cfg)
    return cfg, report


def test_short_soak_eleven_kills_of_every_kind(soak):
    cfg, report = soak
    summary = {k: report.get(k) for k in ("steps", "state", "supervisor_restarts", "all_trainers_failed")}
    verdict = verified(cfg.run_dir)  # cpr verify --replay
    # Every trainer at once: one kill per trainer. Counted from the injector's own log.
    kinds = verdict.facts["kills_by_kind"]
    assert (kinds.get("supervisor"), kinds.get("shard"), kinds.get("trainer")) == (3, 4, 4), (kinds, summary)
    assert report["supervisor_restarts"] == 3, summary
    assert len(report["all_trainers_failed"]) == 1, summary
    assert len(report["failures"]) == 4 and {f["shard"] for f in report["failures"]} == {0, 1}, report["failures"]
    assert verdict.violations == [], (verdict.violations, summary)
    assert verdict.facts["kills"] == 11 and verdict.facts["partial_recoveries"] >= 1, verdict.facts
    # The command line says the same, from a plain shell.
    done = subprocess.run([sys.executable, "-m", "app", "verify", cfg.run_dir, "--wait", "0"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "sound: 185 steps, 11 kills" in done.stdout, (done.stdout, done.stderr)


# --------------------------------------------------------------------------- the checker, tested
# Each mutation of the sound run directory must be reported; the directory is restored after.


def _lines(path: Path) -> list[str]:
    return path.read_text().splitlines(keepends=True)


def _shard_file(run: Path) -> Path:
    return max(run.glob("audit/shard-0-g*.jsonl"), key=lambda p: len(_lines(p)))


def _applied_line(path: Path) -> int:
    lines = _lines(path)
    return next(i for i in range(len(lines) // 2, len(lines)) if '"apply"' in lines[i])


def _drop_apply(run: Path):
    path = _shard_file(run)
    lines = _lines(path)
    del lines[_applied_line(path)]
    path.write_text("".join(lines))


def _duplicate_apply(run: Path):
    path = _shard_file(run)
    lines = _lines(path)
    i = _applied_line(path)
    lines.insert(i + 1, lines[i])
    path.write_text("".join(lines))


def _drop_commit(run: Path):
    path = max(run.glob("audit/trainer-*.jsonl"), key=lambda p: len(_lines(p)))
    lines = _lines(path)
    del lines[next(i for i in range(len(lines) // 2, len(lines)) if '"commit"' in lines[i])]
    path.write_text("".join(lines))


def _tear_middle_line(run: Path):
    path = _shard_file(run)
    lines = _lines(path)
    i = _applied_line(path)
    lines[i] = lines[i][: len(lines[i]) // 2] + "\n"
    path.write_text("".join(lines))


def _report(run: Path, change):
    path = run / "report.json"
    report = json.loads(path.read_text())
    change(report)
    path.write_text(json.dumps(report))


def _drop_reported_kill(run: Path):
    _report(run, lambda r: r["faults_injected"].pop(len(r["faults_injected"]) // 2))


def _add_reported_kill(run: Path):
    _report(run, lambda r: r["faults_injected"].append({**r["faults_injected"][0], "time": 1.0e9}))


def _change_lost_samples(run: Path):
    _report(run, lambda r: r.update(lost_samples=r["lost_samples"] + 1.0))


def _flip_checkpoint_byte(run: Path):
    path = max(run.glob("checkpoints/ckpt-*/shard-1.arrow"))
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))


MUTATIONS = {
    "drop an applied line": (_drop_apply, "skipped steps"),
    "duplicate an applied line": (_duplicate_apply, "again"),
    "drop a trainer's commit line": (_drop_commit, ("not all of", "never committed")),
    "tear a line that is not the last": (_tear_middle_line, "does not parse and is not its writer's last"),
    "remove a kill from the report": (_drop_reported_kill, "in the fault log but not in the report"),
    "add a kill to the report": (_add_reported_kill, "that the fault log lacks"),
    "change the report's lost samples": (_change_lost_samples, "lost samples"),
    "flip a byte of a checkpoint file": (_flip_checkpoint_byte, "hashes to"),
}


@pytest.mark.parametrize("mutation", list(MUTATIONS))
def test_the_checker_reports_each_mutation_of_a_sound_run(soak, mutation):
    cfg, _ = soak
    run = Path(cfg.run_dir)
    mutate, expected = MUTATIONS[mutation]
    backup = run.parent / "backup"
    shutil.rmtree(backup, ignore_errors=True)
    shutil.copytree(run, backup, ignore=shutil.ignore_patterns("checkpoints", "ray_train"))
    shards = {p: p.read_bytes() for p in run.glob("checkpoints/ckpt-*/shard-1.arrow")}
    try:
        mutate(run)
        verdict = verify_run(run, wait_s=0)
    finally:
        for p, data in shards.items():
            p.write_bytes(data)
        for p in backup.rglob("*"):
            if p.is_file():
                shutil.copy2(p, run / p.relative_to(backup))
        shutil.rmtree(backup)
    expected = (expected,) if isinstance(expected, str) else expected
    assert any(e in v for e in expected for v in verdict.violations), verdict.violations


def test_the_checker_reports_a_process_left_running(soak):
    cfg, _ = soak
    run = Path(cfg.run_dir)
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    log = run / "logs" / f"shard-0-{proc.pid}.log"
    try:
        log.write_text("a shard process that outlived its run\n")
        verdict = verify_run(run, wait_s=0)
    finally:
        proc.kill()
        proc.wait()
        log.unlink()
    assert any(f"process {proc.pid}" in v for v in verdict.violations), verdict.violations
