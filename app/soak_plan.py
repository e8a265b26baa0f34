"""What a soak run meets, drawn from its seed: random SIGKILLs of every kind, kills aimed at
named points, stalls and damaged files (``soak_faults``), and with mirrors (``recovery:
replica``) a scenario of its own (``replica_scenario``). Pure (no Ray): a unit test builds any
seed's plan, and ``scheduled_faults`` lists what the run must be asked about afterwards.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from core.config import RunConfig, config_from_dict
from core.config_failures import FaultsConfig

__all__ = ["REPLICA_QUIET_S", "ReplicaScenario", "replica_scenario", "scheduled_faults", "soak_config", "soak_faults"]

# With mirrors the random kills start this long after the first training step: the scenario's
# kills (steps 40-80, about 5 s of training and two recoveries) come first, on a fleet that has
# all its mirrors, so that the first kill always promotes one.
REPLICA_QUIET_S = 30.0
# The step faults other than the scenario's come this many steps after its second kill.
_AFTER_SCENARIO_STEPS = 30


@dataclass(frozen=True)
class ReplicaScenario:
    """Shard ``shard`` killed at ``first_kill_step`` (its mirror is promoted) and again at
    ``second_kill_step``, before a new mirror can exist (the run has no warm spare: a new mirror
    is a new process, seconds away, and the kills are a few steps apart); a stall of each mirror
    in ``mirror_stalls``, and slow checkpoint storage (``slow_storage``)."""

    shard: int
    first_kill_step: int
    second_kill_step: int
    mirror_stalls: tuple[dict, ...]
    slow_storage: dict

    @property
    def quiet_until_step(self) -> int:
        """The first step at which the soak's other step faults may come."""
        return self.second_kill_step + _AFTER_SCENARIO_STEPS

    def at_steps(self) -> dict[str, list[int]]:
        return {f"shard:{self.shard}": [self.first_kill_step, self.second_kill_step]}

    def inject(self) -> list[dict]:
        return [*self.mirror_stalls, self.slow_storage]


def replica_scenario(base: RunConfig, seed: int) -> ReplicaScenario:
    """The replica soak's fixed faults for ``seed``: the double kill after the first checkpoint
    (saves every 20 steps), a stall of every mirror (5-25 s: past the 10 s call timeout or not)
    at random steps of the first half, and 10-30 s of storage 1-3 s slower per file."""
    rng = np.random.default_rng([seed, 39])
    last = base.training.max_steps or 1000
    first = int(rng.integers(40, 61))
    second = first + int(rng.integers(3, 7))
    quiet = second + _AFTER_SCENARIO_STEPS

    def step() -> int:
        return int(rng.integers(quiet, max(quiet + 1, last // 2)))

    stalls = tuple({"kind": "stall", "target": f"mirror:{k}", "after_step": step(),
                    "seconds": round(float(rng.uniform(5, 25)), 1)} for k in range(base.embeddings.num_shards))
    slow = {"kind": "slow_storage", "after_step": step(), "seconds": round(float(rng.uniform(10, 30)), 1),
            "delay_s": round(float(rng.uniform(1, 3)), 1)}
    return ReplicaScenario(int(rng.integers(base.embeddings.num_shards)), first, second, stalls, slow)


def soak_faults(base: RunConfig, seed: int, first_step: int = 20) -> list[dict]:
    """Two stalls (a shard and a trainer, SIGSTOP for 5-25 s at a random step of the first
    half), a corrupted file met by the next recovery and a truncated one met by the next
    rollback (each after a random step of the first quarter), from ``seed``; none before
    ``first_step``."""
    rng = np.random.default_rng([seed, 24])
    last = base.training.max_steps or 1000
    shards, trainers = base.embeddings.num_shards, base.training.num_trainers

    def step(part: int = 2) -> int:
        return int(rng.integers(first_step, max(first_step + 1, last // part)))

    return [
        {"kind": "stall", "target": f"shard:{int(rng.integers(shards))}", "after_step": step(),
         "seconds": round(float(rng.uniform(5, 25)), 1)},
        {"kind": "stall", "target": f"trainer:{int(rng.integers(trainers))}", "after_step": step(),
         "seconds": round(float(rng.uniform(5, 25)), 1)},
        {"kind": "corrupt_checkpoint", "target": f"shard:{int(rng.integers(shards))}", "at": "recovery.spawned",
         "after_step": step(4)},
        {"kind": "truncate_checkpoint", "target": f"shard:{int(rng.integers(shards))}", "at": "rollback.spawned",
         "after_step": step(4)},
    ]


def soak_config(base: RunConfig, run_dir: str, seed: int, kills: int, mtbf_s: float) -> RunConfig:
    """``base`` with random kills of shards, trainers, every trainer and the supervisor (``kills``
    of them, ``mtbf_s`` apart on average), kills aimed at a save, a recovery and a rollback,
    faults other than kills drawn from ``seed`` (``soak_faults``; with mirrors the scenario of
    ``replica_scenario`` first), and the audit log on. The data cache is shared by the soak's
    runs (``soak-cache`` beside the run), by its absolute path: a kept run verifies anywhere."""
    raw = base.model_dump()
    raw.update(run_dir=run_dir, audit_log=True)
    raw["data"]["cache_dir"] = base.data.cache_dir or str(Path(run_dir).resolve().parent / "soak-cache")
    raw["checkpoint"]["keep_last"] = 1000  # the PLS recount reads every incremental back
    # Every kill may be a trainer's (all_trainers counts each): the budget must not end the soak.
    raw["budgets"]["max_trainer_failures"] = max(raw["budgets"]["max_trainer_failures"], 3 * kills)
    replica = base.recovery == "replica"
    scenario = replica_scenario(base, seed) if replica else None
    first = scenario.quiet_until_step if scenario else 20
    raw["faults"] = {
        "targets": ["shards", "trainers", "supervisor", "all_trainers", *(["mirrors"] if replica else [])],
        "distribution": "exponential", "mtbf_s": mtbf_s, "seed": seed, "max_failures": kills,
        "at_points": [{"at": "save.files_written", "kill": "shard:0", "after_step": first if replica else 0},
                      {"at": "recovery.spawned", "kill": "supervisor", "after_step": first if replica else 0},
                      {"at": "rollback.loaded", "kill": "supervisor", "after_step": max(200, first)}],
        "inject": soak_faults(base, seed, first),
    }
    if scenario is not None:
        # Young/Daly's interval at the soak's 6 s MTBF is a save every step or two, and the soak
        # keeps them all: 26 GB in 850 steps filled this disk once. With mirrors saves serve only
        # the fallback: MFU saves every 20 steps, a full one every 80 (about 6 GB kept).
        raw["checkpoint"].update(auto_interval=False, every_steps=100)
        # No warm spare: the promoted shard's new mirror is a new process (seconds), so the
        # scenario's second kill always meets the shard without one.
        raw["embeddings"]["spares"] = 0
        raw["faults"].update(at_steps=scenario.at_steps(), start_after_s=REPLICA_QUIET_S)
        raw["faults"]["inject"] += scenario.inject()
    return config_from_dict(raw)


def scheduled_faults(faults: FaultsConfig) -> list[dict]:
    """Every fault of ``faults`` that is not random (at steps, at points, injected, of hosts), each as
    the injector's log will name it: ``fault``, ``target`` ("shard" or "trainer": one the
    seed picks), ``trigger`` ("at step S", "at POINT"), and its ``after_step``."""
    out = []
    for key, steps in faults.at_steps.items():
        out += [{"fault": "kill", "target": key, "trigger": f"at step {s}", "after_step": s} for s in sorted(steps)]
    for p in faults.at_points:
        out.append({"fault": "kill" if p.kill else "error", "target": p.kill or p.error, "trigger": f"at {p.at}",
                    "after_step": p.after_step})
    for spec in faults.inject:
        trigger = f"at {spec.at}" if spec.at else f"at step {spec.after_step}"
        entry = {"fault": spec.kind, "target": spec.target or "storage", "trigger": trigger,
                 "after_step": spec.after_step}
        if spec.kind in ("stall", "fill_storage", "slow_storage"):
            entry["seconds"] = spec.seconds
        if spec.kind == "slow_storage":
            entry["delay_s"] = spec.delay_s
        out.append(entry)
    out += [{"fault": h.kind, "target": f"host:{h.host}", "trigger": f"at step {h.after_step}",
             "after_step": h.after_step, "seconds": h.seconds} for h in faults.hosts]
    return out
