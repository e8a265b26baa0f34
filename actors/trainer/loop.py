"""The trainer process, run by every Ray Train worker (one torchft replica group each): its
setup, its steps (``actors.trainer.step``) until the schedule's last one, the end of the run
(every trainer agrees on the final checkpoint and on any recovery that came after the last
step), and the held-out evaluation on the first trainer."""

from __future__ import annotations

import copy
import json
import os
import socket
import time
from datetime import timedelta
from urllib.parse import urlsplit

import ray
import ray.train
import torch

from actors.client import SupervisorClient
from actors.lease import Lease, LeaseSpec, trainer_place
from actors.trainer.collective import sum_over_trainers, use_node_interface
from actors.trainer.evaluate import evaluate
from actors.trainer.facts import answer_for
from actors.trainer.pipeline import Prefetcher, microbatch_loader
from actors.trainer.shards import ShardCallFailed, ShardClient
from actors.trainer.step import Trainer
from core.store import MicrobatchStore
from core.config import RunConfig, config_from_dict
from core.data import NUM_DENSE, NUM_SPARSE
from core.deadlines import Deadlines
from core.errors import ConfigError
from core.logs import configure_process_logging
from core.model import DenseAdagrad, DenseModel
from core.records import EvalResult, SaveRequest, StartMarks, TrainerSetup, TrainerStart

__all__ = ["train_loop"]

_EVAL_ATTEMPTS = 3


def train_loop(loop_config: dict) -> None:
    """Ray Train ``train_loop_per_worker``: trains until the schedule's last step, then (on
    rank 0) evaluates on the held-out split and reports to the supervisor."""
    entered = time.time()
    rank = ray.train.get_context().get_world_rank()
    # First, so that library imports' lines land there too. torchft's quorum and commit lines
    # (a few a step) go to the run's log files, and to the console only with `cpr train -v`.
    configure_process_logging(loop_config.get("log_dir"), f"trainer-{rank}", ray.util.get_node_ip_address())
    cfg = config_from_dict(loop_config["config"])
    handle = ray.get_actor(loop_config["supervisor"], namespace=cfg.ray.namespace)
    supervisor = SupervisorClient(handle, Deadlines.of(cfg))
    marks = {"process": _process_start(), "train_fn": entered, "imports": time.time()}
    setup = supervisor.trainer_setup(rank)
    marks["setup"] = time.time()
    if setup.finished:
        return  # Ray Train replaced a trainer that died after the run was over: nothing to do
    trainer = _make_trainer(rank, cfg, supervisor, setup, loop_config, marks)
    answer_for(trainer)
    try:
        # A full recovery during the evaluation rolls the run back: rank 0 redoes the steps.
        while not _train(trainer) and rank == 0 and not _evaluate_and_report(trainer, setup):
            pass
    finally:
        answer_for(None)
        if trainer.audit is not None:
            trainer.audit.close()
        trainer.shards.close()
        trainer.prefetch.close()
        trainer.manager.shutdown()


def _make_trainer(rank: int, cfg: RunConfig, supervisor: SupervisorClient, setup: TrainerSetup, loop_config: dict,
                  marks: dict) -> Trainer:
    """The shard client, the dense model and optimizer, torchft's Manager, and the start step."""
    shards = ShardClient(
        setup.shards, setup.plan, cfg.model.embedding_dim, cfg.embeddings.call_timeout_s,
        run_id=loop_config.get("run_id", ""), node_id=ray.get_runtime_context().get_node_id(),
        shared_memory=cfg.embeddings.transport == "auto",
    )
    # A host that cannot reach the store (a local path it does not share) stops here, saying so.
    try:
        train_file = MicrobatchStore(setup.train_cache, cfg.data.store_cache_mb << 20)
    except ConfigError as err:
        raise ConfigError(f"trainer {rank} on host {ray.util.get_node_ip_address()}: {err}") from None
    marks["client"] = time.time()
    torch.manual_seed(cfg.seed)  # identical dense init on every trainer
    model = DenseModel(NUM_DENSE, NUM_SPARSE, cfg.model.dense_arch, cfg.model.over_arch)
    optimizer = DenseAdagrad(model.parameters(), lr=cfg.training.dense_learning_rate)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)  # a trainer with no microbatches still joins the all-reduce with zeros
    # Step 0's dense state: what a full recovery rolls back to before the first checkpoint.
    initial_state = copy.deepcopy({"model": model.state_dict(), "optim": optimizer.state_dict()})
    marks["model"] = time.time()
    manager, pg = _make_manager(rank, cfg, model, optimizer, loop_config)
    marks["manager"] = time.time()
    lease = _register(rank, cfg, supervisor, StartMarks(**marks), loop_config.get("run_id"))
    trainer = Trainer(
        rank=rank, cfg=cfg, supervisor=supervisor, shards=shards, schedule=setup.schedule, model=model,
        optimizer=optimizer, manager=manager, pg=pg,
        prefetch=Prefetcher(microbatch_loader(train_file, setup.schedule, setup.plan), Deadlines.of(cfg).data_read_s),
        generation=setup.generation, next_checkpoint=setup.next_checkpoint_step, resume=setup.resume,
        replacement=setup.training_started, initial_state=initial_state, audit=_audit_file(setup, rank), lease=lease,
    )
    # A resumed run, or a trainer Ray Train started to replace a dead one: begin at the last
    # checkpoint. A live peer further ahead heals this trainer in its first quorum.
    if setup.resume is not None:
        if setup.resume.dense is not None:
            trainer.load_dense(setup.resume.dense)
        m = cfg.training.microbatches_per_step
        manager.load_state_dict({"step": setup.resume.step, "batches_committed": setup.resume.step * m})
        trainer.audit_load(setup.resume.step, "resume")
    return trainer


def _make_manager(rank: int, cfg: RunConfig, model, optimizer, loop_config: dict):
    from torchft import Manager  # import cost: 1.5 s the driver (which imports this module) does not need
    from torchft.checkpointing.pg_transport import PGTransport

    from actors.gloo import ReconfigurableGloo  # import cost: it imports torchft, as above

    tr = cfg.training
    # The lighthouse reports its address under the machine's hostname even when bound to one
    # interface; reach it on the interface it was bound to.
    use_node_interface()
    lighthouse = urlsplit(os.environ["TORCHFT_LIGHTHOUSE"])
    collective_timeout = timedelta(seconds=tr.collective_timeout_s)
    pg = ReconfigurableGloo(collective_timeout, timedelta(seconds=tr.connect_timeout_s))

    def load_state_dict(sd: dict) -> None:
        model.load_state_dict(sd["model"])
        optimizer.load_state_dict(sd["optim"])

    manager = Manager(
        pg=pg, min_replica_size=1, load_state_dict=load_state_dict,
        state_dict=lambda: {"model": model.state_dict(), "optim": optimizer.state_dict()},
        replica_id=f"cpr_trainer_{rank}",
        lighthouse_addr=f"{lighthouse.scheme}://{loop_config['lighthouse_host']}:{lighthouse.port}",
        hostname=ray.util.get_node_ip_address(), timeout=collective_timeout,
        # Longer than the saving trainer's save after its commit: a peer waiting for it in the
        # next quorum must not give up (and restart) while a slow write drains.
        quorum_timeout=timedelta(seconds=Deadlines.of(cfg).quorum_s),
        checkpoint_transport=PGTransport(pg, timeout=collective_timeout, device=torch.device("cpu")),
        world_size=1, rank=0,
        # Synchronous quorum: a replacement finishes healing inside the quorum and then takes
        # its share of the step with the healed state. With the async quorum it would count as
        # a participant while healing, compute its microbatches on a stale model, and have its
        # dense gradient zeroed, so the step would miss microbatches.
        use_async_quorum=False,
    )
    return manager, pg


def _register(rank: int, cfg: RunConfig, supervisor: SupervisorClient, marks: StartMarks,
              run_id: str | None) -> Lease | None:
    """Start together: a quorum formed before the last trainer has its Manager would leave it
    healing instead of training. A replacement for a dead trainer does not wait. Then the
    lease on its rank (the supervisor granted it at the registration): from now on it joins
    quorums and calls the supervisor only while it holds it. Then the torch threads: the
    cores this trainer may use, divided among the trainers on its node (the shards there are
    idle while trainers run the dense model)."""
    node_id = ray.get_runtime_context().get_node_id()
    deadline = time.monotonic() + cfg.training.collective_timeout_s
    # Its Ray Train worker actor: a recovery asks the trainer for its facts through it.
    worker = ray.get_runtime_context().current_actor
    while not supervisor.register_trainer(TrainerStart(rank, os.getpid(), node_id, marks, worker)):
        if time.monotonic() > deadline:
            break
        time.sleep(0.05)
    lease = None
    if run_id:
        lease = LeaseSpec(run_id, cfg.ray.lease_s).lease(trainer_place(rank, os.getpid(), node_id)).start()
        supervisor.guard = lease.hold
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    threads = cfg.training.threads_per_worker or max(1, cores // max(1, supervisor.trainers_on_node(node_id)))
    torch.set_num_threads(threads)
    return lease


def _audit_file(setup: TrainerSetup, rank: int):
    if setup.audit_dir is None:
        return None
    os.makedirs(setup.audit_dir, exist_ok=True)
    audit = open(os.path.join(setup.audit_dir, f"trainer-{rank}-{os.getpid()}.jsonl"), "a", buffering=1)
    # Quorum ids count per lighthouse, and a new lighthouse counts from 1 again: the checker
    # tells commits of different lighthouses apart by its address.
    audit.write(json.dumps({"t": round(time.time(), 6), "event": "open", "rank": rank, "pid": os.getpid(),
                            "host": socket.gethostname(), "ip": ray.util.get_node_ip_address(),
                            "lighthouse": os.environ.get("TORCHFT_LIGHTHOUSE"),
                            # cpr verify --replay computes this trainer's shares with as many
                            # threads: a matrix product's bits may depend on it.
                            "threads": torch.get_num_threads()}) + "\n")
    return audit


def _process_start() -> float | None:
    """Wall time this process started (Ray Train's worker), from the OS."""
    try:
        import psutil  # import cost: none (Ray's vendored copy, loaded by Ray); here only to read the start time

        return psutil.Process().create_time()
    except Exception:  # noqa: BLE001 - a missing timing mark only blanks a report line
        return None


def _train(t: Trainer) -> bool:
    """Steps until the schedule's last one committed and the run's end is agreed. True if
    the supervisor stopped the run (a budget, an interrupt) before that."""
    status_ref = None
    while True:
        if not t.settle_vote():  # before the next lookup names the last try committed, or the run ends
            return True
        if t.manager.current_step() >= t.schedule.total_steps:
            end = _finish(t)
            if end is not None:
                return end
            continue
        # The supervisor's status, polled without blocking: a stop (interrupt, budget) ends the
        # loop at a step boundary; a rollback may have moved the save schedule.
        if status_ref is None:
            status_ref = t.supervisor.status_ref()
        elif ray.wait([status_ref], timeout=0)[0]:
            status = ray.get(status_ref)
            status_ref = None
            if status.stop:
                return True
            t.next_checkpoint = status.next_checkpoint
        attempt = t.quorum()
        t.compute(attempt)
        flat = t.vote(attempt)
        if not t.commit(attempt, flat):
            return True
        t.phases.lap("commit")
        t.save_and_report(attempt)


def _finish(t: Trainer) -> bool | None:
    """The last step committed, but a shard may have died before its final state was saved,
    and the final save itself may have failed. ``await_final`` waits for the final save and
    probes the shards; the trainers sum two flags over their group ("the fleet changed",
    "the final checkpoint is missing") so that all of them act alike: after a full
    recovery's rollback they redo the steps together (bit-identical to a run without the
    failure); after a partial recovery the recovered shard is part of the final model (its
    lost updates counted as PLS); a missing final checkpoint is saved again. Returns True
    (stopped), False (done), or None (go on: redo steps, or look again)."""
    done = t.manager.current_step()
    final = t.supervisor.await_final(t.generation, done)
    view = final.fleet
    changed_here = float(view.stop or view.generation != t.generation)
    missing_here = float(not final.final_saved)
    seen = torch.tensor([changed_here, missing_here])
    if t.manager.errored() is None and t.manager.num_participants() > 1:
        quorum_id = t.manager._quorum_id
        if sum_over_trainers(t.pg, seen, lambda: t.supervisor.group_broken(quorum_id, done)):
            seen = torch.tensor([changed_here, missing_here])  # a peer died meanwhile: go by this trainer's own view
    if seen[0].item() > 0 and not view.stop and view.generation == t.generation:
        view = t.supervisor.await_shards(t.generation, done)  # a peer saw the change first
    if view.stop:
        return True
    if view.generation != t.generation:
        rolled_back = view.rollback is not None
        t.use_fleet(view)
        return None if rolled_back or t.cfg.checkpoint.final else False
    if seen[1].item() > 0:
        # Every trainer of the group sends its (identical) dense state; one save happens.
        t.supervisor.save_checkpoint(SaveRequest(done, t.dense_blob(), final=True))
        return None
    return False


def _evaluate_and_report(t: Trainer, setup: TrainerSetup) -> bool:
    """Evaluates on the held-out split and reports it. A shard that dies meanwhile is recovered
    like any other and the evaluation runs again; a full recovery's rollback returns False:
    the steps since its checkpoint are to be trained again first."""
    steps = t.manager.current_step()
    t.supervisor.record_training_finished(steps, time.time())
    t0 = time.perf_counter()
    for attempt in range(_EVAL_ATTEMPTS):
        try:
            metrics = evaluate(t.model, t.shards, MicrobatchStore(setup.eval_cache, 0))
            break
        except ShardCallFailed as err:
            t.supervisor.report_shard_failure(err.shard, t.generation, err.reason, steps)
            fleet = t.supervisor.await_shards(t.generation, steps)
            if fleet.stop:
                return True
            t.use_fleet(fleet)
            if fleet.rollback is not None:
                return False
            if attempt == _EVAL_ATTEMPTS - 1:
                raise
    t.supervisor.record_eval(EvalResult(eval_s=time.perf_counter() - t0, steps=steps, **metrics))
    return True
