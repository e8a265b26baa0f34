"""The ``cpr`` command line (also ``python -m app``): datagen, train, emulate, report, export, chaos, soak, verify,
config-docs."""

from __future__ import annotations

import json
import logging
import os
import sys
import threading
import time
from pathlib import Path

import click

from app.overrides import parse_set as _parse_set
from core.errors import ConfigError, CprError

__all__ = ["main"]

# Each command imports its own modules when it runs. All of them at load would take `cpr --help`
# from 0.06 s to 0.36 s (measured, 2-core machine, cold), and those of train, emulate, chaos,
# soak and export go on to import Ray or torch, which --help, config-docs and report never load.
# The cost noted at each import is that module's alone, measured over this one's.


@click.group(context_settings={"max_content_width": 120, "help_option_names": ["-h", "--help"]},
             epilog="`cpr COMMAND --help` tells more. The guide: docs/USER_GUIDE.md.")
@click.option("-v", "--verbose", is_flag=True, help="Log at INFO level; `train` also shows every worker's output.")
def main(verbose: bool) -> None:
    """Fault-tolerant training of DLRM recommendation models on Ray: embedding tables sharded over
    Ray actors, the dense model replicated over Ray Train trainers, and training that goes on
    when either dies."""
    logging.basicConfig(level=logging.INFO if verbose else logging.WARNING, format="%(levelname)s %(name)s: %(message)s")


@main.command(short_help="Write synthetic Criteo-format data.")
@click.option("--rows", type=click.IntRange(1), required=True, help="Training rows.")
@click.option("--eval-rows", type=click.IntRange(1), default=None, help="Held-out rows (default rows/10).")
@click.option("--out", type=click.Path(file_okay=False), required=True, help="Output directory.")
@click.option("--format", "fmt", type=click.Choice(["tsv", "tsv.gz", "parquet"]), default="tsv")
@click.option("--seed", type=click.IntRange(0), default=0)
@click.option("--vocab-rows", type=click.IntRange(2), default=100_000, help="Distinct values per feature.")
def datagen(rows: int, eval_rows: int | None, out: str, fmt: str, seed: int, vocab_rows: int) -> None:
    """Writes deterministic synthetic Criteo-format data (train + eval files and datagen.json)
    into OUT; never over a file that exists there."""
    from core.data.synthetic import targets, write_missing  # import cost: 0.13 s (numpy, pyarrow), see the top

    there = [p for p in targets(out, fmt) if os.path.exists(p)]
    if there:
        raise ConfigError(f"--out {out}: {there[0]} exists; cpr datagen writes only new files: choose another "
                          "--out, or remove the files there")
    s = write_missing(out, {"train_rows": rows, "eval_rows": eval_rows or max(1, rows // 10), "seed": seed,
                            "format": fmt, "vocab_rows": vocab_rows})
    click.echo(f"wrote {s['train_rows']:,} rows to {s['train_path']} and {s['eval_rows']:,} rows to {s['eval_path']}")
    click.echo(f"positive rate {s['positive_rate']:.3f}; ceiling AUC of the hidden model {s['ceiling_auc']:.4f}")


@main.command(short_help="Train: a config, or --resume a run.")
@click.option("--config", "config_path", type=click.Path(dir_okay=False), default=None, help="YAML run config.")
@click.option("--resume", "resume_dir", type=click.Path(file_okay=False), default=None,
              help="Continue the run in RUN_DIR from its last valid checkpoint.")
@click.option("--set", "sets", multiple=True, help="Override a field, e.g. --set training.epochs=2")
@click.option("--skip-bad-lines", is_flag=True, help="Count and skip malformed data lines.")
@click.option("--verify-data", is_flag=True,
              help="Read every input byte again before reusing a preprocessed store (data.verify_data).")
@click.option("--no-progress", is_flag=True, help="Do not show the progress display.")
@click.option("-v", "--verbose", is_flag=True,
              help="Also show Ray's, Ray Train's, torchft's and the workers' output (always in RUN_DIR/logs/).")
@click.pass_context
def train(
    ctx: click.Context, config_path: str | None, resume_dir: str | None, sets: tuple[str, ...], skip_bad_lines: bool,
    verify_data: bool, no_progress: bool, verbose: bool,
) -> None:
    """Trains a model as the config says and writes report.json and summary.txt."""
    from core.config import load_config  # import cost: 0.15 s (pydantic, numpy), see the note at the top

    if (config_path is None) == (resume_dir is None):
        raise click.UsageError("give exactly one of --config FILE or --resume RUN_DIR")
    overrides = _parse_set(sets)
    if skip_bad_lines:
        overrides["data.skip_bad_lines"] = True
    if verify_data and resume_dir is None:  # a resumed run's config gets it below
        overrides["data.verify_data"] = True
    # What was typed is checked before Ray and torch load: a bad value says so in 0.3 s, not 1.5 s.
    cfg = None if resume_dir is not None else load_config(config_path, overrides)
    from app.run import run_training  # import cost: 0.27 s, then Ray and torch; see the top
    from app.report import format_summary  # import cost: 0.18 s, see the note at the top
    from app.resume import resume_config  # import cost: as app.job's

    if resume_dir is not None:  # with its own config; --set may give it a new sharding plan only
        cfg = resume_config(resume_dir, verify_data, overrides)
    verbose = verbose or ctx.find_root().params.get("verbose", False)
    if verbose:
        logging.getLogger().setLevel(logging.INFO)
    report = run_training(cfg, show_progress=not no_progress, resume=resume_dir is not None, verbose=verbose)
    click.echo(format_summary(report))
    click.echo(f"report: {cfg.run_dir}/report.json")


@main.command(short_help="Train on an emulated production clock.")
@click.option("--config", "config_path", type=click.Path(exists=True, dir_okay=False), required=True)
@click.option("--set", "sets", multiple=True, metavar="KEY=VALUE",
              help="Override a config field, e.g. --set recovery=full --set emulation.nodes=256 (repeatable).")
@click.option("--no-progress", is_flag=True, help="Do not show the progress display.")
def emulate(config_path: str, sets: tuple[str, ...], no_progress: bool) -> None:
    """Trains as the config says on an emulated production clock (the config's emulation
    section, or its defaults): the checkpoint interval and shard failures come from the
    production figures, and the overheads are reported as shares of failure-free time."""
    from core.config import EmulationConfig, load_config  # import cost: 0.15 s, see the note at the top

    cfg = load_config(config_path, _parse_set(sets))  # checked before Ray and torch load, as in train
    from app.run import run_training  # import cost: 0.27 s, then Ray and torch; see the note at the top
    from app.report import format_summary  # import cost: 0.18 s, see the note at the top

    if cfg.emulation is None:
        cfg = cfg.model_copy(update={"emulation": EmulationConfig()})
    report = run_training(cfg, show_progress=not no_progress)
    click.echo(format_summary(report))
    click.echo(f"report: {cfg.run_dir}/report.json (its \"emulation\" entry has the emulated clock)")


@main.command("config-docs", short_help="Print the config reference (markdown).")
def config_docs() -> None:
    """Prints the config reference (markdown) from the config models."""
    from core.config_docs import config_reference  # import cost: 0.15 s (pydantic, numpy), see the note at the top

    click.echo(config_reference())


def _duration_s(value: str) -> float:
    """'30s', '5m', '1h' or a plain number of seconds."""
    units = {"s": 1, "m": 60, "h": 3600}
    try:
        if value and value[-1] in units:
            return float(value[:-1]) * units[value[-1]]
        return float(value)
    except ValueError:
        raise click.BadParameter(f"expected a duration like 30s, 5m or 1h, got {value!r}") from None


@main.group(short_help="Kill a running job's actors or hosts.")
@click.option("--run", "run_dir", type=click.Path(file_okay=False), required=True, help="The running job's run_dir.")
@click.pass_context
def chaos(ctx: click.Context, run_dir: str) -> None:
    """Kills actors of a running job (same cluster): one now, or on a schedule."""
    ctx.obj = run_dir


@chaos.command("kill", short_help="SIGKILL one shard, trainer or the supervisor.")
@click.argument("target")
@click.pass_obj
def chaos_kill(run_dir: str, target: str) -> None:
    """SIGKILLs TARGET's process: shard:K, trainer:K or supervisor."""
    from app.chaos import find_supervisor, kill_target  # import cost: 0.06 s, then Ray; see the note at the top

    killed = kill_target(find_supervisor(run_dir), target)
    click.echo(f"killed {killed['target']} (pid {killed['pid']})")


@chaos.command("schedule", short_help="Kill random actors at a mean interval.")
@click.option("--mtbf", "mtbf", default="30s", help="Mean time between failures, e.g. 30s.")
@click.option("--targets", default="shards", help="Comma-separated: shards,trainers,supervisor.")
@click.option("--duration", default="5m", help="Stop after this long, e.g. 5m.")
@click.option("--distribution", type=click.Choice(["exponential", "fixed"]), default="exponential")
@click.option("--seed", type=click.IntRange(0), default=0)
@click.option("--max-failures", type=click.IntRange(1), default=1000)
@click.pass_obj
def chaos_schedule(run_dir: str, mtbf: str, targets: str, duration: str, distribution: str, seed: int, max_failures: int) -> None:
    """Keeps killing random actors with exponential inter-failure times, for a bounded time."""
    from app.chaos import FaultSchedule, find_supervisor, run_schedule  # import cost: 0.06 s, then Ray; see the top

    schedule = FaultSchedule(
        tuple(t.strip() for t in targets.split(",") if t.strip()),
        _duration_s(mtbf), distribution, seed, max_failures, _duration_s(duration),
    )
    kills = run_schedule(
        find_supervisor(run_dir), schedule, threading.Event(),
        on_kill=lambda k: click.echo(f"killed {k['target']} (pid {k['pid']})"),
    )
    click.echo(f"{len(kills)} kills")


@chaos.command("hosts", short_help="Kill or cut off hosts of a namespace cluster.")
@click.option("--cluster-dir", type=click.Path(file_okay=False, exists=True), required=True,
              help="The namespace cluster's CPR_CLUSTER_DIR (scripts/local_cluster.sh).")
@click.option("--wait", "wait_s", type=click.FloatRange(0), default=300.0, show_default=True,
              help="Seconds to wait for the run's config.yaml to appear.")
@click.pass_obj
def chaos_hosts(run_dir: str, cluster_dir: str, wait_s: float) -> None:
    """Carries out the run's ``faults.hosts`` (host kills, partitions) on a namespace cluster,
    from outside its hosts (the machine's root namespace); ends when the run's report is written."""
    from app.host_chaos import Cluster, run_host_faults  # import cost: 0.1 s (pydantic); see the note at the top
    from app.rebuild import REPORT_FILE  # import cost: as above
    from core.config import load_config

    path, deadline = Path(run_dir) / "config.yaml", time.monotonic() + wait_s
    while not path.exists():
        if time.monotonic() > deadline:
            raise CprError(f"{path} did not appear within {wait_s:.0f} s; is the run starting?")
        time.sleep(0.5)
    faults = load_config(str(path)).faults.hosts
    stop = threading.Event()
    started = time.time()
    done = threading.Thread(target=lambda: _wait_for(Path(run_dir) / REPORT_FILE, started, stop), daemon=True)
    done.start()
    for fault in run_host_faults(Cluster(cluster_dir), run_dir, faults, stop):
        click.echo(f"{fault.kind} of host {fault.host} after step {fault.after_step} ({fault.seconds:.1f} s)")


def _wait_for(path: Path, after: float, stop: threading.Event) -> None:
    """Sets ``stop`` once ``path`` is written after ``after`` (a run's report from before is
    not this run's end)."""
    while not (path.exists() and path.stat().st_mtime > after):
        time.sleep(0.5)
    stop.set()


@main.command(short_help="Train under random kills, then verify.")
@click.option("--config", "config_path", type=click.Path(dir_okay=False), default="configs/soak.yaml", show_default=True)
@click.option("--seed", "seeds", type=click.IntRange(0), multiple=True, default=(0,), help="One run per seed.")
@click.option("--kills", type=click.IntRange(1), default=20, show_default=True, help="Random kills per run.")
@click.option("--mtbf", type=float, default=6.0, show_default=True, help="Mean seconds between kills.")
def soak(config_path: str, seeds: tuple[int, ...], kills: int, mtbf: float) -> None:
    """Trains under random SIGKILLs of every kind, then checks the run's invariants from its files and replays it."""
    from app.soak import run_soak  # import cost: 0.13 s, then Ray and torch; see the note at the top

    bad = 0
    for seed in seeds:
        r = run_soak(config_path, f"runs/soak-{seed}", seed, kills, mtbf)
        bad += len(r["violations"]) + r["wedged"]
        click.echo(f"seed {seed}: {r['kills']} kills, {r['shard_recoveries']} shard recoveries, "
                   f"{r['supervisor_restarts']} supervisor restarts, finished={r['finished']}, "
                   f"{len(r['violations'])} violations")
        if (e := r.get("replay")) and "error" not in e:
            click.echo(f"  replay: {e['checkpoints']} checkpoints match" + (" bit for bit" if e["exact"] else "")
                       + f", {e['findings']} findings, {e['wall_s']:.0f} s (training {e['train_seconds']} s)"
                       + ("" if r.get("failure_free_equal") is None else
                          f"; final model equals the failure-free run's: {r['failure_free_equal']}"))
        for line in r["violations"]:
            click.echo(f"  violation: {line}")
    sys.exit(1 if bad else 0)


@main.command(short_help="Export a checkpoint as torchrec's DLRM.")
@click.argument("run_dir", type=click.Path(file_okay=False))
@click.option("--out", "out_dir", type=click.Path(file_okay=False), required=True, help="Output directory.")
@click.option("--step", type=click.IntRange(0), default=None,
              help="A full checkpoint's step (default: the newest full checkpoint that verifies).")
def export(run_dir: str, out_dir: str, step: int | None) -> None:
    """Writes a checkpoint of RUN_DIR as torchrec's DLRM: model.json and model.pt."""
    from app.export import export_model  # import cost: 0.3 s, then torch and torchrec; see the note at the top

    result = export_model(run_dir, out_dir, step)
    click.echo(f"exported step {result.step} ({result.embedding_rows:,} embedding rows) to {result.model_pt}")
    if result.skipped_newer:
        click.echo(f"newer checkpoints not exported (incremental or corrupt): {list(result.skipped_newer)}")


@main.command(short_help="Check a finished run from its files.")
@click.argument("run_dir", type=click.Path(file_okay=False, exists=True))
@click.option("--wait", "wait_s", type=click.FloatRange(0), default=10.0, show_default=True,
              help="Seconds to give the run's processes to go before they count as left behind.")
@click.option("--host", "host_ip", default=None,
              help="Only what the run left on this host of a namespace cluster (run inside it): its processes.")
@click.option("--named-actors", is_flag=True, help="With --host: also the run's named actors, asking the cluster "
              "that RAY_ADDRESS names.")
@click.option("--replay", is_flag=True, help="Also recompute the model in this process, step by committed step, "
              "and compare it with every checkpoint the run left (docs/CHAOS.md).")
def verify(run_dir: str, wait_s: float, host_ip: str | None, named_actors: bool, replay: bool) -> None:
    """Checks a finished RUN_DIR from what its processes wrote (fault log, audit logs, data
    cache, checkpoint files), never trusting its report: lists every violation and exits 1,
    or prints one line and exits 0. Needs the run's audit log (``audit_log: true``)."""
    from verify import verify_run  # import cost: 0.2 s (pyarrow, numpy); see the note at the top

    if host_ip is not None:
        _verify_host(run_dir, host_ip, wait_s, named_actors)
        return
    try:
        verdict = verify_run(run_dir, wait_s)
        replayed = None
        if replay:
            from verify.replay.engine import replay_dir  # import cost: torch and fbgemm, 3 s; only with --replay

            replayed = replay_dir(run_dir)
    except FileNotFoundError as err:
        raise CprError(str(err)) from None
    violations = list(verdict.violations)
    if replayed is not None:  # what it could not replay is not proven either
        violations += [f"replay: {f}" for f in replayed.findings] + [f"not replayed: {g}" for g in replayed.gaps]
        if not replayed.steps:
            violations.append("replay: no committed step in the audit logs (is audit_log on?)")
    if not violations:
        click.echo(verdict.summary())
        if replayed is not None:
            click.echo(replayed.summary() + f" ({replayed.seconds:.1f} s)")
            for line in replayed.excused:
                click.echo(f"not replayed, damaged on purpose: {line}")
        return
    for line in violations:
        click.echo(f"violation: {line}")
    click.echo(f"{run_dir}: {len(violations)} violations")
    sys.exit(1)


def _verify_host(run_dir: str, host_ip: str, wait_s: float, named_actors: bool) -> None:
    from verify.files import load_run  # import cost: 0.2 s (pyarrow, numpy); see the note at the top
    from verify.leftovers import leftovers  # import cost: as above

    run = load_run(run_dir)
    if named_actors and os.environ.get("RAY_ADDRESS") and run.run_info.get("namespace"):
        from app.rayenv import join_ray  # import cost: 0.5 s (ray); only to list the cluster's named actors

        join_ray(os.environ["RAY_ADDRESS"], run.run_info["namespace"], log_to_driver=False)
    left = leftovers(run, wait_s, host=host_ip)
    for line in left:
        click.echo(f"violation: {line}")
    click.echo(json.dumps({"host": host_ip, "left": len(left)}))
    sys.exit(1 if left else 0)


@main.command(short_help="Summary and plots of a run, again.")
@click.argument("run_dir", type=click.Path())
def report(run_dir: str) -> None:
    """Renders summary.txt, timeline.png and overhead.png of RUN_DIR again from its files
    (rebuilt from its events, progress and journal when the run crashed)."""
    from app.report import format_summary, load_run, render  # import cost: 0.18 s, see the note at the top

    rep = load_run(run_dir)
    written = render(run_dir, rep)
    click.echo(format_summary(rep))
    click.echo("wrote " + ", ".join(str(p) for p in written))


def run() -> None:
    """Entry point: user errors print one clear line and exit 2, not a traceback."""
    # Ray reads RAY_AUTH_MODE once, when it is imported, and the commands import it later: set
    # here, a plain shell runs every command with token authentication (the user's value wins).
    os.environ.setdefault("RAY_AUTH_MODE", "token")
    try:
        main(standalone_mode=True)
    except CprError as err:
        click.echo(f"error: {err}", err=True)
        _exit(2)


def _exit(code: int) -> None:
    """Exits with ``code``; at once where a thread still imports ahead of time (the driver's
    Ray Train import, ``app.job``): bad input found meanwhile need not wait seconds for modules
    the run will never use. Everything the command wrote is flushed first; the run was closed."""
    if any(t.is_alive() and not t.daemon for t in threading.enumerate() if t is not threading.main_thread()):
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)
