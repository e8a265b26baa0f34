"""The torchft lighthouse, started by the driver as soon as Ray is up.

Ray Train's ``TorchftConfig`` starts its lighthouse actor only once the worker group exists,
and waits for it: a new process that imports torch and torchft, about 2 s on the path to the
first step (measured: "after_worker_group_start callbacks completed in 2.12s"). Here the
driver starts the same server early, while the shards and Ray Train's controller start, and
``app.raytrain.PrestartedLighthouseConfig`` hands it to Ray Train's torchft backend, which
otherwise behaves as before (a lighthouse that is gone is replaced by a new one of these,
never by Ray Train's own, which needs a CPU that a cluster's head does not have). This module imports only Ray, so the driver starts the actor before it has imported
Ray Train and torch.
"""

from __future__ import annotations

import glob
import importlib.util
import logging
import os

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

__all__ = ["Lighthouse", "start_lighthouse"]

logger = logging.getLogger(__name__)


class Lighthouse:
    """An actor running torchft's LighthouseServer (what Ray Train's LighthouseServerActor
    runs, with the same ``address()``)."""

    def __init__(self, lighthouse_kwargs: dict):
        self.lighthouse = _lighthouse_server_class()(**lighthouse_kwargs)

    def address(self) -> str:
        return self.lighthouse.address()


def _lighthouse_server_class():
    """torchft's LighthouseServer, from its native extension alone. ``import torchft`` would
    import torch first (1.5-2 s of CPU, measured: the whole lighthouse process took 2.0 s of
    CPU to start, 0.4 s this way); the server is Rust and needs none of it."""
    try:
        spec = importlib.util.find_spec("torchft")
        native = glob.glob(os.path.join(os.path.dirname(spec.origin), "_torchft*.so"))[0]
        # The module name must end in the extension's own name (its PyInit symbol).
        ext = importlib.util.spec_from_file_location("_torchft", native)
        module = importlib.util.module_from_spec(ext)
        ext.loader.exec_module(module)
        return module.LighthouseServer
    except Exception as err:  # another layout of torchft: the regular import
        logger.info("loading torchft's extension alone failed (%s); importing torchft", err)
        # import cost: torchft imports torch, 1.5-2 s of CPU (above), paid only on this fallback.
        from torchft.coordination import LighthouseServer

        return LighthouseServer


def start_lighthouse(name: str | None, namespace: str, lighthouse_kwargs: dict):
    """Starts the lighthouse actor (named ``name``, or unnamed) on this node: the driver's, where
    the driver calls this and where Ray Train keeps its controller, which calls it for a group
    started again. It needs no CPU, so a head started without any takes it. Returns its handle
    without waiting for it."""
    return (
        ray.remote(Lighthouse)
        .options(
            name=name,
            namespace=namespace,
            num_cpus=0,
            scheduling_strategy=NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False),
        )
        .remote(lighthouse_kwargs)
    )
