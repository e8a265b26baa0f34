"""The checker's own inputs of a run (``verify.replay``) against the product's: its schedule
gives every step the microbatches and every trainer the positions that ``core.schedule``
gives, and its reader of the training store gives, bit for bit, the labels, dense features
and table rows that a trainer's data pipeline (``actors.trainer.pipeline``) feeds, on stores
built by the product's own preprocessing (hash mapping with a row cap, and a vocabulary).
"""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pytest

from actors.trainer.pipeline import microbatch_loader
from app.dataengines import LocalEngine
from app.dataprep import build_stores, resolve_data
from core.config import config_from_dict
from core.data import generate
from core.plan import make_plan
from core.schedule import StepSchedule
from core.store import MicrobatchStore
from verify.replay import schedule as replay_schedule
from verify.replay.data import DataCache
from verify.replay.schedule import Schedule

pytestmark = pytest.mark.timeout(120)


def _same_schedule(theirs: StepSchedule, mine: Schedule) -> None:
    m = theirs.microbatches_per_step
    assert (mine.num_microbatches, mine.microbatches_per_step, mine.total_steps, mine.seed) == (
        theirs.num_microbatches, m, theirs.total_steps, theirs.seed)
    assert mine.steps_per_epoch == theirs.steps_per_epoch
    for step in range(theirs.total_steps):
        expected = [theirs.microbatch(step, p) for p in range(m)]
        assert mine.microbatches(step) == expected, step
        assert [mine.microbatch(step, p) for p in range(m)] == expected, step
    for live in range(1, 5):
        for rank in range(live + 1):  # rank == live: outside the quorum, no positions
            expected = theirs.assignment(0, rank, live)
            assert mine.positions_of(rank, live) == expected, (rank, live)
            assert mine.assignment(theirs.total_steps - 1, rank, live) == theirs.assignment(
                theirs.total_steps - 1, rank, live)


def test_the_schedules_agree_on_random_configs():
    rng = random.Random(20240611)
    compared = 0
    for _ in range(300):
        n = rng.randint(1, 80)
        m = rng.randint(1, 9)
        epochs = rng.choice([0.01, 0.25, 0.5, 1.0, 1.3, 2.0, 2.75, rng.uniform(0.05, 3.0)])
        max_steps = rng.choice([None, None, rng.randint(1, 40)])
        seed = rng.choice([0, 1, rng.randint(0, 2**31)])
        args = (n, m, epochs, max_steps, seed)
        if n // m < 1:  # fewer microbatches than one step: both refuse
            with pytest.raises(ValueError):
                StepSchedule.from_config(*args)
            with pytest.raises(ValueError):
                Schedule.of(*args)
            continue
        theirs = StepSchedule.from_config(*args)
        _same_schedule(theirs, Schedule.of(*args))
        config = {"seed": seed, "training": {"microbatches_per_step": m, "epochs": epochs, "max_steps": max_steps}}
        assert Schedule.for_run(config, n) == Schedule.of(*args)
        compared += 1
    assert compared > 200


def test_a_schedule_goes_on_past_its_last_step_as_the_product_does():
    theirs, mine = StepSchedule.from_config(23, 4, 1.0, None, 9), Schedule.of(23, 4, 1.0, None, 9)
    for step in range(theirs.total_steps, 4 * theirs.total_steps):  # later epochs: other permutations
        assert mine.microbatches(step) == [theirs.microbatch(step, p) for p in range(4)]


def test_a_config_without_the_keys_takes_the_products_defaults():
    cfg = config_from_dict({"data": {"train": ["train.tsv"], "eval": ["eval.tsv"]}})
    assert replay_schedule.DEFAULT_MICROBATCHES_PER_STEP == cfg.training.microbatches_per_step
    assert replay_schedule.DEFAULT_EPOCHS == cfg.training.epochs
    assert replay_schedule.DEFAULT_MAX_STEPS == cfg.training.max_steps
    assert replay_schedule.DEFAULT_SEED == cfg.seed
    tr = cfg.training
    theirs = StepSchedule.from_config(50, tr.microbatches_per_step, tr.epochs, tr.max_steps, cfg.seed)
    _same_schedule(theirs, Schedule.for_run({}, 50))
    _same_schedule(theirs, Schedule.for_run({"training": {}}, 50))


def test_the_schedule_refuses_what_has_no_meaning():
    s = Schedule.of(10, 3, 1.0, None, 0)
    with pytest.raises(IndexError):
        s.microbatch(0, 3)
    with pytest.raises(ValueError):
        s.positions_of(0, 0)
    with pytest.raises(ValueError):
        Schedule.of(10, 0, 1.0, None, 0)


# --- the data reader against the trainers' own reading path ---------------------------------

ROWS = 32  # microbatch rows


@pytest.fixture(scope="module", params=["hash", "vocab"])
def store(request, tmp_path_factory) -> dict:
    """A training store built by the product (no Ray), from two generated files: their chunks
    and the stitched tails make three parts."""
    base = tmp_path_factory.mktemp(f"replay-{request.param}")
    a = generate(str(base / "a"), 700, 100, fmt="tsv", seed=3, vocab_rows=5000, chunk_rows=300)
    b = generate(str(base / "b"), 650, 100, fmt="tsv.gz", seed=4, vocab_rows=5000, chunk_rows=300)
    raw = {
        "run_dir": str(base / "run"), "seed": 5,
        "data": {"train": [a.train_path, b.train_path], "eval": [a.eval_path], "mapping": request.param,
                 "min_count": 2, "cache_dir": str(base / "cache")},
        "training": {"microbatch_rows": ROWS, "microbatches_per_step": 3, "epochs": 1.5},
    }
    if request.param == "hash":  # tables of their own sizes, some capped by max_ind_range
        raw["model"] = {"table_rows": [97 + 131 * f for f in range(26)], "max_ind_range": 1500}
    cfg = config_from_dict(raw)
    built = build_stores(cfg, resolve_data(cfg), LocalEngine())
    return {"cfg": cfg, "raw": raw, "uri": built["train"].uri, "table_rows": built["table_rows"]}


def _bits(a: np.ndarray) -> np.ndarray:
    return a.view(np.uint32)


def test_every_microbatch_reads_bit_identical_to_the_products_reader(store):
    theirs = MicrobatchStore(store["uri"])
    mine = DataCache(store["uri"])
    assert len(mine) == len(theirs) and len(theirs.manifest.parts) >= 3
    assert mine.table_rows == store["table_rows"]
    caps = np.array(store["table_rows"], dtype=np.int64)
    if store["cfg"].data.mapping == "hash":
        assert store["table_rows"] == store["cfg"].model.rows_per_table and max(store["table_rows"]) == 1500
    for i in range(len(theirs)):
        labels, dense, sparse = theirs.get(i)
        got = mine.microbatch(i)
        assert [a.dtype for a in got] == [np.float32, np.float32, np.int64]
        assert got[0].shape == (ROWS,) and got[1].shape == (ROWS, 13) and got[2].shape == (ROWS, 26)
        assert np.array_equal(_bits(got[0]), _bits(labels)) and np.array_equal(_bits(mine.labels(i)), _bits(labels))
        assert np.array_equal(_bits(got[1]), _bits(dense)) and np.array_equal(_bits(mine.dense(i)), _bits(dense))
        assert np.array_equal(got[2], sparse.astype(np.int64)) and np.array_equal(mine.rows(i), got[2])
        assert mine.sparse(i).dtype == np.uint32 and np.array_equal(mine.sparse(i), sparse)
        assert (got[2] >= 0).all() and (got[2] < caps).all()
    with pytest.raises(IndexError):
        mine.microbatch(len(mine))


def test_a_steps_inputs_are_what_each_trainer_feeds(store):
    cfg = store["cfg"]
    theirs_store = MicrobatchStore(store["uri"])
    tr = cfg.training
    theirs = StepSchedule.from_config(len(theirs_store), tr.microbatches_per_step, tr.epochs, tr.max_steps, cfg.seed)
    load = microbatch_loader(theirs_store, theirs, make_plan("table_wise", store["table_rows"], 2))
    mine_store = DataCache(f"file://{store['uri']}")
    mine = Schedule.for_run(store["raw"], len(mine_store))
    assert mine.total_steps == theirs.total_steps > mine.steps_per_epoch  # into the second epoch
    for step in range(theirs.total_steps):
        for live in (1, 2):
            for rank in range(live):
                labels, dense, rows, _ = load(step, theirs.assignment(step, rank, live))
                parts = [mine_store.microbatch(mine.microbatch(step, p)) for p in mine.positions_of(rank, live)]
                assert np.array_equal(_bits(np.concatenate([p[0] for p in parts])), _bits(labels))
                assert np.array_equal(_bits(np.concatenate([p[1] for p in parts])), _bits(dense))
                got = np.concatenate([p[2] for p in parts])
                assert got.dtype == rows.dtype == np.int64 and np.array_equal(got, rows)


def test_the_checker_reads_the_build_the_run_read_or_none(store, tmp_path):
    """run.json names the build the run read: the checker reads that one, and where it is gone,
    none (another build of the store holds other bytes)."""
    from verify.files import RunFiles
    from verify.replay.data import train_store

    def run(uri: str) -> RunFiles:
        return RunFiles(tmp_path, store["raw"], None, {"train_cache": uri}, {}, [], [], [])

    assert train_store(run(store["uri"])) == store["uri"]
    assert train_store(run(str(Path(store["uri"]).parent / "b-gone00000000"))) is None
