"""The microbatch store: a dataset preprocessed once into fixed-size microbatches with stable
ids, in Arrow IPC files on any ``pyarrow.fs`` URI, and read back by id from any host.

Layout of a store directory ``<cache_dir>/<name>-<key>/``: ``part-NNNNN.arrow`` files whose
record batches are whole microbatches (the chunks of the input in order, then the stitched
tails of the chunks), ``vocab.arrow`` for a frequency-thresholded vocabulary, and
``store.json``, written last: a store exists once its manifest does.
"""

from core.store.format import (
    MANIFEST_FILE,
    Mapping,
    StoreManifest,
    read_manifest,
    store_key,
    write_manifest,
)
from core.store.reader import MicrobatchStore
from core.store.vocab import Vocabulary

__all__ = [
    "MANIFEST_FILE",
    "Mapping",
    "MicrobatchStore",
    "StoreManifest",
    "Vocabulary",
    "read_manifest",
    "store_key",
    "write_manifest",
]
