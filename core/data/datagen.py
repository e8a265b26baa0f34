"""A seeded generator of Criteo-shaped synthetic data, drawn from a hidden click model
whose own AUC on the eval split is known: the ceiling a trained model can approach.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.csv as pacsv
import pyarrow.parquet as pq

from core.data.criteo import COLUMNS, DENSE_COLUMNS, NUM_DENSE, NUM_SPARSE, SPARSE_COLUMNS, preprocess_dense
from core.errors import ConfigError

__all__ = ["GeneratorSummary", "auc", "generate"]


@dataclass(frozen=True)
class GeneratorSummary:
    """What ``generate`` wrote, and how well the hidden click model itself scores."""

    train_path: str
    eval_path: str
    train_rows: int
    eval_rows: int
    ceiling_auc: float  # AUC of the hidden model's click probabilities on the eval split
    positive_rate: float  # fraction of clicks in the train split


_SUFFIXES = {"tsv": ".tsv", "tsv.gz": ".tsv.gz", "parquet": ".parquet"}
_TARGET_POSITIVE_RATE = 0.26
_SPARSE_LOGIT_STD = 1.3  # the categorical effects: the dominant signal
_DENSE_LOGIT_STD = 0.5
_SPARSE_MISSING_MAX = 0.08
_DENSE_MISSING_MAX = 0.3
_NEGATIVE_RATE = 0.005  # of I2 values, which are the only negative ones, as in Criteo
_EFFECT_STATS_RANKS = 1 << 16  # the head of each Zipf law, which holds most of its mass
_CALIBRATION_ROWS = 8192
_UINT32_MAX = 2**32 - 1
_HEX_DIGITS = np.frombuffer(b"0123456789abcdef", dtype=np.uint8)
_STREAM_MODEL, _STREAM_TRAIN, _STREAM_EVAL = 0, 1, 2


def _splitmix64(x: np.ndarray) -> np.ndarray:
    """A well-mixed 64-bit hash of each uint64 (wrapping arithmetic is intended)."""
    z = x + np.uint64(0x9E3779B97F4A7C15)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def _hashed_normal(key: np.ndarray, ranks: np.ndarray) -> np.ndarray:
    """A standard normal per (key, rank), by Box-Muller on the two halves of a hash."""
    h = _splitmix64(key + ranks.astype(np.uint64))
    u1 = ((h >> np.uint64(32)).astype(np.float64) + 0.5) / 2.0**32
    u2 = ((h & np.uint64(0xFFFFFFFF)).astype(np.float64) + 0.5) / 2.0**32
    return np.sqrt(-2.0 * np.log(u1)) * np.cos(2.0 * np.pi * u2)


def _zipf_mass(ranks: np.ndarray, vocab_rows: int, a: float) -> np.ndarray:
    """P(rank) under the truncated power law that ``_HiddenModel.draw_ranks`` samples."""
    if abs(a - 1.0) < 1e-9:
        cdf = lambda y: np.log(y) / math.log(vocab_rows + 1.0)  # noqa: E731
    else:
        top = (vocab_rows + 1.0) ** (1.0 - a) - 1.0
        cdf = lambda y: (y ** (1.0 - a) - 1.0) / top  # noqa: E731
    return cdf(ranks + 2.0) - cdf(ranks + 1.0)


@dataclass(frozen=True)
class _HiddenModel:
    """The ground truth behind the synthetic data: feature distributions and click model.

    logit = bias + sum_j dense_weight[j] * (pp_j - dense_center[j])
                 + sum_f sparse_scale[f] * (effect(f, rank) - effect_mean[f]) / effect_std[f]
    with pp = log1p(max(x, 0)) as the reader computes it and effect a hashed normal, so no
    table per value is needed. Missing fields contribute 0 (pp = 0 for dense).
    """

    vocab_rows: np.ndarray  # int64 [26]
    zipf_a: float
    sparse_missing: np.ndarray  # [26] probability that a categorical field is empty
    id_keys: np.ndarray  # uint32 [26, 3] odd multipliers of the rank -> id permutation
    effect_keys: np.ndarray  # uint64 [26]
    effect_mean: np.ndarray  # [26] over the feature's Zipf law, so that its term is centred
    effect_std: np.ndarray  # [26]
    sparse_scale: np.ndarray  # [26]
    dense_missing: np.ndarray  # [13]
    dense_log_mean: np.ndarray  # [13] x = floor(exp(N(mean, std))): heavy-tailed counts
    dense_log_std: np.ndarray  # [13]
    dense_center: np.ndarray  # [13]
    dense_weight: np.ndarray  # [13]
    bias: float

    @classmethod
    def create(cls, seed: int, vocab_rows: np.ndarray, zipf_a: float) -> _HiddenModel:
        rng = np.random.default_rng(np.random.SeedSequence(seed, spawn_key=(_STREAM_MODEL,)))
        sparse_missing = rng.uniform(0.0, _SPARSE_MISSING_MAX, NUM_SPARSE)
        id_keys = (rng.integers(0, 2**32, (NUM_SPARSE, 3), dtype=np.uint64) | np.uint64(1)).astype(np.uint32)
        effect_keys = rng.integers(0, 2**64, NUM_SPARSE, dtype=np.uint64, endpoint=False)
        # Exponential strengths: a few features matter a lot, most a little, as in real logs.
        strength = rng.exponential(1.0, NUM_SPARSE)
        sparse_scale = strength * _SPARSE_LOGIT_STD / np.sqrt(np.sum(strength**2 * (1.0 - sparse_missing)))
        effect_mean = np.empty(NUM_SPARSE)
        effect_std = np.empty(NUM_SPARSE)
        for f in range(NUM_SPARSE):
            # Moments over the Zipf law: the head exactly, the thin tail as a standard normal.
            ranks = np.arange(min(int(vocab_rows[f]), _EFFECT_STATS_RANKS))
            mass = _zipf_mass(ranks, int(vocab_rows[f]), zipf_a)
            effect = _hashed_normal(effect_keys[f], ranks)
            tail = max(0.0, 1.0 - float(mass.sum()))
            effect_mean[f] = float(mass @ effect)
            second = float(mass @ effect**2) + tail
            effect_std[f] = math.sqrt(max(second - effect_mean[f] ** 2, 1e-12))
        dense_missing = rng.uniform(0.0, _DENSE_MISSING_MAX, NUM_DENSE)
        dense_log_mean = rng.uniform(0.0, 4.0, NUM_DENSE)
        dense_log_std = rng.uniform(0.8, 2.0, NUM_DENSE)
        dense_weight = rng.normal(0.0, 1.0, NUM_DENSE)
        model = cls(
            vocab_rows=vocab_rows,
            zipf_a=zipf_a,
            sparse_missing=sparse_missing,
            id_keys=id_keys,
            effect_keys=effect_keys,
            effect_mean=effect_mean,
            effect_std=effect_std,
            sparse_scale=sparse_scale,
            dense_missing=dense_missing,
            dense_log_mean=dense_log_mean,
            dense_log_std=dense_log_std,
            dense_center=np.zeros(NUM_DENSE),
            dense_weight=np.ones(NUM_DENSE),
            bias=0.0,
        )
        # Standardize the dense term on a sample of the model's own dense features.
        ints, _ = model.draw_dense(rng, _CALIBRATION_ROWS)
        pp = preprocess_dense(ints).astype(np.float64)
        dense_weight *= _DENSE_LOGIT_STD / np.sqrt(np.sum(dense_weight**2)) / np.maximum(pp.std(axis=0), 1e-6)
        # For logit ~ N(b, s^2), E[sigmoid] ~ sigmoid(b / sqrt(1 + pi s^2 / 8)).
        logit_std = math.hypot(_SPARSE_LOGIT_STD, _DENSE_LOGIT_STD)
        target = _TARGET_POSITIVE_RATE
        bias = math.log(target / (1.0 - target)) * math.sqrt(1.0 + math.pi * logit_std**2 / 8.0)
        return dataclasses.replace(model, dense_center=pp.mean(axis=0), dense_weight=dense_weight, bias=bias)

    def draw_dense(self, rng: np.random.Generator, n_rows: int) -> tuple[np.ndarray, np.ndarray]:
        """-> (int64 [n, 13] values with missing as 0, bool [n, 13] missing)."""
        logs = rng.normal(self.dense_log_mean, self.dense_log_std, (n_rows, NUM_DENSE))
        values = np.floor(np.exp(np.minimum(logs, 20.0))).astype(np.int64)
        negative = rng.random(n_rows) < _NEGATIVE_RATE
        values[:, 1] = np.where(negative, -rng.integers(1, 4, n_rows), values[:, 1])
        missing = rng.random((n_rows, NUM_DENSE)) < self.dense_missing
        values[missing] = 0
        return values, missing

    def draw_ranks(self, rng: np.random.Generator, n_rows: int) -> np.ndarray:
        """int64 [n, 26] value ranks, rank r having probability ~ (r + 1)^-a (inverse CDF)."""
        u = rng.random((n_rows, NUM_SPARSE))
        top = self.vocab_rows.astype(np.float64) + 1.0
        a = self.zipf_a
        if abs(a - 1.0) < 1e-9:
            x = top**u
        else:
            x = (1.0 + u * (top ** (1.0 - a) - 1.0)) ** (1.0 / (1.0 - a))
        return np.clip(np.floor(x).astype(np.int64) - 1, 0, self.vocab_rows - 1)

    def ids(self, ranks: np.ndarray) -> np.ndarray:
        """uint32 ids of ranks: a keyed bijection of rank + 1 that keeps 0 for 'missing'.

        Multiplying by an odd number and xor-shifting are both invertible mod 2^32 and
        both map 0 to 0, so distinct ranks get distinct, non-zero, hash-like ids.
        """
        x = (ranks + 1).astype(np.uint32)
        for k, shift in enumerate((16, 13, 16)):
            x = x * self.id_keys[:, k]
            x ^= x >> np.uint32(shift)
        return x

    def sparse_logits(self, ranks: np.ndarray) -> np.ndarray:
        """float64 [n, 26] each categorical value's contribution to the logit."""
        effect = _hashed_normal(self.effect_keys, ranks)
        return self.sparse_scale * (effect - self.effect_mean) / self.effect_std

    def draw_chunk(self, rng: np.random.Generator, n_rows: int) -> tuple[pa.Table, np.ndarray, np.ndarray]:
        """-> (the rows as a Criteo table, int8 labels, float64 click probabilities)."""
        dense, dense_missing = self.draw_dense(rng, n_rows)
        ranks = self.draw_ranks(rng, n_rows)
        sparse_missing = rng.random((n_rows, NUM_SPARSE)) < self.sparse_missing
        logits = np.where(sparse_missing, 0.0, self.sparse_logits(ranks)).sum(axis=1)
        pp = preprocess_dense(dense).astype(np.float64)
        logits += self.bias + (pp - self.dense_center) @ self.dense_weight
        probs = 1.0 / (1.0 + np.exp(-logits))
        labels = (rng.random(n_rows) < probs).astype(np.int8)
        ids = self.ids(ranks)
        arrays = [pa.array(labels)]
        arrays += [pa.array(dense[:, j], mask=dense_missing[:, j]) for j in range(NUM_DENSE)]
        arrays += [_hex_strings(ids[:, f], sparse_missing[:, f]) for f in range(NUM_SPARSE)]
        return pa.Table.from_arrays(arrays, names=list(COLUMNS)), labels, probs


def _hex_strings(ids: np.ndarray, missing: np.ndarray) -> pa.Array:
    """uint32 ids -> Arrow strings of 8 lowercase hex digits, null where missing."""
    n = len(ids)
    be_bytes = ids.astype(">u4").view(np.uint8).reshape(n, 4)
    chars = np.empty((n, 8), dtype=np.uint8)
    chars[:, 0::2] = _HEX_DIGITS[be_bytes >> 4]
    chars[:, 1::2] = _HEX_DIGITS[be_bytes & 15]
    offsets = np.arange(0, 8 * n + 1, 8, dtype=np.int32)
    null_count = int(missing.sum())
    validity = pa.array(~missing).buffers()[1] if null_count else None
    return pa.Array.from_buffers(
        pa.string(), n, [validity, pa.py_buffer(offsets), pa.py_buffer(chars)], null_count=null_count
    )


_SCHEMA = pa.schema(
    [("label", pa.int8())] + [(c, pa.int64()) for c in DENSE_COLUMNS] + [(c, pa.string()) for c in SPARSE_COLUMNS]
)


def _write_split(
    path: str, fmt: str, model: _HiddenModel, rows: int, chunk_rows: int, rng: np.random.Generator, keep_probs: bool
) -> tuple[int, np.ndarray | None, np.ndarray | None]:
    """Streams ``rows`` rows to ``path`` (atomically) -> (positives, probs, labels if kept)."""
    tmp = f"{path}.tmp{os.getpid()}"
    positives = 0
    probs_kept: list[np.ndarray] = []
    labels_kept: list[np.ndarray] = []
    try:
        if fmt == "parquet":
            sink = pq.ParquetWriter(tmp, _SCHEMA)
            stream = None
        else:
            # Arrow's gzip stream writes mtime 0, which keeps .gz output byte-identical.
            stream = pa.output_stream(tmp, compression="gzip" if fmt == "tsv.gz" else None)
            options = pacsv.WriteOptions(include_header=False, delimiter="\t", quoting_style="none")
            sink = pacsv.CSVWriter(stream, _SCHEMA, write_options=options)
        try:
            for start in range(0, rows, chunk_rows):
                table, labels, probs = model.draw_chunk(rng, min(chunk_rows, rows - start))
                sink.write_table(table)
                positives += int(labels.sum())
                if keep_probs:
                    probs_kept.append(probs)
                    labels_kept.append(labels)
        finally:
            sink.close()
            if stream is not None:
                stream.close()
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    if not keep_probs:
        return positives, None, None
    return positives, np.concatenate(probs_kept), np.concatenate(labels_kept)


def auc(scores: np.ndarray, labels: np.ndarray) -> float:
    """ROC AUC by the rank-sum (Mann-Whitney) formula, ties given their average rank."""
    positive = labels.astype(bool)
    n_pos = int(positive.sum())
    n_neg = len(positive) - n_pos
    if n_pos == 0 or n_neg == 0:
        return float("nan")
    _, inverse, counts = np.unique(scores, return_inverse=True, return_counts=True)
    mid_ranks = np.cumsum(counts) - (counts - 1) / 2.0
    rank_sum = float(mid_ranks[inverse][positive].sum())
    return (rank_sum - n_pos * (n_pos + 1) / 2.0) / (n_pos * n_neg)


def generate(
    out_dir: str,
    train_rows: int,
    eval_rows: int,
    fmt: str = "tsv",
    seed: int = 0,
    vocab_rows: Sequence[int] | int = 100_000,
    zipf_a: float = 1.2,
    chunk_rows: int = 100_000,
) -> GeneratorSummary:
    """Writes synthetic Criteo data drawn from a hidden click model, deterministically from ``seed``.

    Files: ``out_dir/train<ext>``, ``out_dir/eval<ext>`` (ext by ``fmt``: .tsv, .tsv.gz,
    .parquet) and ``out_dir/datagen.json`` (the summary, written last). Categorical values
    follow a Zipf law of exponent ``zipf_a`` over ``vocab_rows`` values per feature.
    Train and eval come from the same model through independent random streams.
    """
    if fmt not in _SUFFIXES:
        raise ConfigError(f"fmt = {fmt!r}, must be one of {sorted(_SUFFIXES)}")
    for name, value in (("train_rows", train_rows), ("eval_rows", eval_rows), ("chunk_rows", chunk_rows)):
        if value < 1:
            raise ConfigError(f"{name} = {value}, must be >= 1")
    if not (math.isfinite(zipf_a) and zipf_a > 0):
        raise ConfigError(f"zipf_a = {zipf_a}, must be > 0")
    if isinstance(vocab_rows, (int, np.integer)):
        vocab = np.full(NUM_SPARSE, int(vocab_rows), dtype=np.int64)
    else:
        vocab = np.asarray(vocab_rows, dtype=np.int64)
    if vocab.shape != (NUM_SPARSE,):
        raise ConfigError(f"vocab_rows has {vocab.size} entries, must have {NUM_SPARSE}")
    if (vocab < 1).any() or (vocab > _UINT32_MAX).any():
        raise ConfigError(f"vocab_rows = {vocab.tolist()}, each must be in [1, {_UINT32_MAX}]")

    os.makedirs(out_dir, exist_ok=True)
    model = _HiddenModel.create(seed, vocab, zipf_a)
    train_path = os.path.join(out_dir, "train" + _SUFFIXES[fmt])
    eval_path = os.path.join(out_dir, "eval" + _SUFFIXES[fmt])

    def stream(which: int) -> np.random.Generator:
        return np.random.default_rng(np.random.SeedSequence(seed, spawn_key=(which,)))

    train_positives, _, _ = _write_split(train_path, fmt, model, train_rows, chunk_rows, stream(_STREAM_TRAIN), False)
    _, probs, labels = _write_split(eval_path, fmt, model, eval_rows, chunk_rows, stream(_STREAM_EVAL), True)
    assert probs is not None and labels is not None
    summary = GeneratorSummary(
        train_path=train_path,
        eval_path=eval_path,
        train_rows=train_rows,
        eval_rows=eval_rows,
        ceiling_auc=auc(probs, labels),
        positive_rate=train_positives / train_rows,
    )
    summary_path = os.path.join(out_dir, "datagen.json")
    with open(f"{summary_path}.tmp{os.getpid()}", "w") as f:
        json.dump(dataclasses.asdict(summary), f, indent=2, sort_keys=True)
        f.write("\n")
    os.replace(f"{summary_path}.tmp{os.getpid()}", summary_path)
    return summary
