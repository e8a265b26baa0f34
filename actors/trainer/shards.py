"""A trainer's client of the embedding shards: routes a step's ids to the shards that own
them, gathers the pooled rows and pushes the gradients back, with a timeout on every call.

With shared memory, the arrays for a shard on this trainer's node go through a slab
(``actors.shm``) and the call itself goes over the shard's link (``actors.shard_link``), not
Ray, carrying only where the arrays lie; a shard on another node (or without /dev/shm) gets
them in a Ray call, as Ray objects.
"""

from __future__ import annotations

import time

import numpy as np
import ray

from actors.shard_link import LinkClient, LinkClosed
from actors.shm import ShmSlab, shm_available
from core.plan import ShardingPlan
from core.records import PushResult, ShardInfo
from core.step_protocol import StepId

__all__ = ["ShardClient", "ShardCallFailed", "StaleStep"]


class ShardCallFailed(Exception):
    """A call to embedding shard ``shard`` failed: the actor died, or did not answer in time."""

    def __init__(self, shard: int, reason: str):
        super().__init__(shard, reason)
        self.shard = shard
        self.reason = reason

    def __str__(self) -> str:
        return f"shard {self.shard}: {self.reason}"


class StaleStep(Exception):
    """A shard dropped this attempt's gradients: a newer attempt of the step replaced them.
    The step fails and is redone; no shard is at fault."""


class ShardClient:
    def __init__(self, shards, plan: ShardingPlan, dim: int, timeout_s: float, run_id: str = "",
                 node_id: str | None = None, shared_memory: bool = False):
        self.plan = plan
        self.dim = dim
        self.timeout_s = timeout_s
        self.run_id = run_id
        self.node_id = node_id
        self.shared_memory = shared_memory and node_id is not None and shm_available()
        self._slabs: dict[int, ShmSlab | None] = {}
        self._links: dict[int, LinkClient | None] = {}
        self._shards = list(shards)
        self._pooled: np.ndarray | None = None

    @property
    def shards(self) -> list:
        return self._shards

    @shards.setter
    def shards(self, handles) -> None:
        """New shard handles (a recovery): their slabs start afresh."""
        self.close()
        self._shards = list(handles)

    def close(self) -> None:
        for k in list(self._slabs):
            self._drop_slab(k)
        self._slabs, self._links = {}, {}

    def _slab(self, k: int) -> ShmSlab | None:
        """Shard ``k``'s slab, or None when its arrays travel in the call. A shard on this
        node also gets its link, when it offers one and it connects."""
        if not self.shared_memory:
            return None
        if k not in self._slabs:
            ref = self._shards[k].ready.remote()
            info: ShardInfo = self._gather([ref], first=k)[0]
            local = info.node_id == self.node_id
            self._slabs[k] = ShmSlab(self.run_id, f"s{k}") if local else None
            self._links[k] = None
            if local and info.link:
                try:
                    self._links[k] = LinkClient(info.link, send_timeout_s=self.timeout_s)
                except OSError:
                    pass  # the shard's calls go through Ray
        return self._slabs[k]

    def _drop_slab(self, k: int) -> None:
        slab, link = self._slabs.pop(k, None), self._links.pop(k, None)
        if slab is not None:
            slab.close()
        if link is not None:
            link.close()

    def _send(self, sent: list, method: str, *args, **kwargs) -> None:
        """Starts ``method`` on the next shard (``len(sent)``): over its link ("link" is
        appended), else as a Ray call (its ref). A link that breaks here fails the call, and
        the links of the shards already sent to are dropped with their replies unread."""
        k = len(sent)
        link = self._links.get(k)
        if link is None:
            sent.append(getattr(self._shards[k], method).remote(*args, **kwargs))
            return
        try:
            link.send(method, *args, **kwargs)
            sent.append("link")
        except LinkClosed as err:
            # Every shard already sent to may still write its slab: none is used again.
            for j in range(k + 1):
                self._drop_slab(j)
            raise ShardCallFailed(k, f"link: {err}") from None

    def _gather(self, sent: list, first: int = 0) -> list:
        """Results of one call per shard (shard ``first + i`` for call i: "link" or a Ray ref).
        Every shard whose call failed or did not answer loses its slab and link (a call still
        running may write there later); then ShardCallFailed names the first of them."""
        deadline = time.monotonic() + self.timeout_s
        pending = [r for r in sent if r != "link"]
        _, not_ready = ray.wait(pending, num_returns=len(pending), timeout=self.timeout_s) if pending else ([], [])
        out, failed, raised = [], [], None
        for i, ref in enumerate(sent):
            k = first + i
            if ref == "link":
                try:
                    out.append(self._links[k].receive(deadline))
                except LinkClosed as err:
                    failed.append(ShardCallFailed(k, f"link: {err}"))
                except Exception as err:  # noqa: BLE001 - the shard's own error, raised once every reply is read
                    raised = raised or err
                    out.append(None)
                continue
            if ref in not_ready:
                failed.append(ShardCallFailed(k, f"no answer within {self.timeout_s}s"))
                continue
            try:
                out.append(ray.get(ref))
            except (ray.exceptions.RayActorError, ray.exceptions.ObjectLostError) as err:
                # ObjectLostError: the answer lay in the object store of a host that is gone.
                failed.append(ShardCallFailed(k, type(err).__name__))
            except Exception as err:  # noqa: BLE001 - the shard's own error: raised once every reply is read
                raised = raised or err
                out.append(None)
        for err in failed:
            self._drop_slab(err.shard)
        if failed:
            raise failed[0]
        if raised is not None:
            raise raised
        return out

    def _connect(self) -> None:
        """Every shard's slab and link, before any request of a call is sent."""
        for k in range(len(self._shards)):
            self._slab(k)

    def lookup(self, rows: np.ndarray, step: int | None = None, chunk: tuple[int, ...] = (), routed=None,
               attempt: StepId | None = None, commit: StepId | None = None) -> np.ndarray:
        """Pooled embeddings float32 [B, F, D] of ``rows`` (int64 [B, F]); ``routed``: the
        rows already split per shard (ShardingPlan.route), when a prefetch did it. ``attempt``:
        the try this lookup belongs to; ``commit``: the newest committed try, which every shard
        applies before it answers (``core.step_protocol``)."""
        batch = rows.shape[0]
        refs = []
        self._connect()
        for k in range(len(self._shards)):
            sb = routed[k] if routed is not None else self.plan.route(rows, k)
            slab = self._slab(k)
            out = None
            args = (sb.lengths, sb.indices)
            if slab is not None:
                width = sb.lengths.shape[0] * self.dim
                d_len, d_idx, out = slab.layout(
                    [(sb.lengths.shape, np.int64), (sb.indices.shape, np.int64), ((batch, width), np.float32)]
                )
                slab.view(d_len)[...] = sb.lengths
                slab.view(d_idx)[...] = sb.indices
                args = (d_len, d_idx)
            if step is None:
                self._send(refs, "lookup_eval", *args, out=out)
            else:
                self._send(refs, "lookup", step, chunk, *args, out=out, attempt=attempt, commit=commit)
        parts = [p if isinstance(p, np.ndarray) else self._slabs[k].view(p) for k, p in enumerate(self._gather(refs))]
        if step is None:
            return self.plan.assemble_pooled(parts)
        # A training step's pooled rows go into the same buffer every step (no fresh pages to
        # fault in): the previous step's tensor over it is no longer used once its
        # gradients were pushed.
        shape = (batch, rows.shape[1], self.dim)
        if self._pooled is None or self._pooled.shape != shape:
            self._pooled = np.empty(shape, dtype=np.float32)
        return self.plan.assemble_pooled(parts, out=self._pooled)

    def push_grads(self, step: int, chunk: tuple[int, ...], grad: np.ndarray,
                   attempt: StepId | None = None) -> list[PushResult]:
        refs = []
        self._connect()
        for k in range(len(self._shards)):
            slab = self._slab(k)
            if slab is None:
                self._send(refs, "push_grads", step, chunk, self.plan.gather_grad(grad, k), attempt=attempt)
                continue
            (d_grad,) = slab.layout([((grad.shape[0], len(self.plan.shards[k]) * self.dim), np.float32)])
            self.plan.gather_grad(grad, k, out=slab.view(d_grad))
            self._send(refs, "push_grads", step, chunk, d_grad, attempt=attempt)
        return check_pushed(step, chunk, self._gather(refs))


def check_pushed(step: int, chunk: tuple[int, ...], results: list[PushResult]) -> list[PushResult]:
    """The shards' answers to a push: a chunk replaced by a newer attempt of the step, or a
    step a shard applied already, fails the step (``StaleStep``). A shard applies step s only
    once a trainer that committed it looks up s + 1, and a trainer votes only after its pushes
    returned: a shard that applied the step this trainer is pushing means others committed it
    without this trainer, which is behind (it stalled while they trained on). Its failed step
    then rejoins (``Trainer.rejoin``) instead of committing the step again on a stale model."""
    if any(r.stale for r in results):
        raise StaleStep(f"step {step} microbatches {chunk}: replaced by a newer attempt")
    if any(r.duplicate for r in results):
        raise StaleStep(f"step {step}: a shard applied it already (committed without this trainer, which is behind)")
    return results
