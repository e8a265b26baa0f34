"""What a finished run left on disk, read by the checker itself: the run's config and report,
the audit logs of shards, their mirrors and trainers, the fault injector's log. A line that does not parse
is kept as a torn line with its place in the file, never dropped: the checker decides
whether its writer was killed while writing it.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path

import yaml

__all__ = ["AuditFile", "RunFiles", "read_jsonl", "load_run"]

_SHARD_FILE = re.compile(r"^shard-(\d+)-g(\d+)\.jsonl$")
_TRAINER_FILE = re.compile(r"^trainer-(\d+)-(\d+)\.jsonl$")
# A replica-recovery mirror's log from its start (``actors.shard_mirror``): mirror-<shard>-<role>-<pid>.
_MIRROR_FILE = re.compile(r"^mirror-(\d+)-(.+)\.jsonl$")


@dataclass
class AuditFile:
    """One audit log: its records in file order, and the torn lines (index, text)."""

    path: Path
    kind: str  # "shard", "mirror" (a shard's mirror, until its promotion) or "trainer"
    key: int  # the shard id (the mirrored one's for a mirror) or the trainer rank
    gen: int | None  # a shard's generation (None for a mirror: it has none until promoted)
    records: list[dict] = field(default_factory=list)
    torn: list[tuple[int, str]] = field(default_factory=list)
    lines: int = 0

    def writers(self) -> list[int]:
        """The pids that wrote this file (each process writes an "open" line first)."""
        pids = [r["pid"] for r in self.records if r.get("event") == "open" and "pid" in r]
        if self.kind == "trainer" and not pids:
            pids = [int(_TRAINER_FILE.match(self.path.name).group(2))]
        return pids


def read_jsonl(path: Path) -> tuple[list[dict], list[tuple[int, str]], int]:
    """(records, torn lines as (index, text), number of lines) of a JSON-lines file."""
    records, torn, n = [], [], 0
    with open(path, "rb") as f:
        for n, raw in enumerate(f, start=1):
            text = raw.decode("utf-8", errors="replace").rstrip("\n")
            try:
                record = json.loads(text)
                if not isinstance(record, dict):
                    raise ValueError("not an object")
                records.append({**record, "_line": n})
            except ValueError:
                torn.append((n, text))
    return records, torn, n


@dataclass
class RunFiles:
    run_dir: Path
    config: dict
    report: dict | None
    run_info: dict
    shards: dict[int, list[AuditFile]]  # a shard's generations' logs, then its mirrors'
    trainers: list[AuditFile]
    faults: list[dict]
    fault_torn: list[str]

    @property
    def m(self) -> int:
        return int(self.config["training"]["microbatches_per_step"])

    def resolve(self, path: str) -> Path:
        """A path of the config, relative to where the run was started (the run dir's parent
        when it was given relative to it)."""
        p = Path(path)
        if p.is_absolute() or p.exists():
            return p
        rel = self.run_dir.resolve()
        for _ in Path(self.config["run_dir"]).parts:
            rel = rel.parent
        return rel / p


def load_run(run_dir: str | Path) -> RunFiles:
    run_dir = Path(run_dir)
    if not (run_dir / "config.yaml").exists():
        raise FileNotFoundError(f"{run_dir}: no config.yaml; is this a run directory?")
    config = yaml.safe_load((run_dir / "config.yaml").read_text())
    report_path = run_dir / "report.json"
    report = json.loads(report_path.read_text()) if report_path.exists() else None
    info_path = run_dir / "run.json"
    run_info = json.loads(info_path.read_text()) if info_path.exists() else {}
    shards: dict[int, list[AuditFile]] = {}
    mirrors: dict[int, list[AuditFile]] = {}
    trainers: list[AuditFile] = []
    audit = run_dir / "audit"
    for p in sorted(audit.glob("*.jsonl")) if audit.is_dir() else []:
        if (m := _SHARD_FILE.match(p.name)) is not None:
            f = AuditFile(p, "shard", int(m.group(1)), int(m.group(2)))
            shards.setdefault(f.key, []).append(f)
        elif (m := _MIRROR_FILE.match(p.name)) is not None:
            f = AuditFile(p, "mirror", int(m.group(1)), None)
            mirrors.setdefault(f.key, []).append(f)
        elif (m := _TRAINER_FILE.match(p.name)) is not None:
            f = AuditFile(p, "trainer", int(m.group(1)), None)
            trainers.append(f)
        else:
            continue
        f.records, f.torn, f.lines = read_jsonl(p)
    for k, files in mirrors.items():
        shards.setdefault(k, []).extend(files)
    faults, fault_torn = [], []
    for p in sorted((run_dir / "faults").glob("*.jsonl")) if (run_dir / "faults").is_dir() else []:
        records, torn, _ = read_jsonl(p)
        faults += records
        # The injector fsyncs every line before it acts: a torn line is a lost record.
        fault_torn += [f"{p.name} line {i}: {text[:80]!r}" for i, text in torn]
    return RunFiles(run_dir, config, report, run_info, shards, trainers, faults, fault_torn)
