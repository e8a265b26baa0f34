"""``summary.txt``: a run's report in a dozen lines for people, from a finished run's report
or one rebuilt from a crashed run's files (``app.rebuild``).
"""

from __future__ import annotations

__all__ = ["format_summary"]


def format_summary(report: dict) -> str:
    """The run in a dozen lines. Works for a full report and for one rebuilt from the files of
    a run that did not finish (unknown numbers read ``n/a``)."""
    lines = _overview(report) + _emulation(report) + _trainers(report) + _shard_failures(report)
    # What became of the run goes right under its name.
    lines[1:1] = _outcome(report)
    return "\n".join(lines)


def _fmt(value, spec: str, unit: str = "", missing: str = "n/a") -> str:
    if value is None:
        return missing
    text = format(value, spec)
    # A duration of a few microseconds below zero (two clocks) is zero, not "-0.0".
    return (text[1:] if text.startswith("-") and not text.strip("-0.,") else text) + unit


def _decision(decision: dict) -> tuple[str, str]:
    """A recovery decision's reason as (why, the cost model's numbers): the policy writes
    ``"<why> (<numbers>)"``; the numbers go on a line of their own."""
    reason = decision.get("reason") or decision.get("mode") or ""
    why, sep, numbers = reason.rpartition(" (full: ")
    if not sep or not numbers.endswith(")"):
        return reason, ""
    return why, "full: " + numbers[:-1]


def _modes(report: dict) -> str:
    used = (report.get("recovery") or {}).get("used") or []
    return ", ".join(f"{m} recovery" for m in used) if used else "no recovery needed"


def _data_line(data: dict | None) -> str:
    if not data:
        return "  categorical ids   unknown (no data section)"
    how = "hash (id mod table rows)" if data["mapping"] == "hash" else f"vocabulary (values seen >= {data['min_count']} times)"
    rows = data["table_rows"]
    build = (data.get("preprocessing") or {}).get("train") or {}
    made = "reused" if data.get("reused") else (f"preprocessed on {build.get('engine')} at {build.get('rows_per_s', 0):,.0f} rows/s"
                                              if build else "")
    return (f"  categorical ids   {how}: {sum(rows):,} embedding rows in {len(rows)} tables "
            f"({min(rows):,}..{max(rows):,}); store {made}")


def _overview(report: dict) -> list[str]:
    """The run's name, then one line each: quality, samples, bad lines, failures, failed saves
    (if any), recovery, overhead and wall time."""
    w = report.get("wall_time_s") or {}
    ceiling = report.get("ceiling_auc")
    policy = report.get("checkpoint_policy") or {}
    overhead_pct = report.get("overhead_pct_of_wall") or {}
    samples = report.get("samples_trained")
    return [
        f"run {report.get('run_id')}",
        (
            f"  held-out AUC      {report['auc']:.4f}"
            + (f"  ({report['auc_fraction_of_ceiling']:.1%} of the generator's ceiling {ceiling:.4f})" if ceiling else "")
            + f"\n  held-out log loss {report['log_loss']:.4f}  on {report['eval_rows']:,} rows"
            if report.get("auc") is not None
            else "  held-out AUC      not evaluated (the run stopped before its end)"
        ),
        f"  samples trained   {_fmt(samples, ',', missing='unknown (no config)')} in {report.get('steps')} steps"
        + (f"  ({report['samples_per_s']:,.0f} samples/s)" if report.get("samples_per_s") else ""),
        f"  bad lines skipped {_fmt(report.get('bad_lines_skipped'), '')}",
        _data_line(report.get("data")),
        f"  failures          {len(report.get('failures') or [])} shard ({_modes(report)}), "
        f"{len(report.get('faults_injected') or [])} kills injected, {report.get('supervisor_restarts') or 0} supervisor restarts, "
        f"PLS {_fmt(report.get('pls'), '.5f')} ({report.get('lost_samples') or 0:,.0f} samples' updates lost), "
        f"{report.get('checkpoints_saved', 0)} checkpoints ({report.get('incremental_checkpoints', 0)} incremental, "
        f"policy {_fmt(policy.get('policy'), '')}, every {_fmt(policy.get('interval_steps'), '')} steps"
        + (f", expected PLS {policy['expected_pls']:.5f}" if policy.get("expected_pls") is not None else "")
        + ")",
        *_failed_saves(report),
        f"  recovery          requested {(report.get('recovery') or {}).get('requested') or 'n/a'}; used {_modes(report)}",
        "  overhead          "
        + ", ".join(f"{k.replace('_', ' ')} {_fmt(v, '.2f', '%')}" for k, v in overhead_pct.items())
        + " of wall time"
        + (
            f" (saves held training {split['training_path']:.2f}s; wrote for {split['background']:.2f}s in the background)"
            if (split := report.get("save_split_s"))
            else ""
        ),
        f"  wall time         data {_fmt(w.get('data_prep_s'), '.1f', 's')}, startup {_fmt(w.get('startup_s'), '.1f', 's')}, "
        f"training {_fmt(w.get('training_s'), '.1f', 's')}, evaluation {_fmt(w.get('evaluation_s'), '.1f', 's')}, "
        f"total {_fmt(w.get('total_s'), '.1f', 's')}",
    ]


def _failed_saves(report: dict) -> list[str]:
    """A line for the checkpoint saves that failed, only when some did."""
    failed = report.get("failed_saves") or {}
    if not failed.get("failed"):
        return []
    return [f"  failed saves      {failed['failed']} checkpoint saves failed (at most {failed['longest_in_a_row']} in a "
            "row); training went on, each retried after a backoff"]


def _emulation(report: dict) -> list[str]:
    """The emulated production clock's line, for a run that had one."""
    emu = report.get("emulation")
    if not emu:
        return []
    return [
        f"  emulated          {emu['params']['duration_h']:g} h on {emu['params']['nodes']} hosts (job MTBF "
        f"{emu['mtbf_s'] / 3600:.1f} h, {emu['step_s']:.0f} s a step); {emu['recovery']} recovery, checkpoint every "
        f"{emu['every_steps']} steps ({emu['interval_s'] / 3600:.2f} h); {len(emu['kills'])} failures; overhead "
        f"{emu['overhead_total_pct']:.2f}% of failure-free time ("
        + ", ".join(f"{k.replace('_', ' ')} {v:.2f}%" for k, v in emu["overhead_pct"].items())
        + f"; first-order model {emu['expected_overhead_pct']:.2f}%)"
    ]


def _trainers(report: dict) -> list[str]:
    """Trainer failures, the hosts lost, the rollbacks after every trainer died, then one
    line per killed trainer."""
    lines = []
    trainer_failures = report.get("trainer_failures") or []
    if trainer_failures:
        lines.append(
            f"  trainer failures  {len(trainer_failures)}; {_fmt(report.get('steps_with_fewer_trainers'), '')} steps ran "
            f"with fewer trainers; microbatches per committed step {_fmt(report.get('microbatches_per_committed_step'), '')}"
        )
    for h in report.get("hosts_lost") or []:
        lines.append(
            f"  host lost         {h['node_ip']} with {', '.join(h['actors']) or 'none of this run'}; Ray declared "
            "its node dead "
            + (f"{h['declared_dead_s']:.2f}s after it stopped answering" if h.get("declared_dead_s") is not None
               else "(no failed probe before that)")
        )
    unprotected = (report.get("mirrors") or {}).get("unprotected_at_start")
    if unprotected:
        lines.append(f"  mirrors           shards {unprotected} had no mirror in sync when training started (recovered "
                     "from a checkpoint until one was built)")
    for e in report.get("all_trainers_failed") or []:
        lines.append(
            f"    every trainer died: dense state and shards fell back to checkpoint step {e['fallback_step']} "
            f"({e['steps_lost']} steps redone)"
        )
    for t in trainer_failures:
        # A rebuilt report lacks the commits that time a detection; a full one lacks it only
        # when no trainer survived to notice.
        detect = _fmt(t.get("detection_s"), "", "s", "n/a" if report.get("rebuilt") else "n/a (no survivor)")
        lost = f" (lost with its {t['cause'][:-5]})" if (t.get("cause") or "").startswith("host ") else ""
        lines.append(
            f"    {t['actor']}{lost}: detected {detect}, {_fmt(t.get('steps_with_fewer_trainers'), '')} steps with fewer "
            f"trainers, replacement back after {_fmt(t.get('rejoined_s'), '', 's')} (state from a peer in "
            f"{_fmt(t.get('heal_s'), '', 's')}), joined at step {_fmt(t.get('replacement_joined_at_step'), '')}"
        )
    return lines


def _shard_failures(report: dict) -> list[str]:
    """One line per shard failure, and the cost model's numbers where its decision had them."""
    lines = []
    for f in report.get("failures") or []:
        detect = f"{f['detection_s']:.2f}s" if f.get("detection_s") is not None else "n/a"
        why, numbers = _decision(f.get("decision") or {})
        how = f"spare {f['spare']} adopted" if f.get("spare") else "new process"
        lines.append(
            f"    {f['actor']}: {f['recovery']} recovery ({why}), detected {detect}, {how} in "
            f"{_fmt(f.get('adoption_s', f.get('reschedule_s')), '.2f', 's')}, loaded in {_fmt(f.get('load_s'), '.2f', 's')}, "
            f"serving {_fmt(f.get('serving_s'), '.2f', 's')} after the kill; "
            f"recovered in {f['recovery_s']:.2f}s from step {f['restored_step']} (redone from {_fmt(f.get('failed_at_step'), '')}), "
            f"{f['rows_reloaded']:,} rows / {f['bytes_reloaded'] / 1e6:,.1f} MB reloaded, "
            f"{_fmt(f.get('lost_samples'), ',.0f', missing='uncounted')} lost samples"
        )
        if numbers:
            lines.append(f"      cost model: {numbers}")
    return lines


def _outcome(report: dict) -> list[str]:
    """The lines that say the run did not end normally: crashed (with what the rebuild read
    and missed), interrupted, or stopped by the supervisor; none for a run that finished."""
    state = report.get("state") or {}
    rebuilt = report.get("rebuilt")
    if rebuilt:
        notes = [
            "  CRASHED: the run did not finish (no report.json: its driver was killed, or it is still running); "
            f"rebuilt from {', '.join(rebuilt['from'])}",
            f"  last record       {_fmt(rebuilt.get('last_record_s'), '.1f', 's')} after the run began, "
            f"step {report.get('steps')} of {_fmt(rebuilt.get('total_steps'), '')}, "
            f"supervisor state {state.get('state') or 'unknown'}",
        ]
        return notes + [f"  note: {n}" for n in rebuilt.get("notes", [])]
    if report.get("interrupted"):
        return ["  INTERRUPTED: stopped by a signal; continue with cpr train --resume"]
    if state.get("state") == "failed":
        return [f"  STOPPED: {state.get('reason')}"]
    return []
