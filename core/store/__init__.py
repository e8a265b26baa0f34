"""The microbatch store: a dataset preprocessed once into fixed-size microbatches with stable
ids, in Arrow IPC files on any ``pyarrow.fs`` URI, and read back by id from any host.

Layout of a store directory ``<cache_dir>/<name>-<key>/``: ``store.json``, written last (a
store exists once its manifest does), and the directory of the build it names,
``b-<id>/``, holding ``part-NNNNN.arrow`` files whose record batches are whole microbatches
(the chunks of the input in order, then the stitched tails of the chunks) and ``vocab.arrow``
for a frequency-thresholded vocabulary. Builds write only into a directory of their own, so
two runs may build one store at once and readers never see a file rewritten
(core.store.builds).
"""

from core.store.format import (
    MANIFEST_FILE,
    Mapping,
    StoreManifest,
    publish_manifest,
    read_manifest,
    store_key,
)
from core.store.reader import MicrobatchStore
from core.store.vocab import Vocabulary

__all__ = [
    "MANIFEST_FILE",
    "Mapping",
    "MicrobatchStore",
    "StoreManifest",
    "Vocabulary",
    "publish_manifest",
    "read_manifest",
    "store_key",
]
