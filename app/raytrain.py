"""Ray Train's torchft backend with the driver's prestarted lighthouse (``app.lighthouse``).

Kept apart from ``app.lighthouse`` because importing Ray Train imports torch (1.7 s).
"""

from __future__ import annotations

import logging

import ray
from ray.train.v2.torch.torchft_config import TorchftConfig, _TorchftBackend

__all__ = ["PrestartedLighthouseConfig"]

logger = logging.getLogger(__name__)


class PrestartedLighthouseConfig(TorchftConfig):
    """``TorchftConfig`` whose backend uses the named lighthouse actor if it is alive."""

    def __init__(self, lighthouse_name: str | None, lighthouse_namespace: str, **kwargs):
        self.lighthouse_name = lighthouse_name
        self.lighthouse_namespace = lighthouse_namespace
        super().__init__(**kwargs)

    @property
    def backend_cls(self):
        return _PrestartedLighthouseBackend


class _PrestartedLighthouseBackend(_TorchftBackend):
    def _maybe_create_lighthouse_actor(self, backend_config: PrestartedLighthouseConfig) -> str:
        if self.lighthouse_actor is None and backend_config.lighthouse_name:
            try:
                actor = ray.get_actor(backend_config.lighthouse_name, namespace=backend_config.lighthouse_namespace)
                address = ray.get(actor.address.remote())
                self.lighthouse_actor = actor
                logger.info("using the prestarted torchft lighthouse at %s", address)
                return address
            except (ValueError, ray.exceptions.RayActorError) as err:
                logger.warning("the prestarted lighthouse is not available (%s); starting one", err)
        return super()._maybe_create_lighthouse_actor(backend_config)
