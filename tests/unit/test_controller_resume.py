"""``--resume``: a new attempt's fleet generation and every shard's go on from the last
attempt's journal, so that a try (generation, step, attempt) and a shard's audit log name one
thing in the whole run directory; a supervisor restarted during the resumed start finds the
same first fleet. With the fakes of test_controller, no Ray."""

from actors.supervisor.machine import Running
from tests.unit.test_controller import FakeExecutor, MemoryJournal, _controller


def test_a_resumed_attempt_takes_the_generations_after_the_last_attempts():
    first = MemoryJournal()
    one, _, _ = _controller(first, FakeExecutor(first))
    one.on_shard_death(1, 0, "ActorDiedError", 999.5)
    one.loop.execute_once()
    one.on_shard_death(1, 1, "ActorDiedError", 999.6)  # journaled; the driver dies before it is carried out
    assert (one.served.gens, one.generation) == ([0, 1], 1)
    last = first.last()["controller"]

    second = MemoryJournal()
    two, _, _ = _controller(second, FakeExecutor(second), previous=last)
    assert two.first_fleet() == [1, 3] and two.generation == 2
    assert two.served.names == ["shard-0-g1", "shard-1-g3"]
    assert second.last()["controller"]["next_gens"] == [2, 4], "reserved before any spawn"
    # The supervisor restarted during that start rebuilds the same first fleet from its journal.
    again, _, _ = _controller(MemoryJournal(), FakeExecutor(MemoryJournal()))
    again.load(second.last()["controller"])
    assert again.first_fleet() == [1, 3] and again.generation == 2
    # A death in the new attempt takes the next generation, never one of the last attempt's.
    two.on_shard_death(0, 1, "ActorDiedError", 1000.5)
    two.loop.execute_once()
    assert isinstance(two.state, Running) and two.served.gens == [2, 3] and two.generation == 3
