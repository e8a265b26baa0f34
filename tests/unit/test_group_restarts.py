"""When cpr starts Ray Train's worker group again after its controller gave up (no Ray)."""

from __future__ import annotations

import ray
from ray.train import ControllerError

from app.raytrain import _port_taken


def test_a_group_whose_process_group_lost_its_port_to_another_process_is_started_again():
    # Seen once in the suite on 2 cores: Ray Train picked a free port for the group's store,
    # another process of the host bound it first, and the run failed at its start.
    taken = RuntimeError("torch.distributed.DistNetworkError: The server socket has failed to listen on any local "
                         "network address. port: 54551, useIpv6: false, code: -98, name: EADDRINUSE")
    assert _port_taken(ControllerError(taken))
    assert not _port_taken(ControllerError(ray.exceptions.RaySystemError("a bug")))
