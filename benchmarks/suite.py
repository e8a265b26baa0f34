"""The test suite as the README's second command runs it, recorded: runs ``./dev.sh test`` (or the
command after ``--``) in the repository, streams its output, and writes
benchmarks/results/suite.json: the commit, the machine, the date, the command, the exit status,
pytest's summary line (tests passed, failed, skipped; its seconds), the wall time with setup, and
the console's first and last lines. ``render`` draws the README's block from it.

    .venv/bin/python benchmarks/suite.py                 # ./dev.sh test, from this checkout
    .venv/bin/python benchmarks/suite.py --name suite_unit -- ./dev.sh unit   # the unit tier: suite_unit.json
    .venv/bin/python benchmarks/suite.py --out DIR -- bash .ci/run
    python3 benchmarks/suite.py --from-log LOG --repo CLONE   # a run already made: its log, its checkout

``--from-log`` records a run that was not started by this script (a clean clone's ``bash .ci/run``
whose output went to LOG, with ``time``'s "real" line): the commit is CLONE's HEAD, the date the
log's last write.
"""

from __future__ import annotations

import argparse
import datetime
import json
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.meta import run_metadata  # noqa: E402

SUMMARY = re.compile(r"^=*\s*(?P<counts>\d+ \w+.*) in (?P<seconds>[\d.]+)s(?: \((?P<clock>[\d:]+)\))?\s*=*$")
_NOISE = re.compile(r"^WARNING: Location 'file:")  # pip's notes about absent local indexes


def summary_of(lines: list[str]) -> dict | None:
    """pytest's last summary line, as counts and seconds: '604 passed, 4 warnings in 860.69s (0:14:20)'."""
    for line in reversed(lines):
        m = SUMMARY.match(line.strip())
        if m:
            counts = {kind: int(n) for n, kind in re.findall(r"(\d+) (\w+)", m["counts"])}
            return {"line": line.strip().strip("= "), "counts": counts, "seconds": float(m["seconds"])}
    return None


def _from_log(log: Path, repo: Path, command: str) -> tuple[dict, list[str], int, float]:
    lines = [x for x in log.read_text().splitlines() if not _NOISE.match(x)]
    rc = next((int(x[3:]) for x in reversed(lines) if x.startswith("rc=")), None)
    real = next((x.split()[1] for x in lines if x.startswith("real\t") or x.startswith("real ")), "0m0s")
    minutes, seconds = real.rstrip("s").split("m")
    head = subprocess.run(["git", "-C", str(repo), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    date = datetime.datetime.fromtimestamp(log.stat().st_mtime, datetime.timezone.utc).isoformat(timespec="seconds")
    meta = {**run_metadata(), "commit": head.stdout.strip(), "date": date, "command": command}
    body = [x for x in lines if not x.startswith(("rc=", "real", "user", "sys")) and x.strip()]
    return meta, body, rc, int(minutes) * 60 + float(seconds)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(ROOT / "benchmarks/results"))
    parser.add_argument("--name", default="suite", help="The results file's name: NAME.json.")
    parser.add_argument("--tail", type=int, default=1, help="Last console lines kept besides the summary.")
    parser.add_argument("--from-log", type=Path, help="Record this log of a run made already (see above).")
    parser.add_argument("--repo", type=Path, default=ROOT, help="With --from-log: the checkout that ran it.")
    parser.add_argument("command", nargs="*", default=["./dev.sh", "test"])
    args = parser.parse_args()
    if args.from_log:
        meta, lines, rc, wall_s = _from_log(args.from_log, args.repo, " ".join(args.command))
        return _write(args, meta, lines, rc, wall_s)
    meta = run_metadata()  # before the run: the commit it tests
    t0 = time.monotonic()
    proc = subprocess.Popen(args.command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines = []
    for line in proc.stdout:
        sys.stdout.write(line)
        if not _NOISE.match(line):
            lines.append(line.rstrip("\n"))
    rc = proc.wait()
    return _write(args, {**meta, "command": " ".join(args.command)}, lines, rc, time.monotonic() - t0)


def _write(args, meta: dict, lines: list[str], rc: int, wall_s: float) -> int:
    result = {"meta": meta, "exit_status": rc, "wall_s": round(wall_s, 1), "summary": summary_of(lines),
              "first_lines": lines[:1], "last_lines": lines[-args.tail:]}
    out = Path(args.out) / f"{args.name}.json"
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {out}")
    return rc


def render(result: dict) -> str:
    """The console's first and last lines as a block, and what they say in one sentence."""
    s = result.get("summary") or {}
    body = "\n".join(["$ " + result["meta"]["command"], *result["first_lines"], "...", *result["last_lines"]])
    said = (f"Exit status {result['exit_status']}; {s.get('line', 'no pytest summary')}; "
            f"{result['wall_s'] / 60:.1f} minutes with the setup.")
    return f"{said}\n\n```text\n{body}\n```\n"


if __name__ == "__main__":
    sys.exit(main())
