"""The front door without a cluster: `cpr --help` says what every command does, a config
without run_dir can be run again and again (a new directory each time, runs/latest to the
newest), a summary never shows a negative zero, and what a run asks of a cluster."""

from __future__ import annotations

import click
import pytest
from click.testing import CliRunner

from app.cli import main
from app.logs import point_latest
from app.rayenv import _check_lease, resources_needed
from app.summary import _fmt
from core.config import config_from_dict, load_config
from core.errors import ConfigError


def _commands(group: click.Group, prefix: str = "") -> dict[str, click.Command]:
    out = {}
    for name, cmd in group.commands.items():
        out[prefix + name] = cmd
        if isinstance(cmd, click.Group):
            out.update(_commands(cmd, f"{prefix}{name} "))
    return out


def test_help_lists_what_every_command_does_whole():
    listing = CliRunner().invoke(main, ["--help"], terminal_width=80).output
    for path, cmd in _commands(main).items():
        short = cmd.get_short_help_str(limit=80)
        assert short and not short.endswith("..."), (path, short)
        if " " not in path:
            assert f"{path}" in listing and short in listing, (path, listing)
        # Every command's own --help works without Ray, torch or a config.
        group, *sub = path.split()
        result = CliRunner().invoke(main, [group, *(["--run", "RUN_DIR"] if sub else []), *sub, "--help"])
        assert result.exit_code == 0 and "Usage:" in result.output, (path, result.output)


def test_a_config_without_run_dir_gets_a_new_directory_every_run():
    first, second = load_config("configs/local.yaml"), load_config("configs/local.yaml")
    assert first.run_dir.startswith("runs/") and second.run_dir.startswith("runs/")
    assert first.run_dir != second.run_dir
    assert first.checkpoint_uri != second.checkpoint_uri  # the second run finds no checkpoints of the first
    given = load_config("configs/local.yaml", {"run_dir": "/tmp/mine"})
    assert given.run_dir == "/tmp/mine"


def test_runs_latest_points_to_the_newest_run(tmp_path):
    runs = tmp_path / "runs"
    for name in ("20261126-010000-aaaaaa", "20261126-020000-bbbbbb"):
        (runs / name).mkdir(parents=True)
        point_latest(runs / name)
        assert (runs / "latest").resolve() == (runs / name).resolve()
    assert (runs / "latest").readlink().name == "20261126-020000-bbbbbb"  # relative: the tree can move
    elsewhere = tmp_path / "mine"
    elsewhere.mkdir()
    point_latest(elsewhere)  # a run_dir outside runs/ leaves the link alone
    assert (runs / "latest").resolve().name == "20261126-020000-bbbbbb"


def test_a_duration_a_hair_below_zero_is_shown_as_zero():
    assert _fmt(-0.0, ".1f", "s") == "0.0s"
    assert _fmt(-0.04, ".1f", "s") == "0.0s"
    assert _fmt(-0.2, ".1f", "s") == "-0.2s"
    assert _fmt(-1234.0, ",.0f") == "-1,234"
    assert _fmt(None, ".1f") == "n/a"


def test_resources_a_run_holds_at_once():
    cfg = config_from_dict({
        "data": {"train": ["t.tsv"], "eval": ["e.tsv"]},
        "embeddings": {"num_shards": 3, "spares": 2, "num_cpus": 0.5, "num_gpus": 0.25},
        "training": {"num_trainers": 4},
    })
    assert resources_needed(cfg) == {"CPU": 5 * 0.5 + 4, "GPU": 5 * 0.25}


def test_a_lease_as_long_as_rays_node_death_timeout_is_refused_naming_the_field():
    death = 1.5  # the namespace cluster's head: 500 ms x 3
    data = {"train": ["t.tsv"], "eval": ["e.tsv"]}
    _check_lease(config_from_dict({"data": data, "ray": {"lease_s": death / 2}}), death)
    with pytest.raises(ConfigError) as refused:
        _check_lease(config_from_dict({"data": data, "ray": {"lease_s": death}}), death)
    assert "ray.lease_s" in str(refused.value) and f"< {death:g}" in str(refused.value)


def test_the_lost_samples_line_names_the_step_the_shard_failed_at():
    from app.console import format_event

    line = format_event({"kind": "lost_samples_counted", "actor": "shard:1", "lost_samples": 6144.0,
                         "first_step": 0, "failed_at_step": 66})
    assert line == "[failure] shard:1: 6,144 samples' updates lost (failed at step 66)"


def test_the_suite_record_reads_pytests_summary_line():
    from benchmarks.suite import summary_of

    lines = ["....", "========= 603 passed, 1 skipped, 4 warnings in 860.69s (0:14:20) =========", "real 15m"]
    assert summary_of(lines) == {"line": "603 passed, 1 skipped, 4 warnings in 860.69s (0:14:20)",
                                 "counts": {"passed": 603, "skipped": 1, "warnings": 4}, "seconds": 860.69}
    assert summary_of(["1 failed, 2 passed in 3.10s"])["counts"] == {"failed": 1, "passed": 2}
    assert summary_of(["no summary here"]) is None
