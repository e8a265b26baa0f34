"""What a person watching a run sees: one line per event that matters (checkpoints,
failures, recoveries, decisions), and a progress bar (step, samples/s, loss, live trainers)."""

from __future__ import annotations

import threading

import ray
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

from actors.client import SupervisorClient
from app.tallies import hosts_lost

__all__ = ["format_event", "progress_loop"]

_POLL_ERRORS = (ray.exceptions.RayError, TimeoutError)


def format_event(e: dict) -> str | None:
    """One line for the events a person watching the run cares about, else None."""
    kind = e["kind"]
    if kind == "shard_recovered":
        detect = f"detected in {e['detection_s']:.2f}s, " if e.get("detection_s") is not None else ""
        spare = e.get("spare")
        how = f"spare {spare.rsplit('-', 1)[-1]} adopted" if spare else "new process"
        serving = f"; serving {e['serving_s']:.2f}s after the kill" if e.get("serving_s") is not None else ""
        return (
            f"[failure] {e['actor']} died ({e['cause']}); {detect}{e['recovery']} recovery from step "
            f"{e['restored_step']} in {e['recovery_s']:.2f}s ({how} in {e['reschedule_s']:.2f}s, load "
            f"{e['load_s']:.2f}s{serving}), {e['rows_reloaded']:,} rows reloaded"
        )
    if kind == "lost_samples_counted":
        # first_step is when this incarnation of the shard went live, not where the loss began.
        return f"[failure] {e['actor']}: {e['lost_samples']:,.0f} samples' updates lost (failed at step {e['failed_at_step']})"
    if kind == "state_changed" and e["state"] == "failed":
        return f"[stopped] {e['reason']}"
    if kind == "fault_injected":
        return f"[chaos] killing {e['target']} (pid {e['pid']}, {e['trigger']})"
    if kind == "trainer_healed":
        return f"[failure] trainer:{e['rank']} replaced by Ray Train; healed from a live peer in {e['heal_s']:.2f}s, training again from step {e['step']}"
    if kind == "all_trainers_failed":
        return f"[failure] every trainer died; dense state and shards fell back to checkpoint step {e['fallback_step']}"
    if kind == "trainer_group_restarted":
        return f"[failure] Ray Train's controller gave up ({e['reason']}); trainers started again (attempt {e['attempt']})"
    if kind == "supervisor_restarted":
        return f"[failure] supervisor restarted; rebuilt its state in {e['rebuilt_s']:.2f}s from step {e['last_checkpoint_step']}"
    if kind == "checkpoint_saved":
        what = "final, full" if e.get("final") else e.get("checkpoint_kind", "full")
        background = f", written in the background in {e['background_s']:.2f}s" if "background_s" in e else ""
        return (
            f"[checkpoint] step {e['step']} ({what}): {e['bytes'] / 1e6:,.1f} MB, held training "
            f"{e['duration_s']:.2f}s{background}"
        )
    if kind == "checkpoint_failed":
        again = f"trying again at step {e['retry_step']}" if e.get("retry_step") is not None else "saving again later"
        in_a_row = f", {e['failed_in_a_row']} failed in a row" if e.get("failed_in_a_row") else ""
        return f"[checkpoint] step {e['step']} not saved ({e['error']}); abandoned{in_a_row}, {again}"
    if kind == "host_lost":
        (h,) = hosts_lost([e])
        after = f" {h['declared_dead_s']:.2f}s after it stopped answering" if h["declared_dead_s"] is not None else ""
        return (f"[failure] host {h['node_ip']} lost, with {', '.join(h['actors']) or 'none of this run'}; "
                f"Ray declared its node dead{after}")
    if kind == "mirrors_missing":
        return (f"[mirrors] training starts without a mirror in sync for shards {e['shards']}: until one is built, "
                "their recovery is from a checkpoint (lost samples counted)")
    if kind == "spare_moved":
        return f"[spares] the warm spare moved to host {e['to_ip']}, which holds no shard ({e['to'].rsplit('-', 1)[-1]})"
    if kind == "spare_lost":
        return f"[failure] warm spare {e['spare']} died ({e['cause']}); starting another"
    if kind == "shard_initial_rows":
        return f"[checkpoint] shard {e['shard']} starts from its initial rows: {e['reason']}"
    if kind == "checkpoint_fallback":
        return f"[checkpoint] step {e['step']} refused ({e['reason']}); using an older valid checkpoint"
    if kind == "interval_changed":
        return (
            f"[decision] checkpoint every {e['interval_steps']} steps ({e['interval_s']:.1f}s, {e['mode']} recovery "
            f"expected, MTBF {e['mtbf_s']:.0f}s): {e['reason']}"
        )
    if kind == "plan_changed":
        return (f"[plan] {e['why']} on {e['shards']} {e['sharding']} shards (plan generation {e['generation']}) from "
                f"{e['previous_shards']} {e['previous_sharding']} at checkpoint step {e['step']}: {e['rows_moved']:,} "
                f"rows ({e['bytes_moved'] / 1e6:,.1f} MB with their optimizer state) read from other shards' files")
    if kind == "replacement_joined":
        return f"[failure] trainer:{e['rank']}'s replacement joined the live trainers at step {e['step']}"
    if kind == "recovery_error":
        return f"[failure] recovery attempt {e['attempt']} failed in {e['state']}: {e['error']}; trying again"
    return None


def progress_loop(supervisor: SupervisorClient, stop: threading.Event, total_steps: int, show_bar: bool,
                  header: str = "") -> None:
    """Until ``stop``: the event lines as they come, and the progress bar (``show_bar``)."""
    seen = 0
    if header:
        Console(highlight=False).print(header, markup=False, soft_wrap=True)

    def new_events(print_line) -> None:
        nonlocal seen
        try:
            events = supervisor.events_since(seen)
        except _POLL_ERRORS:  # the supervisor may be restarting; the next poll catches up
            return
        seen += len(events)
        for e in events:
            line = format_event(e)
            if line:
                print_line(line)

    if not show_bar:
        console = Console(highlight=False)

        def say(line: str) -> None:
            console.print(line, markup=False, soft_wrap=True)

        while not stop.wait(1.0):
            new_events(say)
        new_events(say)
        return

    columns = (
        TextColumn("[bold]train"),
        BarColumn(),
        TextColumn("step {task.completed}/{task.total}"),
        TextColumn("{task.fields[rate]} samples/s  loss {task.fields[loss]}  trainers {task.fields[trainers]}"),
        TimeElapsedColumn(),
    )
    with Progress(*columns, transient=False) as bar:
        task = bar.add_task("train", total=total_steps, rate="-", loss="-", trainers="-")
        while not stop.wait(1.0):
            new_events(lambda line: bar.console.print(line, highlight=False, markup=False, soft_wrap=True))
            try:
                p = supervisor.progress()
            except _POLL_ERRORS:  # the supervisor may be restarting; the next poll retries
                continue
            if p:
                bar.update(
                    task,
                    completed=p.step,
                    rate=f"{p.samples_per_s:,.0f}",
                    loss=f"{p.loss:.4f}",
                    trainers=p.trainers,
                )
        new_events(lambda line: bar.console.print(line, highlight=False, markup=False, soft_wrap=True))
