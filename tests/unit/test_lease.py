"""Leases (actors.lease): a process acts only while the key names it as of a read less than a
term ago; a read naming another holder fences it; the supervisor's grant waits out the term
unless the predecessor is known to have exited."""

from __future__ import annotations

import pytest

from actors.lease import Fenced, Fences, Lease, LeaseSpec, lease_key, shard_place, trainer_place



class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class KV:
    """The GCS's key-value store as the lease sees it: reads can be cut off."""

    def __init__(self):
        self.data: dict[bytes, bytes] = {}
        self.reachable = True
        self.reads = 0

    def read(self, key: bytes, timeout_s: float):
        self.reads += 1
        if not self.reachable:
            raise TimeoutError("GCS unreachable")
        return self.data.get(key)

    def write(self, key: bytes, value: bytes) -> None:
        self.data[key] = value


def _lease(kv: KV, clock: Clock, place=shard_place(0, 1), term=1.0):
    fenced = []
    lease = LeaseSpec("run", term).lease(place, read=kv.read, clock=clock,
                                         on_fenced=lambda me, other: fenced.append((me, other)))
    return lease, fenced


def test_a_lease_is_held_for_a_term_from_the_read_that_named_its_holder():
    kv, clock = KV(), Clock()
    role, holder = shard_place(0, 1)
    kv.write(lease_key("run", role), holder.encode())
    lease, fenced = _lease(kv, clock)
    lease.renew()
    assert lease.valid() and lease.hold(timeout_s=0)
    # The GCS out of reach: the lease runs out one term after the last read was sent.
    kv.reachable = False
    clock.now += 0.6
    lease.renew()
    assert lease.valid()
    clock.now += 0.5
    lease.renew()
    assert not lease.valid() and not lease.hold(timeout_s=0)
    # Back in reach, still named: held again. Nothing fenced it.
    kv.reachable = True
    lease.renew()
    assert lease.valid() and fenced == []


def test_an_unset_key_is_held_by_whoever_reads_it():
    kv, clock = KV(), Clock()
    lease, fenced = _lease(kv, clock)
    lease.renew()
    assert lease.valid() and fenced == []


def test_a_successor_named_in_the_key_fences_the_predecessor_even_inside_its_term():
    kv, clock = KV(), Clock()
    fences = Fences(LeaseSpec("run", 1.0), write=kv.write, sleep=lambda s: None, clock=clock)
    fences.grant([shard_place(3, 1)], wait=False)
    old, fenced = _lease(kv, clock, shard_place(3, 1))
    old.renew()
    assert old.valid()
    fences.grant([shard_place(3, 2)], wait=False)
    old.renew()
    assert fenced == [("g1", "was replaced by g2")]
    assert not old.valid()
    with pytest.raises(Fenced):  # however it is called: no caller can go on
        old.hold(timeout_s=5.0)
    new, fenced_new = _lease(kv, clock, shard_place(3, 2))
    new.renew()
    assert new.valid() and fenced_new == []


def test_a_trainer_on_a_lost_host_is_fenced_and_its_replacement_holds_the_rank():
    kv, clock = KV(), Clock()
    fences = Fences(LeaseSpec("run", 1.0), write=kv.write, sleep=lambda s: None, clock=clock)
    fences.grant([trainer_place(0, 111, "nodeA")], wait=False)
    zombie, fenced = _lease(kv, clock, trainer_place(0, 111, "nodeA"))
    zombie.renew()
    assert zombie.valid()
    fences.grant([trainer_place(0, None, "nodeA")], wait=False)  # its host was declared dead
    zombie.renew()
    assert fenced == [("111@nodeA", "was replaced by lost@nodeA")]
    fences.grant([trainer_place(0, 222, "nodeB")], wait=False)
    replacement, fenced_r = _lease(kv, clock, trainer_place(0, 222, "nodeB"))
    replacement.renew()
    assert replacement.valid() and fenced_r == []


def test_a_grant_waits_out_the_term_unless_the_predecessor_exited():
    kv, clock, slept = KV(), Clock(), []

    def sleep(s):
        slept.append(s)
        clock.now += s

    fences = Fences(LeaseSpec("run", 0.75), write=kv.write, sleep=sleep, clock=clock)
    assert fences.grant([shard_place(1, 4)], wait=False) == 0.0 and slept == []
    assert kv.data[lease_key("run", "shard-1")] == b"g4"
    assert fences.grant([shard_place(1, 5), shard_place(2, 1)], wait=True) == pytest.approx(0.75)
    assert slept == [0.75] and kv.data[lease_key("run", "shard-2")] == b"g1"
    # The predecessor's last read before the write grants it less than a term past the write:
    # once the grant returns, it no longer holds its lease.
    pred, _ = _lease(kv, clock, shard_place(1, 4), term=0.75)
    clock.now -= 0.75  # it read just before the write
    kv.data[lease_key("run", "shard-1")] = b"g4"
    pred.renew()
    kv.data[lease_key("run", "shard-1")] = b"g5"
    clock.now += 0.75
    assert not pred.valid()


def test_hold_returns_only_with_a_quarter_term_left_for_the_act_that_follows():
    kv, clock = KV(), Clock()
    lease, _ = _lease(kv, clock, term=1.0)
    lease.renew()  # held until 101.0
    kv.reachable = False
    clock.now = 100.7
    assert lease.valid() and lease.hold(timeout_s=0)
    clock.now = 100.8  # 0.2 s left: still valid, but too little to begin an act
    assert lease.valid() and not lease.hold(timeout_s=0)


def test_a_fence_read_while_a_caller_waits_raises_in_that_caller():
    kv, clock = KV(), Clock()
    lease, fenced = _lease(kv, clock)
    lease.renew()
    clock.now += 2.0  # expired: a caller would wait for the next read
    kv.write(lease_key("run", "shard-0"), b"g2")
    lease.renew()
    with pytest.raises(Fenced):
        lease.hold(timeout_s=1.0)
    assert fenced == [("g1", "was replaced by g2")]


def test_an_act_that_ended_after_the_lease_ran_out_fences_the_process():
    """hold()'s promise enforced: the act that follows it must end while the lease holds; one
    that ended later may have overlapped a successor's, so the process is fenced (it exits)."""
    kv, clock = KV(), Clock()
    lease, fenced = _lease(kv, clock, term=1.0)
    lease.renew()  # held until 101.0 on this process's clock
    assert lease.hold(timeout_s=0)
    kv.reachable = False  # cut off from here on
    clock.now = 100.9
    lease.check_act("a short act")  # ended inside the lease
    assert lease.held_through(100.99) and not lease.held_through(101.0)
    assert fenced == []
    clock.now = 101.2
    with pytest.raises(Fenced, match="held no lease when a long act ended"):
        lease.check_act("a long act")
    assert fenced == [("g1", "held no lease when a long act ended (it may have overlapped a successor)")]
    with pytest.raises(Fenced):  # it never acts again, even once the GCS is back
        kv.reachable = True
        lease.renew()
        lease.hold(timeout_s=0)


def test_an_act_longer_than_a_quarter_term_holds_while_the_lease_is_renewed():
    """What counts is the lease at the act's end, not the quarter term: renewals that named this
    holder meanwhile keep a long act (a slow mirror's receipt) inside the lease."""
    kv, clock = KV(), Clock()
    lease, fenced = _lease(kv, clock, term=1.0)
    lease.renew()
    assert lease.hold(timeout_s=0)
    for _ in range(8):  # 2 s of act, renewed every quarter term
        clock.now += 0.25
        lease.renew()
    ended = lease.now()
    lease.check_act("a long act", ended)
    assert lease.held_through(ended) and fenced == []


def test_keys_are_per_run():
    assert lease_key("a", "shard-0") != lease_key("b", "shard-0")
