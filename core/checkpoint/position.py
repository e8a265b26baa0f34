"""Where in the training data a checkpoint was taken: the ``DATA_POSITION_FILE`` blob that
a resumed run reads to continue with the next step's microbatches, and to refuse a config
that would order the data differently.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass

from core.checkpoint.files import DATA_POSITION_FILE
from core.checkpoint.reader import CheckpointReader
from core.errors import CheckpointCorrupt

__all__ = ["DataPosition", "read_position"]


@dataclass(frozen=True)
class DataPosition:
    """The data schedule at a checkpoint: every field an integer >= 0."""

    next_step: int  # the first step the checkpoint has not trained
    microbatches_per_step: int
    microbatch_rows: int
    num_microbatches: int  # in the training data, which the schedule permutes
    seed: int  # of the schedule's permutations
    samples_trained: int

    def to_json(self) -> bytes:
        return json.dumps(dataclasses.asdict(self)).encode()


_FIELDS = tuple(f.name for f in dataclasses.fields(DataPosition))


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
    return DataPosition(**{name: document[name] for name in _FIELDS})
