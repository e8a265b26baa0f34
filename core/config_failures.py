"""The failure sections of the run config: injected faults (``faults``), the failure budgets
(``budgets``) and the production-scale emulation (``emulation``), with the base every
section shares (typed, frozen, unknown keys refused)."""

from __future__ import annotations

import re
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from core.points import POINTS
from policies import BudgetLimits

__all__ = ["Section", "FaultPoint", "FaultSpec", "HostFault", "FaultsConfig", "EmulationConfig", "BudgetsConfig"]


class Section(BaseModel):
    # Unknown keys are typos; failing on them beats silently ignoring a setting.
    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)


class FaultPoint(Section):
    """A kill, or an error, at a named point of the supervisor's work (like torchft's EventInjector.fail_at)."""

    at: str
    """save.snapshotted: every shard copied the rows to save, files being written in the background;
    save.files_written: shard files written, manifest not; recovery.spawned: new shards answer, nothing
    loaded; recovery.loaded: loaded, fleet not committed; rollback.spawned: a rollback's respawned shards answer,
    nothing loaded; rollback.loaded: every shard loaded, nothing fenced;
    thread.NAME: a pass of the supervisor's background thread NAME (shard-watch, recovery-executor,
    spare-keeper, host-watch, save-pipeline, lost-samples)."""
    kill: str | None = Field(None, pattern=r"^(supervisor|all_trainers|shard:\d+|trainer:\d+|mirror:\d+)$")
    """What to kill there, once: supervisor, all_trainers, shard:K, trainer:K or mirror:K (recovery: replica)."""
    error: str | None = Field(None, min_length=1)
    """Instead of a kill: raise an unexpected error with this message there, once (as a bug would)."""
    after_step: int = Field(0, ge=0)
    """Only once this many training steps committed."""

    @field_validator("at")
    @classmethod
    def _check_point(cls, v: str) -> str:
        if v not in POINTS:
            raise ValueError(f"must be one of {', '.join(POINTS)}")
        return v

    @model_validator(mode="after")
    def _one_action(self) -> "FaultPoint":
        if (self.kill is None) == (self.error is None):
            raise ValueError("give exactly one of kill or error")
        return self


class FaultSpec(Section):
    """A fault other than a kill, injected once: when training step ``after_step`` committed, or at a named
    point of the supervisor's work (``at``) once that many steps committed."""

    kind: Literal["stall", "corrupt_checkpoint", "truncate_checkpoint", "fill_storage", "slow_storage"]
    """stall: SIGSTOP the target's process for ``seconds``, then SIGCONT it (a process that stops answering
    without dying; after a step, a target being replaced or a mirror being built is waited for up to 30 s);
    corrupt_checkpoint: flip bytes in the middle of the target shard's file of the newest committed
    checkpoint; truncate_checkpoint: cut that file to half its size (a torn or bit-rotted file);
    fill_storage: fill the checkpoint storage's free space for ``seconds`` (a local filesystem with at most
    4 GiB free, e.g. a small tmpfs; refused on anything bigger); slow_storage: for ``seconds``, every file
    written to the checkpoint storage takes ``delay_s`` longer (a local filesystem)."""
    target: str | None = Field(None, pattern=r"^(shard:\d+|trainer:\d+|mirror:\d+)$")
    """The process to stall (shard:K, trainer:K, or mirror:K with recovery: replica), or the shard whose
    checkpoint file is damaged (shard:K); none for fill_storage and slow_storage."""
    after_step: int = Field(0, ge=0)
    """Without ``at``: injected once this training step committed. With ``at``: only once this many steps
    committed."""
    at: str | None = None
    """A point of the supervisor's work (see faults.at_points[].at), e.g. recovery.spawned: a damaged file
    there is the one the recovery is about to load."""
    seconds: float = Field(10.0, gt=0.0, le=3600.0)
    """How long a stall, a full storage or a slow one lasts."""
    delay_s: float = Field(2.0, gt=0.0, le=600.0)
    """slow_storage: how much longer each file written takes."""

    @field_validator("at")
    @classmethod
    def _check_point(cls, v: str | None) -> str | None:
        if v is not None and v not in POINTS:
            raise ValueError(f"must be one of {', '.join(POINTS)}")
        return v

    @model_validator(mode="after")
    def _check_target(self) -> "FaultSpec":
        if self.kind in ("fill_storage", "slow_storage"):
            if self.target is not None:
                raise ValueError(f"{self.kind} acts on the checkpoint storage: give no target")
        elif self.target is None:
            raise ValueError(f"{self.kind} needs a target")
        elif self.kind != "stall" and not self.target.startswith("shard:"):
            raise ValueError(f"{self.kind} damages a shard's checkpoint file: target must be shard:K")
        return self


class HostFault(Section):
    """A fault of a whole host of a namespace cluster (``scripts/local_cluster.sh``), carried out from
    outside every host by ``cpr chaos hosts`` (no process of the run can kill or cut off its own host)."""

    kind: Literal["host_kill", "partition"]
    """host_kill: SIGKILL every process of the host at once, and start it again (a fresh host) ``seconds``
    later; partition: cut the host's link for ``seconds``, then restore it (a host whose Ray node was
    declared dead meanwhile is started again)."""
    host: int = Field(ge=1, le=8)
    """The worker host (1..hosts-1; host 0 is the head, which runs the driver and the supervisor)."""
    after_step: int = Field(0, ge=0)
    """Once this training step committed."""
    seconds: float = Field(10.0, gt=0.0, le=600.0)
    """How long the host is gone (host_kill) or cut off (partition)."""


class FaultsConfig(Section):
    """Injected failures, so that a run with failures is reproducible."""

    targets: list[Literal["shards", "trainers", "supervisor", "all_trainers", "mirrors"]] = ["shards"]
    """Which actors may be killed (SIGKILL of the actor's process); all_trainers kills every trainer at once."""
    mtbf_s: float = Field(20.0, gt=0.0)
    """Mean time between injected failures."""
    distribution: Literal["exponential", "fixed"] = "exponential"
    """Inter-failure times: exponential with mean mtbf_s (memoryless, as real failures), or fixed."""
    seed: int = Field(0, ge=0)
    """Seed of the schedule: which actor dies and when."""
    max_failures: int = Field(3, ge=0)
    """Stop injecting after this many kills."""
    start_after_s: float = Field(0.0, ge=0.0)
    """Injection starts this long after the first training step."""
    at_steps: dict[str, list[int]] = {}
    """Kills once a training step committed, e.g. ``{trainer: [40], shard: [70]}``; keys: shard, trainer
    (one chosen by the seed), shard:K, trainer:K, supervisor, all_trainers. Independent of machine speed."""
    at_points: list[FaultPoint] = []
    """Kills at named points of the supervisor's work, each once (see faults.at_points[].at)."""
    inject: list[FaultSpec] = []
    """Faults other than kills, each once after a training step: stalls, damaged checkpoint files (see
    faults.inject[].kind)."""
    hosts: list[HostFault] = []
    """Faults of whole hosts of a namespace cluster, each once after a training step (see
    faults.hosts[].kind); carried out by ``cpr chaos hosts``, not by the run."""

    @field_validator("at_steps")
    @classmethod
    def _check_at_steps(cls, v: dict[str, list[int]]) -> dict[str, list[int]]:
        for key, steps in v.items():
            if not re.fullmatch(r"shard|trainer|supervisor|all_trainers|shard:\d+|trainer:\d+", key):
                raise ValueError(f"key {key!r} must be shard, trainer, shard:K, trainer:K, supervisor or all_trainers")
            if any(s < 0 for s in steps):
                raise ValueError(f"{key}: steps must be >= 0, got {steps}")
        return v


class EmulationConfig(Section):
    """The CPR paper's production-scale emulation (Maeng et al., MLSys 2021, arXiv 2011.02999): real
    training, with failures and the save, load and rescheduling costs on an emulated clock. The PLS, the
    AUC, the rows saved and reloaded, the steps redone and the tracking share are measured on the real run;
    the save, load, rescheduling and lost-computation overheads are these constants times those counts,
    charged, not timed (docs/EMULATION.md)."""

    node_mtbf_h: float = Field(6335.0, gt=0.0, le=10_000_000.0)
    """Mean time between failures of one host, in hours. Source: Llama 3's pre-training saw 419 unexpected
    interruptions in a 54-day snapshot on 16,384 GPUs = 2,048 hosts of 8, so 2,048 x 54 x 24 / 419 = 6,335 h
    per host (Dubey et al., The Llama 3 Herd of Models, arXiv 2407.21783, section 3.3.4)."""
    nodes: int = Field(128, ge=1, le=1_000_000)
    """Hosts of the emulated job; its MTBF is node_mtbf_h / nodes (49.5 h by default). Assumption: 128 is
    a size chosen for a large recommendation-training job, not a published figure."""
    duration_h: float = Field(240.0, gt=0.0, le=1_000_000.0)
    """Failure-free production training time the run stands for; each step is duration_h / steps of it.
    Assumption: 240 h (10 days) is chosen, not a published figure; with the job MTBF it sets how many
    failures a run meets (about 4.8 expected at the defaults)."""
    save_s: float = Field(600.0, gt=0.0, le=86_400.0)
    """Training stall of one full checkpoint save (o_save), in seconds; a prioritized (MFU/SSU) save costs
    its share of the rows. Assumption: 600 s is chosen, not a published figure (the CPR paper gives none we
    could confirm); charged, never timed here."""
    load_s: float = Field(600.0, ge=0.0, le=86_400.0)
    """Loading the whole model from a checkpoint (o_load), in seconds; a partial recovery pays the dead
    shard's share of the rows. Assumption: 600 s, equal to save_s, is chosen, not a published figure;
    charged, never timed here."""
    reschedule_s: float = Field(300.0, ge=0.0, le=86_400.0)
    """Getting a replacement host and process running (o_res), per failure, in seconds. Assumption: 300 s
    is chosen, not a published figure; charged, never timed here."""
    seed: int = Field(0, ge=0)
    """Seed of the failure schedule (times on the emulated clock, and which shard fails)."""
    max_failures: int = Field(100, ge=0, le=10_000)
    """Stop placing failures after this many."""


class BudgetsConfig(Section):
    """Failure budgets (like Ray Train's FailureConfig): past one the run stops with an error
    naming the budget and the counts, writes its report, and ``--resume`` continues it."""

    max_shard_recoveries: int = Field(100, ge=-1)
    """Embedding-shard deaths recovered before the run stops (-1: no limit)."""
    max_step_redos: int = Field(20, ge=-1)
    """Times one training step may fail and be redone before the run stops (-1: no limit)."""
    max_supervisor_restarts: int = Field(20, ge=-1)
    """Supervisor restarts before the run stops (-1: no limit)."""
    max_executor_errors: int = Field(5, ge=-1)
    """Failed attempts of one recovery before the run stops: an error, or a replacement shard that did not
    answer in time (killed and respawned under a new name) (-1: no limit)."""
    max_trainer_failures: int = Field(20, ge=-1)
    """Trainer deaths Ray Train replaces, and restarts of the whole trainer group, before the run stops
    (-1: no limit)."""
    max_failed_saves: int = Field(20, ge=-1)
    """Checkpoint saves that fail in a row before the run stops (a commit starts the count again; training
    goes on meanwhile, each retry after 1, 2, 4 ... steps, never more than the regular interval). 20 in a
    row is at least ten intervals without a new checkpoint for any interval up to 1,024 steps (-1: no
    limit)."""

    def limits(self) -> BudgetLimits:
        return BudgetLimits(**self.model_dump())
