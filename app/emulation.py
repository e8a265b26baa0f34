"""The CPR paper's production-scale emulation (``cpr emulate``, the ``emulation:`` config section).

A small machine cannot live through a production cluster's failure pattern: a job on 128 hosts
fails about every two days, and its checkpoints take minutes. The emulation trains for real, on
real data, with real shards, and puts time on an *emulated clock* instead of the wall clock:

* every training step stands for ``duration_h / steps`` of production time;
* the failure-free run is ``duration_h`` long, and failures arrive on the emulated clock with
  exponential gaps of mean ``node_mtbf_h / nodes`` (the same times for every run of a seed);
* the checkpoint interval is the policy's own choice (``policies.decide_recovery``) for the
  production costs: Young/Daly for full and replica recovery, the PLS-target interval for partial;
* when the clock reaches a failure, an embedding shard is really killed (SIGKILL), so the run
  really recovers: partial recovery loses that shard's updates since its checkpoint (the PLS,
  and its effect on AUC, are measured), full recovery rolls back and redoes the steps, replica
  recovery promotes the shard's mirror (nothing lost, nothing loaded); in replica mode no shard is
  killed while a mirror is not in sync (being rebuilt: seconds, against a production MTBF of hours);
* the costs go on the emulated clock: a save stalls ``save_s`` times the share of the rows it
  wrote, a recovery loads ``load_s`` times the share of the rows it reloaded and pays
  ``reschedule_s``, redone steps cost their emulated step time, access tracking (MFU/SSU) and
  the mirrors' feed (replica) cost their measured share of the step time, and a promotion its
  measured time from the kill to serving again (replica).

The overheads are reported as shares of the failure-free training time, ``duration_h``.

What is measured and what is charged (the report's ``emulation`` entry keeps them apart, under
``measured`` and ``charged``):

* **measured** on the real run: the PLS and the AUC, the rows each save wrote and each recovery
  reloaded, the steps a full recovery redid, the real step time and the share of it that MFU/SSU
  access tracking took (the ``tracking`` overhead is that share of ``duration_h``), the share the
  trainers waited for the mirrors to hold each step (``mirror_feed``, likewise) and each
  promotion's kill-to-serving time (``promotion``: a mirror already runs, nobody waits for a host);
* **charged** at production constants: ``save``, ``load`` and ``rescheduling`` are the constants
  ``save_s``, ``load_s`` and ``reschedule_s`` times the counts above (a replica run's fallback to
  a checkpoint, when a mirror was not in sync, is charged as a partial recovery), and ``lost_computation`` is
  the redone steps times the emulated step time. Nothing of them is timed here: for the same
  interval and the same failures they are the same on every machine, and with full saves the save
  charge is the same for every seed. The constants' sources are in ``EmulationConfig`` and docs/EMULATION.md.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field

import numpy as np
import ray

from core.config import EmulationConfig, RunConfig
from app.chaos import kill_target
from core.errors import ConfigError
from policies import CostInputs, decide_recovery, interval_steps

__all__ = ["Emulation", "OVERHEADS", "MEASURED", "CHARGED"]

logger = logging.getLogger(__name__)

OVERHEADS = ("save", "load", "lost_computation", "rescheduling", "tracking", "mirror_feed", "promotion")
# The overheads timed on the real run, and those charged at the production constants.
MEASURED = ("tracking", "mirror_feed", "promotion")
CHARGED = ("save", "load", "lost_computation", "rescheduling")
_RECOVERED = ("shard_recovered",)
_MIRROR_GONE = ("mirror_lost", "mirror_failed", "mirror_dropped")  # the shard has no mirror in sync


@dataclass
class Emulation:
    """The emulated clock of one run: its schedule, its interval, and the costs it charges."""

    params: EmulationConfig
    total_steps: int
    num_shards: int
    total_rows: int
    recovery: str
    pls_target: float
    replica_step_frac: float | None = None  # the cost model's share of a step for mirrors (replica only)
    kills: list[dict] = field(default_factory=list)

    @classmethod
    def of(cls, cfg: RunConfig, total_steps: int) -> "Emulation":
        if cfg.emulation is None:
            raise ConfigError("emulation: the config has no emulation section")
        replica = cfg.checkpoint.replica_step_frac if cfg.recovery == "replica" else None
        return cls(cfg.emulation, total_steps, cfg.embeddings.num_shards, sum(cfg.model.rows_per_table),
                   cfg.recovery, cfg.checkpoint.pls_target, replica)

    @property
    def step_s(self) -> float:
        """Production seconds one training step stands for."""
        return self.params.duration_h * 3600.0 / max(self.total_steps, 1)

    @property
    def duration_s(self) -> float:
        return self.params.duration_h * 3600.0

    @property
    def mtbf_s(self) -> float:
        """The emulated job's mean time between failures."""
        return self.params.node_mtbf_h * 3600.0 / self.params.nodes

    @property
    def decision(self):
        p = self.params
        inputs = CostInputs(mtbf_s=self.mtbf_s, save_cost_s=p.save_s, load_cost_s=p.load_s,
                            reschedule_cost_s=p.reschedule_s, num_shards=self.num_shards, pls_target=self.pls_target,
                            replica_step_frac=self.replica_step_frac)
        return decide_recovery(self.recovery, inputs)

    @property
    def replica(self) -> bool:
        return self.decision.mode.value == "replica"

    @property
    def every_steps(self) -> int:
        return interval_steps(self.decision.interval_s, self.step_s, min_steps=1)

    def failure_times_s(self) -> list[float]:
        """Emulated times of the failures: exponential gaps of mean ``mtbf_s``, up to
        twice the failure-free duration (a run with full recovery lasts longer)."""
        rng = np.random.default_rng([self.params.seed, 0])
        times, t = [], 0.0
        while len(times) < self.params.max_failures:
            t += float(rng.exponential(self.mtbf_s))
            if t > 2.0 * self.duration_s:
                break
            times.append(t)
        return times

    def configure(self, cfg: RunConfig) -> RunConfig:
        """``cfg`` with the emulated interval and mode, and progress reported every step (the
        clock advances by the committed steps)."""
        d = self.decision
        ck = cfg.checkpoint.model_copy(update={"every_steps": self.every_steps, "every_s": None, "auto_interval": False})
        tr = cfg.training.model_copy(update={"progress_every_steps": 1})
        logger.warning(
            "emulation: %d steps of %.0f s each (%.1f h); job MTBF %.1f h; %s every %d steps (%.2f h); %s",
            self.total_steps, self.step_s, self.params.duration_h, self.mtbf_s / 3600, d.mode.value,
            self.every_steps, self.every_steps * self.step_s / 3600, d.reason,
        )
        return cfg.model_copy(update={"checkpoint": ck, "training": tr, "recovery": d.mode.value, "faults": None})

    def _share(self, rows: int | None) -> float:
        return min(1.0, (rows or 0) / self.total_rows) if self.total_rows else 1.0

    def _save_cost_s(self, rows: int | None) -> float:
        return self.params.save_s * self._share(rows)

    def _load_cost_s(self, rows: int | None) -> float:
        return self.params.load_s * self._share(rows)

    def _event_cost_s(self, e: dict) -> float:
        """Emulated stall of an event, as it happens (for the clock that places failures)."""
        if e["kind"] == "checkpoint_saved" and not e.get("final"):
            return self._save_cost_s(e.get("rows"))
        if e["kind"] in _RECOVERED and e.get("recovery") == "replica":
            return e.get("serving_s") or 0.0  # a promotion: measured, kill to serving again
        if e["kind"] in _RECOVERED:
            return self._load_cost_s(e.get("rows_reloaded")) + self.params.reschedule_s
        return 0.0

    def drive(self, supervisor, stop: threading.Event, poll_s: float = 0.02) -> None:
        """Kills a shard each time the emulated clock reaches the next failure. The clock is
        the steps executed (redone ones too) times ``step_s``, plus the emulated cost of the
        saves and recoveries so far. One failure at a time: the next waits for the recovery, and
        in replica mode also until every shard's mirror is in sync again (``_MirrorGate``: a
        wait in real time, not on the emulated clock). No failure after the last training step
        (the emulated job is over then)."""
        times = iter(self.failure_times_s())
        next_s = next(times, None)
        pick = np.random.default_rng([self.params.seed, 1])
        gate = _MirrorGate(self.replica)
        executed, last_step, cursor, overhead_s, recovering = 0, 0, 0, 0.0, False  # progress counts steps done
        while next_s is not None and not stop.wait(poll_s):
            try:
                progress = supervisor.progress()
                events = supervisor.events_since(cursor)
            except (ray.exceptions.RayError, TimeoutError):
                continue
            cursor += len(events)
            for e in events:
                overhead_s += self._event_cost_s(e)
                recovering = recovering and e["kind"] not in _RECOVERED
                gate.see(e)
            if progress is not None:
                step = progress.step
                if step > last_step:
                    executed += step - last_step
                last_step = step
                if step >= self.total_steps:
                    return  # training is over: the emulated job has ended, later failures do not hit it
            clock_s = executed * self.step_s + overhead_s
            if recovering or clock_s < next_s or gate.holds():
                continue
            target = f"shard:{int(pick.integers(self.num_shards))}"
            try:
                killed = kill_target(supervisor, target, trigger="emulation")
            except (ConfigError, ray.exceptions.RayError, TimeoutError) as err:
                # Being recovered, already dead, or the supervisor busy: try again shortly.
                logger.info("emulation: %s", err)
                continue
            self.kills.append({**killed, "scheduled_s": round(next_s, 1), "emulated_s": round(clock_s, 1),
                               "step": last_step, **gate.waited()})
            recovering = True
            next_s = next(times, None)

    def _tracking_share(self, report: dict) -> float:
        """Share of the real step time that MFU/SSU access tracking took, over all shards. Each
        shard's counter covers only its own process (a respawned shard starts at 0), so the
        rate per step comes from each shard process over the steps it served, times the
        shards; summing the counters would drop the dead processes' share."""
        wall_training_s = (report.get("wall_time_s") or {}).get("training_s") or 0.0
        steps = report.get("steps") or 0
        rates = []
        for st in report.get("shards") or []:
            served = (st.get("applied_step", -1) + 1) - (st.get("first_step_after_load") or 0)
            if st.get("tracking_s") is not None and served > 0:
                rates.append(st["tracking_s"] / served)
        if not rates or wall_training_s <= 0 or steps <= 0:
            return 0.0
        return (sum(rates) / len(rates) * self.num_shards) / (wall_training_s / steps)

    def _mirror_share(self, report: dict) -> float:
        """Share of the real step time the trainers waited for the mirrors to hold each step
        (replica), over all shards, as ``_tracking_share`` counts tracking: each shard process's
        wait per step it fed its mirror (``mirror_send_s / mirror_steps``: a promoted mirror's
        process counts from its promotion, the steps it fed as a primary; steps with no mirror, while
        one was rebuilt, are left out: at production scale that is seconds in days), times the
        shards. A trainer pushes to every shard at once, so the waits overlap in part: an upper bound."""
        wall_training_s = (report.get("wall_time_s") or {}).get("training_s") or 0.0
        steps = report.get("steps") or 0
        rates = [st["mirror_send_s"] / st["mirror_steps"] for st in report.get("shards") or [] if st.get("mirror_steps")]
        if not rates or wall_training_s <= 0 or steps <= 0:
            return 0.0
        return (sum(rates) / len(rates) * self.num_shards) / (wall_training_s / steps)

    def _seconds(self, report: dict, saves: list[dict], shares: dict) -> dict:
        """Each overhead once, in production seconds: a replica recovery (a promotion) costs its
        measured kill-to-serving time and nothing else; any other recovery (a replica run's
        fallback to a checkpoint included) its load and rescheduling at the constants."""
        failures = report.get("failures", [])
        promoted = [f for f in failures if f.get("recovery") == "replica"]
        restored = [f for f in failures if f.get("recovery") != "replica"]
        return {
            "save": sum(self._save_cost_s(e.get("rows")) for e in saves),
            "load": sum(self._load_cost_s(f.get("rows_reloaded")) for f in restored),
            "lost_computation": sum(f.get("lost_steps_recomputed") or 0 for f in failures) * self.step_s,
            "rescheduling": self.params.reschedule_s * len(restored),
            "tracking": shares["tracking"] * self.duration_s,
            "mirror_feed": shares["mirror_feed"] * self.duration_s,
            "promotion": sum(f.get("serving_s") or 0.0 for f in promoted),
        }

    def account(self, report: dict) -> dict:
        """The emulated overheads of a finished run, as seconds and as % of ``duration_h``, and
        apart: what the real run ``measured`` and what is ``charged`` at the production constants.
        Each cost is counted once (``_seconds``): saves from their events, load and rescheduling
        from the recoveries from a checkpoint, redone steps from the full recoveries' counts,
        tracking and the mirrors' feed from their measured shares of the real step time,
        promotions from their measured kill-to-serving times."""
        p = self.params
        events = report.get("events", [])
        failures = report.get("failures", [])
        saves = [e for e in events if e["kind"] == "checkpoint_saved" and not e.get("final")]
        shares = {"tracking": self._tracking_share(report), "mirror_feed": self._mirror_share(report)}
        seconds = self._seconds(report, saves, shares)
        d = self.decision
        expected = {"partial": d.expected_overhead_frac_partial,
                    "replica": d.expected_overhead_frac_replica}.get(d.mode.value, d.expected_overhead_frac_full)
        pct = {k: round(100.0 * v / self.duration_s, 3) for k, v in seconds.items()}
        charged = {
            "what": "production constants times the counts measured (not timed here)",
            "constants_s": {"save_s": p.save_s, "load_s": p.load_s, "reschedule_s": p.reschedule_s,
                            "step_s": round(self.step_s, 3)},
            "overhead_pct": {k: pct[k] for k in CHARGED},
            "overhead_total_pct": round(sum(pct[k] for k in CHARGED), 3),
        }
        return {
            "params": p.model_dump(),
            "step_s": round(self.step_s, 3),
            "mtbf_s": round(self.mtbf_s, 1),
            "recovery": d.mode.value,
            "interval_s": round(d.interval_s, 1),
            "every_steps": self.every_steps,
            "decision": d.reason,
            "expected_overhead_pct": round(100.0 * expected, 3) if expected is not None else None,
            "expected_pls": d.expected_pls,
            "failures_scheduled": len(self.failure_times_s()),
            "kills": self.kills,
            "saves": len(saves),
            "overhead_s": {k: round(v, 1) for k, v in seconds.items()},
            "overhead_pct": pct,
            "overhead_total_pct": round(100.0 * sum(seconds.values()) / self.duration_s, 3),
            "measured": self._measured(report, saves, failures, shares, pct),
            "charged": charged,
        }

    def _measured(self, report: dict, saves: list[dict], failures: list[dict], shares: dict, pct: dict) -> dict:
        steps = report.get("steps") or 0
        training_s = (report.get("wall_time_s") or {}).get("training_s")
        saved = [self._share(e.get("rows")) for e in saves]
        reloaded = [self._share(f.get("rows_reloaded")) for f in failures]
        promoted = [f for f in failures if f.get("recovery") == "replica"]
        out = {
            "what": "measured on the real run",
            "pls": report.get("pls"),
            "auc": report.get("auc"),
            "steps": steps,
            "step_s_real": round(training_s / steps, 5) if training_s and steps else None,
            "tracking_share_of_step_pct": round(100.0 * shares["tracking"], 3),
            "saves": len(saves),
            "rows_saved_share_mean": round(sum(saved) / len(saved), 4) if saved else None,
            "recoveries": len(failures),
            "rows_reloaded_share_mean": round(sum(reloaded) / len(reloaded), 4) if reloaded else None,
            "steps_redone": sum(f.get("lost_steps_recomputed") or 0 for f in failures),
            "overhead_pct": {k: pct[k] for k in MEASURED},
        }
        if self.replica:
            out.update({
                "mirror_feed_share_of_step_pct": round(100.0 * shares["mirror_feed"], 3),
                "promotions": len(promoted),
                "promotion_s": [f.get("serving_s") for f in promoted],
                "fallbacks": len(failures) - len(promoted),  # recovered from a checkpoint: no mirror in sync
                "mirrors": report.get("mirrors"),
            })
        return out

@dataclass
class _MirrorGate:
    """Replica mode: the shards whose mirror is not in sync (promoted, lost, dropped or failed to
    build, until their ``mirror_ready``). While there is one, no shard is killed: at production
    scale a mirror is rebuilt in seconds and the job fails every couple of days, so a failure
    almost never finds a shard without its mirror; on this clock (a step stands for an hour) the
    rebuild would span emulated hours. The kill waits in real time, and says how long."""

    enabled: bool
    unmirrored: set = field(default_factory=set)
    since: float | None = None  # when a due kill began to wait (monotonic)

    def see(self, e: dict) -> None:
        if not self.enabled:
            return
        if e["kind"] in _RECOVERED or e["kind"] in _MIRROR_GONE:
            self.unmirrored.add(e.get("shard"))
        elif e["kind"] == "mirror_ready":
            self.unmirrored.discard(e.get("shard"))

    def holds(self) -> bool:
        """True while a due kill must wait for a mirror."""
        if not self.unmirrored:
            return False
        if self.since is None:
            self.since = time.monotonic()
        return True

    def waited(self) -> dict:
        """For the kill's record (replica mode): the real seconds it waited for a mirror."""
        if not self.enabled:
            return {}
        waited, self.since = (0.0 if self.since is None else time.monotonic() - self.since), None
        return {"waited_for_mirror_s": round(waited, 3)}
