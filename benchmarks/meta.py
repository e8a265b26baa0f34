"""What every benchmark result carries: the commit, the machine, the date and the command."""

from __future__ import annotations

import datetime
import os
import platform
import shlex
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _memory_gib() -> float | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return round(int(line.split()[1]) / 2**20, 1)
    except OSError:
        pass
    return None


def run_metadata() -> dict:
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True).stdout.strip()

    dirty = bool(git("status", "--porcelain", "--untracked-files=no"))
    return {
        "commit": (git("rev-parse", "--short", "HEAD") or "unknown") + ("+dirty" if dirty else ""),
        "machine": {"cpu": _cpu_model(), "cores": os.cpu_count(), "memory_gib": _memory_gib(),
                    "python": platform.python_version()},
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join(shlex.quote(a) for a in ["python", *sys.argv]),
    }


def describe(meta: dict) -> str:
    m = meta["machine"]
    return (f"`{meta['command']}` at commit `{meta['commit']}` on {m['cpu']}, {m['cores']} cores, "
            f"{m['memory_gib']} GiB, Python {m['python']}, {meta['date']}")
