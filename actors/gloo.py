"""torchft's reconfigurable gloo process group with a separate, shorter connect timeout.

torchft builds a new gloo process group after every quorum change, and gloo uses one
timeout for both connecting and collectives. When a peer dies between the quorum and the
connection, gloo retries the connection about five times, each for the whole timeout, so
with a 60 s collective timeout the survivors stall five minutes before the next quorum can
drop the dead peer. Here the connection gets its own timeout and the collectives keep theirs.
"""

from __future__ import annotations

from datetime import timedelta

import torch
from torchft import ProcessGroupGloo

__all__ = ["ReconfigurableGloo"]


class ReconfigurableGloo(ProcessGroupGloo):
    def __init__(self, timeout: timedelta, connect_timeout: timedelta) -> None:
        super().__init__(timeout=timeout)
        self._connect_timeout = connect_timeout

    def _create_pg(self, store, rank: int, world_size: int):
        collective = self._timeout
        self._timeout = self._connect_timeout
        try:
            pg = super()._create_pg(store, rank, world_size)
        finally:
            self._timeout = collective
        pg._get_backend(torch.device("cpu"))._set_default_timeout(collective)
        return pg
