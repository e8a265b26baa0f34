"""The supervisor: one actor per run (``actor.Supervisor``) that delegates to parts which each
own their state: the recovery controller (events -> ``machine.transition`` -> journal ->
executor), the trainer desk and book, the failure ledger, the spare pool, the checkpoint
coordinator and the event log, with hooks for metrics, the event files and fault injection.
Loaded lazily, so a unit test of one part imports neither Ray nor the others."""

from __future__ import annotations

import importlib

__all__ = ["Supervisor", "supervisor_name"]


def __getattr__(name: str):
    if name in __all__:
        return getattr(importlib.import_module("actors.supervisor.actor"), name)
    raise AttributeError(name)
