"""The replay: the run's model recomputed in one process, step by committed step, and compared
with every checkpoint the run left.

Events come in the order they happened (``history``). A commit of step ``s`` is computed as
the run computes it: each microbatch through the dense model on its own, the M gradients
summed in position order (whoever computed which: ``actors/trainer/grads.py``), Adagrad; the
embedding gradients of all M microbatches update the tables in one kernel call, in
microbatch-id order. A load sets a state to a checkpoint's:
a trainer's load the dense model (0: the initial one), a shard's load that shard's rows
(its chain merged, oldest first; [] the initial rows). A shard's load takes effect at the
first step its new generation served, so a commit logged a moment after a shard died (a
slow trainer's line) still updates the rows the dead generation held, as it did.

At every step boundary the run saved, the replay's state is kept against that checkpoint's
files (the last time the boundary was reached before the checkpoint committed: a step
fenced by a rollback is saved again under the same number)."""

from __future__ import annotations

import copy
import time
from collections import Counter
from dataclasses import dataclass, field

import numpy as np
import torch

from verify.files import RunFiles, load_run
from verify.kills import planted_damage
from verify.replay.compare import Tolerance, dense_problems, rows_problems
from verify.replay.data import DataCache, train_store
from verify.replay.dense import DenseDLRM, adagrad
from verify.replay.history import Commit, DenseLoad, History, ShardLoad, read_history
from verify.replay.loaded import CLOCK_SLACK_S, LoadedFiles
from verify.replay.saved import saved_dense, saved_rows
from verify.replay.schedule import Schedule
from verify.replay.tables import Tables, dense_digest
from verify.store import Store

__all__ = ["ReplayResult", "replay_run", "replay_dir"]

NUM_DENSE, NUM_SPARSE = 13, 26


@dataclass
class ReplayResult:
    steps: int = 0  # commits computed (a step redone after a rollback counts again)
    checkpoints: list[int] = field(default_factory=list)  # compared and matching
    findings: list[str] = field(default_factory=list)  # where the run's model parts from the replay
    gaps: list[str] = field(default_factory=list)  # what the replay could not check, and why
    excused: list[str] = field(default_factory=list)  # not checked because the fault injector damaged its file
    loads: dict[str, int] = field(default_factory=dict)  # the history's loads by kind: "shard recovery", "dense resume"
    exact: bool = True  # every comparison matched bit for bit
    seconds: float = 0.0

    @property
    def sound(self) -> bool:
        return not self.findings

    def summary(self) -> str:
        how = "bit for bit" if self.exact else "within tolerance"
        head = f"replay: {self.steps} steps, {len(self.checkpoints)} checkpoints match {how}"
        return head if self.sound else f"replay: {len(self.findings)} finding(s); first: {self.findings[0]}"


class Replay:
    def __init__(self, run: RunFiles, store: Store, cache: DataCache, schedule: Schedule,
                 tolerance: Tolerance | None = None):
        cfg = run.config
        self.run, self.store, self.cache, self.schedule = run, store, cache, schedule
        self.m = schedule.microbatches_per_step
        self.rows_per_microbatch = int(cfg["training"]["microbatch_rows"])
        self.seed = int(cfg.get("seed", 0))
        self.tolerance = tolerance or Tolerance()
        self.history: History = read_history(run, self.m)
        # The shards every reload after an unknown state must cover: those of the run's last plan.
        self._shards_now = set(range(int(cfg["embeddings"]["num_shards"]))) & self.history.shards()
        model, emb = cfg["model"], cfg["embeddings"]
        self.tables = Tables(list(cache.table_rows), int(model["embedding_dim"]), float(emb["learning_rate"]),
                             float(emb["eps"]))
        self._initialize_all()
        torch.manual_seed(self.seed)  # the run's dense init: the same seed, the same layers in order
        self.model = DenseDLRM(NUM_DENSE, NUM_SPARSE, list(model["dense_arch"]), list(model["over_arch"]))
        self.optimizer = adagrad(self.model, float(cfg["training"]["dense_learning_rate"]))
        self.initial_dense = copy.deepcopy((self.model.state_dict(), self.optimizer.state_dict()))
        self.saved = {s: self.store.commit_time(s) for s in self.store.committed()}
        self.damage = planted_damage(run)  # files the fault injector damaged on purpose
        self.files = LoadedFiles(self.store, self.saved, self.damage, self.history)
        # A load reads a checkpoint's file where it still holds what the load read; else (removed,
        # damaged since, saved again after a rollback) the replay's own state at that boundary,
        # kept for the purpose: the base of a chain only (an increment's rows are known only
        # from its file).
        self._snap_shard = {(load.chain[0], load.shard, load.generation) for load in self.history.shard_loads
                            if load.chain and self.files.read(load, load.chain[0])[1] is not None}
        self._snap_dense = {d.step for d in self.history.dense_loads
                            if d.step > 0 and self.files.source(d.step, "dense.pt", d.t) is None}
        self._snapshots: dict[tuple, object] = {}
        # After a load it could not replay, nothing is compared until every shard and the dense
        # model were loaded again (a rollback): every later state depends on the unknown one.
        self.unknown, self._reloaded = False, set()
        self.result = ReplayResult(loads=dict(sorted(Counter(
            [f"shard {s.why}" for s in self.history.shard_loads] + [f"dense {d.why}" for d in self.history.dense_loads]
        ).items())))
        # step -> (when reached, problems then, bit for bit then): a later reach (the step redone
        # after a rollback, before the checkpoint was saved again) replaces it, exactness included.
        self._at_boundary: dict[int, tuple[float, list[str], bool]] = {}
        self._parted: set[tuple[str, str]] = set()  # the processes whose logged state parted already
        self._loaded_now: list[str] = []  # the shard loads that took effect before the step in hand

    def _initialize_all(self) -> None:
        """The rows before training, as the run's first plan drew them (a slice's rows depend on
        its bounds): the logs opened first last, so that theirs win where a resume on another
        plan cut the tables otherwise."""
        opened = self.history.opened
        for key, slices in sorted(self.history.slices.items(), key=lambda kv: -opened.get(kv[0], 0.0)):
            for table, start, end in slices:
                self.tables.initialize(self.seed, table, start, end)

    def run_all(self) -> ReplayResult:
        t0 = time.perf_counter()
        if self.history.accelerated:  # fbgemm's CUDA kernel sums a row's gradients in another order
            self.result.gaps.append(f"{', '.join(self.history.accelerated)}: the replay computes "
                                    "on the CPU kernel, whose sums part from the GPU's in the last bits (RESULTS.md)")
            return self.result
        pending: list[ShardLoad] = []
        for event in self.history.events():
            if isinstance(event, DenseLoad):
                self._load_dense(event.step, event.t)
            elif isinstance(event, ShardLoad):
                pending.append(event)
            else:
                self._loaded_now = []
                pending = self._apply_loads(pending, event.step)
                self._commit(event)
                self._reached(event.step + 1, event.t)
        self._apply_loads(pending, None)
        self._conclude()
        self.result.seconds = time.perf_counter() - t0
        return self.result

    def _apply_loads(self, pending: list[ShardLoad], step: int | None) -> list[ShardLoad]:
        """The loads that took effect before ``step`` (all with None); the rest stay pending, and
        so does every later load of a shard with one pending (a shard's loads keep their order)."""
        keep, held = [], set()
        due = _due_steps(pending)
        for load, first in zip(pending, due):
            if step is not None and (load.shard in held or first is not None and first > step):
                keep.append(load)
                held.add(load.shard)
            else:
                self._load_shard(load)
                self._loaded_now.append(f"shard {load.shard} generation {load.generation} loaded {load.chain}")
        return keep

    def _gap(self, text: str, planted: bool = False) -> None:
        """What the replay cannot recompute: a gap, or, where the fault injector damaged the file
        a load read after it was read, an excused one (the test's doing, not the run's)."""
        (self.result.excused if planted else self.result.gaps).append(text)
        self.unknown, self._reloaded = True, set()

    def _reloaded_one(self, what) -> None:
        self._reloaded.add(what)
        if self.unknown and self._reloaded >= {"dense", *self._shards_now}:
            self.unknown = False

    def _load_dense(self, step: int, t: float) -> None:
        source = self.files.source(step, "dense.pt", t) if step > 0 else None
        if step == 0 or source is None and step in self._snapshots.get("dense", {}):
            model_sd, optim_sd = copy.deepcopy(self.initial_dense if step == 0 else self._snapshots["dense"][step])
            self.model.load_state_dict(model_sd)
            self.optimizer.load_state_dict(optim_sd)
        elif source is not None:
            params, sums, steps = saved_dense(self.store, step, source)
            with torch.no_grad():
                for p, q in zip(self.model.parameters(), params):
                    p.copy_(q)
            for p, s, n in zip(self.model.parameters(), sums, steps):
                st = self.optimizer.state[p]
                st["sum"] = (s if s is not None else torch.zeros_like(p)).detach().clone()
                st["step"] = torch.tensor(float(n))
        else:
            return self._gap(f"the dense model was loaded from checkpoint {step}, whose file no longer holds "
                             "what was loaded, at a step the replay never reached")
        self._reloaded_one("dense")

    def _load_shard(self, load: ShardLoad) -> None:
        k, gen = load.shard, load.generation
        slices = self.history.slices_of(k, gen)
        for table, start, end in slices:
            self.tables.initialize(self.seed, table, start, end)
        for i, step in enumerate(load.chain):
            found, name = self.files.read(load, step)
            if name is None:
                for j, source in found:
                    rows = saved_rows(self.store, step, j, source)
                    for table, start, end in slices:  # a file of another plan holds others' rows too
                        at = (rows.tables == table) & (rows.rows >= start) & (rows.rows < end)
                        self.tables.put(int(table), rows.rows[at], rows.weights[at], rows.momentum[at])
            elif i == 0 and (step, k, gen) in self._snapshots:
                for (table, start, end), (w, m) in zip(slices, self._snapshots[(step, k, gen)]):
                    self.tables.put(table, np.arange(start, end), w, m)
            elif any(d.step == step and d.file == name and d.time > load.t for d in self.damage):
                return self._gap(f"shard {k} generation {load.generation} loaded checkpoint {step} (chain "
                                 f"{load.chain}), whose file the fault injector damaged after", planted=True)
            else:
                return self._gap(f"shard {k} generation {load.generation} loaded checkpoint {step} (chain "
                                 f"{load.chain}), whose file no longer holds what was loaded")
        self._reloaded_one(k)

    def _commit(self, c: Commit) -> None:
        """Step ``c.step`` as the run computes it: each microbatch through the dense model on its
        own (with the threads of the trainer that computed it), the M gradients summed in
        position order, Adagrad; the pooled gradients of all M, in microbatch-id order, through
        the tables' kernel."""
        m, step = self.m, c.step
        slots: dict[int, list[torch.Tensor]] = {}
        ids, pooled_grads = {}, {}
        known = next((t for _, _, t in c.shares if t), None)  # a share nobody logged: its peers' count
        for _rank, share, threads in c.shares:
            if threads or known:
                torch.set_num_threads(int(threads or known))
            for i in share:
                labels, dense, rows = self.cache.microbatch(self.schedule.microbatch(step, i - step * m))
                pooled = self.tables.lookup(rows).requires_grad_(True)
                self.optimizer.zero_grad(set_to_none=True)
                loss = torch.nn.functional.binary_cross_entropy_with_logits(
                    self.model(torch.from_numpy(dense.copy()), pooled), torch.from_numpy(labels.copy()), reduction="sum")
                (loss / (m * self.rows_per_microbatch)).backward()
                slots[i - step * m] = [p.grad for p in self.model.parameters()]
                ids[i], pooled_grads[i] = rows, pooled.grad.numpy()
        if sorted(slots) != list(range(m)):
            self.result.findings.append(f"step {step}: committed with microbatch positions {sorted(slots)}, not 0..{m - 1}")
            return
        with torch.no_grad():
            for j, p in enumerate(self.model.parameters()):
                total = slots[0][j].clone()
                for position in range(1, m):
                    total += slots[position][j]
                p.grad = total
        self.optimizer.step()
        order = sorted(ids)
        merged = np.concatenate([ids[i] for i in order])
        self.tables.step(merged, np.concatenate([pooled_grads[i] for i in order]))
        self.result.steps += 1
        self._check_digests(c, merged)

    def _check_digests(self, c: Commit, merged: np.ndarray) -> None:
        """The state each process logged it left after this step, against the replay's: the
        first step and process where they part (a checkpoint only says they parted since the
        one before)."""
        if self.unknown:
            return
        params = list(self.model.parameters())
        mine = dense_digest(params, [self.optimizer.state[p]["sum"] for p in params])
        for rank, digest in c.dense:
            if digest != mine:
                self._first_part(f"step {c.step}: trainer {rank}'s dense model after the commit differs from the "
                                 "replay")
        if c.try_ is None:
            return
        for shard, gen, name, digest in self.history.applies.get((c.step, (c.try_[0], c.try_[2])), []):
            if digest != self.tables.digest(self.history.slices_of(shard, gen), merged):
                self._first_part(f"step {c.step}: shard {shard}'s rows after the apply ({name}) differ from the "
                                 "replay")

    def _first_part(self, finding: str) -> None:
        """Digest findings: each process's first only (everything after it differs too)."""
        who = finding.split(": ", 1)[1].split(" ", 2)[:2]
        if tuple(who) not in self._parted:
            self._parted.add(tuple(who))
            loads = "; ".join(self._loaded_now)
            self.result.findings.append(finding + (f" (before this step {loads})" if loads else ""))

    def _reached(self, boundary: int, t: float) -> None:
        """The state holds ``boundary`` committed steps: kept against checkpoint ``boundary``
        if the run saved one after this moment, and kept for a later load if one needs it."""
        if self.unknown:  # a comparison from an earlier timeline of this boundary is void now
            self._at_boundary.pop(boundary, None)
            return
        for (k, gen), slices in self.history.slices.items():
            if (boundary, k, gen) in self._snap_shard:
                self._snapshots[(boundary, k, gen)] = [self.tables.rows_of(t_, np.arange(a, e)) for t_, a, e in slices]
        if boundary in self._snap_dense:
            self._snapshots.setdefault("dense", {})[boundary] = copy.deepcopy(self._dense_state())
        when = self.saved.get(boundary)
        if when is None or when < t - CLOCK_SLACK_S:
            return
        self._at_boundary[boundary] = (t, *self._compare(boundary))

    def _dense_state(self) -> tuple[dict, dict]:
        return self.model.state_dict(), self.optimizer.state_dict()

    def _compare(self, step: int) -> tuple[list[str], bool]:
        """The problems of checkpoint ``step`` against the replay's state now, and whether every
        value matched bit for bit."""
        seen = _Exactness()
        return self._problems(step, seen), seen.exact

    def _problems(self, step: int, seen: "_Exactness") -> list[str]:
        problems = []
        for k in self.store.shard_files(step):
            if not self.files.ok(step, f"shard-{k}.arrow"):
                continue  # damaged on purpose by the fault injector (cpr verify checks nobody loaded it)
            try:
                rows = saved_rows(self.store, step, k)
            except (OSError, KeyError, ValueError) as err:  # pyarrow's ArrowInvalid is a ValueError
                problems.append(f"checkpoint {step} shard {k}: unreadable ({err})")
                continue
            problems += rows_problems(step, k, rows, self.tables, self.tolerance, seen)
        if not self.files.ok(step, "dense.pt"):
            return problems
        try:
            params, sums, steps = saved_dense(self.store, step)
        except (OSError, KeyError, RuntimeError, ValueError) as err:
            return problems + [f"checkpoint {step} dense: unreadable ({err})"]
        return problems + dense_problems(step, self.model, self.optimizer, params, sums, steps, self.tolerance,
                                         seen)

    def _conclude(self) -> None:
        for step in sorted(self.saved):
            if step not in self._at_boundary:
                self.result.gaps.append(f"checkpoint {step}: not compared (the replay never reached it before it was "
                                        "saved, or its state was unknown then)")
                continue
            _, problems, exact = self._at_boundary[step]
            self.result.exact = self.result.exact and exact
            if problems:
                self.result.findings += problems
            else:
                self.result.checkpoints.append(step)


@dataclass
class _Exactness:
    exact: bool = True  # set False by a comparison that matched only within the tolerance (or not)


def _due_steps(pending: list[ShardLoad]) -> list[int | None]:
    """The step before which each pending load takes effect: its generation's first step, or a
    later load's of the same shard if that comes sooner (a load whose generation completed a step
    that a rollback then undid, the rollback's load of that shard due at the step redone)."""
    due: list[int | None] = [None] * len(pending)
    soonest: dict[int, int | None] = {}
    for i in reversed(range(len(pending))):
        load = pending[i]
        later = soonest.get(load.shard, load.first_step)
        first = None if load.first_step is None or later is None else min(load.first_step, later)
        due[i] = soonest[load.shard] = first
    return due


def replay_run(run: RunFiles, store: Store, cache: DataCache, tolerance: Tolerance | None = None) -> ReplayResult:
    schedule = Schedule.for_run(run.config, len(cache))
    threads = torch.get_num_threads()
    try:
        return Replay(run, store, cache, schedule, tolerance).run_all()
    finally:
        torch.set_num_threads(threads)


def replay_dir(run_dir, tolerance: Tolerance | None = None) -> ReplayResult:
    """``replay_run`` on a run directory: its checkpoints where its config says, its training
    store where run.json names it."""
    run = load_run(run_dir)
    storage = run.config["checkpoint"].get("storage") or str(run.run_dir.resolve() / "checkpoints")
    uri = train_store(run)
    if uri is None:
        raise FileNotFoundError(f"{run_dir}: the run's training store is not found; the replay needs it")
    return replay_run(run, Store(storage), DataCache(uri), tolerance)
