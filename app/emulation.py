"""The CPR paper's production-scale emulation (``cpr emulate``, the ``emulation:`` config section).

A small machine cannot live through a production cluster's failure pattern: a job on 128 hosts
fails about every two days, and its checkpoints take minutes. The emulation trains for real, on
real data, with real shards, and puts time on an *emulated clock* instead of the wall clock:

* every training step stands for ``duration_h / steps`` of production time;
* the failure-free run is ``duration_h`` long, and failures arrive on the emulated clock with
  exponential gaps of mean ``node_mtbf_h / nodes`` (the same times for every run of a seed);
* the checkpoint interval is the policy's own choice (``policies.decide_recovery``) for the
  production costs: Young/Daly for full recovery, the PLS-target interval for partial;
* when the clock reaches a failure, an embedding shard is really killed (SIGKILL), so the run
  really recovers: partial recovery loses that shard's updates since its checkpoint (the PLS,
  and its effect on AUC, are measured), full recovery rolls back and redoes the steps;
* the costs go on the emulated clock: a save stalls ``save_s`` times the share of the rows it
  wrote, a recovery loads ``load_s`` times the share of the rows it reloaded and pays
  ``reschedule_s``, redone steps cost their emulated step time, and access tracking (MFU/SSU)
  costs its measured share of the step time.

The overheads are reported as shares of the failure-free training time, ``duration_h``.

What is measured and what is charged (the report's ``emulation`` entry keeps them apart, under
``measured`` and ``charged``):

* **measured** on the real run: the PLS and the AUC, the rows each save wrote and each recovery
  reloaded, the steps a full recovery redid, the real step time and the share of it that MFU/SSU
  access tracking took (the ``tracking`` overhead is that share of ``duration_h``);
* **charged** at production constants: ``save``, ``load`` and ``rescheduling`` are the constants
  ``save_s``, ``load_s`` and ``reschedule_s`` times the counts above, and ``lost_computation`` is
  the redone steps times the emulated step time. Nothing of them is timed here: for the same
  interval and the same failures they are the same on every machine, and with full saves the save
  charge is the same for every seed. The constants' sources are in ``EmulationConfig`` and docs/EMULATION.md.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field

import numpy as np
import ray

from core.config import EmulationConfig, RunConfig
from app.chaos import kill_target
from core.errors import ConfigError
from policies import CostInputs, decide_recovery, interval_steps

__all__ = ["Emulation", "OVERHEADS", "MEASURED", "CHARGED"]

logger = logging.getLogger(__name__)

OVERHEADS = ("save", "load", "lost_computation", "rescheduling", "tracking")
# The overheads timed on the real run, and those charged at the production constants.
MEASURED = ("tracking",)
CHARGED = ("save", "load", "lost_computation", "rescheduling")
_RECOVERED = ("shard_recovered",)


@dataclass
class Emulation:
    """The emulated clock of one run: its schedule, its interval, and the costs it charges."""

    params: EmulationConfig
    total_steps: int
    num_shards: int
    total_rows: int
    recovery: str
    pls_target: float
    kills: list[dict] = field(default_factory=list)

    @classmethod
    def of(cls, cfg: RunConfig, total_steps: int) -> "Emulation":
        if cfg.emulation is None:
            raise ConfigError("emulation: the config has no emulation section")
        return cls(cfg.emulation, total_steps, cfg.embeddings.num_shards, sum(cfg.model.rows_per_table),
                   cfg.recovery, cfg.checkpoint.pls_target)

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
                            reschedule_cost_s=p.reschedule_s, num_shards=self.num_shards, pls_target=self.pls_target)
        return decide_recovery(self.recovery, inputs)

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
        if e["kind"] in _RECOVERED:
            return self._load_cost_s(e.get("rows_reloaded")) + self.params.reschedule_s
        return 0.0

    def drive(self, supervisor, stop: threading.Event, poll_s: float = 0.02) -> None:
        """Kills a shard each time the emulated clock reaches the next failure. The clock is
        the steps executed (redone ones too) times ``step_s``, plus the emulated cost of the
        saves and recoveries so far. One failure at a time: the next waits for the recovery. No
        failure after the last training step (the emulated job is over then)."""
        times = iter(self.failure_times_s())
        next_s = next(times, None)
        pick = np.random.default_rng([self.params.seed, 1])
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
            if progress is not None:
                step = progress.step
                if step > last_step:
                    executed += step - last_step
                last_step = step
                if step >= self.total_steps:
                    return  # training is over: the emulated job has ended, later failures do not hit it
            clock_s = executed * self.step_s + overhead_s
            if recovering or clock_s < next_s:
                continue
            target = f"shard:{int(pick.integers(self.num_shards))}"
            try:
                killed = kill_target(supervisor, target, trigger="emulation")
            except (ConfigError, ray.exceptions.RayError, TimeoutError) as err:
                # Being recovered, already dead, or the supervisor busy: try again shortly.
                logger.info("emulation: %s", err)
                continue
            self.kills.append({**killed, "scheduled_s": round(next_s, 1), "emulated_s": round(clock_s, 1),
                               "step": last_step})
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

    def account(self, report: dict) -> dict:
        """The emulated overheads of a finished run, as seconds and as % of ``duration_h``, and
        apart: what the real run ``measured`` and what is ``charged`` at the production constants.
        Each cost is counted once: saves from their events, load and rescheduling from the
        recoveries, redone steps from the full recoveries' counts, tracking from its measured
        share of the real step time (``_tracking_share``)."""
        p = self.params
        events = report.get("events", [])
        failures = report.get("failures", [])
        saves = [e for e in events if e["kind"] == "checkpoint_saved" and not e.get("final")]
        tracking_share = self._tracking_share(report)
        seconds = {
            "save": sum(self._save_cost_s(e.get("rows")) for e in saves),
            "load": sum(self._load_cost_s(f.get("rows_reloaded")) for f in failures),
            "lost_computation": sum(f.get("lost_steps_recomputed") or 0 for f in failures) * self.step_s,
            "rescheduling": p.reschedule_s * len(failures),
            "tracking": tracking_share * self.duration_s,
        }
        d = self.decision
        expected = d.expected_overhead_frac_partial if d.mode.value == "partial" else d.expected_overhead_frac_full
        pct = {k: round(100.0 * v / self.duration_s, 3) for k, v in seconds.items()}
        steps = report.get("steps") or 0
        training_s = (report.get("wall_time_s") or {}).get("training_s")
        shares = [self._share(e.get("rows")) for e in saves]
        reloaded = [self._share(f.get("rows_reloaded")) for f in failures]
        measured = {
            "what": "measured on the real run",
            "pls": report.get("pls"),
            "auc": report.get("auc"),
            "steps": steps,
            "step_s_real": round(training_s / steps, 5) if training_s and steps else None,
            "tracking_share_of_step_pct": round(100.0 * tracking_share, 3),
            "saves": len(saves),
            "rows_saved_share_mean": round(sum(shares) / len(shares), 4) if shares else None,
            "recoveries": len(failures),
            "rows_reloaded_share_mean": round(sum(reloaded) / len(reloaded), 4) if reloaded else None,
            "steps_redone": sum(f.get("lost_steps_recomputed") or 0 for f in failures),
            "overhead_pct": {k: pct[k] for k in MEASURED},
        }
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
            "expected_overhead_pct": round(100.0 * expected, 3),
            "expected_pls": d.expected_pls,
            "failures_scheduled": len(self.failure_times_s()),
            "kills": self.kills,
            "saves": len(saves),
            "overhead_s": {k: round(v, 1) for k, v in seconds.items()},
            "overhead_pct": pct,
            "overhead_total_pct": round(100.0 * sum(seconds.values()) / self.duration_s, 3),
            "measured": measured,
            "charged": charged,
        }
