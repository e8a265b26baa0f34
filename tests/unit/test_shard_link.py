"""The trainer's end of a shard link: a request the shard does not read (a process stopped,
not dead) fails within the call's deadline instead of blocking the step for good."""

from __future__ import annotations

import socket
import time

import numpy as np
import pytest

from actors.shard_link import LinkClient, LinkClosed

pytestmark = pytest.mark.timeout(30)


def test_a_send_the_shard_never_reads_fails_within_its_deadline(tmp_path):
    path = str(tmp_path / "link.sock")
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(path)
    server.listen(1)
    client = LinkClient(path, send_timeout_s=0.3)
    conn, _ = server.accept()  # accepted, never read: the socket's buffers fill up
    t0 = time.monotonic()
    with pytest.raises(LinkClosed, match="sending lookup"):
        client.send("lookup", np.zeros(4 << 20, dtype=np.float32))
    assert time.monotonic() - t0 < 5 and client.closed
    conn.close()
    server.close()
