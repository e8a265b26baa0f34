"""``cpr export``: one checkpoint of a run as a plain torchrec DLRM, ``model.json`` (its
constructor arguments) and ``model.pt`` (its state_dict), loadable without cpr, Ray or the
shard layout: the shards' row-wise or table-wise slices are merged into whole tables.
"""

from __future__ import annotations

import io
import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from core.checkpoint import DENSE_FILE, FULL, CheckpointInfo, CheckpointStore
from core.config import RunConfig, load_config
from core.data import NUM_DENSE, SPARSE_COLUMNS
from core.data.sources import child_uri, shown
from core.store import Vocabulary
from core.store.vocab import VOCAB_FILE
from core.errors import CheckpointCorrupt, CheckpointNotFound, CprError

__all__ = ["ExportError", "ExportResult", "build_dlrm", "export_model", "MODEL_JSON", "MODEL_PT"]

# torch and torchrec (3.5 s to import, measured, 2-core machine) load only where the tensors are
# made, after the run, the checkpoint and its embedding rows are checked: an export refused there
# (no run directory, no full checkpoint, an incremental step, a corrupt one) says so in 0.4 s.

logger = logging.getLogger(__name__)

MODEL_JSON = "model.json"
MODEL_PT = "model.pt"
VOCAB_PARQUET = "vocab.parquet"


class ExportError(CprError):
    """The run directory, the requested step or the output directory cannot be exported."""


@dataclass(frozen=True)
class ExportResult:
    step: int
    model_json: str
    model_pt: str
    embedding_rows: int
    skipped_newer: tuple[int, ...]
    """Without ``--step``: committed checkpoints newer than ``step``, incremental or corrupt,
    that were not exported (see ``export_model``)."""


def export_model(run_dir: str, out_dir: str, step: int | None = None) -> ExportResult:
    """Writes ``out_dir/model.json`` and ``out_dir/model.pt`` from checkpoint ``step`` of the
    run in ``run_dir`` (default: its newest full checkpoint that verifies).

    Only full checkpoints are exported. An MFU/SSU incremental holds just the rows its policy
    chose; merged over its chain it gives rows last saved at different steps, while its dense
    state is that of its own step, so the pair is a model that never existed. The
    coordinator's ``consistent_chain`` rolls back to the full checkpoint alone for the same
    reason. A finished run ends with a full checkpoint at its last step.

    Raises:
        ExportError: ``run_dir`` is not a run directory, ``step`` is incremental, or the
            output cannot be written.
        CheckpointNotFound: no full checkpoint verifies, or ``step`` is not committed.
        CheckpointCorrupt: the checkpoint fails its checksums or does not fit the config.
        ConfigError: the run's ``config.yaml`` is invalid.
    """
    cfg, uri = _run_config(run_dir)
    store = CheckpointStore(uri)
    try:
        info, newer = _choose(store, uri, step)
        tables = _embedding_tables(store, info, cfg)
        dense = _dense_state(store, info)
    except OSError as exc:
        raise ExportError(f"cannot read the checkpoints under {uri}: {exc}") from None
    state = _dlrm_state(cfg, tables, dense, info.step)
    doc = {**_model_doc(cfg, info.step), "categorical": _categorical(cfg)}
    vocabulary = _vocabulary(cfg, run_dir) if cfg.data.mapping == "vocab" else None
    result = _write(out_dir, doc, state, info.step, sum(len(t) for t in tables), newer)
    if vocabulary is not None:
        _write_vocabulary(Path(out_dir) / VOCAB_PARQUET, vocabulary)
    return result


def _categorical(cfg: RunConfig) -> dict:
    """How a raw Criteo categorical id (8 hex digits, as an unsigned 32-bit number; missing: 0)
    becomes the row of its table, the way the run's preprocessing mapped it."""
    if cfg.data.mapping == "hash":
        return {"mapping": "hash", "row": "id mod num_embeddings of the column's table"}
    return {"mapping": "vocab", "min_count": cfg.data.min_count, "vocab_file": VOCAB_PARQUET,
            "row": f"the row of (column, id) in {VOCAB_PARQUET}; 0 for an id it does not list"}


def _vocabulary(cfg: RunConfig, run_dir: str) -> Vocabulary:
    """The vocabulary stored with the run's training store (run.json names the store)."""
    info = Path(run_dir) / "run.json"
    store = json.loads(info.read_text()).get("train_cache") if info.exists() else None
    if not store:
        raise ExportError(f"{run_dir}: run.json names no training store, so its vocabulary cannot be exported")
    try:
        return Vocabulary.read(child_uri(store, VOCAB_FILE))
    except (OSError, ValueError) as exc:
        raise ExportError(f"cannot read the run's vocabulary {shown(child_uri(store, VOCAB_FILE))}: {exc}") from None


def _write_vocabulary(path: Path, vocabulary: Vocabulary) -> None:
    import pyarrow.parquet as pq  # import cost: 0.1 s, for a vocabulary run's export only

    table = vocabulary.to_table().select(["column", "value", "row"])
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    pq.write_table(table, tmp)
    os.replace(tmp, path)


def _run_config(run_dir: str) -> tuple[RunConfig, str]:
    """The run's config and its checkpoint URI. Without ``checkpoint.storage`` the checkpoints
    are taken from ``run_dir`` itself, so a moved or copied run directory still exports."""
    path = Path(run_dir)
    if not path.is_dir():
        raise ExportError(f"{run_dir}: no such run directory")
    config_path = path / "config.yaml"
    if not config_path.is_file():
        raise ExportError(f"{run_dir}: no config.yaml there; is it a run directory?")
    cfg = load_config(config_path)
    return cfg, cfg.checkpoint.storage or str(path.resolve() / "checkpoints")


def _choose(store: CheckpointStore, uri: str, step: int | None) -> tuple[CheckpointInfo, tuple[int, ...]]:
    """The full checkpoint to export, verified, and (default step only) the newer
    checkpoints passed over."""
    committed = store.list_committed()
    if not committed:
        raise CheckpointNotFound(f"no checkpoint under {uri}: the run saved none yet")
    if step is not None:
        if step not in committed:
            raise CheckpointNotFound(
                f"no checkpoint at step {step} under {uri}; committed steps: {_steps_text(committed)}"
            )
        if store.info(step).kind != FULL:
            raise ExportError(_incremental_refusal(store, store.info(step), committed))
        return store.verify(step), ()
    info = store.latest_valid(kind=FULL)
    if info is None:
        corrupt = "; ".join(f"step {s}: {reason}" for s, reason in store.fallbacks) or "none"
        raise CheckpointNotFound(
            f"no valid full checkpoint under {uri} ({len(committed)} committed; corrupt: {corrupt})"
        )
    newer = tuple(s for s in committed if s > info.step)
    logger.info("exporting full checkpoint %d; newer ones not exported (incremental or corrupt): %s", info.step, newer)
    return info, newer


def _incremental_refusal(store: CheckpointStore, info: CheckpointInfo, committed: list[int]) -> str:
    later_full = next((s for s in committed if s > info.step and _kind(store, s) == FULL), None)
    nearest = " or ".join(f"--step {s}" for s in (info.base_step, later_full) if s is not None)
    policy = info.meta.get("policy", "mfu/ssu")
    return (
        f"step {info.step} is an incremental checkpoint ({policy}): it holds only the rows its policy chose, "
        f"so its rows and its dense state are not one model; export a full checkpoint: {nearest}"
    )


def _kind(store: CheckpointStore, step: int) -> str | None:
    try:
        return store.info(step).kind
    except CprError:  # an unreadable manifest, or removed by retention meanwhile
        return None


def _steps_text(steps: list[int], most: int = 12) -> str:
    shown = ", ".join(map(str, steps[-most:]))
    return f"..., {shown}" if len(steps) > most else shown


def _embedding_tables(store: CheckpointStore, info: CheckpointInfo, cfg: RunConfig) -> list[np.ndarray]:
    """float32 [rows_t, D] per table, each row taken from the one shard file that holds it."""
    table_rows = cfg.model.rows_per_table
    dim = cfg.model.embedding_dim
    where = f"checkpoint step {info.step}"
    # The plan that wrote it says how many shard files there are (a resume may have changed the
    # run's number since); one that records none was written by the run's own plan.
    written = store.plan(info)
    expected_shards = list(range(written.num_shards if written is not None else cfg.embeddings.num_shards))
    if info.shard_ids != expected_shards:
        raise CheckpointCorrupt(f"{where} has shard files {info.shard_ids}, the run has shards {expected_shards}")
    weights = [np.empty((n, dim), dtype=np.float32) for n in table_rows]
    copies = [np.zeros(n, dtype=np.int64) for n in table_rows]
    for shard_id in info.shard_ids:
        part = store.read_shard(info.step, shard_id)
        if part.dim != dim:
            raise CheckpointCorrupt(f"{where}: shard {shard_id} has embedding dim {part.dim}, the config says {dim}")
        for t in np.unique(part.tables):
            if not 0 <= t < len(table_rows):
                raise CheckpointCorrupt(
                    f"{where}: shard {shard_id} has rows of table {t}, the run has {len(table_rows)} tables"
                )
            mine = part.tables == t
            rows = part.rows[mine]
            if rows.min() < 0 or rows.max() >= table_rows[t]:
                raise CheckpointCorrupt(
                    f"{where}: shard {shard_id} has row {rows.max()} of table {SPARSE_COLUMNS[t]}, "
                    f"which has {table_rows[t]} rows"
                )
            copies[t] += np.bincount(rows, minlength=table_rows[t])
            weights[t][rows] = part.weights[mine]
    for t, counts in enumerate(copies):
        if (counts != 1).any():
            raise CheckpointCorrupt(
                f"{where}: table {SPARSE_COLUMNS[t]} has {int((counts == 0).sum())} rows in no shard file and "
                f"{int((counts > 1).sum())} in several, of {table_rows[t]}"
            )
    return weights


def _dense_state(store: CheckpointStore, info: CheckpointInfo) -> dict:
    import torch  # import cost: 1.5 s, deferred past the checks (see the top)

    blob = store.read_blob(info.step, DENSE_FILE)
    try:
        saved = torch.load(io.BytesIO(blob), weights_only=True)
        return dict(saved["model"])
    except Exception as exc:  # a blob that verifies but does not unpickle: any error torch raises
        raise CheckpointCorrupt(
            f"checkpoint step {info.step}: {DENSE_FILE} is unreadable: {type(exc).__name__}: {exc}"
        ) from None


def _model_doc(cfg: RunConfig, step: int) -> dict:
    m = cfg.model
    return {
        "embedding_dim": m.embedding_dim,
        "tables": [
            {"name": f"t_{column}", "num_embeddings": rows, "feature_names": [column]}
            for column, rows in zip(SPARSE_COLUMNS, m.rows_per_table)
        ],
        "dense_in_features": NUM_DENSE,
        "dense_arch_layer_sizes": list(m.dense_arch),
        "over_arch_layer_sizes": list(m.over_arch),
        "step": step,
    }


def build_dlrm(doc: dict, device: str = "cpu"):
    """torchrec's DLRM as ``model.json`` describes it (``device="meta"``: no storage)."""
    import torch  # import cost: 1.5 s, deferred past the checks (see the top)
    from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, PoolingType  # import cost: 2 s more, as torch
    from torchrec.models.dlrm import DLRM  # import cost: part of torchrec's, as above

    tables = [
        EmbeddingBagConfig(
            name=t["name"],
            embedding_dim=doc["embedding_dim"],
            num_embeddings=t["num_embeddings"],
            feature_names=list(t["feature_names"]),
            pooling=PoolingType.SUM,
        )
        for t in doc["tables"]
    ]
    where = torch.device(device)
    return DLRM(
        embedding_bag_collection=EmbeddingBagCollection(tables=tables, device=where),
        dense_in_features=doc["dense_in_features"],
        dense_arch_layer_sizes=list(doc["dense_arch_layer_sizes"]),
        over_arch_layer_sizes=list(doc["over_arch_layer_sizes"]),
        dense_device=where,
    )


def _dlrm_state(cfg: RunConfig, tables: list[np.ndarray], dense: dict, step: int) -> dict:
    """DLRM's state_dict: our DenseModel has DLRM's DenseArch and OverArch parameters under
    the same attribute names (core.model), so its keys are DLRM's as they are. SparseArch stacks the pooled tables
    in the order of the EBC's feature names, C1..C26, the order the shards' pooled output
    has for DenseModel (a shard slice's table index is the Criteo column)."""
    import torch  # import cost: 1.5 s, deferred past the checks (see the top)

    model = build_dlrm(_model_doc(cfg, step), device="meta")
    prefix = "sparse_arch.embedding_bag_collection.embedding_bags"
    state = {f"{prefix}.t_{column}.weight": torch.from_numpy(w) for column, w in zip(SPARSE_COLUMNS, tables)}
    state.update(dense)
    try:
        # strict: every key and shape must fit, so model.pt loads into the model of model.json
        model.load_state_dict(state, strict=True, assign=True)
    except RuntimeError as exc:
        detail = " ".join(str(exc).split())
        raise CheckpointCorrupt(
            f"checkpoint step {step}: {DENSE_FILE} does not fit the config's model: {detail}"
        ) from None
    return model.state_dict()


def _write(
    out_dir: str, doc: dict, state: dict, step: int, embedding_rows: int, newer: tuple[int, ...]
) -> ExportResult:
    import torch  # import cost: 1.5 s, deferred past the checks (see the top)

    out = Path(out_dir)
    json_path, pt_path = out / MODEL_JSON, out / MODEL_PT
    try:
        out.mkdir(parents=True, exist_ok=True)
        # Written beside and renamed: a reader never sees a half-written model.pt.
        tmp_pt = out / f".{MODEL_PT}.tmp-{os.getpid()}"
        torch.save(state, tmp_pt)
        os.replace(tmp_pt, pt_path)
        tmp_json = out / f".{MODEL_JSON}.tmp-{os.getpid()}"
        tmp_json.write_text(json.dumps(doc, indent=1) + "\n")
        os.replace(tmp_json, json_path)
    except OSError as exc:
        raise ExportError(f"cannot write the export to {out_dir}: {exc}") from None
    return ExportResult(step, str(json_path), str(pt_path), embedding_rows, newer)
