"""Exactly once, as equalities over the audit logs the shards and trainers wrote.

Each shard and the dense optimizer are walked in time order as a count of the steps in
their state: an apply or a commit of step ``s`` must find exactly ``s`` steps there (no gap,
no repeat); a load of a checkpoint at step ``c`` sets the count to ``c`` (a rollback or a
resume: steps ``c``.. are then applied exactly once more), except a partial recovery, which
keeps the steps its predecessor applied and loses the updates no checkpoint held (counted
in lost samples). At the end every count equals the run's number of steps.

A replica-recovery mirror's log is walked on its own from its base (the steps in its primary's
rows when it started): its applies find the same counts, and a promoted mirror's walk ends at
the count its generation's "replica" load claims.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from verify.files import AuditFile

__all__ = ["LostSpanSeen", "applies_committed", "walk_shard", "walk_mirrors", "walk_dense", "torn_lines"]


@dataclass
class LostSpanSeen:
    """A generation of a shard that died and was recovered partially: what it applied since
    its last load (step -> microbatch ids), the chain its replacement loaded, and the first
    step anyone redid after it."""

    shard: int
    generation: int
    chain: list[int]
    applied: dict[int, list[int]] = field(default_factory=dict)
    redo: int | None = None


def _expected(step: int, m: int) -> list[int]:
    return list(range(step * m, step * m + m))


def walk_shard(k: int, files: list[AuditFile], m: int, total: int,
               retired_at: int | None = None) -> tuple[list[str], list[LostSpanSeen]]:
    """Shard ``k``'s generations' logs walked in time order (its mirrors' on their own).
    ``retired_at``: a shard the run's last plan has not, whose last attempt ended and was
    resumed from that step on fewer shards: its walk ends there, not at ``total``."""
    mirrors = [f for f in files if f.kind == "mirror"]
    files = [f for f in files if f.kind != "mirror"]
    events = sorted((r for f in files for r in f.records), key=lambda r: (r["t"], r.get("gen", 0), r["_line"]))
    v: list[str] = []
    done, holder, pending = 0, None, None  # steps in the state; the generation serving; an unresolved load
    stretch: dict[int, dict[int, list[int]]] = {}  # gen -> its applies since its last load
    spans: list[LostSpanSeen] = []
    open_spans: list[LostSpanSeen] = []  # spans whose redo step has not come yet
    for e in events:
        gen, kind = e.get("gen", 0), e.get("event")
        if kind == "load" and e.get("why") == "replica":
            # A mirror took the shard's place with the steps in its rows (``step``); its
            # predecessor may have applied one more, which the mirror holds and applies next.
            c = e["step"]
            if not done - 1 <= c <= done:
                v.append(f"shard {k} generation {gen}: a mirror with {c} steps replaced one with {done}")
            # Its rows hold every step its predecessor applied since that one's last load: a
            # later partial recovery of this generation loses those too.
            stretch[gen] = dict(stretch.get(holder, {})) if holder is not None else {}
            holder, pending, done = gen, None, c
            continue
        if kind == "load":
            c = e["chain"][-1] if e["chain"] else 0
            if holder is not None and gen < holder:
                v.append(f"shard {k} generation {gen} loaded a checkpoint after generation {holder} took over")
            if e.get("why") == "recovery" and holder is not None and holder != gen and stretch.get(holder):
                span = LostSpanSeen(k, holder, list(e["chain"]), dict(stretch[holder]))
                spans.append(span)
                open_spans.append(span)
            if e.get("why") != "recovery":
                for span in spans:  # a later rollback redoes what it reverts
                    span.redo = c if span.redo is None else min(span.redo, c)
            holder, pending = gen, (c, e.get("why"), done)
            stretch[gen] = {}
            if e.get("why") != "recovery":
                done = c
        elif kind == "complete":
            # A step whose gradients were all here, applied at its commit: a generation that
            # dies between the two loses that step's update too (counted in its lost samples).
            if holder is None or gen >= holder:
                stretch.setdefault(gen, {}).setdefault(e["step"], e["microbatches"])
        elif kind == "apply":
            s = e["step"]
            if sorted(e["microbatches"]) != _expected(s, m):
                v.append(f"shard {k} applied step {s} with microbatches {e['microbatches']}, not {_expected(s, m)}")
            if holder is not None and gen < holder:
                v.append(f"shard {k} generation {gen} applied step {s} after generation {holder} took over")
                continue
            holder = gen if holder is None else holder
            if pending is not None:
                c, why, before = pending
                if why == "recovery":
                    # before + 1: the predecessor's last step was complete, not applied (at its commit)
                    if not c <= s <= before + 1:
                        v.append(f"shard {k} generation {gen} loaded step {c} and then applied step {s}, "
                                 f"outside [{c}, {before + 1}]")
                    done = s
                pending = None
            for span in open_spans:
                span.redo = s if span.redo is None else min(span.redo, s)
            open_spans = []
            if s < done:
                v.append(f"shard {k} applied step {s} again (generation {gen}) with no load reverting it")
            elif s > done:
                v.append(f"shard {k} skipped steps {done}..{s - 1}: applied step {s} next (generation {gen})")
            done = s + 1
            stretch.setdefault(gen, {})[s] = e["microbatches"]
    end = total if retired_at is None else retired_at
    for span in open_spans:  # the trainers redid its steps from the end (a retired shard's: from the resume)
        span.redo = end if span.redo is None else span.redo
    if retired_at is None and done != total:
        v.append(f"shard {k} holds {done} applied steps at the end, the run has {total}")
    elif retired_at is not None and done < retired_at:
        v.append(f"shard {k} held {done} applied steps when the run resumed without it from step {retired_at}")
    return v + walk_mirrors(k, mirrors, files, m), spans


def _counts_held(files: list[AuditFile]) -> dict[int, set[int]]:
    """generation -> the step counts its rows held: the initial rows' 0, what each load set,
    and each count an apply reached."""
    held: dict[int, set[int]] = {}
    for f in files:
        counts = held.setdefault(f.gen or 0, {0})
        for r in f.records:
            if r.get("event") == "load":
                counts.add(r["step"] if r.get("why") == "replica" else (r["chain"][-1] if r["chain"] else 0))
            elif r.get("event") == "apply":
                counts.add(r["step"] + 1)
    return held


def walk_mirrors(k: int, mirrors: list[AuditFile], files: list[AuditFile], m: int) -> list[str]:
    """Each mirror of shard ``k`` from its base (``files``: the shard's generations' logs): the
    base is a count its primary's generation held, an apply of step ``s`` finds exactly ``s``
    steps in the mirror's rows, and the mirror whose log a "replica" load names (``mirror_log``)
    walked to the count that load claims (and its own "promoted" line says)."""
    v: list[str] = []
    held, walked = _counts_held(files), {}
    for f in mirrors:
        who, done = f"the mirror of shard {k} ({f.path.name})", None
        for r in f.records:
            kind = r.get("event")
            if kind == "base":
                done, g = r["step"], r.get("primary_gen")
                if done not in (held.get(g, set()) if g is not None else set().union(*held.values())):
                    v.append(f"{who} took a base of {done} steps, which its primary (generation {g}) never held")
            elif kind == "apply":
                s = r["step"]
                if sorted(r["microbatches"]) != _expected(s, m):
                    v.append(f"{who} applied step {s} with microbatches {r['microbatches']}, not {_expected(s, m)}")
                if done is None:
                    v.append(f"{who} applied step {s} before it had a base")
                elif s < done:
                    v.append(f"{who} applied step {s} again: its rows held {done} steps")
                elif s > done:
                    v.append(f"{who} skipped steps {done}..{s - 1}: applied step {s} next")
                done = s + 1
            elif kind == "promoted" and r.get("step") != done:
                v.append(f"{who} was promoted claiming {r.get('step')} steps; its log holds {done}")
        walked[f.path.name] = done
    for f in files:
        for r in f.records:
            if r.get("event") != "load" or r.get("why") != "replica" or r.get("mirror_log") is None:
                continue
            name = r["mirror_log"]
            if name not in walked:
                v.append(f"shard {k} generation {f.gen}: the mirror that took its place left no log {name}")
            elif walked[name] != r["step"]:
                v.append(f"shard {k} generation {f.gen}: a mirror took its place claiming {r['step']} steps; "
                         f"its log ({name}) walks to {walked[name]}")
    return v


def walk_dense(trainers: list[AuditFile], m: int, total: int, killed: set[int]) -> list[str]:
    """The dense optimizer: one commit group per (step, quorum, lighthouse), its trainers' shares exactly
    the step's M microbatch ids; a group of step ``s`` finds ``s`` steps committed, or a
    rollback or resume to ``s`` since the previous group, or one of its trainers went on from its
    own load of ``s`` (a replacement that loaded the checkpoint while a lone trainer of the
    quorum before, about to die, committed its try of ``s``: every trainer died, that try with
    them, and the run went on from the checkpoint)."""
    v: list[str] = []
    groups: dict[tuple[int, int, str | None], list[dict]] = {}
    loads: list[dict] = []
    # A try a trainer logged committed before it learnt that a peer's vote had aborted it (its
    # own vote rode on its commit report): that trainer logged "aborted" and rejoined.
    aborted = {tuple(r["try"]) for f in trainers for r in f.records if r.get("event") == "aborted" and r.get("try")}
    for f in trainers:
        lighthouse = None  # quorum ids count per lighthouse: a new one counts from 1 again
        loaded = None  # the step of this trainer's load it has trained from since (a heal to it keeps it)
        for r in f.records:
            if r.get("event") == "open":
                lighthouse, loaded = r.get("lighthouse"), None
            elif r.get("event") == "commit":
                if tuple(r.get("try") or ()) not in aborted:
                    groups.setdefault((r["step"], r["quorum"], lighthouse), []).append({**r, "_file": f,
                                                                                         "_loaded": loaded})
                loaded = None
            elif r.get("event") == "load":
                loads.append(r)
                loaded = r["step"]
            elif r.get("event") == "heal" and r.get("step") != loaded:
                loaded = None
    order = sorted(groups.items(), key=lambda kv: min(c["t"] for c in kv[1]))
    loads.sort(key=lambda r: r["t"])
    done, li, last_t = 0, 0, float("-inf")
    for (step, quorum, _), commits in order:
        t = min(c["t"] for c in commits)
        since = []
        while li < len(loads) and loads[li]["t"] <= t:
            if loads[li]["t"] > last_t:
                since.append(loads[li]["step"])
            li += 1
        v += _check_group(step, quorum, commits, m, trainers, killed)
        if step < done:
            if step not in since and not any(c["_loaded"] == step for c in commits):
                v.append(f"dense step {step} committed again (quorum {quorum}) with no rollback or resume to it")
        elif step > done:
            v.append(f"dense steps {done}..{step - 1} never committed before step {step} (quorum {quorum})")
        done, last_t = step + 1, max(c["t"] for c in commits)
    if done != total:
        v.append(f"the dense model holds {done} committed steps at the end, the run has {total}")
    return v


def _check_group(step: int, quorum: int, commits: list[dict], m: int, trainers: list[AuditFile],
                 killed: set[int]) -> list[str]:
    v = []
    if any(c["total"] != m for c in commits):
        v.append(f"step {step} (quorum {quorum}) committed {[c['total'] for c in commits]} microbatches, not {m}")
    ids = sorted(i for c in commits for i in c["microbatches"])
    if len(ids) != len(set(ids)) or not set(ids) <= set(_expected(step, m)):
        v.append(f"step {step} (quorum {quorum}): the trainers' shares {ids} overlap or stray from {_expected(step, m)}")
    elif ids != _expected(step, m) and not _share_of_killed(step, commits, trainers, killed):
        v.append(f"step {step} (quorum {quorum}) committed microbatches {ids}, not all of {_expected(step, m)}")
    return v


def _share_of_killed(step: int, commits: list[dict], trainers: list[AuditFile], killed: set[int]) -> bool:
    """A share missing from a commit group is explained only by a trainer killed while it
    committed: a killed writer whose file ends holding exactly ``step`` committed steps (its
    last commit was the step before, or it had just healed, resumed or rolled back to it)."""
    ranks = {c["rank"] for c in commits}
    for f in trainers:
        if f.key in ranks or not set(f.writers()) & killed:
            continue
        held = None
        for r in f.records:
            if r.get("event") == "commit":
                held = r["step"] + 1
            elif r.get("event") in ("load", "heal"):
                held = r["step"]
        if held == step:
            return True
    return False


def applies_committed(shards: dict[int, list[AuditFile]], trainers: list[AuditFile]) -> list[str]:
    """A shard (or a mirror) applies a step only on a commit of its try: every apply of a step
    the trainers committed in a try names its try (generation, attempt), and one they committed
    (a try is one decision for every trainer; a step redone after a rollback commits again in
    another try, and any of its committed tries may be the one applied). A step no trainer's
    log says committed (every one killed before writing it) is not checked."""
    committed: dict[int, set[tuple[int, int]]] = {}
    for f in trainers:
        for r in f.records:
            if r.get("event") == "commit" and r.get("try") is not None:
                g, step, attempt = r["try"]
                committed.setdefault(step, set()).add((g, attempt))
    v = []
    for k, files in sorted(shards.items()):
        for f in files:
            who = f"the mirror of shard {k} ({f.path.name})" if f.kind == "mirror" else f"shard {k}"
            for r in f.records:
                if r.get("event") != "apply" or r["step"] not in committed:
                    continue
                tries = sorted(committed[r["step"]])
                if r.get("try") is None:
                    v.append(f"{who} applied step {r['step']} naming no try; the trainers committed it in {tries}")
                elif tuple(r["try"]) not in committed[r["step"]]:
                    v.append(f"{who} applied step {r['step']} of try {tuple(r['try'])}, which no trainer committed "
                             f"(committed: {tries})")
    return v


def torn_lines(files: list[AuditFile], killed: set[int]) -> list[str]:
    """A torn line is accepted only as the last line its writer wrote (the end of the file,
    or the line before the next writer's "open"), and only if that writer was killed."""
    v = []
    for f in files:
        opens = sorted((r["_line"], r.get("pid")) for r in f.records if r.get("event") == "open")
        for line, text in f.torn:
            writer = next((pid for at, pid in reversed(opens) if at < line), None)
            if writer is None and f.kind == "trainer":
                writer = f.writers()[0]
            following = [at for at, _ in opens if at > line]
            last_of_writer = line == f.lines or (following and following[0] == line + 1)
            if not last_of_writer:
                v.append(f"{f.path.name} line {line} does not parse and is not its writer's last: {text[:80]!r}")
            elif writer not in killed:
                v.append(f"{f.path.name} line {line} is torn but its writer (pid {writer}) was not killed: {text[:80]!r}")
    return v
