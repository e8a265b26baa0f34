"""A lost host, named: when Ray declares a node of the run's cluster dead, one ``host_lost``
event names the host and every actor of the run it held (shards placed there or seen dying
there just before, trainers by registered node, spares in the pool or seen dying; none for a
host that held none); their own deaths and recoveries follow as usual."""

from __future__ import annotations

from collections.abc import Callable

from actors.supervisor.events import EventLog

__all__ = ["HostLossReporter"]

# Actors whose death was seen this long before Ray's verdict (or the first failed probe)
# died with the host.
_BEFORE_S = 5.0


class HostLossReporter:
    def __init__(
        self,
        events: EventLog,
        shards_on: Callable[[str, float], list[str]],
        trainers_on: Callable[[str], list[str]],
        spares_on: Callable[[str, float], list[str]],
        mirrors_on: Callable[[str, float], list[str]] = lambda node, since: [],
    ):
        self._mirrors_on = mirrors_on
        self._events = events
        self._shards_on = shards_on
        self._trainers_on = trainers_on
        self._spares_on = spares_on

    def on_host_lost(self, info: dict) -> None:
        node = info["node_id"]
        since = (info["unreachable_since"] or info["declared_dead_at"]) - _BEFORE_S
        actors = (self._shards_on(node, since) + self._trainers_on(node) + self._spares_on(node, since)
                  + self._mirrors_on(node, since))
        # Also a host that held none of the run's actors (one just added back): the report names
        # every host the run lost, as the fault log of a chaos run does.
        self._events.record("host_lost", actors=actors, **info)
