"""Mutations planted in a sound run's checkpoints, one at a time, as a faulty product would
have written them: the run is recomputed with one defect (an update dropped, doubled or
written to other rows, a shard's recovery that reset its rows to their initial values), and
every checkpoint from the defect on is rewritten with that recomputation's state (rows,
Adagrad state and dense model: a defect in one place reaches every later step), its
manifest re-hashed to match. The audit logs stay as the sound run wrote them: a defect that
writes the log lines a correct run writes. ``cpr verify --replay`` must find each one, at
the first checkpoint after it, naming the shard."""

from __future__ import annotations

import io
import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from core.checkpoint.files import write_blob, write_shard_file
from core.checkpoint.rows import ShardRows
from verify.files import load_run
from verify.replay.data import DataCache, train_store
from verify.replay.engine import Replay
from verify.replay.history import Commit, ShardLoad
from verify.replay.saved import saved_rows
from verify.replay.schedule import Schedule
from verify.replay.tables import Tables, dense_digest
from verify.store import Store

__all__ = ["Mutation", "plant", "copy_run", "change_one_float"]


@dataclass(frozen=True)
class Mutation:
    kind: str  # "drop", "double", "other_rows", "initial_rows", "mirror_skip"
    shard: int
    step: int  # the step whose update is wrong; for initial_rows, the step its recovery served first


def copy_run(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("logs"))
    return dst


class _Faulty(Replay):
    def __init__(self, *args, mutation: Mutation, **kw):
        super().__init__(*args, **kw)
        self.mutation = mutation
        self.states: dict[int, tuple] = {}  # boundary -> (rows per shard, dense) to write
        self.logged: dict[tuple, str] = {}  # the digests its audit lines then carry
        self.mirror: Tables | None = None
        if mutation.kind == "mirror_skip":
            self.promotion = _promotion(self.run, mutation.shard)
            emb = self.run.config["embeddings"]
            self.lr_eps = (float(emb["learning_rate"]), float(emb["eps"]))
        self.done = False

    def _shard_rows(self):
        return {k: [(t, s, e, *self.tables.rows_of(t, np.arange(s, e))) for t, s, e in self.history.slices_of(k)]
                for k in sorted(self.history.shards())}

    def _check_digests(self, c: Commit, merged: np.ndarray) -> None:
        self._last = (c, merged)  # what the faulty process logs: the digests of its state after the step

    def _commit(self, c: Commit) -> None:
        self._mutated_commit(c)
        c, merged = self._last
        params = list(self.model.parameters())
        self.logged[("dense", c.try_)] = dense_digest(params, [self.optimizer.state[p]["sum"] for p in params])
        for k in sorted(self.history.shards()):
            self.logged.setdefault((k, c.step, (c.try_[0], c.try_[2])),
                                   self.tables.digest(self.history.slices_of(k), merged))

    def _mutated_commit(self, c: Commit) -> None:
        mu = self.mutation
        if mu.kind == "mirror_skip":
            return self._mirror_commit(c)
        if self.done or mu.kind == "initial_rows" or c.step != mu.step:
            return super()._commit(c)
        self.done = True
        mine = self.history.slices_of(mu.shard)
        before = [(t, s, e, *self.tables.rows_of(t, np.arange(s, e))) for t, s, e in mine]
        captured = []
        original = self.tables.step
        self.tables.step = lambda ids, grad: (captured.append((ids, grad)), original(ids, grad))[1]
        try:
            super()._commit(c)
        finally:
            self.tables.step = original
        after = [(t, s, e, *self.tables.rows_of(t, np.arange(s, e))) for t, s, e in mine]
        if mu.kind == "drop":
            for t, s, _, w, m in before:
                self.tables.put(t, np.arange(s, s + len(w)), w, m)
        elif mu.kind == "double":
            others = self._shard_rows()
            original(*captured[0])
            for k, rows in others.items():
                if k != mu.shard:
                    for t, s, _, w, m in rows:
                        self.tables.put(t, np.arange(s, s + len(w)), w, m)
        elif mu.kind == "other_rows":
            for (t, s, _, w0, m0), (_, _, _, w1, m1) in zip(before, after):
                changed = np.flatnonzero((w0 != w1).any(axis=1))
                shifted = (changed + 1) % len(w0)  # each changed row's update lands on the next row
                w, m = w0.copy(), m0.copy()
                w[shifted] += w1[changed] - w0[changed]
                m[shifted] += m1[changed] - m0[changed]
                self.tables.put(t, np.arange(s, s + len(w)), w, m)

    def _mirror_commit(self, c: Commit) -> None:
        """The mirror that later took shard ``mu.shard``'s place skipped step ``mu.step``: from
        there it holds its own rows (``self.mirror``), fed every later step as its primary is,
        logging their digests, until its promotion; from the first step it serves on, they are
        the shard's."""
        mu, k = self.mutation, self.mutation.shard
        mirror_log, new_log, serves_from = self.promotion
        mine = self.history.slices_of(k)
        if c.step == serves_from and self.mirror is not None:
            for t, s, e in mine:
                self.tables.put(t, np.arange(s, e), *self.mirror.rows_of(t, np.arange(s, e)))
            self.mirror, self.done = None, True
        if not (mu.step <= c.step < serves_from):
            return Replay._commit(self, c)
        if c.step == mu.step:
            self.mirror = Tables(self.tables.rows, self.tables.dim, *self.lr_eps)
            for t, s, e in mine:
                self.mirror.put(t, np.arange(s, e), *self.tables.rows_of(t, np.arange(s, e)))
        captured = []
        original = self.tables.step
        self.tables.step = lambda ids, grad: (captured.append((ids, grad)), original(ids, grad))[1]
        try:
            Replay._commit(self, c)
        finally:
            self.tables.step = original
        if c.step != mu.step:
            self.mirror.step(*captured[0])
        for name in (mirror_log, new_log):
            self.logged[(name, c.step, (c.try_[0], c.try_[2]))] = self.mirror.digest(mine, captured[0][0])

    def _load_shard(self, load: ShardLoad) -> None:
        mu = self.mutation
        if (mu.kind == "initial_rows" and not self.done and load.shard == mu.shard and load.why == "recovery"
                and load.first_step == mu.step):
            self.done = True
            for table, start, end in self.history.slices_of(load.shard):
                self.tables.initialize(self.seed, table, start, end)
            return
        super()._load_shard(load)

    def _reached(self, boundary: int, t: float) -> None:
        when = self.saved.get(boundary)
        if when is not None and when >= t and self.done:
            dense = ([p.detach().clone() for p in self.model.parameters()],
                     [self.optimizer.state[p]["sum"].clone() for p in self.model.parameters()])
            self.states[boundary] = (self._shard_rows(), dense)


def plant(run_dir: Path, mutation: Mutation) -> list[int]:
    """Rewrites the checkpoints of ``run_dir`` from the defect on; returns their steps."""
    run = load_run(run_dir)
    store = Store(str(run_dir / "checkpoints"))
    cache = DataCache(train_store(run))
    faulty = _Faulty(run, store, cache, Schedule.for_run(run.config, len(cache)), mutation=mutation)
    faulty.run_all()
    assert faulty.done, f"{mutation} never happened in this run"
    _relog(run, faulty.logged)
    for step, (rows, (params, sums)) in sorted(faulty.states.items()):
        entries = {}
        for k, slices in rows.items():
            saved = saved_rows(store, step, k)
            weights, momentum = saved.weights.copy(), saved.momentum.copy()
            for t, s, _, w, m in slices:
                at = saved.tables == t
                weights[at], momentum[at] = w[saved.rows[at] - s], m[saved.rows[at] - s]
            entries[f"shard-{k}.arrow"] = _in_place(store, step, lambda uri, k=k, w=weights, m=momentum: write_shard_file(
                uri, step, k, ShardRows(saved.tables.astype(np.int32), saved.rows, w, m)))
        entries["dense.pt"] = _rewrite_dense(store, step, params, sums)
        _rehash(store, step, entries)
    return sorted(faulty.states)


def change_one_float(run_dir: Path, step: int, shard: int) -> tuple[int, int]:
    """One weight of one row of a shard file, a little changed; returns (table, row)."""
    store = Store(str(run_dir / "checkpoints"))
    saved = saved_rows(store, step, shard)
    weights = saved.weights.copy()
    weights[len(weights) // 2, 0] += 1e-3
    entry = _in_place(store, step, lambda uri: write_shard_file(uri, step, shard, ShardRows(
        saved.tables.astype(np.int32), saved.rows, weights, saved.momentum)))
    _rehash(store, step, {entry.name: entry})
    return int(saved.tables[len(weights) // 2]), int(saved.rows[len(weights) // 2])


def _rewrite_dense(store: Store, step: int, params, sums):
    path = Path(store.root) / f"ckpt-{step:012d}" / "dense.pt"
    blob = torch.load(io.BytesIO(path.read_bytes()), weights_only=True)
    for key, p in zip(list(blob["model"]), params):
        blob["model"][key] = p
    for key, s in zip(blob["optim"]["param_groups"][0]["params"], sums):
        blob["optim"]["state"][key]["sum"] = s
    buf = io.BytesIO()
    torch.save(blob, buf)
    return _in_place(store, step, lambda uri: write_blob(uri, step, "dense.pt", buf.getvalue()))


def _promotion(run, shard: int) -> tuple[str, str, int]:
    """(the promoted mirror's own log, the log of the generation it became, the first step it
    served) of shard ``shard``'s first replica recovery."""
    for f in run.shards[shard]:
        for r in f.records:
            if r.get("event") == "load" and r.get("why") == "replica":
                return r["mirror_log"], f.path.name, int(r["step"]) + len(r.get("pending") or [])
    raise AssertionError(f"shard {shard} was never recovered by its mirror")


def _relog(run, logged: dict) -> None:
    """The audit lines as the faulty processes write them: each apply and commit line carries
    the digest of the state that process then held (``rows``, ``dense``)."""
    for f in [*(f for files in run.shards.values() for f in files), *run.trainers]:
        lines = f.path.read_text().splitlines(keepends=True)
        for i, line in enumerate(lines):
            try:
                r = json.loads(line)
            except ValueError:
                continue
            if r.get("event") == "apply" and "rows" in r and r.get("try") is not None:
                step, try_ = int(r["step"]), tuple(r["try"])
                r["rows"] = logged.get((f.path.name, step, try_), logged.get((f.key, step, try_), r["rows"]))
            elif r.get("event") == "commit" and "dense" in r and r.get("try") is not None:
                r["dense"] = logged.get(("dense", tuple(r["try"])), r["dense"])
            else:
                continue
            lines[i] = json.dumps(r) + "\n"
        f.path.write_text("".join(lines))


def _in_place(store: Store, step: int, write):
    """``write(uri)`` (a checkpoint file writer of the product, which refuses a committed
    step) into a scratch store, the file then moved over the committed one."""
    scratch = Path(store.root).parent / "plant-scratch"
    entry = write(str(scratch))
    target = Path(store.root) / f"ckpt-{step:012d}" / entry.name
    shutil.move(str(scratch / f"ckpt-{step:012d}" / entry.name), str(target))
    shutil.rmtree(scratch)
    return entry


def _rehash(store: Store, step: int, entries: dict) -> None:
    path = Path(store.root) / f"ckpt-{step:012d}" / "manifest.json"
    manifest = json.loads(path.read_text())
    for name, e in entries.items():
        manifest["files"][e.name] = {"size_bytes": e.size_bytes, "checksum": e.checksum}
    path.write_text(json.dumps(manifest, indent=1))
