"""Replica recovery's mirror of an embedding shard (``recovery: replica``): another shard process,
on another host where the cluster has one, that holds the same rows and Adagrad state as its
primary at every committed step, so that it can take the primary's place with nothing lost and
nothing read from storage.

The mirror is fed the step's inputs, not its results. When a step's gradients are all on the
primary (its last ``push_grads``), the primary sends the step's ids and pooled-row gradients,
merged in microbatch order exactly as it will apply them, to the mirror and answers the trainer
only once the mirror has them: a step that trainers commit is on both. Both apply a step at its
commit (when the next step's first request comes, or a save of it), with the same fbgemm kernel
on the same inputs, so their rows stay bit-identical; a step redone after a failure replaces its
inputs on both. A mirror that cannot take a step, or does not within ``Deadlines.mirror_feed_s``
(shorter than the trainer's wait for the push), is killed by its primary before the step can
commit (the step fails and is redone without it), so no mirror that missed a commit lives, and
a stalled mirror never makes the trainer give up on its healthy primary.

With ``audit_log`` a mirror keeps an audit log of its own from its start,
``mirror-<shard>-<its role>-<pid>.jsonl``: an "open" line naming the shard it mirrors, a "base"
line per ``sync_base`` (``step``: the steps in the primary's rows, ``primary_gen``: its
generation), and an "apply" line per step it applies, as a shard's. Promoted, it goes on in the
log of the generation it became, whose "replica" load names the mirror's log (``mirror_log``):
``cpr verify`` walks the mirror's steps from its base to the count that load claims.

``MirrorRole`` is mixed into ``EmbeddingShard``: the primary's side (``attach_mirror``, the feed)
and the mirror's (``become_mirror``, ``sync_base``, ``replicate``, promotion in ``adopt``).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable

import numpy as np
import ray

from core.plan import TableSlice
from actors.shard_chunks import merge_chunks
from actors.shard_link import LinkClient
from actors.shm import ShmSlab, shm_available

__all__ = ["MirrorFeed", "MirrorRole", "MirrorMissed"]

logger = logging.getLogger(__name__)


def mirror_slab(shard_id: int) -> str:
    """The name of the slab a primary feeds shard ``shard_id``'s mirror through (``ShmSlab``)."""
    return f"mirror{shard_id}"


class MirrorMissed(RuntimeError):
    """This mirror cannot serve: it missed a step its primary's trainers may have committed."""


class MirrorFeed:
    """The primary's end: sends each complete step to the mirror and waits ``timeout_s`` (the
    primary's ``Deadlines.mirror_feed_s``) for its receipt. ``may_act``: whether the primary
    still holds its place (its lease); a primary cut off from the cluster kills no mirror, which
    may be its successor by now."""

    def __init__(self, handle, name: str, timeout_s: float, may_act: Callable[[], bool] = lambda: True):
        self.handle, self.name, self.timeout_s, self.may_act = handle, name, timeout_s, may_act
        self._link: LinkClient | None = None
        self._slab: ShmSlab | None = None

    def send(self, step: int, lengths: np.ndarray, indices: np.ndarray, grad: np.ndarray,
             try_: tuple[int, int] | None = None) -> bool:
        """True once the mirror holds step ``step``'s inputs (of try ``try_``); False (and the
        mirror killed) if it did not take them in time."""
        try:
            if self._link is not None:
                self._send_linked(step, lengths, indices, grad, try_)
            else:
                ray.get(self.handle.replicate.remote(step, lengths, indices, grad, try_), timeout=self.timeout_s)
        except Exception as err:  # noqa: BLE001 - Ray's, the link's, or the mirror's refusal: it missed the step
            logger.warning("mirror %s did not take step %d (%s): killing it; the step is redone without it",
                           self.name, step, type(err).__name__)
            self.kill()
            return False
        return True

    def use_link(self, link: LinkClient, slab: ShmSlab) -> None:
        """From now on the steps go over ``link`` with their arrays in ``slab`` (the mirror is
        on this node): set only once the base is in the mirror, which every step sent later
        must follow."""
        self._link, self._slab = link, slab

    def _send_linked(self, step: int, lengths: np.ndarray, indices: np.ndarray, grad: np.ndarray,
                     try_: tuple[int, int] | None) -> None:
        """The step over the link, sent and answered within ``timeout_s`` in all (one deadline:
        the push's whole wait must stay under its trainer's)."""
        deadline = time.monotonic() + self.timeout_s
        arrays = (lengths, indices, grad)
        where = self._slab.layout([(a.shape, a.dtype) for a in arrays])
        for a, w in zip(arrays, where):
            self._slab.view(w)[...] = a
        self._link.send("replicate", step, *where, try_)
        self._link.receive(deadline)

    def kill(self) -> bool:
        """Kills the mirror, only while this primary holds its place (``may_act``; a fenced one
        raises there and exits). False: not killed."""
        self.close_link()
        if not self.may_act():
            logger.warning("mirror %s not killed: this primary could not confirm its place", self.name)
            return False
        try:
            ray.kill(self.handle, no_restart=True)
        except (ValueError, ray.exceptions.RayError):
            pass
        return True

    def close_link(self) -> None:
        link, slab, self._link, self._slab = self._link, self._slab, None, None
        if link is not None:
            link.close()
        if slab is not None:
            slab.close()


class _MirrorOf:
    """What a mirror knows of its primary's stream: the shard, whether the base (the primary's
    rows) arrived, and why the stream broke, if it did. The steps it holds and has not applied
    are its pending steps, every one complete; all but the newest are committed."""

    def __init__(self, shard_id: int):
        self.shard_id = shard_id
        self.based = False
        self.broken: str | None = None
        self.log: str | None = None  # its audit log's name (``audit_log``)
        self.work = threading.Event()


class MirrorRole:
    """Mixed into EmbeddingShard (which provides ``_lock``, ``_pending``, ``_complete``,
    ``_commit_before``, ``_allocate``, ``_activate``, ``deadlines`` and the tables)."""

    _feed: MirrorFeed | None = None
    _mirror: _MirrorOf | None = None
    mirror_steps, mirror_send_s = 0, 0.0  # every feed's, for the report

    # ------------------------------------------------------------------ the primary's side

    def attach_mirror(self, name: str, timeout_s: float, run_id: str = "", link: str | None = None) -> dict:
        """Makes the actor ``name`` this shard's mirror: copies the rows and Adagrad state as
        they stand (a step complete but not applied goes after them) and feeds it every step
        from now on, waiting ``deadlines.mirror_feed_s`` for each step's receipt. ``timeout_s``
        bounds the wait for the copy (outside the lock). Runs in the "mirror" concurrency
        group: only the copy holds training. A mirror on this node (``link``: its link's address)
        takes its steps over that link, their arrays in a shared-memory slab of run ``run_id``
        (``actors.shm``): a Ray call carrying a demo step's 1.7 MB took 8 ms here."""
        handle = ray.get_actor(name, namespace=ray.get_runtime_context().namespace)
        t0 = time.perf_counter()
        with self._lock:
            if self._feed is not None and self._feed.name != name:
                self._feed.kill()  # a mirror replaced: the old one must never serve
            elif self._feed is not None:
                self._feed.close_link()  # the same mirror attached again: a new feed, a new link
            applied = self.applied_step
            weights = [w.detach().cpu().numpy() for w in self.tbe.split_embedding_weights()]
            states = [s[0].detach().cpu().numpy() for s in self.tbe.split_optimizer_states()]
            # Submitted under the lock, so they reach the mirror before any step sent later.
            refs = [handle.sync_base.remote(self.shard_id, applied, weights, states, self.generation)]
            if self._complete is not None:
                refs.append(handle.replicate.remote(self._complete, *merge_chunks(self._pending.ordered(self._complete)),
                                                    self._pending.try_of(self._complete)))
            self._feed = feed = MirrorFeed(handle, name, self.deadlines.mirror_feed_s, self._may_act)
            hold_s = time.perf_counter() - t0
        try:
            ray.get(refs, timeout=timeout_s)
        except (ray.exceptions.RayError, ray.exceptions.GetTimeoutError):
            with self._lock:
                if self._feed is feed:
                    self._feed = None
            feed.kill()
            raise
        linked = link is not None and self._link_mirror(feed, link, run_id)
        return {"hold_s": round(hold_s, 4), "sync_s": round(time.perf_counter() - t0, 4), "base_step": applied + 1,
                "linked": linked}

    def _link_mirror(self, feed: MirrorFeed, address: str, run_id: str) -> bool:
        """Moves ``feed`` to the link at ``address`` (the mirror is on this node); True if it
        did. Without shared memory, or a link that cannot connect, the feed stays on Ray calls."""
        if not shm_available():
            return False
        try:
            link = LinkClient(address, send_timeout_s=feed.timeout_s)
        except OSError as err:
            logger.warning("mirror %s: no link (%r); its steps go by Ray calls", feed.name, err)
            return False
        with self._lock:
            if self._feed is not feed:  # replaced or dropped meanwhile
                link.close()
                return False
            feed.use_link(link, ShmSlab(run_id, mirror_slab(self.shard_id)))
        return True

    def _send_to_mirror(self, step: int) -> bool:
        """The primary's last push of ``step`` made it complete: the mirror must hold it before
        the trainer hears so. False: the mirror failed (and was killed)."""
        if self._feed is None:
            return True
        t0 = time.perf_counter()
        if self._feed.send(step, *merge_chunks(self._pending.ordered(step)), self._pending.try_of(step)):
            self.mirror_steps += 1
            self.mirror_send_s += time.perf_counter() - t0
            return True
        self._feed = None
        return False

    def _drop_mirror(self) -> None:
        """The rows were reloaded (a rollback or a resume): the mirror no longer matches them."""
        if self._feed is not None:
            self._feed.kill()
            self._feed = None

    # ------------------------------------------------------------------ the mirror's side

    def become_mirror(self, shard_id: int, slices: list[TableSlice]) -> dict:
        """A spare becomes the mirror of shard ``shard_id``: it allocates tables of its slices
        (or takes those it holds ready) and waits for ``sync_base``."""
        with self._lock:
            if self.shard_id is not None or self._mirror is not None:
                raise RuntimeError(f"{self.spare} is already shard {self.shard_id} or a mirror")
            t0 = time.perf_counter()
            self._allocate(shard_id, list(slices), init=False)
            self._mirror = _MirrorOf(shard_id)
            role = self.spare.rsplit("-", 1)[-1] if self.spare else "mirror"
            self._mirror.log = self._open_audit(f"mirror-{shard_id}-{role}-{os.getpid()}.jsonl", spare=self.spare)
        threading.Thread(target=self._mirror_apply_loop, name="mirror-apply", daemon=True).start()
        return {"alloc_s": round(time.perf_counter() - t0, 4)}

    def sync_base(self, shard_id: int, applied_step: int, weights: list, states: list,
                  primary_gen: int | None = None) -> None:
        """The primary's rows and Adagrad state after ``applied_step``: this mirror's start
        (its primary serves as generation ``primary_gen``)."""
        with self._lock:
            m = self._mirror
            if m is None or m.shard_id != shard_id:
                raise MirrorMissed(f"{self.spare} is not a mirror of shard {shard_id}")
            torch = self._torch
            with torch.no_grad():
                for w, src in zip(self.tbe.split_embedding_weights(), weights):
                    w.copy_(torch.from_numpy(src))
                for st, src in zip(self.tbe.split_optimizer_states(), states):
                    st[0].copy_(torch.from_numpy(src))
            self._pending.clear()
            self._complete = None
            self.applied_step = applied_step
            m.based, m.broken = True, None
            self._log({"event": "base", "step": applied_step + 1, "primary_gen": primary_gen})

    def replicate(self, step: int, lengths: np.ndarray, indices: np.ndarray, grad: np.ndarray,
                  try_: tuple[int, int] | None = None) -> None:
        """Step ``step``'s inputs, complete on the primary in try ``try_`` (its audit log names
        it). The steps it holds before ``step`` are committed: the mirror's thread applies them
        after this answer. Step ``step`` again (redone after a failure) replaces its inputs. A
        gap breaks the mirror for good."""
        with self._lock:
            m = self._mirror
            if m is None or not m.based or m.broken:
                raise MirrorMissed(f"{self.spare}: no base, or broken ({m.broken if m else 'not a mirror'})")
            lengths, indices, grad = (self._shm.get(a) for a in (lengths, indices, grad))  # copies of a slab's arrays
            last = self._last_held()
            if not last <= step <= last + 1 or step <= self.applied_step:
                m.broken = f"got step {step} after step {last} (applied {self.applied_step})"
                raise MirrorMissed(f"{self.spare}: {m.broken}")
            microbatches = tuple(range(step * self.microbatches_per_step, (step + 1) * self.microbatches_per_step))
            self._pending.add(step, microbatches, np.asarray(lengths), np.asarray(indices), try_=try_)
            self._pending.chunk(step, microbatches).grad = np.asarray(grad)
            if len(self._pending.steps()) > 1:
                m.work.set()  # a step is never applied on this (the primary's) call

    def _last_held(self) -> int:
        """The newest step a mirror holds: its newest pending one, else the last it applied."""
        held = self._pending.steps()
        return held[-1] if held else self.applied_step

    def _mirror_apply_loop(self) -> None:
        """Applies the committed steps a mirror holds (every one before the newest), off the
        path of the primary's request."""
        m = self._mirror
        while m is not None and self._mirror is m:
            m.work.wait(1.0)
            m.work.clear()
            try:
                with self._lock:
                    if self._mirror is m:
                        self._apply_committed()
            except Exception as err:  # noqa: BLE001 - the mirror cannot serve; its primary kills it at the next step
                logger.exception("mirror of shard %d: applying failed", m.shard_id)
                m.broken = f"apply failed: {err!r}"[:200]

    def _apply_committed(self) -> None:
        for step in self._pending.steps()[:-1]:
            self._log(self._apply(step))  # a mirror holds no lease; its audit log is its own until promoted

    def _promote(self, shard_id: int, generation: int, committed: int | None) -> None:
        """This mirror becomes shard ``shard_id`` of ``generation``: refused if it ever missed
        a step, or if it lacks a step the trainers committed (``committed`` steps)."""
        m = self._mirror
        if m.shard_id != shard_id or not m.based or m.broken:
            raise MirrorMissed(f"{self.spare} cannot serve shard {shard_id}: "
                               f"{m.broken or 'no base' if m.shard_id == shard_id else f'mirror of {m.shard_id}'}")
        if committed is not None and self._last_held() < committed - 1:
            raise MirrorMissed(f"{self.spare} holds steps up to {self._last_held()} but {committed} steps are committed")
        self._apply_committed()  # every step before the newest it holds is committed
        held = self._pending.steps()
        self._complete = held[-1] if held else None  # applied at its commit, as on the primary
        self._log({"event": "promoted", "shard": shard_id, "generation": generation, "step": self.applied_step + 1})
        self._mirror = None
        self._promoted = True
        m.work.set()
        # The primary that fed it over its link is gone: its slab files with it.
        self._shm.remove_mapped(f"-{mirror_slab(shard_id)}-")
        self._activate(shard_id, generation)
        self._log({"event": "load", "chain": [], "why": "replica", "step": self.applied_step + 1,
                   "pending": [self._complete] if self._complete is not None else [], "mirror_log": m.log})
        self._ckpt.full_next = "promoted from a mirror, which counts no accesses: every row"
        self._ckpt.prepare_snapshot_buffer()
        logger.warning("%s promoted to shard %d generation %d at step %d", self.spare, shard_id, generation,
                       self.applied_step + 1)
