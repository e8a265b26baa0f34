"""The idle workers a run asks for (app.warm): how many of each kind, and each environment
written as Ray 2.60 writes the one its actors get (a raylet matches them by the exact string;
tests/integration/test_warm_start.py checks that the next run takes them)."""

from __future__ import annotations

import json

from app.warm import _serialized, run_processes, shares, train_env_vars
from core.config import config_from_dict

DATA = {"train": ["t.tsv"], "eval": ["e.tsv"]}


def test_a_run_asks_for_one_worker_for_each_of_its_processes():
    cfg = config_from_dict({"data": DATA, "embeddings": {"num_shards": 3, "spares": 1}, "training": {"num_trainers": 2}})
    assert run_processes(cfg) == {"job": (2, 4, 1.0), "controller": (2, 0, 0.0), "trainer": (0, 2, 1.0)}
    replica = config_from_dict({"data": DATA, "recovery": "replica", "embeddings": {"num_shards": 3, "spares": 0}})
    assert run_processes(replica)["job"][:2] == (2, 6)  # a mirror for every shard


def test_each_environment_is_written_as_ray_writes_it(monkeypatch):
    monkeypatch.setenv("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "0.5")
    train = train_env_vars({})
    assert train["RAY_TRAIN_HEALTH_CHECK_INTERVAL_S"] == "0.5" and "RAY_WARN_BLOCKING_GET_INSIDE_ASYNC" in train

    # No job environment (cpr's embedded Ray, the test suite's): the job's is Ray's default (no
    # string), the controller's as Python writes it, the trainers' merged by Ray's core worker.
    plain = _serialized("", train)
    assert plain["job"] == ""
    assert plain["controller"] == json.dumps({"env_vars": dict(sorted(train.items()))})
    assert plain["trainer"] == json.dumps({"env_vars": dict(sorted(train.items()))}, separators=(",", ":"))

    # A job environment (a cluster, `ray job submit --working-dir`): the job's as the job says it;
    # both others merged with it, its other fields kept, compact, text as it is (as measured with
    # Ray 2.60: '{"env_vars":{"A":"2","B":"4","D":"3","Z":"1"}}' for a child of a child).
    said = '{"env_vars": {"A": "2", "Z": "é"}, "working_dir": "gcs://_ray_pkg_1.zip"}'
    merged = _serialized(said, train)
    assert merged["job"] == said
    assert merged["controller"] == merged["trainer"] == (
        '{"env_vars":{"A":"2",' + ",".join(f'"{k}":"{v}"' for k, v in sorted(train.items())) + ',"Z":"é"},'
        '"working_dir":"gcs://_ray_pkg_1.zip"}')


def test_processes_spread_over_the_nodes_that_hold_them_as_many_as_the_run_starts():
    assert shares(2, {"a": 8.0, "b": 8.0, "c": 0.0}, 1.0) == {"a": 1, "b": 1}
    assert shares(3, {"a": 1.0, "b": 2.0}, 2.0) == {"b": 3}  # a has no room for one
    assert sum(shares(2, {f"n{i}": 4.0 for i in range(100)}, 1.0).values()) == 2  # not one a node
    assert shares(0, {"a": 4.0}, 1.0) == {} and shares(2, {"a": 0.5}, 1.0) == {}
