"""When the next checkpoint is due: the configured interval in steps or seconds, or the CPR
cost model's (``auto_interval``), scaled for MFU/SSU saves. Mixed into ``CheckpointCoordinator``."""

from __future__ import annotations

from policies import interval_steps

__all__ = ["SaveSchedule"]


class SaveSchedule:
    """Uses the coordinator's ``cfg``, ``step_time_s``, ``costs``, ``controller``, ``clock`` and
    ``record_event``, and sets ``interval_steps_in_use``."""

    def after(self, step: int) -> int | None:
        """The step count at which the next checkpoint is due, or None when saves are off.

        MFU/SSU saves write r of the rows, 1/r times as often as full saves would come.
        With ``auto_interval`` the interval comes from the CPR cost model, re-chosen (and
        logged) as the online estimates change; the time since the last failure counts as
        exposure, so a quiet stretch lengthens the interval again.
        """
        ck = self.cfg.checkpoint
        if not ck.enabled:
            return None
        scale = ck.r if ck.policy != "full" else 1.0
        step_time_s = self.step_time_s()
        fallback_steps = self.cfg.training.progress_every_steps
        candidates = []
        if ck.every_steps is not None:
            candidates.append(max(1, round(ck.every_steps * scale)))
        if ck.every_s is not None:
            candidates.append(interval_steps(ck.every_s * scale, step_time_s) if step_time_s else fallback_steps)
        if ck.auto_interval:
            candidates.append(self._auto_interval(scale, step_time_s, fallback_steps))
        self.interval_steps_in_use = min(candidates)
        return step + self.interval_steps_in_use

    def _auto_interval(self, scale: float, step_time_s: float | None, fallback_steps: int) -> int:
        self.costs.observe_time(self.clock())
        decision, change = self.controller.update()
        steps = interval_steps(decision.interval_s * scale, step_time_s) if step_time_s else fallback_steps
        if change is not None or steps != self.interval_steps_in_use:
            self.record_event(
                "interval_changed", interval_s=round(decision.interval_s * scale, 3), interval_steps=steps,
                step_time_s=round(step_time_s, 4) if step_time_s else None, mtbf_s=round(self.costs.mtbf_s(), 3),
                mode=decision.mode.value, reason=change.reason if change is not None else "measured step time changed",
            )
        return steps

