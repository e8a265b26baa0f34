"""``data.generate``: synthetic data written for a run whose (local) input files do not exist
yet, only ever into the generator's own directory and never over a file.

The generator writes ``<dir>/train<ext>``, ``<dir>/eval<ext>`` and ``<dir>/datagen.json``
(what it wrote and with which parameters). A run generates only when ``data.train`` and
``data.eval`` name exactly those two files, and ``<dir>`` does not exist, is empty, or was
written by the generator (it holds ``datagen.json``); anything else missing is an error naming
the field and the path. The files are generated in a directory of their own inside ``<dir>``
and linked into place one by one, each only if it is still missing: a file that exists is
never written, and two runs generating at once both finish with the same files.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import uuid

from core.config_data import DataConfig
from core.data.datagen import generate
from core.data.sources import has_wildcard, is_local, split_uri
from core.errors import ConfigError

__all__ = ["SUMMARY_FILE", "ceiling_auc", "generate_missing", "targets", "write_missing"]

logger = logging.getLogger(__name__)

SUMMARY_FILE = "datagen.json"
_SCRATCH = ".generating-"  # a generation's own directory inside the generator's: never the user's
_SUFFIXES = {"tsv": ".tsv", "tsv.gz": ".tsv.gz", "parquet": ".parquet"}


def generate_missing(data: DataConfig) -> None:
    """Writes the generator's files that ``data`` names and are missing (``data.generate``
    set); raises ConfigError where an input is missing that it must not write."""
    gen = data.generate
    named = [(field, uri) for field, uris in (("data.train", data.train), ("data.eval", data.eval)) for uri in uris]
    missing = [(field, uri) for field, uri in named
               if is_local(uri) and not has_wildcard(uri) and not os.path.exists(split_uri(uri)[1])]
    directory = os.path.dirname(split_uri(data.train[0])[1]) if is_local(data.train[0]) else ""
    suffix = _SUFFIXES[gen.format]
    train_path, eval_path = os.path.join(directory, f"train{suffix}"), os.path.join(directory, f"eval{suffix}")
    ours = (len(data.train) == 1 and len(data.eval) == 1 and is_local(data.train[0]) and is_local(data.eval[0])
            and split_uri(data.train[0])[1] == train_path and split_uri(data.eval[0])[1] == eval_path)
    if not missing:  # the files are there: used as they are, whoever wrote them
        return
    field, uri = missing[0]
    if not ours:
        raise ConfigError(
            f"{field}: {split_uri(uri)[1]} does not exist (data.generate writes only <dir>/train{suffix} and "
            f"<dir>/eval{suffix}, when data.train and data.eval name exactly those two files)")
    foreign = [n for n in (os.listdir(directory) if os.path.isdir(directory) else []) if not n.startswith(_SCRATCH)]
    if foreign and not os.path.exists(os.path.join(directory, SUMMARY_FILE)):
        raise ConfigError(
            f"{field}: {split_uri(uri)[1]} does not exist; data.generate writes only into a directory of its own, "
            f"and {directory} holds files it did not write (no {SUMMARY_FILE})")
    summary = _check_parameters(directory, data)
    present = [p for p in (train_path, eval_path) if os.path.exists(p)]
    if present and "parameters" not in summary:
        raise ConfigError(
            f"{field}: {split_uri(uri)[1]} does not exist, and {directory}/{SUMMARY_FILE} does not say how "
            f"{os.path.basename(present[0])} was generated (seed, vocabulary): a file generated now might not match "
            f"it; remove {directory} to generate both again")
    write_missing(directory, _parameters(data))


def _parameters(data: DataConfig) -> dict:
    g = data.generate
    return {"train_rows": g.train_rows, "eval_rows": g.eval_rows, "seed": g.seed, "format": g.format,
            "vocab_rows": g.vocab_rows}


def _summary(directory: str) -> dict:
    """What ``<directory>/datagen.json`` holds ({} without one, or if it holds no object);
    raises OSError or ValueError when it cannot be read."""
    try:
        with open(os.path.join(directory, SUMMARY_FILE)) as f:
            summary = json.load(f)
    except FileNotFoundError:
        return {}
    return summary if isinstance(summary, dict) else {}


def ceiling_auc(directory: str) -> float | None:
    """The ceiling AUC the generator recorded for the data in ``directory`` (its
    ``datagen.json``), or None: not the generator's directory, or a summary that does not say
    (the report then has no ceiling; nothing else depends on it)."""
    try:
        value = _summary(directory).get("ceiling_auc")
    except (OSError, ValueError) as exc:
        logger.warning("%s is unreadable (%s); the report shows no ceiling AUC",
                       os.path.join(directory, SUMMARY_FILE), exc)
        return None
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def _check_parameters(directory: str, data: DataConfig) -> dict:
    """The generator's directory holds what ``data.generate`` asks for, or an error says so.
    Returns its summary ({} without one)."""
    try:
        summary = _summary(directory)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"data.generate: {os.path.join(directory, SUMMARY_FILE)} is unreadable ({exc}); remove "
                          f"{directory} to generate it again") from None
    if not summary:
        return summary
    recorded = summary.get("parameters") or {k: summary.get(k) for k in ("train_rows", "eval_rows")}
    wanted = {k: v for k, v in _parameters(data).items() if k in recorded}
    if recorded != wanted:
        differ = ", ".join(f"{k}={recorded[k]} (config: {wanted[k]})" for k in wanted if recorded[k] != wanted[k])
        raise ConfigError(f"data.generate: {directory} holds data generated with {differ}; remove {directory} "
                          "to generate it again, or set data.generate as it was")
    return summary


def targets(directory: str, fmt: str) -> list[str]:
    """The files the generator writes into ``directory`` for format ``fmt``."""
    suffix = _SUFFIXES[fmt]
    return [os.path.join(directory, n) for n in (f"train{suffix}", f"eval{suffix}", SUMMARY_FILE)]


def write_missing(directory: str, parameters: dict) -> dict:
    """Generates synthetic data (``parameters``: train_rows, eval_rows, seed, format,
    vocab_rows) in a directory of its own inside ``directory``, then links each of its files
    into ``directory`` where that file is still missing; never writes over one. Returns the
    summary (as ``datagen.json`` holds it)."""
    p = parameters
    os.makedirs(directory, exist_ok=True)
    scratch = os.path.join(directory, f"{_SCRATCH}{uuid.uuid4().hex[:12]}")
    try:
        summary = generate(scratch, p["train_rows"], p["eval_rows"], fmt=p["format"], seed=p["seed"],
                           vocab_rows=p["vocab_rows"])
        document = {**summary.__dict__, "train_path": os.path.join(directory, os.path.basename(summary.train_path)),
                    "eval_path": os.path.join(directory, os.path.basename(summary.eval_path)), "parameters": p}
        written = os.path.join(scratch, SUMMARY_FILE)
        with open(written, "w") as f:
            json.dump(document, f, indent=2, sort_keys=True)
            f.write("\n")
        # The summary first: a directory holding a data file and no summary is never the generator's,
        # whenever another run looks, or this one dies.
        _link_if_missing(written, os.path.join(directory, SUMMARY_FILE))
        for made in (summary.train_path, summary.eval_path):
            _link_if_missing(made, os.path.join(directory, os.path.basename(made)))
        return document
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def _link_if_missing(source: str, target: str) -> None:
    try:
        os.link(source, target)
    except FileExistsError:
        pass  # written meanwhile (another run generating at once: the same bytes)
