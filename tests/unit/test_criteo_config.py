"""configs/criteo_kaggle.yaml: it loads, its 26 tables are the Kaggle cardinalities capped at
its max_ind_range, and its memory estimate is the hand-computed one, within the budget its
comments state."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from core.config import load_config
from core.memory import dense_parameters, memory_estimate

pytestmark = pytest.mark.timeout(120)

CONFIG = Path(__file__).resolve().parents[2] / "configs" / "criteo_kaggle.yaml"
# Distinct values per categorical column of the Kaggle train.txt, as the DLRM reference
# (facebookresearch/dlrm) and torchrec's DLRM example list them.
KAGGLE_COUNTS = [
    1460, 583, 10131227, 2202608, 305, 24, 12517, 633, 3, 93145, 5683, 8351593, 3194,
    27, 14992, 5461306, 10, 5652, 2173, 4, 7046547, 18, 15, 286181, 105, 142572,
]
BUDGET_BYTES = 8 << 30
GIB = 1 << 30


@pytest.fixture(scope="module")
def cfg():
    return load_config(CONFIG)


def test_tables_are_the_kaggle_counts_capped(cfg):
    cap = cfg.model.max_ind_range
    assert cap == 5_000_000
    assert cfg.model.table_rows == KAGGLE_COUNTS
    rows = cfg.model.rows_per_table
    assert len(rows) == 26 and all(1 <= r <= cap for r in rows)
    assert rows == [min(c, cap) for c in KAGGLE_COUNTS]
    assert sum(r < c for r, c in zip(rows, KAGGLE_COUNTS)) == 4  # C3, C12, C16, C21
    assert cfg.data.train != cfg.data.eval


def test_memory_estimate_is_the_hand_computation(cfg):
    est = memory_estimate(cfg)
    rows = sum(min(c, 5_000_000) for c in KAGGLE_COUNTS)
    assert rows == 22_771_904
    dim = 16
    assert est.embedding_rows == rows
    assert est.weights_bytes == rows * dim * 4
    assert est.optimizer_bytes == rows * 4  # row-wise Adagrad: one float per row
    # a full save: weights, momentum, int64 row id, int32 table id, plus 36 bytes of index scratch
    assert est.checkpoint_copy_bytes == rows * (dim * 4 + 4 + 8 + 4 + 36)
    # 13-128-64-16 and (16 + 26*27/2 = 367)-256-128-1, weights and biases
    dense = (13 * 128 + 128) + (128 * 64 + 64) + (64 * 16 + 16) + (367 * 256 + 256) + (256 * 128 + 128) + (128 + 1)
    assert est.dense_params == dense == 138_321
    assert est.dense_bytes == dense * 4 * 3 * 2  # params, grads, Adagrad sums; 2 trainers
    assert est.total_bytes == rows * (dim * 4 + 4) + rows * (dim * 4 + 52) + dense * 24

    # table-wise over 2 shards, largest table first: C3, C4, C16 on one, the other 23 on the other
    assert [s.rows for s in est.shards] == [5_000_000 + 2_202_608 + 5_000_000, rows - 12_202_608]
    assert sum(s.total_bytes for s in est.shards) + est.dense_bytes == est.total_bytes


def test_mirrors_add_every_shards_rows_and_adagrad_state_once_more(cfg):
    """``recovery: replica``: each shard's mirror holds its weights and row-wise Adagrad state."""
    plain, mirrored = memory_estimate(cfg, mirrors=False), memory_estimate(cfg, mirrors=True)
    assert plain.mirror_bytes == 0
    assert mirrored.mirror_bytes == plain.weights_bytes + plain.optimizer_bytes
    assert mirrored.total_bytes == plain.total_bytes + mirrored.mirror_bytes
    assert memory_estimate(cfg.model_copy(update={"recovery": "replica"})).mirror_bytes == mirrored.mirror_bytes
    assert "mirrors" in mirrored.describe() and "mirrors" not in plain.describe()


def test_memory_fits_the_budget_the_comments_state(cfg):
    est = memory_estimate(cfg)
    assert est.total_bytes < BUDGET_BYTES / 2
    text = CONFIG.read_text()
    assert f"Total {est.total_bytes / GIB:.2f} GiB" in text
    assert f"weights {est.weights_bytes / GIB:.2f} GiB" in text
    assert f"in-memory copy\n#   {est.checkpoint_copy_bytes / GIB:.2f} GiB" in text
    for s in est.shards:
        assert re.search(rf"shard {s.shard} \([^)]*\) {s.total_bytes / GIB:.2f} GiB", text), s
    uncapped_model = cfg.model.model_copy(update={"max_ind_range": None})
    uncapped = memory_estimate(cfg.model_copy(update={"model": uncapped_model}))
    stated = f"Uncapped ({uncapped.embedding_rows:,} rows) the same model would take "
    stated += f"{uncapped.total_bytes / GIB:.2f} GiB"
    assert stated in text


def test_dense_parameters_match_the_model():
    from core.model import DenseModel

    for dense_arch, over_arch in (([128, 64, 16], [256, 128, 1]), ([64, 16], [64, 1]), ([8], [4, 1])):
        model = DenseModel(13, 26, dense_arch, over_arch)
        assert dense_parameters(13, 26, dense_arch, over_arch) == sum(p.numel() for p in model.parameters())
