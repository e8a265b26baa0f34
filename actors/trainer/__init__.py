"""The trainer: the Ray Train worker's loop (``train_loop``), its step protocol, and its
clients of the shards and the supervisor. Loaded lazily: the driver names ``train_loop``
without paying for the trainer's own imports."""

from __future__ import annotations

import importlib

__all__ = ["train_loop"]


def __getattr__(name: str):
    if name == "train_loop":
        return importlib.import_module("actors.trainer.loop").train_loop
    raise AttributeError(name)
