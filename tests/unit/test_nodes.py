"""Placement over hosts and the host watch's bookkeeping, on node tables written by hand (no Ray)."""

from __future__ import annotations

import socket

from actors.nodes import HostWatch, interface_for, least_loaded


def _row(node: str, alive: bool, ip: str = "10.0.0.1", cpus: float = 4.0) -> dict:
    return {"NodeID": node, "Alive": alive, "NodeManagerAddress": ip, "NodeManagerPort": 1,
            "DeathReasonMessage": "" if alive else "health check failed", "Resources": {"CPU": cpus}}


def test_least_loaded_spreads_and_skips_hosts_that_stopped_answering():
    taken: list = []
    for _ in range(4):
        taken.append(least_loaded(["b", "a"], taken))
    assert sorted(taken) == ["a", "a", "b", "b"]  # two shards on each host
    assert least_loaded(["a", "b", "c"], ["a", "b"]) == "c"  # an empty host first
    assert least_loaded(["a", "b"], [], avoid={"a"}) == "b"
    assert least_loaded(["a"], [], avoid={"a"}) is None


def test_host_watch_reports_each_lost_node_once_with_its_first_failed_probe():
    lost = []
    watch = HostWatch(lambda: {"a", "b"}, lost.append)
    assert watch.observe([_row("a", True), _row("b", True, "10.0.0.2")], now=10.0) == []
    watch.probed({"a": True, "b": False}, now=10.25)
    watch.probed({"a": True, "b": False}, now=10.5)  # still down: the first failure counts
    assert watch.suspects() == {"b"}
    assert watch.since("b") == 10.25 and watch.since("a") is None
    assert watch.usable() == ["a"]  # nothing new goes to a host that stopped answering

    (info,) = watch.observe([_row("a", True), _row("b", False, "10.0.0.2")], now=11.5)
    assert info["node_id"] == "b" and info["node_ip"] == "10.0.0.2"
    assert info["unreachable_since"] == 10.25 and info["declared_dead_at"] == 11.5
    assert info["reason"] == "health check failed"
    assert watch.suspects() == set()  # dead now, no longer a suspect
    assert watch.since("b") == 10.25  # a shard death seen after the verdict still gets it
    assert watch.observe([_row("a", True), _row("b", False)], now=12.0) == []  # once


def test_host_watch_ignores_dead_nodes_it_never_saw_alive_and_clears_a_probe_that_answers():
    watch = HostWatch(lambda: set(), lambda info: None)
    assert watch.observe([_row("old", False), _row("a", True)], now=1.0) == []
    watch.probed({"a": False}, now=1.0)
    watch.probed({"a": True}, now=1.25)  # a slow answer, not a lost host
    assert watch.suspects() == set() and watch.since("a") is None


def test_interface_for_names_the_loopback_interface():
    name = interface_for("127.0.0.1")
    assert name is not None and socket.if_nametoindex(name) > 0
    assert interface_for("203.0.113.77") is None  # an address no interface here holds


def test_usable_nodes_are_alive_with_cpus():
    watch = HostWatch(lambda: set(), lambda info: None)
    watch.observe([_row("head", True, cpus=0.0), _row("a", True), _row("b", False)], now=1.0)
    assert watch.usable() == ["a"]  # a head started with --num-cpus=0 takes no shard or spare
