"""The kill the injector sends, against a process that dies on its own around it: a zombie is
never signalled or recorded, and a kill recorded with the supervisor whose signal then finds no
process is withdrawn from its books and logged as aborted, so the report and the fault log agree
(``cpr verify`` found a kill recorded twice by the chaos schedule in the soak)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import ray

from actors.faults import kill_process, kill_processes
from verify.files import load_run
from verify.kills import landed_kills


class _Books:
    """Stands for the supervisor's two kill methods (a handle's ``.remote`` returns a real
    object ref). ``reap`` is a process that dies while the kill is being recorded."""

    def __init__(self, reap: subprocess.Popen | None = None):
        self.recorded, self.withdrawn, self.reap = [], [], reap
        self.record_kill = _Method(self._record)
        self.withdraw_kill = _Method(self.withdrawn.append)

    def _record(self, kill):
        self.recorded.append(kill)
        if self.reap is not None:
            self.reap.kill()
            self.reap.wait()


class _Method:
    def __init__(self, fn):
        self.fn = fn

    def remote(self, *args):
        return ray.put(self.fn(*args))


def _run_dir(tmp_path):
    (tmp_path / "config.yaml").write_text("{}\n")  # all load_run needs besides the fault log
    return load_run(tmp_path)


def _sleeper() -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])


def test_a_zombie_is_not_killed_again_and_nothing_is_recorded(ray_local, tmp_path):
    child = _sleeper()
    os.kill(child.pid, signal.SIGKILL)
    os.waitid(os.P_PID, child.pid, os.WEXITED | os.WNOWAIT)  # dead, not reaped: a zombie
    books = _Books()
    assert kill_process(books, "shard:0", child.pid, "test", str(tmp_path / "faults")) is None
    assert books.recorded == [] and not (tmp_path / "faults").exists()
    child.wait()


def test_a_kill_whose_target_died_while_it_was_recorded_is_withdrawn(ray_local, tmp_path):
    child = _sleeper()
    books = _Books(reap=child)
    log_dir = str(tmp_path / "faults")
    assert kill_process(books, "trainer:1", child.pid, "test", log_dir) is None
    assert len(books.recorded) == 1 and books.withdrawn == books.recorded
    run = _run_dir(tmp_path)
    assert [r["event"] for r in run.faults] == ["sending", "aborted"]
    assert landed_kills(run) == ([], [])


def test_a_live_process_is_killed_once_and_logged_as_sent(ray_local, tmp_path):
    child = _sleeper()
    books = _Books()
    when = kill_process(books, "shard:1", child.pid, "test", str(tmp_path / "faults"))
    assert child.wait(timeout=10) == -signal.SIGKILL
    assert [k.time for k in books.recorded] == [when] and books.withdrawn == []
    kills, problems = landed_kills(_run_dir(tmp_path))
    assert [(k.target, k.pid) for k in kills] == [("shard:1", child.pid)] and problems == []


def test_every_trainer_is_recorded_first_and_then_all_are_signalled_together(ray_local, tmp_path):
    """``all_trainers``: no victim dies before every kill is recorded, so none sees another's
    death (and exits, or is restarted) before its own signal (a flaky fault test lost the
    second trainer's kill that way)."""
    children = [_sleeper(), _sleeper()]
    alive_at_record = []

    class _Watching(_Books):
        def _record(self, kill):
            alive_at_record.append([c.poll() is None for c in children])
            super()._record(kill)

    books = _Watching()
    log_dir = str(tmp_path / "faults")
    times = kill_processes(books, [("trainer:0", children[0].pid), ("trainer:1", children[1].pid)], "test", log_dir)
    assert [c.wait(timeout=10) for c in children] == [-signal.SIGKILL] * 2
    assert alive_at_record == [[True, True], [True, True]]
    assert times == [k.time for k in books.recorded] and books.withdrawn == []
    kills, problems = landed_kills(_run_dir(tmp_path))
    assert sorted(k.target for k in kills) == ["trainer:0", "trainer:1"] and problems == []
