"""Where in the training data a checkpoint was taken: the ``DATA_POSITION_FILE`` blob that
a resumed run reads to continue with the next step's microbatches, and to refuse a config
that would order the data differently, or other data: the training store's key and the
input files it was built from (core.store.identity) are kept with it.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass

from core.checkpoint.files import DATA_POSITION_FILE
from core.checkpoint.reader import CheckpointReader
from core.errors import CheckpointCorrupt, CprError
from core.store.identity import Source, changed_sources

__all__ = ["DataPosition", "newest_position", "other_data", "read_position"]


@dataclass(frozen=True)
class DataPosition:
    """The data schedule at a checkpoint: every field an integer >= 0."""

    next_step: int  # the first step the checkpoint has not trained
    microbatches_per_step: int
    microbatch_rows: int
    num_microbatches: int  # in the training data, which the schedule permutes
    seed: int  # of the schedule's permutations
    samples_trained: int
    store_key: str = ""  # of the training store (core.store.store_key); "" in checkpoints older than it
    inputs: tuple = ()  # the training store's input files: Source.as_dict() each, in order

    def to_json(self) -> bytes:
        return json.dumps(dataclasses.asdict(self)).encode()


_FIELDS = tuple(f.name for f in dataclasses.fields(DataPosition) if f.name not in ("store_key", "inputs"))


def read_position(store: CheckpointReader, step: int) -> DataPosition:
    """The data position saved with checkpoint ``step`` of ``store``, checksum verified.

    Raises:
        CheckpointCorrupt: the blob fails its checksum, was committed without it, or is not
            a JSON object holding every field of DataPosition as an integer >= 0 (naming the
            step, the file and what is wrong).
        CheckpointNotFound: ``step`` is not committed (or was removed meanwhile).
    """
    raw = store.read_blob(step, DATA_POSITION_FILE)
    where = f"checkpoint step {step}: file {DATA_POSITION_FILE}"
    try:
        document = json.loads(raw)
    except ValueError as exc:  # json.JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise CheckpointCorrupt(f"{where} is not JSON: {exc}") from None
    if not isinstance(document, dict):
        raise CheckpointCorrupt(f"{where} holds a JSON {type(document).__name__}, expected an object")
    missing = [name for name in _FIELDS if name not in document]
    if missing:
        raise CheckpointCorrupt(f"{where} lacks {', '.join(missing)}; it has {sorted(document)}")
    for name in _FIELDS:
        value = document[name]
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise CheckpointCorrupt(f"{where} has {name} = {value!r}, expected an integer >= 0")
    key, inputs = document.get("store_key", ""), document.get("inputs", [])
    if not isinstance(key, str) or not isinstance(inputs, list) or not all(isinstance(i, dict) for i in inputs):
        raise CheckpointCorrupt(f"{where} has store_key = {key!r} and inputs of type {type(inputs).__name__}, "
                                "expected a string and a list of objects")
    return DataPosition(**{name: document[name] for name in _FIELDS}, store_key=key, inputs=tuple(inputs))


def other_data(saved: DataPosition, now: DataPosition, step: int) -> str | None:
    """Why a run cannot continue from checkpoint ``step`` (its position ``saved``) on the data
    it has ``now``, or None when the training store is the same one (or the checkpoint is older
    than the store's key in a position, and cannot tell)."""
    if not saved.store_key or saved.store_key == now.store_key:
        return None
    changed = changed_sources([Source.of(s) for s in saved.inputs], [Source.of(s) for s in now.inputs])
    return (f"--resume: the training data changed since checkpoint step {step} "
            f"({'; '.join(changed) or 'the same files, preprocessed with other options'}); a run continues only on "
            "the data it trained on: restore the files, or start a new run")


def newest_position(store: CheckpointReader) -> tuple[int, DataPosition] | None:
    """(step, position) of the newest committed checkpoint whose position reads: what the
    driver compares its data with before a resume builds anything (every checkpoint of a run
    holds the same store key: a run never continues on other data)."""
    for step in reversed(store.list_committed()):
        try:
            return step, read_position(store, step)
        except CprError:  # corrupt, or removed meanwhile: the one before it
            continue
    return None
