"""The replay's own kernels compute what the product computes, bit for bit: its tables (every
table whole, one fbgemm kernel) against the product's shards (slices of them, row-wise or
table-wise) over steps whose microbatches two trainers split, and its dense DLRM against
the trainers' model from the same seed. The replay's exactness rests on these equalities."""

import numpy as np
import pytest
import torch

from actors.shard import EmbeddingShard
from core.model import DenseAdagrad, DenseModel
from core.plan import make_plan
from verify.replay.dense import DenseDLRM, adagrad
from verify.replay.tables import Tables

pytestmark = pytest.mark.timeout(120)

M, ROWS, DIM, SEED = 4, 8, 4, 3
TABLE_ROWS = [50] * 26


@pytest.fixture(autouse=True)
def _no_ray(monkeypatch):
    monkeypatch.setattr("ray.get_runtime_context", lambda: type("C", (), {"get_node_id": lambda self: "n"})())


def _steps(n):
    for step in range(n):
        rng = np.random.default_rng(step)
        rows = rng.integers(0, 3, size=(M, ROWS, 26))  # few ids: a row's gradients sum in order
        scale = 10.0 ** rng.integers(-3, 3, size=(M, ROWS, 1, 1))
        yield step, rows, (rng.standard_normal((M, ROWS, 26, DIM)) * scale).astype(np.float32)


@pytest.mark.parametrize("kind,shards", [("row_wise", 2), ("table_wise", 3)])
def test_the_replays_tables_apply_the_shards_bits(kind, shards):
    plan = make_plan(kind, TABLE_ROWS, shards)
    product = [EmbeddingShard(k, list(plan.shards[k]), DIM, 0.1, 1e-8, SEED, microbatches_per_step=M)
               for k in range(shards)]
    replay = Tables(TABLE_ROWS, DIM, 0.1, 1e-8)
    for k in range(shards):
        for s in plan.shards[k]:
            replay.initialize(SEED, s.table, s.row_start, s.row_end)
    split = [(0, 2), (1, 3)]  # two trainers, positions by rank
    for step, rows, grads in _steps(4):
        chunks = [tuple(step * M + i for i in part) for part in split]
        for k, shard in enumerate(product):
            for part, chunk in zip(split, chunks):
                routed = plan.route(np.concatenate([rows[i] for i in part]), k)
                shard.lookup(step, chunk, routed.lengths, routed.indices)
            for part, chunk in zip(split, chunks):
                shard.push_grads(step, chunk, plan.gather_grad(np.concatenate([grads[i] for i in part]), k))
        replay.step(rows.reshape(M * ROWS, 26), grads.reshape(M * ROWS, 26, DIM))
    for k, shard in enumerate(product):  # the last step applies at the next step's first lookup
        routed = plan.route(np.zeros((ROWS, 26), dtype=np.int64), k)
        shard.lookup(4, (16,), routed.lengths, routed.indices)
    changed = 0
    for k, shard in enumerate(product):
        for s, (w, m) in zip(plan.shards[k], shard.get_rows()):
            rw, rm = replay.rows_of(s.table, np.arange(s.row_start, s.row_end))
            assert np.array_equal(w, rw) and np.array_equal(m, rm), (k, s)
            changed += int((m > 0).sum())
    assert changed > 0


def test_the_replays_dense_model_is_the_trainers_bit_for_bit():
    torch.manual_seed(5)
    ours = DenseModel(13, 26, [32, 8], [32, 1])
    ours_opt = DenseAdagrad(ours.parameters(), lr=0.05)
    torch.manual_seed(5)
    theirs = DenseDLRM(13, 26, [32, 8], [32, 1])
    theirs_opt = adagrad(theirs, 0.05)
    assert all(torch.equal(a, b) for a, b in zip(ours.parameters(), theirs.parameters()))
    gen = torch.Generator().manual_seed(1)
    for _ in range(3):
        dense, pooled = torch.randn(64, 13, generator=gen), torch.randn(64, 26, 8, generator=gen)
        labels = (torch.rand(64, generator=gen) < 0.3).float()
        outs = []
        for model, opt in ((ours, ours_opt), (theirs, theirs_opt)):
            p = pooled.clone().requires_grad_(True)
            opt.zero_grad(set_to_none=False) if opt is ours_opt else opt.zero_grad(set_to_none=True)
            loss = torch.nn.functional.binary_cross_entropy_with_logits(model(dense, p), labels, reduction="sum")
            (loss / 256).backward()
            opt.step()
            outs.append(p.grad)
        assert torch.equal(outs[0], outs[1])
    assert all(torch.equal(a, b) for a, b in zip(ours.parameters(), theirs.parameters()))
    assert all(torch.equal(ours_opt.state[i]["sum"], theirs_opt.state[p]["sum"])
               for i, p in enumerate(theirs.parameters()))
