"""A run's data made ready on Ray Data: the inputs resolved (``pyarrow.fs`` URIs and globs),
cut into chunks, and preprocessed by Ray Data tasks spread over the cluster's CPUs into the
microbatch stores of the training and evaluation data (core.store), which are reused when
their inputs and options match.

Ray Data runs each stage as a ``map`` over a dataset of task descriptions (chunks, then
parts); every task streams its chunk from storage and writes its part to the store, so the
driver holds only the tasks' summaries, whatever the input size. A vocabulary run counts the
ids in the same pass, sums the counts per feature with a Ray Data ``groupby``, and remaps
the parts it wrote with the vocabulary. ``app.dataengines`` runs the stages: on Ray Data, or
one after another in this process (``LocalEngine``).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import os
import time
from dataclasses import dataclass

import ray

from app.dataengines import LocalEngine, RayDataEngine
from core.config import RunConfig, config_from_dict
from core.data.chunks import Chunk, plan_chunks
from core.data.criteo import SPARSE_COLUMNS
from core.data.sources import InputFile, check_distinct, child_uri, is_local, open_filesystem, resolve_inputs
from core.data.sources import shown as shown_uri, split_uri
from core.data.synthetic import ceiling_auc, generate_missing
from core.errors import ConfigError, InsufficientData
from core.store import Mapping, StoreManifest, Vocabulary, publish_manifest, read_manifest, store_key
from core.store.format import manifest_exists
from core.store.build import part_name, remap_part, stitch_tails, write_chunk
from core.store.builds import StoreSlot
from core.store.identity import Source, changed_sources, chunk_digest, fingerprint
from core.store.vocab import VOCAB_FILE

__all__ = ["DataInputs", "StoreInfo", "build_stores", "local_inputs", "one_task_each", "prepare_data",
           "resolve_data", "with_table_rows"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class StoreInfo:
    uri: str
    rows: int
    microbatches: int
    microbatch_rows: int
    bad_lines: int
    reused: bool
    mapping: dict
    build: dict
    key: str
    inputs: list[dict]  # Source.as_dict() of each input file, in order
    vocab_uri: str | None  # the vocabulary (mapping vocab), else None
    content: str  # StoreManifest.content: a digest of the bytes it was built from


@dataclass(frozen=True)
class DataInputs:
    train: list[InputFile]
    eval: list[InputFile]
    ceiling_auc: float | None


def resolve_data(cfg: RunConfig) -> DataInputs:
    """Synthetic data generated where configured and missing (core.data.synthetic: only into
    the generator's own directory), then every input URI resolved to its files: a URI that
    does not exist, cannot be read, a glob that matches nothing, or a file named twice (within
    or across train and eval), stops the run here, before Ray or any actor starts."""
    d = cfg.data
    if d.generate is not None:
        generate_missing(d)
    train, evaluation = resolve_inputs(d.train, "data.train"), resolve_inputs(d.eval, "data.eval")
    check_distinct(train, evaluation)
    ceiling = ceiling_auc(os.path.dirname(split_uri(d.train[0])[1])) if is_local(d.train[0]) else None
    return DataInputs(train, evaluation, ceiling)


def local_inputs(inputs: DataInputs) -> tuple[tuple[str, str, int], ...]:
    """(field, path, size) of every input file named by a local path: what every host of a
    cluster must see (``core.storage.expected_files``)."""
    return tuple((field, f.uri, f.size) for field, files in (("data.train", inputs.train), ("data.eval", inputs.eval))
                 for f in files if is_local(f.uri))


def one_task_each(cfg: RunConfig, inputs: DataInputs) -> bool:
    """Whether the training and the evaluation data are one chunk each: one task, which the
    driver runs itself (``build_stores``), so it can do so before Ray starts."""
    size = cfg.data.chunk_mb << 20
    return len(plan_chunks(inputs.train, size)) == 1 and len(plan_chunks(inputs.eval, size)) == 1


def build_stores(cfg: RunConfig, inputs: DataInputs, engine=None) -> dict:
    """The train and eval stores: ``{"train": StoreInfo, "eval": StoreInfo, "ceiling_auc",
    "table_rows"}``; ``table_rows`` is what the mapping gives each table. ``engine``: where
    the tasks run; default: Ray Data across the cluster (Ray must be up), except for data of
    one chunk, which is one task, and the driver runs it (Ray Data's start, 2-4 s on a fresh
    cluster, would cost more than the task; see ``LocalEngine``)."""
    engine = engine or _AutoEngine()
    mapping = _mapping(cfg)
    train_sources, train_key = _identity(cfg, inputs.train, "train")
    train = _build(engine, cfg, "train", inputs.train, train_sources, train_key, mapping, keep_tail=False,
                   vocab_uri=None)
    mapping = Mapping(**{**train.mapping, "table_rows": tuple(train.mapping["table_rows"])})
    # a vocabulary is the training bytes': another build of other bytes under the same key is another
    eval_sources, eval_key = _identity(cfg, inputs.eval, "eval",
                                       vocab_of=train.content if mapping.kind == "vocab" else None)
    evaluation = _build(engine, cfg, "eval", inputs.eval, eval_sources, eval_key, mapping, keep_tail=True,
                        vocab_uri=train.vocab_uri)
    return {"train": train, "eval": evaluation, "ceiling_auc": inputs.ceiling_auc, "table_rows": list(mapping.table_rows)}


def _mapping(cfg: RunConfig) -> Mapping:
    """The mapping the training store's ids go through (a vocabulary's sizes known once built)."""
    if cfg.data.mapping == "hash":
        return Mapping("hash", tuple(cfg.model.rows_per_table))
    return Mapping("vocab", (), cfg.data.min_count)


def _identity(cfg: RunConfig, files: list[InputFile], name: str, **more) -> tuple[list[Source], str]:
    """(each file's fingerprint, the store's key) of the store ``name`` of ``files``: the
    inputs and the options that shape its contents."""
    d, mapping = cfg.data, _mapping(cfg)
    if mapping.kind == "hash":
        options = {"mapping": "hash", "table_rows": mapping.table_rows}
    else:
        options = {"mapping": "vocab", "min_count": d.min_count}
    # chunk_mb too: a chunk's leftover rows go to the last part, so the chunks shape the microbatches
    options.update(rows=cfg.training.microbatch_rows, skip=d.skip_bad_lines, chunk_mb=d.chunk_mb, name=name, **more)
    sources = [fingerprint(f) for f in files]
    return sources, store_key(sources, options)


def train_identity(cfg: RunConfig, inputs: DataInputs) -> tuple[str, tuple[dict, ...]]:
    """(key, inputs) of the training store these inputs make: what a checkpoint's data
    position records (core.checkpoint.position), known before the store is built."""
    sources, key = _identity(cfg, inputs.train, "train")
    return key, tuple(s.as_dict() for s in sources)


def prepare_data(cfg: RunConfig, engine=None) -> dict:
    """``build_stores`` of the config's inputs (benchmarks: ``engine=LocalEngine()`` needs no Ray)."""
    return build_stores(cfg, resolve_data(cfg), engine)


class _AutoEngine:
    """Ray Data for data of several chunks, the driver for one."""

    def __init__(self) -> None:
        self._ray_data: RayDataEngine | None = None

    def choose(self, chunks: int):
        if chunks == 1:
            return LocalEngine()
        if self._ray_data is None:
            self._ray_data = RayDataEngine()
        return self._ray_data


def with_table_rows(cfg: RunConfig, table_rows: list[int]) -> RunConfig:
    """``cfg`` with the tables a vocabulary gave (``hash``: unchanged)."""
    if cfg.data.mapping != "vocab" or cfg.model.rows_per_table == list(table_rows):
        return cfg
    raw = cfg.model_dump()
    raw["model"].update(table_rows=list(table_rows), max_ind_range=None)
    small = min(table_rows)
    if cfg.embeddings.sharding == "row_wise" and small < cfg.embeddings.num_shards:
        column = SPARSE_COLUMNS[list(table_rows).index(small)]
        raise ConfigError(
            f"data.mapping: vocab gave table {column} {small} rows (values seen >= data.min_count={cfg.data.min_count} "
            f"times, plus the shared row), fewer than embeddings.num_shards={cfg.embeddings.num_shards} that row_wise "
            "sharding needs; lower data.min_count or embeddings.num_shards, or use embeddings.sharding: table_wise")
    return config_from_dict(raw)


def _build(engine, cfg: RunConfig, name: str, files: list[InputFile], sources: list[Source], key: str,
           mapping: Mapping, keep_tail: bool, vocab_uri: str | None) -> StoreInfo:
    """The store of ``files``: found (checked byte for byte first with ``data.verify_data``),
    or built into a directory of its own and published (core.store.builds); a build that
    fails removes what it wrote. The run reads the build it gets here (``StoreInfo.uri``)."""
    slot = StoreSlot(child_uri(cfg.cache_dir, f"{name}-{key}"))
    shown = shown_uri(slot.uri)
    with slot.held():
        found, stale = read_manifest(slot.uri), None
        # a manifest of another version or shape: replaced, and every build directory kept (its runs read one)
        foreign = found is None and manifest_exists(slot.uri)
        if found is not None and cfg.data.verify_data:
            changed = _changed_chunks(found, files)
            if changed:
                logger.warning("%s data: the store %s no longer matches its inputs (%s); building it again", name,
                               shown, "; ".join(changed))
                found, stale = None, found
        if found is not None:
            slot.remove_orphans({found.dir} | {r["dir"] for r in found.replaced})
            logger.info("%s data: reusing the store %s (%d microbatches)", name, shown, found.microbatches)
            return _info(slot.uri, found, True)
        now = round(time.time())
        if stale is not None:
            replaced = [*stale.replaced, {"dir": stale.dir, "at": now}]
            logger.warning("%s data: the store's build of the older bytes, %s/%s, is kept for runs that started on "
                           "it; remove it when none runs", name, shown, stale.dir)
        else:  # nothing, or builds named by a manifest this version cannot read: kept as replaced
            replaced = [{"dir": d, "at": now} for d in slot.builds()] if foreign else []
        slot.remove_orphans({r["dir"] for r in replaced})
        build, build_uri = slot.new_build()
        try:
            manifest = _build_into(engine, cfg, name, files, sources, key, mapping, keep_tail, vocab_uri, build,
                                   build_uri, shown)
            publish_manifest(build_uri, manifest, replace=True)  # the build's own, which its runs read
            store = dataclasses.replace(manifest.under(build), replaced=replaced)
            published = publish_manifest(slot.uri, store, replace=stale is not None or foreign)
        except BaseException:
            slot.discard(build)
            raise
    theirs = None if published else read_manifest(slot.uri)
    if theirs is not None:  # another run published the same store first (object storage): theirs is used
        slot.remove(build)
        logger.info("%s data: another run built the store %s first; using it", name, shown)
        return _info(slot.uri, theirs, True)
    logger.info("%s data: %d rows in %d microbatches, %.1f s", name, manifest.rows, manifest.microbatches,
                manifest.build["seconds"])
    return _info(slot.uri, store, False)


def _changed_chunks(found: StoreManifest, files: list[InputFile]) -> list[str]:
    """Every chunk the store was built from, read again and its digest compared with the one
    the build took: the files whose bytes differ (``data.verify_data``)."""
    by_name = {f.name: f for f in files}
    changed: list[str] = []
    for c in found.chunks:
        f = by_name.get(c["file"])
        if f is None or c["file"] in changed:
            continue
        if chunk_digest(Chunk(f, c["start"], c["stop"])) != c["digest"]:
            changed.append(c["file"])
    recorded = [Source.of(s) for s in found.inputs]
    return [f"{n}: its bytes changed" for n in changed] + changed_sources(recorded, [fingerprint(f) for f in files])


def _build_into(engine, cfg: RunConfig, name: str, files: list[InputFile], sources: list[Source], key: str,
                mapping: Mapping, keep_tail: bool, vocab_uri: str | None, build: str, uri: str,
                shown: str) -> StoreManifest:
    """The store's files written into ``uri``, its build's own directory (``build`` inside the
    store's); returns the manifest that publishes them."""
    t0 = time.perf_counter()
    chunks = plan_chunks(files, cfg.data.chunk_mb << 20)
    if isinstance(engine, _AutoEngine):
        engine = engine.choose(len(chunks))
    counting = mapping.kind == "vocab" and vocab_uri is None
    logger.info("%s data: preprocessing %d file(s) in %d chunk(s) on %s into %s", name, len(files), len(chunks),
                engine.name, shown)
    rows = cfg.training.microbatch_rows
    task = functools.partial(_write_chunk_task, store_uri=uri, rows=rows, skip=cfg.data.skip_bad_lines,
                             mapping=None if counting else mapping, vocab_uri=vocab_uri)
    done = engine.map(task, [{"index": i, "chunk": _chunk_dict(c)} for i, c in enumerate(chunks)], name)
    _check_usable(name, files, done, 1 if keep_tail else rows)
    tails = [s["index"] for s in done if s["tail_rows"]]
    kind = "raw" if counting else "part"
    # One small task (fewer than a microbatch of rows per chunk, read one chunk's at a time): the driver's.
    last = _stitch_task({"index": len(chunks), "tails": tails}, store_uri=uri, rows=rows, keep_tail=keep_tail, kind=kind)
    parts = [s for s in done if s["microbatches"]] + ([last] if last["microbatches"] else [])
    vocab = None
    if counting:
        counts = [child_uri(uri, part_name(s["index"], "counts")) for s in done]
        vocabulary = engine.vocabulary(counts, cfg.data.min_count, name)
        for c in counts:
            _delete(c)
        vocabulary.write(child_uri(uri, VOCAB_FILE))
        vocab = VOCAB_FILE
        mapping = Mapping("vocab", vocabulary.table_rows, cfg.data.min_count)
        engine.map(functools.partial(_remap_task, store_uri=uri, vocab_uri=child_uri(uri, VOCAB_FILE)),
                   [{"index": p["index"]} for p in parts], name)
    if sum(p["microbatches"] for p in parts) == 0:
        raise InsufficientData(f"{name} data: {sum(s['usable'] for s in done)} usable rows, fewer than one "
                               f"microbatch of {rows} rows")
    seconds = time.perf_counter() - t0
    usable = sum(s["usable"] for s in done)
    logger.info("%s data: %d rows read, %.1f s (%.0f rows/s)", name, usable, seconds, usable / max(seconds, 1e-9))
    return StoreManifest(
        key=key, microbatch_rows=rows, rows=usable - last["dropped_rows"],
        parts=[{"file": part_name(p["index"]), "microbatches": p["microbatches"]} for p in parts],
        bad_lines=sum(s["bad_lines"] for s in done), mapping=_mapping_dict(mapping), sources=[f.name for f in files],
        dir=build, vocab=vocab,  # an evaluation store reads the training store's vocabulary
        inputs=[s.as_dict() for s in sources],
        chunks=[{"file": s["file"], "start": s["start"], "stop": s["stop"], "digest": s["digest"]} for s in done],
        build=_build_stats(done, seconds, usable, engine.name),
    )


def _mapping_dict(mapping: Mapping) -> dict:
    return {"kind": mapping.kind, "table_rows": list(mapping.table_rows), "min_count": mapping.min_count}


def _info(store_uri: str, m: StoreManifest, reused: bool) -> StoreInfo:
    """What the run uses of the store whose manifest (the store's) is ``m``: its build's URI."""
    uri = child_uri(store_uri, m.dir)
    vocab_uri = child_uri(store_uri, m.vocab) if m.vocab else None
    return StoreInfo(uri, m.rows, m.microbatches, m.microbatch_rows, m.bad_lines, reused, m.mapping, m.build, m.key,
                     m.inputs, vocab_uri, m.content)


def _build_stats(done: list[dict], seconds: float, usable: int, engine: str) -> dict:
    hosts: dict[str, dict] = {}
    for s in done:
        h = hosts.setdefault(s["node_ip"], {"chunks": 0, "rows": 0, "task_s": 0.0, "peak_rss_mb": 0.0})
        h["chunks"] += 1
        h["rows"] += s["usable"]
        h["task_s"] = round(h["task_s"] + s["seconds"], 3)
        h["peak_rss_mb"] = round(max(h["peak_rss_mb"], s["peak_rss_mb"]), 1)
    return {"engine": engine, "seconds": round(seconds, 3), "rows_per_s": round(usable / max(seconds, 1e-9)),
            "chunks": len(done), "hosts": hosts}


def _check_usable(name: str, files: list[InputFile], done: list[dict], rows: int) -> None:
    """Stops a run on data that cannot train or evaluate anything: a file without a usable row
    (empty, or all of it skipped), or fewer than ``rows`` rows (training: one microbatch)."""
    per_file = {f.name: [0, 0] for f in files}
    for s in done:
        per_file[s["file"]][0] += s["usable"]
        per_file[s["file"]][1] += s["bad_lines"]

    def counts(path: str, usable: int, skipped: int) -> str:
        if usable + skipped == 0:
            return f"{path}: empty (0 lines)"
        return f"{path}: {usable + skipped} lines read, {skipped} skipped as malformed, {usable} usable"

    empty = [(p, u, s) for p, (u, s) in per_file.items() if u == 0]
    if empty:
        raise InsufficientData(f"{name} data: {len(empty)} of {len(per_file)} file(s) hold no usable row; "
                               + "; ".join(counts(*f) for f in empty))
    usable = sum(u for u, _ in per_file.values())
    if usable < rows:
        raise InsufficientData(f"{name} data: {usable} usable rows, fewer than one microbatch of {rows} rows; "
                               + "; ".join(counts(p, u, s) for p, (u, s) in per_file.items()))


# --- what the Ray Data tasks run -------------------------------------------------------------


def _chunk_dict(c: Chunk) -> str:
    f = c.file
    return json.dumps([f.uri, f.name, f.size, f.mtime_ns, c.start, c.stop])


def _chunk_of(raw: str) -> Chunk:
    uri, name, size, mtime, start, stop = json.loads(raw)
    return Chunk(InputFile(uri, name, size, mtime), start, stop)


def _write_chunk_task(row: dict, store_uri: str, rows: int, skip: bool, mapping: Mapping | None,
                      vocab_uri: str | None) -> dict:
    if vocab_uri is not None:
        mapping = _VocabMapping(vocab_uri)
    out = write_chunk(_chunk_of(row["chunk"]), store_uri, row["index"], rows, skip, mapping)
    return {**out, "node_ip": _node_ip()}


class _VocabMapping:
    """A known vocabulary as write_chunk's mapping (read once per worker process)."""

    kind = "vocab"

    def __init__(self, uri: str):
        self._vocabulary = _vocabulary(uri)

    def map_ids(self, sparse):
        return self._vocabulary.map_ids(sparse)


@functools.lru_cache(maxsize=2)
def _vocabulary(uri: str) -> Vocabulary:
    return Vocabulary.read(uri)


def _stitch_task(row: dict, store_uri: str, rows: int, keep_tail: bool, kind: str) -> dict:
    out = stitch_tails(store_uri, list(row["tails"]), row["index"], rows, keep_tail, kind)
    return {**out, "node_ip": _node_ip()}


def _remap_task(row: dict, store_uri: str, vocab_uri: str) -> dict:
    return {**remap_part(store_uri, row["index"], _vocabulary(vocab_uri)), "node_ip": _node_ip()}


def _delete(uri: str) -> None:
    fs, path = open_filesystem(uri)
    fs.delete_file(path)


def _node_ip() -> str:
    return ray.util.get_node_ip_address() if ray.is_initialized() else "127.0.0.1"
