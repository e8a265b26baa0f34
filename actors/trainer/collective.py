"""What trainers do together: the SUM all-reduce of a step's dense gradient over the quorum,
which a survivor walks away from when a peer's all-reduce of the same step already failed,
and the network interface gloo must use on a cluster."""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable

import ray
from torch.distributed import AllreduceOptions, ReduceOp

from actors.nodes import interface_for

__all__ = ["GroupBroken", "sum_over_trainers", "use_node_interface"]

logger = logging.getLogger(__name__)

# How often a trainer still waiting for its all-reduce asks whether the group broke.
_GROUP_CHECK_S = 0.1


class GroupBroken(Exception):
    """Another trainer's all-reduce of this step failed in the same quorum: a trainer of it
    died. This trainer stopped waiting for its own all-reduce, which cannot complete."""


def sum_over_trainers(pg, flat, group_broken: Callable[[], bool]) -> Exception | None:
    """Sums ``flat`` in place over the quorum's trainers. Returns None, or why the sum failed.

    A trainer killed in the middle of a gloo ring all-reduce makes its neighbours' calls fail
    at once, but a survivor that was waiting for data from one of those neighbours (not from
    the dead one) waits out the whole collective timeout: gloo cannot cancel a pending
    receive (``abort``, ``shutdown`` and dropping the group leave it blocked; measured), and
    the failed neighbour never sends. Meanwhile it heartbeats, so the lighthouse holds the
    next quorum for it. So the wait here is in slices: while the sum is pending,
    ``group_broken()`` is asked every ``_GROUP_CHECK_S`` (a failed all-reduce elsewhere in
    the same quorum and step); if so the trainer walks away. The abandoned receive ends in
    gloo's worker thread at its timeout; nothing reads its result, and the next quorum
    builds a new group. A sum done within ``_GROUP_CHECK_S`` asks nothing; a slower one (a
    peer still computing) costs one small supervisor call per slice.
    """
    opts = AllreduceOptions()
    opts.reduceOp = ReduceOp.SUM
    try:
        fut = pg.allreduce([flat], opts).get_future()
    except Exception as err:  # noqa: BLE001 - the group is already known broken (a peer died before the call)
        return err
    finished = threading.Event()
    fut.add_done_callback(lambda _: finished.set())
    while not finished.wait(_GROUP_CHECK_S):
        try:
            broken = group_broken()
        except Exception as err:  # noqa: BLE001 - the supervisor restarting: gloo's own timeout still bounds the wait
            logger.warning("could not ask whether the group broke (%r); still waiting for the sum", err)
            broken = False
        if broken:
            return GroupBroken("another trainer's all-reduce of this step failed; stopped waiting for this one")
    try:
        fut.value()
    except Exception as err:  # noqa: BLE001 - any failure of the collective fails the step, which is redone
        return err
    return None


def use_node_interface() -> str | None:
    """gloo connects to peers over the interface that holds this node's Ray IP: the hostname
    can resolve to 127.0.0.1 (it does inside the test cluster's hosts), which no peer on
    another host can reach. An interface set by the user (GLOO_SOCKET_IFNAME) wins; the
    embedded Ray sets ``lo``. Returns the interface used."""
    if not os.environ.get("GLOO_SOCKET_IFNAME"):
        ip = ray.util.get_node_ip_address()
        name = interface_for(ip)
        if name is None:
            logger.warning("no interface holds this node's IP %s; gloo picks one from the hostname", ip)
        else:
            os.environ["GLOO_SOCKET_IFNAME"] = name
    return os.environ.get("GLOO_SOCKET_IFNAME")
