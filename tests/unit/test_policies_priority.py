"""Row-priority policies on a Zipf access stream: coverage, memory, resets, determinism, edges."""

from __future__ import annotations

import numpy as np
import pytest

from policies.priority import (
    DEFAULT_FULL_EVERY,
    FullPolicy,
    MfuPolicy,
    PriorityPolicy,
    SaveSelection,
    SsuPolicy,
    make_policy,
)

pytestmark = pytest.mark.timeout(60)

NUM_ROWS = 100_000
ACCESSES = 200_000
BATCH_ROWS = 1_000
ZIPF_A = 1.1
R = 0.1
SAMPLE_RATE = 0.1


@pytest.fixture(scope="module")
def zipf_stream() -> np.ndarray:
    rng = np.random.default_rng(0)
    p = 1.0 / np.arange(1, NUM_ROWS + 1) ** ZIPF_A
    p /= p.sum()
    # Hot ranks land on random row ids so low ids get no help from tie-breaking.
    return rng.permutation(NUM_ROWS)[rng.choice(NUM_ROWS, size=ACCESSES, p=p)]


def _feed(policy: PriorityPolicy, stream: np.ndarray) -> None:
    for i in range(0, stream.size, BATCH_ROWS):
        policy.observe(stream[i : i + BATCH_ROWS])


def _coverage(stream: np.ndarray, sel: SaveSelection) -> float:
    return float(np.isin(stream, sel.rows).mean())


def _assert_well_formed(sel: SaveSelection, num_rows: int) -> None:
    assert sel.rows.dtype == np.int64
    assert sel.rows.ndim == 1
    assert not sel.rows.flags.writeable
    if sel.rows.size:
        assert np.all(np.diff(sel.rows) > 0)  # sorted and unique
        assert sel.rows[0] >= 0 and sel.rows[-1] < num_rows
    if not sel.full:
        assert sel.rows.size <= sel.budget_rows
    assert sel.reason


def test_mfu_covers_most_accesses_and_is_the_optimal_top_k(zipf_stream: np.ndarray) -> None:
    mfu = MfuPolicy(NUM_ROWS, R)
    _feed(mfu, zipf_stream)
    sel = mfu.select(1)
    _assert_well_formed(sel, NUM_ROWS)
    assert not sel.full and sel.budget_rows == 10_000 and sel.rows.size == 10_000
    cov = _coverage(zipf_stream, sel)
    assert cov >= 0.85  # measured 0.915
    counts = np.bincount(zipf_stream, minlength=NUM_ROWS)
    best = np.sort(counts)[::-1][: sel.budget_rows].sum() / ACCESSES
    assert cov == pytest.approx(best)  # exact top-k: no k rows cover more


def test_ssu_covers_a_large_share_with_a_fraction_of_the_memory(zipf_stream: np.ndarray) -> None:
    mfu = MfuPolicy(NUM_ROWS, R)
    ssu = SsuPolicy(NUM_ROWS, R, SAMPLE_RATE, seed=1)
    _feed(mfu, zipf_stream)
    _feed(ssu, zipf_stream)
    sel = ssu.select(1)
    _assert_well_formed(sel, NUM_ROWS)
    cov = _coverage(zipf_stream, sel)
    assert cov >= 0.75  # measured 0.82 with ~5.3k sampled rows
    assert cov <= _coverage(zipf_stream, mfu.select(1)) + 1e-12
    assert cov > 5 * sel.rows.size / NUM_ROWS  # far better than random rows of the same count
    assert ssu.tracking_bytes * 5 <= mfu.tracking_bytes  # 40 kB vs 400 kB here
    assert mfu.tracking_bytes == NUM_ROWS * 4


def test_ssu_reservoir_replacement_keeps_set_bounded_and_valid(zipf_stream: np.ndarray) -> None:
    ssu = SsuPolicy(NUM_ROWS, 0.01, 1.0, seed=3)
    _feed(ssu, zipf_stream)
    sel = ssu.select(1)
    _assert_well_formed(sel, NUM_ROWS)
    assert ssu.sampled_rows == ssu.capacity_rows == 1_000 == sel.rows.size
    assert np.isin(sel.rows, zipf_stream).all()  # only accessed rows are ever sampled
    assert _coverage(zipf_stream, sel) > 10 * sel.rows.size / NUM_ROWS


def test_ssu_sample_rate_one_small_stream_keeps_every_row() -> None:
    ssu = SsuPolicy(100, 0.5, 1.0, seed=0)
    ssu.observe(np.array([7, 3, 7, 99, 0]))
    ssu.observe(np.array([3, 42]))
    assert ssu.select(1).rows.tolist() == [0, 3, 7, 42, 99]


def test_mfu_mark_saved_resets_counters(zipf_stream: np.ndarray) -> None:
    mfu = MfuPolicy(NUM_ROWS, R)
    _feed(mfu, zipf_stream)
    first = mfu.select(1)
    assert mfu.access_count(first.rows).min() > 0
    mfu.mark_saved(first.rows)
    assert mfu.access_count(first.rows).max() == 0
    second = mfu.select(2)
    _assert_well_formed(second, NUM_ROWS)
    assert np.intersect1d(first.rows, second.rows).size == 0  # saved rows are clean now
    assert second.rows.size > 0  # touched rows that missed the first cut
    mfu.mark_saved(np.arange(NUM_ROWS))
    assert mfu.select(3).rows.size == 0


def test_ssu_mark_saved_empties_the_sample(zipf_stream: np.ndarray) -> None:
    ssu = SsuPolicy(NUM_ROWS, R, SAMPLE_RATE, seed=1)
    _feed(ssu, zipf_stream[:20_000])
    sel = ssu.select(1)
    assert sel.rows.size > 0
    ssu.mark_saved(sel.rows[: sel.rows.size // 2])
    assert ssu.sampled_rows == sel.rows.size - sel.rows.size // 2
    ssu.mark_saved(sel.rows)
    assert ssu.sampled_rows == 0 and ssu.select(2).rows.size == 0


def test_full_policy_selects_all_rows_and_tracks_nothing() -> None:
    full = FullPolicy(1_000)
    full.observe(np.array([1, 2, 3]))
    for i in (0, 1, 7):
        sel = full.select(i)
        _assert_well_formed(sel, 1_000)
        assert sel.full and sel.rows.tolist() == list(range(1_000))
    assert full.tracking_bytes == 0
    assert full.scale_interval_s(120.0) == 120.0


@pytest.mark.parametrize("policy", ["mfu", "ssu"])
def test_every_full_every_th_save_is_full(policy: str) -> None:
    p = make_policy(policy, 1_000, 0.1, 0.5, seed=0, full_every=4)
    p.observe(np.arange(50))
    fulls = [p.select(i).full for i in range(10)]
    assert fulls == [True, False, False, False, True, False, False, False, True, False]
    assert make_policy(policy, 10, 0.5, 0.5, seed=0).select(DEFAULT_FULL_EVERY).full
    every = make_policy(policy, 10, 0.5, 0.5, seed=0, full_every=1)
    assert all(every.select(i).full for i in range(5))


def test_mfu_ties_go_to_lower_row_ids_and_untouched_rows_are_skipped() -> None:
    mfu = MfuPolicy(10, 0.2)  # budget 2 rows
    mfu.observe(np.array([5, 3, 7]))
    assert mfu.select(1).rows.tolist() == [3, 5]
    mfu.observe(np.array([7, 7]))
    assert mfu.select(1).rows.tolist() == [3, 7]
    only = MfuPolicy(10, 0.5)
    only.observe(np.array([4, 4]))
    sel = only.select(1)
    assert sel.rows.tolist() == [4] and sel.candidate_rows == 1


def test_priority_interval_is_scaled_by_r() -> None:
    assert MfuPolicy(100, 0.1).scale_interval_s(120.0) == pytest.approx(12.0)
    assert SsuPolicy(100, 0.25, 0.1, 0).interval_scale == 0.25


def test_budget_rows_is_exact_for_round_fractions() -> None:
    # 0.1 * 100_000 is 10000.000000000002 in floats; the budget must stay 10_000.
    assert MfuPolicy(100_000, 0.1).budget_rows == 10_000
    assert MfuPolicy(10, 0.01).budget_rows == 1
    assert MfuPolicy(7, 0.5).budget_rows == 4


def test_ssu_is_deterministic_given_a_seed(zipf_stream: np.ndarray) -> None:
    stream = zipf_stream[:50_000]
    runs = []
    for seed in (5, 5, 6):
        ssu = SsuPolicy(NUM_ROWS, R, SAMPLE_RATE, seed=seed)
        _feed(ssu, stream)
        runs.append(ssu.select(1).rows)
    assert np.array_equal(runs[0], runs[1])
    assert not np.array_equal(runs[0], runs[2])


@pytest.mark.parametrize(
    ("call", "arg"),
    [
        (lambda: MfuPolicy(0, 0.1), "num_rows"),
        (lambda: MfuPolicy(10, 0.0), "r"),
        (lambda: MfuPolicy(10, 1.5), "r"),
        (lambda: MfuPolicy(10, 0.5, full_every=0), "full_every"),
        (lambda: SsuPolicy(10, 0.5, 0.0, 0), "sample_rate"),
        (lambda: SsuPolicy(10, 0.5, 0.5, -1), "seed"),
        (lambda: make_policy("lru", 10, 0.5, 0.5, 0), "name"),
        (lambda: MfuPolicy(10, 0.5).observe(np.array([3, 10])), "rows"),
        (lambda: MfuPolicy(10, 0.5).observe(np.array([-1])), "rows"),
        (lambda: MfuPolicy(10, 0.5).observe(np.array([1.0])), "rows"),
        (lambda: SsuPolicy(10, 0.5, 0.5, 0).mark_saved(np.array([11])), "rows"),
        (lambda: FullPolicy(10).select(-1), "save_index"),
    ],
)
def test_invalid_args_raise_config_error(call, arg: str) -> None:
    with pytest.raises(ValueError, match=rf"\b{arg}\b"):
        call()


def test_make_policy_builds_each_kind() -> None:
    assert isinstance(make_policy("full", 10, 0.5, 0.5, 0), FullPolicy)
    assert isinstance(make_policy("mfu", 10, 0.5, 0.5, 0), MfuPolicy)
    ssu = make_policy("ssu", 10, 0.5, 0.25, 9)
    assert isinstance(ssu, SsuPolicy) and ssu.sample_rate == 0.25 and ssu.seed == 9
    assert [make_policy(n, 10, 0.5, 0.5, 0).name for n in ("full", "mfu", "ssu")] == ["full", "mfu", "ssu"]


def test_empty_observe_is_a_no_op() -> None:
    for p in (MfuPolicy(10, 0.5), SsuPolicy(10, 0.5, 1.0, 0)):
        p.observe(np.array([], dtype=np.int64))
        assert p.select(1).rows.size == 0
