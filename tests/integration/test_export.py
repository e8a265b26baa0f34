"""``cpr export``: a short real run exported and loaded with torchrec's own classes only
scores the held-out AUC the run reported; refusals (no run, no checkpoint, a step that does
not exist, an incremental step, a corrupt checkpoint) are one clear error.

The refusal tests build their checkpoints with CheckpointStore directly and need no Ray."""

from __future__ import annotations

import io
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from click.testing import CliRunner

from core.checkpoint import DENSE_FILE, FULL, INCREMENTAL, CheckpointStore, ShardRows, write_blob, write_shard_file
from core.plan import make_plan
from app.cli import main
from core.config import config_from_dict
from core.data import CriteoReader
from core.errors import CheckpointCorrupt, CheckpointNotFound, CprError
from app.export import ExportError, export_model
from core.model import DenseModel

pytestmark = [pytest.mark.timeout(300)]


def _dlrm_from_export(out: Path):
    """The exported model, built from model.json with torchrec's classes and nothing of cpr."""
    from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, PoolingType
    from torchrec.models.dlrm import DLRM

    doc = json.loads((out / "model.json").read_text())
    tables = [
        EmbeddingBagConfig(
            name=t["name"],
            embedding_dim=doc["embedding_dim"],
            num_embeddings=t["num_embeddings"],
            feature_names=t["feature_names"],
            pooling=PoolingType.SUM,
        )
        for t in doc["tables"]
    ]
    model = DLRM(
        embedding_bag_collection=EmbeddingBagCollection(tables=tables, device=torch.device("cpu")),
        dense_in_features=doc["dense_in_features"],
        dense_arch_layer_sizes=doc["dense_arch_layer_sizes"],
        over_arch_layer_sizes=doc["over_arch_layer_sizes"],
    )
    model.load_state_dict(torch.load(out / "model.pt", weights_only=True), strict=True)
    return model.eval(), doc


def _held_out_auc(model, doc: dict, eval_paths: list[str]) -> float:
    from torchmetrics.functional.classification import binary_auroc
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    keys = [f for t in doc["tables"] for f in t["feature_names"]]
    num_embeddings = np.array([t["num_embeddings"] for t in doc["tables"]], dtype=np.int64)
    scores, labels = [], []
    with torch.no_grad():
        for batch in CriteoReader(eval_paths, batch_rows=4096):
            ids = batch.sparse.astype(np.int64) % num_embeddings  # [B, 26]
            features = KeyedJaggedTensor.from_lengths_sync(
                keys=keys,
                values=torch.from_numpy(np.ascontiguousarray(ids.T).reshape(-1)),  # feature-major
                lengths=torch.ones(ids.size, dtype=torch.int32),
            )
            scores.append(torch.sigmoid(model(torch.from_numpy(batch.dense), features).squeeze(-1)))
            labels.append(torch.from_numpy(batch.labels))
    return float(binary_auroc(torch.cat(scores), torch.cat(labels).to(torch.int64)))


@pytest.mark.integration
@pytest.mark.timeout(600)
def test_exported_model_scores_the_reported_auc(ray_local, small_data, tmp_path):
    from app.run import run_training

    cfg = config_from_dict(
        {
            "run_dir": str(tmp_path / "run"),
            "seed": 5,
            "data": {
                "train": [small_data.train_path], "eval": [small_data.eval_path], "cache_dir": str(tmp_path / "cache")
            },
            "model": {"embedding_dim": 8, "table_rows": 20_000, "dense_arch": [32, 8], "over_arch": [32, 1]},
            # row-wise: every table is cut over both shards, which the export merges back
            "embeddings": {"num_shards": 2, "sharding": "row_wise", "call_timeout_s": 30},
            "training": {"num_trainers": 1, "microbatch_rows": 128, "microbatches_per_step": 4, "max_steps": 40},
            "checkpoint": {"every_steps": 15},
        }
    )
    report = run_training(cfg, show_progress=False)
    assert report["steps"] == 40

    exported = export_model(cfg.run_dir, str(tmp_path / "export"))
    assert exported.step == report["steps"], "the default is the run's final full checkpoint"
    model, doc = _dlrm_from_export(tmp_path / "export")
    assert [t["feature_names"] for t in doc["tables"]] == [[f"C{i}"] for i in range(1, 27)]
    auc = _held_out_auc(model, doc, cfg.data.eval)
    assert abs(auc - report["auc"]) < 0.005, (auc, report["auc"])

    # The command line writes the same model; an earlier full step exports a different one.
    result = CliRunner().invoke(main, ["export", cfg.run_dir, "--out", str(tmp_path / "cli")])
    assert result.exit_code == 0, result.output
    assert f"exported step {report['steps']}" in result.output
    ours = torch.load(tmp_path / "export" / "model.pt", weights_only=True)
    theirs = torch.load(tmp_path / "cli" / "model.pt", weights_only=True)
    assert all(torch.equal(ours[k], theirs[k]) for k in ours)
    earlier = export_model(cfg.run_dir, str(tmp_path / "step15"), step=15)
    assert earlier.step == 15
    older = torch.load(tmp_path / "step15" / "model.pt", weights_only=True)
    assert not torch.equal(older["over_arch.model.1.weight"], ours["over_arch.model.1.weight"])


# ----------------------------------------------------------------------------- refusals

_TABLE_ROWS = [3 + t for t in range(26)]  # distinct sizes: a table mixed up with another fails


def _fake_run(tmp_path: Path) -> tuple[Path, CheckpointStore]:
    """A run directory with config.yaml and no checkpoint yet; row-wise over two shards."""
    run_dir = tmp_path / "run"
    cfg = config_from_dict(
        {
            "run_dir": str(run_dir),
            "data": {"train": ["unused.tsv"], "eval": ["unused.tsv"]},
            "model": {"embedding_dim": 2, "table_rows": _TABLE_ROWS, "dense_arch": [4, 2], "over_arch": [4, 1]},
            "embeddings": {"num_shards": 2, "sharding": "row_wise"},
        }
    )
    run_dir.mkdir()
    (run_dir / "config.yaml").write_text(yaml.safe_dump(cfg.model_dump(), sort_keys=False))
    return run_dir, CheckpointStore(cfg.checkpoint_uri, keep_last=100)


def _save(store: CheckpointStore, step: int, seed: int, base_step: int | None = None) -> dict:
    """Commits a checkpoint of random rows (every row, or the first row of every slice for an
    incremental) and a DenseModel; returns {"tables": [table weights], "dense": state_dict}."""
    rng = np.random.default_rng(seed)
    plan = make_plan("row_wise", _TABLE_ROWS, 2)
    tables = [rng.standard_normal((n, 2)).astype(np.float32) for n in _TABLE_ROWS]
    entries = []
    for k, slices in enumerate(plan.shards):
        chosen = [(s.table, r) for s in slices for r in range(s.row_start, s.row_end)]
        if base_step is not None:
            chosen = [(s.table, s.row_start) for s in slices]
        t = np.array([c[0] for c in chosen], dtype=np.int32)
        r = np.array([c[1] for c in chosen], dtype=np.int64)
        w = np.stack([tables[a][b] for a, b in chosen])
        entries.append(write_shard_file(store.uri, step, k, ShardRows(t, r, w, np.zeros(len(t), np.float32))))
    torch.manual_seed(seed)
    dense = DenseModel(13, 26, [4, 2], [4, 1]).state_dict()
    buf = io.BytesIO()
    torch.save({"model": dense, "optim": {}}, buf)
    entries.append(write_blob(store.uri, step, DENSE_FILE, buf.getvalue()))
    kind = FULL if base_step is None else INCREMENTAL
    store.commit(step, entries, kind=kind, base_step=base_step, meta={"policy": "full" if base_step is None else "mfu"})
    return {"tables": tables, "dense": dense}


def test_export_merges_row_wise_slices_of_the_newest_full(tmp_path):
    run_dir, store = _fake_run(tmp_path)
    _save(store, 10, seed=1)
    _save(store, 20, seed=2, base_step=10)
    saved = _save(store, 30, seed=3)
    _save(store, 40, seed=4, base_step=30)

    result = export_model(str(run_dir), str(tmp_path / "out"))
    assert result.step == 30 and result.skipped_newer == (40,)
    model, doc = _dlrm_from_export(tmp_path / "out")
    assert doc["step"] == 30
    state = model.state_dict()
    for i, weights in enumerate(saved["tables"], start=1):
        key = f"sparse_arch.embedding_bag_collection.embedding_bags.t_C{i}.weight"
        assert torch.equal(state[key], torch.from_numpy(weights)), key
    for key, value in saved["dense"].items():
        assert torch.equal(state[key], value), key


def test_refusals_name_the_problem(tmp_path):
    with pytest.raises(ExportError, match="no such run directory"):
        export_model(str(tmp_path / "nowhere"), str(tmp_path / "out"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ExportError, match="no config.yaml"):
        export_model(str(tmp_path / "empty"), str(tmp_path / "out"))

    run_dir, store = _fake_run(tmp_path)
    with pytest.raises(CheckpointNotFound, match="saved none yet"):
        export_model(str(run_dir), str(tmp_path / "out"))

    _save(store, 10, seed=1)
    _save(store, 20, seed=2, base_step=10)
    _save(store, 30, seed=3)
    with pytest.raises(CheckpointNotFound, match=r"no checkpoint at step 7 .*committed steps: 10, 20, 30"):
        export_model(str(run_dir), str(tmp_path / "out"), step=7)
    with pytest.raises(ExportError, match=r"step 20 is an incremental checkpoint \(mfu\).*--step 10 or --step 30"):
        export_model(str(run_dir), str(tmp_path / "out"), step=20)
    assert not (tmp_path / "out").exists()

    # A corrupt newest full: named when asked for, passed over (to step 10) by default.
    shard = Path(store.uri) / "ckpt-000000000030" / "shard-1.arrow"
    shard.write_bytes(shard.read_bytes()[:-8] + b"corrupt!")
    with pytest.raises(CheckpointCorrupt, match="checkpoint step 30: file shard-1.arrow has checksum"):
        export_model(str(run_dir), str(tmp_path / "out"), step=30)
    assert export_model(str(run_dir), str(tmp_path / "out")).step == 10


def test_a_shard_file_missing_rows_is_corrupt(tmp_path):
    run_dir, store = _fake_run(tmp_path)
    plan = make_plan("row_wise", _TABLE_ROWS, 2)
    entries = []
    for k, slices in enumerate(plan.shards):
        rows = [(s.table, r) for s in slices for r in range(s.row_start, s.row_end)][: None if k == 0 else -1]
        t = np.array([a for a, _ in rows], dtype=np.int32)
        r = np.array([b for _, b in rows], dtype=np.int64)
        data = ShardRows(t, r, np.zeros((len(t), 2), np.float32), np.zeros(len(t), np.float32))
        entries.append(write_shard_file(store.uri, 5, k, data))
    store.commit(5, entries)
    with pytest.raises(CheckpointCorrupt, match="table C26 has 1 rows in no shard file"):
        export_model(str(run_dir), str(tmp_path / "out"))


def test_command_line_error_is_one_line(tmp_path):
    done = subprocess.run(
        [sys.executable, "-m", "app", "export", str(tmp_path / "nowhere"), "--out", str(tmp_path / "out")],
        capture_output=True, text=True, timeout=120, cwd=Path(__file__).resolve().parents[2],
    )
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [f"error: {tmp_path / 'nowhere'}: no such run directory"]
    assert issubclass(ExportError, CprError)


def test_a_vocabulary_run_exports_its_vocabulary_to_map_raw_ids(tmp_path):
    """The exported model maps raw Criteo ids the way the run's preprocessing did: model.json
    says how, and vocab.parquet lists (column, id, row), readable without cpr."""
    import pyarrow.parquet as pq

    from core.store import Vocabulary

    run_dir, store = _fake_run(tmp_path)
    raw = yaml.safe_load((run_dir / "config.yaml").read_text())
    raw["data"].update(mapping="vocab", min_count=2)
    (run_dir / "config.yaml").write_text(yaml.safe_dump(raw, sort_keys=False))
    # table t has _TABLE_ROWS[t] = 3 + t rows: row 0 shared, and 2 + t values of its own
    vocabulary = Vocabulary([np.arange(100, 102 + t, dtype=np.uint32) * (t + 1) for t in range(26)])
    assert list(vocabulary.table_rows) == _TABLE_ROWS
    train_store = tmp_path / "cache" / "train-abc"
    vocabulary.write(str(train_store / "vocab.arrow"))
    (run_dir / "run.json").write_text(json.dumps({"train_cache": str(train_store)}))
    _save(store, 10, seed=1)

    export_model(str(run_dir), str(tmp_path / "out"))
    doc = json.loads((tmp_path / "out" / "model.json").read_text())
    assert doc["categorical"]["mapping"] == "vocab" and doc["categorical"]["vocab_file"] == "vocab.parquet"
    table = pq.read_table(tmp_path / "out" / "vocab.parquet").to_pydict()
    rows = {(c, v): r for c, v, r in zip(table["column"], table["value"], table["row"])}
    assert rows[("C1", 100)] == 1 and rows[("C1", 101)] == 2 and rows[("C3", 3 * 103)] == 4
    assert len(rows) == sum(_TABLE_ROWS) - 26
    (run_dir / "run.json").unlink()
    with pytest.raises(ExportError, match="names no training store"):
        export_model(str(run_dir), str(tmp_path / "out2"))
