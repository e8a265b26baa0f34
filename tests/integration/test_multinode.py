"""Several hosts on this machine (``scripts/local_cluster.sh``): a head and two worker hosts,
each in its own network and PID namespaces, with the driver on the head.

- Training spreads over the hosts (shards by placement, one trainer per worker host, gloo
  over the hosts' addresses), and survives the loss of a whole worker host: its shards come
  back on the survivor (one on the warm spare), its trainer is replaced, every step keeps
  its M microbatches, and the report names the host, what it took and how long Ray took to
  declare it dead. The host, added back, gets the warm spare. Then the other worker host is
  cut off for a few seconds (its link down): Ray declares it lost, the run goes on on the
  added host, and the cut-off host, back on the network, is fenced and joins again fresh.
  ``cpr verify`` checks the run from its files, and each host for what the run left on it.
- Storage that is not shared by every host is refused before training, naming the field.
- A cluster with its data, microbatch store and checkpoints in object storage (an S3 API
  server on the head) trains, rolls back to its checkpoint in S3 when a shard dies, and ends
  with the AUC of the same run on local files.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

import pytest
import yaml

from app.host_chaos import Cluster, kill_host, partition_host, restart_host
from app.soak_hosts import check_hosts
from core.faultlog import FaultLog, fault_log_dir
from tests.s3_server import moto_argv, wait_until_running
from tests.integration.checks import verified

pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]

M = 4


def _config(cluster, name: str, **overrides) -> Path:
    shared = cluster.shared
    cfg = {
        "run_dir": str(shared / name),
        "seed": 0,
        "data": {
            "train": [str(shared / "data" / "train.tsv")],
            "eval": [str(shared / "data" / "eval.tsv")],
            "generate": {"train_rows": 150_000, "eval_rows": 5_000, "seed": 0, "format": "tsv"},
            "cache_dir": str(shared / "cache"),
        },
        "model": {"embedding_dim": 16, "table_rows": 20_000, "dense_arch": [32, 16], "over_arch": [32, 1]},
        "embeddings": {"num_shards": 2, "spares": 1},
        "training": {"num_trainers": 2, "microbatch_rows": 256, "microbatches_per_step": M, "epochs": 4},
        "checkpoint": {"every_steps": 10},
        "recovery": "partial",
        "audit_log": True,
    }
    for key, value in overrides.items():  # "section.field", or a top-level field
        section, _, field = key.rpartition(".")
        (cfg[section] if section else cfg)[field] = value
    path = shared / f"{name}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def _events(run_dir: Path) -> list[dict]:
    path = run_dir / "events.jsonl"
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            pass  # a line being written
    return out


def _step(run_dir: Path) -> int:
    path = run_dir / "progress.jsonl"
    lines = path.read_text().splitlines() if path.exists() else []
    for line in reversed(lines):
        try:
            return json.loads(line).get("step", 0)
        except json.JSONDecodeError:
            continue
    return 0


def _wait(what: str, predicate, driver, log: Path, timeout: float = 240.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        if driver.poll() is not None:
            pytest.fail(f"the driver exited ({driver.returncode}) before {what}: {log.read_text()[-3000:]}")
        time.sleep(0.2)
    pytest.fail(f"timed out waiting for {what}: {log.read_text()[-3000:]}")


def _start_run(cluster, name: str, cfg: Path, log: Path):
    """``cpr train`` of ``cfg`` on the head (host 0), its run directory ``name`` on the shared
    storage. The hosts' processes write their pids in their own PID namespaces: cpr verify checks
    those from inside each host (``cluster.json``), the rest from here. Returns the run
    directory, the host controller, the fault log and the driver process."""
    run_dir = cluster.shared / name
    run_dir.mkdir()
    (run_dir / "cluster.json").write_text(json.dumps({"hosts": {cluster.ip(n): n for n in range(3)}}))
    ctl, faults = Cluster(cluster.dir, cluster.env), FaultLog(fault_log_dir(run_dir))
    driver = cluster.popen(0, [sys.executable, "-m", "app", "train", "--config", str(cfg)], log)
    return run_dir, ctl, faults, driver


def _trainer_hosts(run_dir: Path) -> dict[int, str]:
    """rank -> host IP of each trainer's first process, from its log file's name."""
    out = {}
    for f in sorted((run_dir / "logs").glob("trainer-*.log"), key=lambda p: p.stat().st_mtime):
        _, rank, ip, _pid = f.stem.split("-")
        out.setdefault(int(rank), ip)
    return out


def _stop(driver) -> None:
    if driver.poll() is None:
        os.killpg(driver.pid, signal.SIGKILL)
        driver.wait(timeout=30)


def _on_host(run_dir: Path, kind: str, ip: str, after: float) -> list[dict]:
    return [e for e in _events(run_dir) if e["kind"] == kind and e["time"] > after
            and (e.get("node_ip") == ip or kind != "host_lost")]


def test_training_across_hosts_survives_the_loss_of_a_host_and_a_partition(local_cluster, tmp_path):
    cluster = local_cluster
    cfg = _config(cluster, "hostloss", **{"training.epochs": 5})
    log = tmp_path / "driver.log"
    run_dir, ctl, faults, driver = _start_run(cluster, "hostloss", cfg, log)
    try:
        # Placement: the shards on both worker hosts, one trainer on each, the spare on one.
        ready = _wait("the shards", lambda: [e for e in _events(run_dir) if e["kind"] == "shards_ready"], driver, log)[0]
        workers = {cluster.ip(1), cluster.ip(2)}
        assert set(ready["nodes"]) == workers, ready
        spare = _wait("a warm spare", lambda: [e for e in _events(run_dir) if e["kind"] == "spare_ready"], driver, log)[0]
        _wait("step 20", lambda: _step(run_dir) >= 20, driver, log)
        trainers = _trainer_hosts(run_dir)
        assert set(trainers.values()) == workers, trainers

        # The worker host without the spare goes, with everything on it.
        victim_ip = (workers - {spare["node_ip"]}).pop()
        victim = int(victim_ip.rsplit(".", 1)[1]) - 10
        lost_shards = {f"shard:{k}" for k, ip in enumerate(ready["nodes"]) if ip == victim_ip}
        lost_trainers = {f"trainer:{r}" for r, ip in trainers.items() if ip == victim_ip}
        killed_at = kill_host(ctl, faults, victim, "test")
        recovered = _wait(
            "the lost shards' recovery",
            lambda: len(_on_host(run_dir, "shard_recovered", victim_ip, killed_at)) >= len(lost_shards)
            and _on_host(run_dir, "shard_recovered", victim_ip, killed_at), driver, log)
        # The host comes back: the warm spare moves to it (the survivor holds every shard).
        restart_host(ctl, faults, victim, "test")
        moved = _wait("the spare's move to the added host",
                      lambda: [e for e in _events(run_dir) if e["kind"] == "spare_moved"], driver, log)
        assert moved[0]["to_ip"] == victim_ip, moved

        # Then the survivor is cut off for 4 s: Ray declares it lost, its shards and trainer
        # come back on the added host, and when its link returns it is fenced (its raylet
        # exits) and joins again as a fresh host. Nothing it ran may apply or commit after.
        other = 3 - victim
        parted_at = partition_host(ctl, faults, other, 4.0, "test")
        _wait("the cut-off host's loss", lambda: _on_host(run_dir, "host_lost", cluster.ip(other), parted_at),
              driver, log)
        driver.wait(timeout=400)
        assert driver.returncode == 0, log.read_text()[-3000:]
        left = check_hosts(ctl, 3, run_dir, tmp_path / "hosts.log")
    finally:
        _stop(driver)

    report = json.loads((run_dir / "report.json").read_text())
    _check_host_loss(report, run_dir, victim_ip, killed_at, lost_shards, lost_trainers, spare, recovered, parted_at)
    # Until the partition, no trainer but the lost host's was started again.
    restarted = {f"trainer:{e['rank']}" for e in report["events"]
                 if e["kind"] == "trainer_started" and e["starts"] > 1 and e["time"] < parted_at}
    assert restarted == lost_trainers, restarted
    partitioned = [h for h in report["hosts_lost"] if h["node_ip"] == cluster.ip(other)]
    assert len(partitioned) == 1 and partitioned[0]["declared_dead_at"] > parted_at, report["hosts_lost"]
    # The whole run from its files (exactly-once applies and commits, kills and host losses
    # against the report, lost samples recounted, checkpoints hashed), and nothing left anywhere.
    verdict = verified(run_dir)
    assert verdict.violations == [] and left == [], (verdict.violations, left)
    assert verdict.facts["host_faults"] == 2, verdict.facts


def _check_host_loss(report, run_dir, victim_ip, killed_at, lost_shards, lost_trainers, spare, recovered, parted_at):
    assert report["auc"] is not None and report["state"]["state"] == "finished"
    # Every committed step had its M microbatches, also while a trainer was missing.
    assert report["microbatches_per_committed_step"] == [M]
    assert report["steps_with_fewer_trainers"] >= 1
    # The survivors went on: no fallback (until the partition, which may cut off every trainer:
    # the lost host's replacement ran beside the survivor's).
    assert not [e for e in report["all_trainers_failed"] if e["time"] < parted_at], report["all_trainers_failed"]
    # The host loss, what it took, and Ray's verdict, measured against the kill.
    (host,) = [h for h in report["hosts_lost"] if h["node_ip"] == victim_ip]
    assert lost_shards | lost_trainers <= set(host["actors"]), host
    assert 0 < host["declared_dead_at"] - killed_at < 10, (host, killed_at)
    assert host["declared_dead_s"] is not None and 0 <= host["declared_dead_s"] < 10
    assert host["unreachable_since"] - killed_at < 2, (host, killed_at)
    # Its shards recovered alone (partial), on the surviving host, one on the warm spare.
    by_actor = {e["actor"]: e for e in recovered}
    assert set(by_actor) == lost_shards
    assert all(e["recovery"] == "partial" for e in recovered)
    assert spare["spare"] in {e["spare"] for e in recovered}
    assert all(e["serving_s"] is not None for e in recovered)
    # Its trainer was replaced by Ray Train and healed from the survivor.
    failures = {t["actor"]: t for t in report["trainer_failures"] if t["cause"] == f"host {victim_ip} lost"}
    assert set(failures) == lost_trainers
    assert all(t["rejoined_s"] is not None for t in failures.values())
    summary = (run_dir / "summary.txt").read_text()
    assert f"host lost         {victim_ip}" in summary
    # No slab of a dead trainer is left on any host.
    assert not list(Path("/dev/shm").glob(f"cpr-{report['run_id']}-*"))


def test_replica_recovery_survives_the_loss_of_the_host_holding_a_shard(local_cluster, tmp_path):
    """``recovery: replica`` on two worker hosts: each shard's mirror on the other host. The host
    holding shard 0 (and shard 1's mirror, and a trainer) is killed: shard 0's mirror takes its
    place with nothing lost, shard 1 gets a new mirror, the run finishes and ``cpr verify`` finds
    every step applied exactly once."""
    cluster = local_cluster
    cfg = _config(cluster, "replica", **{"embeddings.spares": 0, "recovery": "replica"})
    log = tmp_path / "driver.log"
    run_dir, ctl, faults, driver = _start_run(cluster, "replica", cfg, log)
    try:
        ready = _wait("the shards", lambda: [e for e in _events(run_dir) if e["kind"] == "shards_ready"], driver, log)[0]
        mirrors = _wait("both mirrors", lambda: len(m := [e for e in _events(run_dir) if e["kind"] == "mirror_ready"]) >= 2
                        and m, driver, log)
        _wait("step 20", lambda: _step(run_dir) >= 20, driver, log)
        victim_ip = ready["nodes"][0]
        victim = int(victim_ip.rsplit(".", 1)[1]) - 10
        killed_at = kill_host(ctl, faults, victim, "test")
        _wait("shard 0's recovery", lambda: [e for e in _events(run_dir) if e["kind"] == "shard_recovered"
                                             and e["time"] > killed_at], driver, log)
        driver.wait(timeout=400)
        assert driver.returncode == 0, log.read_text()[-3000:]
    finally:
        _stop(driver)
    # No shard and its mirror on one host while another host had room.
    assert all(m["node_id"] != m["primary_node"] for m in mirrors[:2]), mirrors
    report = json.loads((run_dir / "report.json").read_text())
    [failure] = report["failures"]
    assert failure["actor"] == "shard:0" and failure["recovery"] == "replica" and failure["lost_samples"] == 0
    assert report["lost_samples"] == 0 and report["auc"] is not None
    assert any(e["kind"] == "mirror_ready" and e["shard"] == 1 and e["time"] > killed_at for e in report["events"])
    try:
        verdict = verified(run_dir)
        assert verdict.violations == [], verdict.violations
    finally:
        restart_host(ctl, faults, victim, "test")  # the module's next tests use both worker hosts


def test_storage_that_is_not_shared_is_refused(local_cluster, tmp_path):
    """The cache and the checkpoints on the head's private disk: the other hosts would not
    see them. The run stops before training, naming the fields and a host."""
    cluster = local_cluster
    local = cluster.local / "refused"
    cfg = _config(cluster, "refused", **{"data.cache_dir": str(local / "cache"), "checkpoint.storage": str(local / "ckpt")})
    log = tmp_path / "driver.log"
    driver = cluster.popen(0, [sys.executable, "-m", "app", "train", "--config", str(cfg)], log)
    try:
        driver.wait(timeout=180)
    finally:
        _stop(driver)
    out = log.read_text()
    assert driver.returncode != 0, out[-3000:]
    assert "not shared by every host" in out, out[-3000:]
    assert "data.cache_dir" in out and "checkpoint.storage" in out, out[-3000:]
    assert f"host {cluster.ip(1)}" in out or f"host {cluster.ip(2)}" in out, out[-3000:]
    assert not (cluster.shared / "refused" / "events.jsonl").exists()  # no supervisor, no training


def _upload_from_head(cluster, endpoint: str, files: dict[str, Path]) -> None:
    """The bucket and the data files put into the S3 server on the head (whose address only
    the cluster's hosts reach), by a process on the head."""
    code = (
        "import sys, json, pyarrow.fs as f\n"
        f"fs = f.S3FileSystem(endpoint_override={endpoint!r}, scheme='http', region='us-east-1', "
        "allow_bucket_creation=True)\n"
        "fs.create_dir('cpr')\n"
        "for key, path in json.loads(sys.argv[1]).items():\n"
        "    with fs.open_output_stream(key, compression=None) as out, open(path, 'rb') as src:\n"
        "        out.write(src.read())\n"
    )
    cluster.script("exec", "0", "--", sys.executable, "-c", code, json.dumps({k: str(v) for k, v in files.items()}))


def test_a_cluster_trains_from_object_storage_alone(local_cluster, ray_local, tmp_path):
    """Training data, eval data, the microbatch store and the checkpoints all in an S3 API
    server on the head's address; the store preprocessed by Ray Data tasks on the worker hosts;
    a shard killed and the run rolled back to its checkpoint in S3. The run ends with the AUC of
    the same run on local files, on one node."""
    from core.config import load_config
    from core.data import generate

    from .small_runs import train_to_report

    cluster = local_cluster
    data = generate(str(cluster.shared / "s3data"), 40_000, 4_000, fmt="tsv", seed=3, vocab_rows=2_000)
    log = tmp_path / "moto.log"
    moto = cluster.popen(0, moto_argv(cluster.ip(0), 9000), log)
    driver = None
    try:
        wait_until_running(log)
        endpoint = f"{cluster.ip(0)}:9000"
        _upload_from_head(cluster, endpoint, {"cpr/criteo/train.tsv": Path(data.train_path),
                                              "cpr/criteo/eval.tsv": Path(data.eval_path)})

        def s3(key: str) -> str:
            return f"s3://{key}?endpoint_override={endpoint}&scheme=http&region=us-east-1"

        run = {"data": {"train": [s3("cpr/criteo/train*")], "eval": [s3("cpr/criteo/eval.tsv")],
                        "cache_dir": s3("cpr/cache"), "chunk_mb": 3},
               "checkpoint": {"every_steps": 5, "storage": s3("cpr/ckpt")}}
        cfg = _s3_config(cluster.shared / "s3run", run)
        driver = cluster.popen(0, [sys.executable, "-m", "app", "train", "--config", str(cfg), "--no-progress"],
                               tmp_path / "driver.log")
        # Meanwhile, the same run on local files on one node (the local Ray of this process).
        local = _s3_config(tmp_path / "local", {"data": {"train": [data.train_path], "eval": [data.eval_path],
                                                         "cache_dir": str(tmp_path / "cache"), "chunk_mb": 3},
                                                "checkpoint": {"every_steps": 5}})
        same = train_to_report(load_config(local))
        driver.wait(timeout=400)
        assert driver.returncode == 0, (tmp_path / "driver.log").read_text()[-3000:]
    finally:
        if driver is not None:
            _stop(driver)
        _stop(moto)
    report = json.loads((cluster.shared / "s3run" / "report.json").read_text())
    assert report["state"]["state"] == "finished" and report["data"]["train_store"].startswith("s3://cpr/cache/")
    preprocessing = report["data"]["preprocessing"]["train"]
    assert preprocessing["engine"] == "Ray Data" and preprocessing["chunks"] >= 2
    assert set(preprocessing["hosts"]) <= {cluster.ip(1), cluster.ip(2)}  # the head has no CPU for tasks
    (failure,) = report["failures"]
    assert failure["recovery"] == "full" and report["checkpoints_saved"] >= 2

    assert same["steps"] == report["steps"] and same["eval_rows"] == report["eval_rows"]
    # One trainer, and a full recovery (every shard and the dense model back to the checkpoint in
    # S3, the steps since redone): each run computes the same sums in the same order, so the same
    # data trains to the same model. Anything the data path read or mapped otherwise would show.
    assert same["failures"][0]["recovery"] == "full"
    assert same["auc"] == pytest.approx(report["auc"], abs=1e-6), (same["auc"], report["auc"])


def _s3_config(run_dir: Path, sections: dict) -> Path:
    cfg = {
        "run_dir": str(run_dir), "seed": 0,
        "model": {"embedding_dim": 8, "table_rows": 20_000, "dense_arch": [32, 8], "over_arch": [32, 1]},
        "embeddings": {"num_shards": 2},
        "training": {"num_trainers": 1, "microbatch_rows": 256, "microbatches_per_step": M, "epochs": 1},
        "recovery": "full",
        "faults": {"max_failures": 0, "at_steps": {"shard:0": [12]}},
        **sections,
    }
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    path = run_dir.parent / f"{run_dir.name}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path
