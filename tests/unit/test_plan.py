"""Sharding plans: every row of every table is owned by exactly one shard, and routing
plus scatter reproduce an unsharded lookup."""

import numpy as np
import pytest

from core.plan import make_plan

pytestmark = pytest.mark.timeout(60)

TABLE_ROWS = [1000, 7, 50_000, 3, 128] + [97] * 21


def _owner_counts(plan):
    counts = [np.zeros(r, dtype=np.int64) for r in plan.table_rows]
    for slices in plan.shards:
        for s in slices:
            counts[s.table][s.row_start : s.row_end] += 1
    return counts


@pytest.mark.parametrize("kind", ["table_wise", "row_wise"])
@pytest.mark.parametrize("num_shards", [1, 2, 3, 26])
def test_every_row_owned_exactly_once(kind, num_shards):
    rows = TABLE_ROWS if kind == "table_wise" else [max(r, num_shards) for r in TABLE_ROWS]
    plan = make_plan(kind, rows, num_shards)
    assert plan.num_shards == num_shards
    for t, c in enumerate(_owner_counts(plan)):
        assert (c == 1).all(), f"table {t}: rows owned {set(c.tolist())} times"
    assert sum(plan.shard_rows(k) for k in range(num_shards)) == sum(rows)
    assert sum(plan.shard_fraction(k) for k in range(num_shards)) == pytest.approx(1.0)


def test_table_wise_balances_rows():
    plan = make_plan("table_wise", [100] * 26, 2)
    assert [len(s) for s in plan.shards] == [13, 13]


def test_table_wise_rejects_more_shards_than_tables():
    with pytest.raises(ValueError, match="num_shards"):
        make_plan("table_wise", [10] * 26, 27)


@pytest.mark.parametrize("kind", ["table_wise", "row_wise"])
def test_route_and_scatter_equal_unsharded_sum_pooling(kind):
    rng = np.random.default_rng(0)
    table_rows = [int(x) for x in rng.integers(5, 300, size=26)]
    dim, batch = 4, 64
    tables = [rng.standard_normal((r, dim)).astype(np.float32) for r in table_rows]
    rows = np.stack([rng.integers(0, r, size=batch) for r in table_rows], axis=1)
    expected = np.stack([tables[t][rows[:, t]] for t in range(26)], axis=1)

    plan = make_plan(kind, table_rows, 3)
    parts = []
    for k in range(3):
        sb = plan.route(rows, k)
        # What the shard's sum-pooling kernel computes from lengths/indices.
        pooled = np.zeros((batch, len(plan.shards[k]), dim), dtype=np.float32)
        pos = 0
        for i, s in enumerate(plan.shards[k]):
            for b in range(batch):
                for _ in range(sb.lengths[i, b]):
                    pooled[b, i] += tables[s.table][s.row_start + sb.indices[pos]]
                    pos += 1
        assert pos == sb.indices.size
        parts.append(pooled.reshape(batch, -1))
    out = plan.assemble_pooled(parts)
    np.testing.assert_allclose(out, expected, rtol=1e-6)
    # Into a given array, whatever it held.
    again = np.full_like(out, np.nan)
    assert plan.assemble_pooled(parts, out=again) is again
    np.testing.assert_array_equal(again, out)


def test_gather_grad_picks_the_shards_tables():
    plan = make_plan("table_wise", [10] * 26, 2)
    grad = np.arange(2 * 26 * 3, dtype=np.float32).reshape(2, 26, 3)
    g = plan.gather_grad(grad, 1).reshape(2, -1, 3)
    np.testing.assert_array_equal(g, grad[:, plan.slice_tables(1), :])
    out = np.zeros((2, len(plan.shards[1]) * 3), dtype=np.float32)
    assert plan.gather_grad(grad, 1, out=out) is out
    np.testing.assert_array_equal(out.reshape(2, -1, 3), grad[:, plan.slice_tables(1), :])
