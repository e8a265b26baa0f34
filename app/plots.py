"""The run's pictures, drawn into its run directory: ``timeline.png`` (loss and samples/s
over wall time, with kills, recoveries, rollbacks and checkpoints marked) and
``overhead.png`` (where the wall time went, and what fault tolerance cost).

Drawn with matplotlib's object API on the Agg canvas: no pyplot, no display, no global state,
so a report can be rendered from any thread of a job.
"""

from __future__ import annotations

from pathlib import Path

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.patches import Patch

__all__ = ["write_plots", "draw_timeline", "draw_overhead", "TIMELINE_FILE", "OVERHEAD_FILE"]

TIMELINE_FILE = "timeline.png"
OVERHEAD_FILE = "overhead.png"

_DPI = 110
_KILL = "tab:red"
_SHARD_RECOVERY = "tab:red"
_TRAINER_HEAL = "tab:orange"
_SUPERVISOR = "tab:brown"
_ROLLBACK = "tab:purple"
_CHECKPOINT = "tab:green"
_CHECKPOINT_FAILED = "tab:olive"
# Kill labels beyond this many overlap into a smear; the markers alone still count them.
_MAX_KILL_LABELS = 12
_STRIP_ROWS = ("checkpoints", "kills", "recoveries", "rollbacks")
_ROW = {name: i for i, name in enumerate(_STRIP_ROWS)}


def write_plots(run_dir: str | Path, report: dict) -> list[Path]:
    """Draws both pictures of ``report`` into ``run_dir``; returns the files written."""
    written = []
    for name, draw in ((TIMELINE_FILE, draw_timeline), (OVERHEAD_FILE, draw_overhead)):
        path = Path(run_dir) / name
        fig = draw(report)
        FigureCanvasAgg(fig)
        fig.savefig(path, dpi=_DPI)
        written.append(path)
    return written


def _status(report: dict) -> str:
    if report.get("rebuilt"):
        return "did not finish (rebuilt from its files)"
    if report.get("interrupted"):
        return "interrupted"
    state = (report.get("state") or {}).get("state")
    return "stopped early" if state == "failed" else "finished"


def _origin(events: list[dict], progress: list[dict]) -> float | None:
    """Time zero of the timeline: the run's first event or progress record."""
    times = [e["time"] for e in events if e.get("time") is not None]
    times += [p["time"] for p in progress if p.get("time") is not None]
    return min(times) if times else None


def _kill_time(e: dict) -> float:
    return e.get("at") if e.get("at") is not None else e["time"]


def _recovery_spans(events: list[dict]) -> list[tuple[float, float, str, str]]:
    """``(start, end, colour, kind)`` of each recovery: from the kill (where known) to the
    moment the run had its actor back."""
    kills = [e for e in events if e["kind"] == "fault_injected"]

    def last_kill(target: str, before: float) -> float | None:
        times = [_kill_time(k) for k in kills if k.get("target") == target and _kill_time(k) <= before]
        return max(times) if times else None

    spans = []
    for e in events:
        end = e["time"]
        if e["kind"] == "shard_recovered":
            start = next(
                (e[k] for k in ("killed_at", "detected_at") if e.get(k) is not None),
                end - (e.get("recovery_s") or 0.0),
            )
            spans.append((start, end, _SHARD_RECOVERY, "shard"))
        elif e["kind"] == "trainer_healed":
            start = last_kill(f"trainer:{e.get('rank')}", end)
            spans.append((start if start is not None else end - (e.get("heal_s") or 0.0), end, _TRAINER_HEAL, "trainer"))
        elif e["kind"] == "supervisor_restarted":
            start = last_kill("supervisor", end)
            if start is None:
                start = end - (e.get("detection_s") or 0.0) - (e.get("rebuilt_s") or 0.0)
            spans.append((start, end, _SUPERVISOR, "supervisor"))
    return spans


def draw_timeline(report: dict) -> Figure:
    """Training loss and samples/s over wall time; below them a strip of what happened."""
    events = sorted((e for e in report.get("events") or [] if e.get("time") is not None), key=lambda e: e["time"])
    progress = sorted((p for p in report.get("progress") or [] if p.get("time") is not None), key=lambda p: p["time"])
    t0 = _origin(events, progress) or 0.0

    fig = Figure(figsize=(11, 7), layout="constrained")
    loss_ax, rate_ax, strip = fig.subplots(3, 1, sharex=True, gridspec_kw={"height_ratios": [3, 3, 1.6]})
    fig.suptitle(f"run {report.get('run_id', '?')}: {_status(report)}")
    # Legend entries in the order they are drawn; one per kind of mark.
    handles: dict[str, object] = {}
    _plot_progress(loss_ax, rate_ax, progress, t0, handles)
    curves = (loss_ax, rate_ax)
    _mark_recoveries(curves, strip, events, t0, handles)
    _mark_kills(curves, strip, events, t0, handles)
    _mark_rollbacks(curves, strip, events, t0, handles)
    _mark_checkpoints(strip, events, t0, handles)
    _mark_training_span(curves, strip, events, t0, handles)

    strip.set_yticks(range(len(_STRIP_ROWS)), _STRIP_ROWS, fontsize=8)
    strip.set_ylim(-0.6, len(_STRIP_ROWS) - 0.2)
    strip.invert_yaxis()
    strip.set_xlim(left=0)
    strip.set_xlabel("seconds since the run's first event")
    for ax in (loss_ax, rate_ax, strip):
        ax.grid(axis="x", alpha=0.3)
    if handles:
        fig.legend(list(handles.values()), list(handles), loc="outside lower center", ncols=min(len(handles), 4), fontsize=8)
    return fig


def _plot_progress(loss_ax, rate_ax, progress: list[dict], t0: float, handles: dict) -> None:
    """The loss and samples/s curves, and the live trainers on a second axis of the latter."""
    xs = [p["time"] - t0 for p in progress]
    loss = [(x, p["loss"]) for x, p in zip(xs, progress) if p.get("loss") is not None]
    rate = [(x, p["samples_per_s"]) for x, p in zip(xs, progress) if p.get("samples_per_s") is not None]
    if loss:
        loss_ax.plot(*zip(*loss), color="tab:blue", marker=".", lw=1.4)
    else:
        loss_ax.text(0.5, 0.5, "no progress records", transform=loss_ax.transAxes, ha="center", color="gray")
    if rate:
        rate_ax.plot(*zip(*rate), color="tab:cyan", marker=".", lw=1.4)
    loss_ax.set_ylabel("training loss")
    rate_ax.set_ylabel("samples/s")
    rate_ax.set_ylim(bottom=0)
    trainers = [(x, p["trainers"]) for x, p in zip(xs, progress) if p.get("trainers") is not None]
    if trainers:
        twin = rate_ax.twinx()
        twin.step(*zip(*trainers), where="post", color="gray", ls=":", lw=1.2)
        twin.set_ylabel("live trainers", color="gray")
        twin.set_ylim(0, max(n for _, n in trainers) + 1)
        twin.yaxis.get_major_locator().set_params(integer=True)
        handles["live trainers"] = Line2D([], [], color="gray", ls=":")


def _mark_recoveries(curves: tuple, strip, events: list[dict], t0: float, handles: dict) -> None:
    """Each recovery shaded over the curves and as a bar on the strip."""
    # Shard, trainer and supervisor recoveries overlap in time: each gets its own lane.
    lane = {"shard": -0.25, "trainer": 0.0, "supervisor": 0.25}
    for start, end, colour, kind in _recovery_spans(events):
        for ax in curves:
            ax.axvspan(start - t0, end - t0, color=colour, alpha=0.12, lw=0)
        strip.broken_barh([(start - t0, max(end - start, 0.0))], (_ROW["recoveries"] + lane[kind] - 0.12, 0.24),
                          color=colour, alpha=0.7)
        handles[f"{kind} recovery (kill to back)"] = Patch(color=colour, alpha=0.35)


def _mark_kills(curves: tuple, strip, events: list[dict], t0: float, handles: dict) -> None:
    """Each kill as a dashed line over the curves and a labelled cross on the strip."""
    kills = [e for e in events if e["kind"] == "fault_injected"]
    for e in kills:
        x = _kill_time(e) - t0
        for ax in curves:
            ax.axvline(x, color=_KILL, ls="--", lw=0.9, alpha=0.8)
        strip.plot([x], [_ROW["kills"]], marker="x", color=_KILL, ms=7, mew=2)
        if len(kills) <= _MAX_KILL_LABELS:
            strip.annotate(str(e.get("target", "")), (x, _ROW["kills"]), xytext=(3, 4),
                           textcoords="offset points", fontsize=7, color=_KILL)
    if kills:
        handles["kill (fault injected)"] = Line2D([], [], color=_KILL, ls="--", marker="x")


def _mark_rollbacks(curves: tuple, strip, events: list[dict], t0: float, handles: dict) -> None:
    """Each rollback over the curves, and on the strip with the step it went back to."""
    rollbacks = {
        "all_trainers_failed": ("rollback (every trainer died)", "-", "fallback_step"),
        "checkpoint_fallback": ("checkpoint fallback", ":", "step"),
        "trainer_group_restarted": ("trainer group restarted", "-.", "step"),
    }
    for i, e in enumerate(e for e in events if e["kind"] in rollbacks):
        label, style, step_key = rollbacks[e["kind"]]
        x = e["time"] - t0
        for ax in curves:
            ax.axvline(x, color=_ROLLBACK, ls=style, lw=1.5)
        strip.plot([x], [_ROW["rollbacks"]], marker="v", color=_ROLLBACK, ms=7)
        if e.get(step_key) is not None:
            # Alternately above and below the marker, so neighbours do not overprint.
            strip.annotate(f"to step {e[step_key]}", (x, _ROW["rollbacks"]), xytext=(4, 5 if i % 2 == 0 else -11),
                           textcoords="offset points", fontsize=7, color=_ROLLBACK)
        handles[label] = Line2D([], [], color=_ROLLBACK, ls=style, marker="v")


def _mark_checkpoints(strip, events: list[dict], t0: float, handles: dict) -> None:
    """Checkpoints saved and failed, on the strip."""
    saved = [e["time"] - t0 for e in events if e["kind"] == "checkpoint_saved"]
    failed = [e["time"] - t0 for e in events if e["kind"] == "checkpoint_failed"]
    if saved:
        strip.plot(saved, [_ROW["checkpoints"]] * len(saved), ls="", marker="|", ms=12, mew=1.5, color=_CHECKPOINT)
        handles["checkpoint saved"] = Line2D([], [], ls="", marker="|", ms=10, mew=1.5, color=_CHECKPOINT)
    if failed:
        strip.plot(failed, [_ROW["checkpoints"]] * len(failed), ls="", marker="x", ms=7, color=_CHECKPOINT_FAILED)
        handles["checkpoint failed"] = Line2D([], [], ls="", marker="x", color=_CHECKPOINT_FAILED)


def _mark_training_span(curves: tuple, strip, events: list[dict], t0: float, handles: dict) -> None:
    """The start and end of training on every axis, and the startup before it shaded."""
    for kind in ("training_started", "training_finished"):
        for e in (e for e in events if e["kind"] == kind):
            x = e.get("wall_time", e["time"]) - t0
            for ax in (*curves, strip):
                ax.axvline(x, color="black", ls=":", lw=0.9)
            handles["training start / end"] = Line2D([], [], color="black", ls=":")
            if kind == "training_started" and x > 0:
                for ax in curves:
                    ax.axvspan(0, x, color="gray", alpha=0.08, lw=0)
                handles["startup (before the first step)"] = Patch(color="gray", alpha=0.2)


def _seconds(value) -> str:
    return "n/a" if value is None else f"{value:.2f} s"


def draw_overhead(report: dict) -> Figure:
    """Left: wall time by phase, and the training phase split into fault-tolerance overhead
    and the rest. Right: each overhead in seconds and in percent of wall time."""
    wall = report.get("wall_time_s") or {}
    overhead = report.get("overhead_s") or {}
    pct = report.get("overhead_pct_of_wall") or {}
    fig = Figure(figsize=(12, 4.8), layout="constrained")
    split_ax, bars_ax = fig.subplots(1, 2, gridspec_kw={"width_ratios": [1.15, 1]})
    total = wall.get("total_s")
    fig.suptitle(f"run {report.get('run_id', '?')}: {_status(report)}; wall time {_seconds(total)}")

    phases = [(name, wall.get(f"{key}_s")) for key, name in (
        ("data_prep", "data prep"), ("startup", "startup"), ("training", "training"), ("evaluation", "evaluation"))]
    known = {k: v for k, v in overhead.items() if v is not None}
    training = wall.get("training_s")
    rest = [("training less overhead", max(training - sum(known.values()), 0.0))] if training is not None else []
    rows = [("wall time", phases), ("training", [(k.replace("_", " "), v) for k, v in known.items()] + rest)]
    colours = {name: f"C{i}" for i, (name, _) in enumerate(phases)}
    colours.update({k.replace("_", " "): f"C{i + 4}" for i, k in enumerate(overhead)})
    colours["training less overhead"] = colours["training"]
    handles = {}
    for y, (label, segments) in enumerate(rows):
        left = 0.0
        for name, value in segments:
            if not value:
                continue
            bar = split_ax.barh(y, value, left=left, color=colours[name], edgecolor="white",
                                hatch="//" if name == "training less overhead" else None)
            handles.setdefault(name, bar)
            if total and value / total > 0.08:
                split_ax.text(left + value / 2, y, f"{value:.1f} s", ha="center", va="center", fontsize=8,
                              bbox={"facecolor": "white", "alpha": 0.75, "lw": 0, "pad": 1})
            left += value
    split_ax.set_yticks(range(len(rows)), [label for label, _ in rows])
    split_ax.invert_yaxis()
    split_ax.set_xlabel("seconds")
    split_ax.set_title("where the wall time went", fontsize=10)
    missing = [name for name, value in phases if value is None]
    if missing:
        split_ax.text(0.99, 0.02, "unknown: " + ", ".join(missing), transform=split_ax.transAxes,
                      ha="right", fontsize=8, color="gray")
    if handles:
        split_ax.legend(list(handles.values()), list(handles), fontsize=7, loc="upper center",
                        bbox_to_anchor=(0.5, -0.18), ncols=4)

    names = list(overhead)
    values = [overhead[k] or 0.0 for k in names]
    bars_ax.barh(range(len(names)), values, color=[colours[k.replace("_", " ")] for k in names])
    for y, k in enumerate(names):
        text = _seconds(overhead[k]) + (f"  ({pct[k]:.2f}% of wall)" if pct.get(k) is not None else "")
        bars_ax.text(values[y], y, " " + text, va="center", fontsize=8)
    bars_ax.set_yticks(range(len(names)), [k.replace("_", " ") for k in names])
    bars_ax.invert_yaxis()
    bars_ax.set_xlim(0, max(values + [1e-3]) * 1.6)
    bars_ax.set_xlabel("seconds")
    share = sum(v for v in pct.values() if v is not None)
    bars_ax.set_title(f"fault-tolerance overhead: {sum(values):.2f} s, {share:.1f}% of wall time", fontsize=10)
    if not names:
        bars_ax.text(0.5, 0.5, "no overhead recorded", transform=bars_ax.transAxes, ha="center", color="gray")
    return fig
