"""What happened to the model, read from the audit logs: which tries of which steps the
trainers committed and who computed which microbatches, and every load that changed a
state (a trainer's dense model set to a checkpoint's, a shard's rows set to a checkpoint
chain's). The replay trusts these lines for *which* events happened and recomputes their
consequences; a replica promotion, a heal and a trainer's death change nothing."""

from __future__ import annotations

from dataclasses import dataclass, field

from verify.files import RunFiles

__all__ = ["Commit", "DenseLoad", "ShardLoad", "History", "read_history"]


@dataclass
class Commit:
    """One committed try of ``step``: ``shares`` (rank, microbatch ids in the order that
    trainer fed them, threads it computed with), rank order; a share nobody logged (its
    trainer was killed as it committed) has rank None."""

    step: int
    try_: tuple[int, ...] | None
    t: float
    shares: list[tuple[int | None, list[int], int | None]] = field(default_factory=list)
    dense: list[tuple[int, str]] = field(default_factory=list)  # (rank, digest of its dense state after)


@dataclass
class DenseLoad:
    step: int  # the dense model is now checkpoint ``step``'s (0: the initial one)
    t: float
    why: str


@dataclass
class ShardLoad:
    shard: int
    generation: int
    chain: list[int]  # the checkpoints it merged, oldest first ([]: the initial rows)
    why: str
    t: float
    first_step: int | None  # the first step this generation served after the load


@dataclass
class History:
    commits: list[Commit]
    dense_loads: list[DenseLoad]
    shard_loads: list[ShardLoad]
    # (shard, generation) -> [table, row_start, row_end]: a resume on another plan changes them
    slices: dict[tuple[int, int], list[tuple[int, int, int]]]
    # (step, (generation, attempt)) -> (shard, the generation whose rows it holds, audit file name, digest of the
    # rows after the apply)
    applies: dict[tuple, list[tuple[int, str, str]]] = field(default_factory=dict)
    accelerated: list[str] = field(default_factory=list)  # shards that ran on a GPU: other kernels, other sums
    opened: dict[tuple[int, int], float] = field(default_factory=dict)  # (shard, generation) -> when its log opened

    def slices_of(self, shard: int, generation: int | None = None) -> list[tuple[int, int, int]]:
        """The rows generation ``generation`` of ``shard`` held: its own log's, else those of the
        shard's latest generation before it (a mirror holds its primary's); None: the latest."""
        gens = [g for k, g in self.slices if k == shard and (generation is None or g <= generation)]
        return self.slices[(shard, max(gens))] if gens else []

    def shards(self) -> set[int]:
        return {k for k, _ in self.slices}

    def events(self) -> list:
        """Every event in time order."""
        return sorted([*self.commits, *self.dense_loads, *self.shard_loads], key=lambda e: e.t)


def read_history(run: RunFiles, m: int) -> History:
    groups: dict[tuple, list[dict]] = {}
    aborted: set[tuple] = set()  # tries a trainer logged committed before it learnt they were aborted
    dense_loads: list[DenseLoad] = []
    for f in run.trainers:
        lighthouse, threads = None, None
        for i, r in enumerate(f.records):
            kind = r.get("event")
            if kind == "open":
                lighthouse, threads = r.get("lighthouse"), r.get("threads")
            elif kind == "commit":
                key = ("try", *r["try"]) if r.get("try") is not None else ("quorum", r["step"], r["quorum"], lighthouse)
                groups.setdefault(key, []).append({**r, "_threads": threads})
            elif kind == "aborted" and r.get("try") is not None:
                aborted.add(("try", *r["try"]))
            elif kind == "load" and _trained_from(f.records[i + 1:], int(r["step"])):
                dense_loads.append(DenseLoad(int(r["step"]), float(r["t"]), str(r.get("why"))))
    commits = [_commit(records, m) for key, records in groups.items() if key not in aborted]
    shard_loads: list[ShardLoad] = []
    slices: dict[tuple[int, int], list[tuple[int, int, int]]] = {}
    opened: dict[tuple[int, int], float] = {}
    applies: dict[tuple, list[tuple[int, str, str]]] = {}
    devices: set[str] = set()
    for k, files in run.shards.items():
        for f in files:
            # A mirror holds the rows of the generation it mirrors (its "base" line names it).
            gen = f.gen if f.kind == "shard" else next((r.get("primary_gen") for r in f.records
                                                        if r.get("event") == "base"), None)
            for r in f.records:  # a mirror's applies too: its rows must be the shard's at every step
                if r.get("event") == "apply" and r.get("rows") and r.get("try") is not None:
                    applies.setdefault((int(r["step"]), tuple(r["try"])), []).append((k, gen, f.path.name, r["rows"]))
            if f.kind != "shard":  # a mirror's own log: its rows are the shard's until it takes its place
                continue
            records = sorted(f.records, key=lambda r: (r.get("t", 0.0), r["_line"]))
            for i, r in enumerate(records):
                kind = r.get("event")
                if kind == "open" and "slices" in r and (k, int(f.gen or 0)) not in slices:
                    slices[(k, int(f.gen or 0))] = [tuple(int(x) for x in s) for s in r["slices"]]
                    opened[(k, int(f.gen or 0))] = float(r.get("t", 0.0))
                if kind == "open" and str(r.get("device", "cpu")) != "cpu":
                    devices.add(f"shard {k} ({f.path.name}) on {r['device']}")
                if kind != "load" or r.get("why") == "replica":
                    continue
                served = next((int(n["step"]) for n in records[i + 1:] if n.get("event") in ("complete", "apply")), None)
                shard_loads.append(ShardLoad(k, int(f.gen or 0), [int(c) for c in r.get("chain") or []],
                                             str(r.get("why")), float(r["t"]), served))
    commits = [c for c in commits if not _never_applied(c, run) or _went_on_from(c, run)]
    return History(sorted(commits, key=lambda c: c.t), sorted(dense_loads, key=lambda d: d.t),
                   sorted(shard_loads, key=lambda s: s.t), slices, applies, sorted(devices), opened)


def _never_applied(c: Commit, run: RunFiles) -> bool:
    """A try a trainer logged committed (its vote went with the commit report, not waited for)
    and then died before it heard the answer: the run did not go on from it if no shard ever
    applied it and a shard applied another try of that step after it. The trainers that took
    over started from a checkpoint, and the shards never held it."""
    if c.try_ is None:
        return False
    g, s, a = c.try_
    later = False
    for files in run.shards.values():
        for f in files:
            for r in f.records:
                if r.get("event") != "apply" or int(r["step"]) != s or r.get("try") is None:
                    continue
                if tuple(r["try"]) == (g, a):
                    return False
                later = later or float(r["t"]) > c.t
    return later


def _went_on_from(c: Commit, run: RunFiles) -> bool:
    """The trainers went on from ``c``: a trainer that logged it committed next committed the
    step after it (no load, heal or abort between), so its step holds in the dense model even
    though every shard lost it. Judged in each trainer's own log, never by comparing times
    across processes: a peer may load the checkpoint a moment before a dying trainer logs its
    lone try."""
    key = list(c.try_ or ())
    for f in run.trainers:
        for i, r in enumerate(f.records):
            if r.get("event") != "commit" or r.get("try") != key:
                continue
            after = next((n for n in f.records[i + 1:] if n.get("event") in ("commit", "load", "heal", "aborted")), None)
            if after is not None and after["event"] == "commit" and int(after["step"]) == c.step + 1:
                return True
    return False


def _trained_from(after: list[dict], step: int) -> bool:
    """A trainer's load set the run's dense model only if that trainer went on from it: its
    next commit is of the loaded step. A replacement starts from the newest checkpoint and
    then heals from a live peer ahead of it: that load was superseded (a heal to the loaded
    step itself changes nothing: every trainer there loaded the same checkpoint)."""
    for r in after:
        if r.get("event") == "heal" and int(r["step"]) == step:
            continue  # a quorum of trainers that all loaded it: the same state
        if r.get("event") in ("heal", "load", "open"):
            return False
        if r.get("event") == "commit":
            return int(r["step"]) == step
    return False


def _commit(records: list[dict], m: int) -> Commit:
    step = int(records[0]["step"])
    by_rank: dict[int, dict] = {}
    for r in records:
        by_rank.setdefault(int(r["rank"]), r)
    shares: list[tuple[int | None, list[int], int | None]] = [
        (rank, [int(i) for i in r["microbatches"]], r["_threads"]) for rank, r in sorted(by_rank.items())]
    logged = {i for _, ids, _ in shares for i in ids}
    missing = [i for i in range(step * m, step * m + m) if i not in logged]
    if missing:
        shares.append((None, missing, None))
    t = min(float(r["t"]) for r in records)
    try_ = tuple(records[0]["try"]) if records[0].get("try") is not None else None
    dense = [(rank, r["dense"]) for rank, r in sorted(by_rank.items()) if r.get("dense")]
    return Commit(step, try_, t, shares, dense)
