"""Which checkpoint files a load read, and where they are now: the checkpoint's directory, a
copy a rollback fenced (an audited run keeps them), or gone. A shard's load reads its own
file, or, where the checkpoint's plan gave its rows to other shards (a resume on another
number of shards), the files of the shards that held them."""

from __future__ import annotations

from verify.kills import Damage
from verify.replay.history import History, ShardLoad
from verify.store import Store, files_read

__all__ = ["CLOCK_SLACK_S", "LoadedFiles"]

# A manifest's time is its storage's clock (object stores keep whole seconds); a commit's, the
# trainer's: within this much they may be either way round.
CLOCK_SLACK_S = 1.0


class LoadedFiles:
    def __init__(self, store: Store, saved: dict[int, float | None], damage: list[Damage], history: History):
        self.store, self.saved, self.damage, self.history = store, saved, damage, history
        self.fenced = store.fenced()

    def ok(self, step: int, name: str, loaded_at: float | None = None) -> bool:
        """Checkpoint ``step``'s file ``name`` holds what it held when committed (not damaged on
        purpose since) and, with ``loaded_at``, was committed before then (not saved again
        after a rollback fenced it)."""
        when = self.saved.get(step)
        if when is None or any(d.step == step and d.file == name and d.time > when for d in self.damage):
            return False
        return loaded_at is None or when <= loaded_at + CLOCK_SLACK_S

    def source(self, step: int, name: str, loaded_at: float) -> str | None:
        """Where the file ``name`` of checkpoint ``step`` is as a load at ``loaded_at`` read it:
        the checkpoint's directory, a fenced copy committed before the load and fenced after
        it (an audited run keeps them), or None (removed, or damaged since)."""
        if self.ok(step, name, loaded_at):
            return self.store._path(step)
        for committed, fenced_at, directory in self.fenced.get(step, []):
            damaged = any(d.step == step and d.file == name and committed < d.time < fenced_at for d in self.damage)
            if committed <= loaded_at + CLOCK_SLACK_S and loaded_at <= fenced_at + CLOCK_SLACK_S and not damaged:
                return directory
        return None

    def read(self, load: ShardLoad, step: int) -> tuple[list[tuple[int, str]], str | None]:
        """The files of checkpoint ``step`` that ``load`` read, as (shard, directory), and the
        name of the first of them no longer found (None: all found). Which files: those the plan
        of the checkpoint the load read (its manifest there, a fenced copy's own) gave the load's
        rows; its own file where that manifest records no plan."""
        own = f"shard-{load.shard}.arrow"
        directory = self.source(step, own, load.t) or self._read_from(step, load.t)
        if directory is None:
            return [], own
        slices = self.history.slices_of(load.shard, load.generation)
        found = []
        for j in files_read(load.shard, slices, self.store.plan_in(directory)):
            name = f"shard-{j}.arrow"
            if self.source(step, name, load.t) != directory:  # damaged since, or not in the copy read
                return found, name
            found.append((j, directory))
        return found, None

    def _read_from(self, step: int, loaded_at: float) -> str | None:
        """The directory of checkpoint ``step`` as a load at ``loaded_at`` found it, whatever
        became of the shard's own file (a plan without it): the checkpoint's, if committed
        before then, else a fenced copy live then."""
        when = self.saved.get(step)
        if when is not None and when <= loaded_at + CLOCK_SLACK_S:
            return self.store._path(step)
        for committed, fenced_at, directory in self.fenced.get(step, []):
            if committed <= loaded_at + CLOCK_SLACK_S and loaded_at <= fenced_at + CLOCK_SLACK_S:
                return directory
        return None
