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
from core.store.identity import TIME_ONLY, Source, changed_sources

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
    content: str = ""  # StoreManifest.content: a digest of the bytes the training store was built from

    def to_json(self) -> bytes:
        return json.dumps(dataclasses.asdict(self)).encode()


_DATA = ("store_key", "inputs", "content")  # what names the data, since issue 42
_FIELDS = tuple(f.name for f in dataclasses.fields(DataPosition) if f.name not in _DATA)


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
    key, inputs, content = document.get("store_key", ""), document.get("inputs", []), document.get("content", "")
    if not (isinstance(key, str) and isinstance(content, str) and isinstance(inputs, list)
            and all(isinstance(i, dict) for i in inputs)):
        raise CheckpointCorrupt(f"{where} has store_key = {key!r}, content = {content!r} and inputs of type "
                                f"{type(inputs).__name__}, expected two strings and a list of objects")
    return DataPosition(**{name: document[name] for name in _FIELDS}, store_key=key, inputs=tuple(inputs),
                        content=content)


def other_data(saved: DataPosition, now: DataPosition, step: int) -> str | None:
    """Why a run cannot continue from checkpoint ``step`` (its position ``saved``) on the data
    it has ``now``, or None when it is the same data, or cannot be told yet.

    With both contents known (the supervisor's restore, once the store was found or built),
    the bytes decide: the same bytes under another key (files touched, copied with new times)
    continue; other bytes under the same key (a store built again by data.verify_data) do not.
    Before the store is built (the driver's check, ``now.content`` unknown), the inputs'
    sizes and ends decide, and differences of time alone wait for the content. A checkpoint
    older than the key in its position cannot tell."""
    if not saved.store_key:
        return None
    changed = changed_sources([Source.of(s) for s in saved.inputs], [Source.of(s) for s in now.inputs])
    if saved.content and now.content:
        if saved.content == now.content:
            return None
        changed = [c for c in changed if not c.endswith(TIME_ONLY)] or ["their bytes changed"]
    elif saved.store_key == now.store_key:
        return None
    else:
        changed = [c for c in changed if not c.endswith(TIME_ONLY)]
        if not changed and [s["name"] for s in saved.inputs] == [s["name"] for s in now.inputs]:
            return None  # times alone, or options of another version: the content decides, once read
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
