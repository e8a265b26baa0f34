"""Trainer failures at production scale: the per-failure costs measured by
``benchmarks/trainer_failures.py`` on this machine, carried onto the emulated clock of a job of
many hosts with production constants.

The model (a pure function of the measured costs and the constants, ``scale_model``):

- Failures: each host fails independently with mean time between failures ``host_mtbf_h``, so
  a job of N hosts fails every ``host_mtbf_h / N`` hours. One replica group (one trainer) per
  host; every failure is taken as a trainer's host (the embedding shards are left out: their
  recovery is ``benchmarks/recovery.py``'s subject).
- (b) checkpoint-and-restart: a failure stops all N hosts until the whole group is back: a
  replacement host is found (``reschedule_s``), the new group starts (``restart_s``, measured
  here), loads the last checkpoint (``load_s``) and redoes the steps since it (half the
  checkpoint interval on average; the interval is Young/Daly's sqrt(2 * save_s * job MTBF)).
- (a) cpr: a failure stops the group only until the survivors step without the dead trainer
  (``stall_s``, measured here); then the N-1 survivors train all M microbatches of every step,
  so 1/N of the job's capacity is missing until the replacement trains again: a new host
  (``reschedule_s``) plus the replacement's start and heal (``rejoin_s``, measured here).
- A failure that costs the whole job C seconds leaves it ``1 / (1 + C / job_mtbf)`` of its
  failure-free speed.

Checkpoint saves cost both sides the same (same kind of save, same interval) and are left out
of the kept shares. Constants: ``CONSTANTS`` names each one's source, or says it is an
assumption. Writes benchmarks/results/trainer_failures_scale.json and .md.

    .venv/bin/python benchmarks/trainer_failures_scale.py
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.meta import describe, run_metadata  # noqa: E402

__all__ = ["CONSTANTS", "HOSTS", "kept_share", "young_daly_interval_s", "failure_costs", "scale_model",
           "measured_inputs", "check_here", "render", "main"]

HOSTS = (64, 512, 2048)
MTBF_SCENARIOS = {"host_mtbf_h": "Llama 3's pre-training", "host_mtbf_h_research_cluster": "Meta's research clusters"}

# name -> (value, source). "Assumption" where nothing citable gives the number.
CONSTANTS: dict[str, tuple[float, str]] = {
    "host_mtbf_h": (
        54 * 24 * 2048 / 419,
        "Llama 3 pre-training: 419 unexpected interruptions in 54 days on 16,384 GPUs = 2,048 hosts of 8 "
        "(Dubey et al. 2024, The Llama 3 Herd of Models, arXiv 2407.21783, section 3.3.4); as configs/emulate.yaml",
    ),
    "host_mtbf_h_research_cluster": (
        7.9 * 128,
        "Meta's research clusters: 7.9 h mean time to failure for 1,024-GPU jobs = 128 hosts of 8 (Kokolis et al. "
        "2024, Revisiting Reliability in Large-Scale Machine Learning Research Clusters, arXiv 2410.21680)",
    ),
    "reschedule_s": (300.0, "assumption (configs/emulate.yaml's reschedule_s): a replacement host found and started"),
    "load_s": (600.0, "assumption (configs/emulate.yaml's load_s): the whole model loaded from a checkpoint at scale"),
    "save_s": (600.0, "assumption (configs/emulate.yaml's save_s): the stall of one full save, for Young/Daly"),
}


def kept_share(cost_per_failure_s: float, job_mtbf_s: float) -> float:
    """Share of its failure-free speed a job keeps when each failure costs it ``cost_per_failure_s``."""
    return 1.0 / (1.0 + cost_per_failure_s / job_mtbf_s)


def young_daly_interval_s(save_s: float, job_mtbf_s: float) -> float:
    """Young's first-order optimal checkpoint interval, sqrt(2 * save cost * MTBF)."""
    return math.sqrt(2.0 * save_s * job_mtbf_s)


def failure_costs(hosts: int, measured: dict, constants: dict) -> dict:
    """Seconds of the whole job's time one trainer failure costs each method at ``hosts`` hosts."""
    job_mtbf_s = constants["host_mtbf_h"] * 3600.0 / hosts
    interval_s = young_daly_interval_s(constants["save_s"], job_mtbf_s)
    a, b = measured["a_cpr"], measured["b_ray_train_ddp"]
    missing_s = constants["reschedule_s"] + a["rejoin_s"]  # one host's share of the work is missing
    return {
        "job_mtbf_s": job_mtbf_s,
        "checkpoint_interval_s": interval_s,
        "a_cpr": {"stall_s": a["stall_s"], "one_host_missing_s": missing_s,
                  "total_s": a["stall_s"] + missing_s / hosts},
        "b_ray_train_ddp": {"reschedule_s": constants["reschedule_s"], "restart_s": b["restart_s"],
                            "load_s": constants["load_s"], "redo_s": interval_s / 2.0,
                            "total_s": constants["reschedule_s"] + b["restart_s"] + constants["load_s"]
                            + interval_s / 2.0},
    }


def scale_model(measured: dict, constants: dict, hosts=HOSTS) -> list[dict]:
    """Per job size: each method's cost per failure and the share of its failure-free speed it keeps.
    ``measured``: {"a_cpr": {"stall_s", "rejoin_s"}, "b_ray_train_ddp": {"restart_s"}};
    ``constants``: host_mtbf_h, reschedule_s, load_s, save_s (plain numbers)."""
    rows = []
    for n in hosts:
        c = failure_costs(n, measured, constants)
        keep_a = kept_share(c["a_cpr"]["total_s"], c["job_mtbf_s"])
        keep_b = kept_share(c["b_ray_train_ddp"]["total_s"], c["job_mtbf_s"])
        rows.append({"hosts": n, **c, "kept": {"a": keep_a, "b": keep_b}, "ratio_of_kept": keep_a / keep_b})
    return rows


def measured_inputs(trainer_failures: dict) -> dict:
    """The inputs ``scale_model`` takes from a ``trainer_failures.json``."""
    c = trainer_failures["per_event_costs"]
    return {
        "a_cpr": {"stall_s": c["a_cpr"]["stall_s"], "rejoin_s": c["a_cpr"]["rejoin_s"]},
        "b_ray_train_ddp": {"restart_s": c["b_ray_train_ddp"]["restart_s"]},
    }


def check_here(trainer_failures: dict) -> dict:
    """The same cost model on this machine's runs (N = its trainers, no rescheduling, its own load
    and redo), against the extra training time per kill measured there."""
    c, n = trainer_failures["per_event_costs"], trainer_failures["trainers"]
    a, b = c["a_cpr"], c["b_ray_train_ddp"]
    return {
        "a_cpr": {"model_s": a["stall_s"] + a["rejoin_s"] / n, "measured_s": a["extra_s_per_kill"]},
        "b_ray_train_ddp": {"model_s": b["ready_s"] + b["redo_s"], "measured_s": b["extra_s_per_kill"]},
    }


def _scenario_table(rows: list[dict]) -> list[str]:
    lines = [
        "| hosts | job MTBF | (a) cpr: stall + one host missing / N | (a) keeps | (b) DDP: reschedule + restart + load "
        "+ redo (half the interval) | (b) keeps | ratio of kept |",
        "|---:|---:|---|---:|---|---:|---:|",
    ]
    for r in rows:
        a, b = r["a_cpr"], r["b_ray_train_ddp"]
        lines.append(
            f"| {r['hosts']:,} | {r['job_mtbf_s'] / 3600:.1f} h | {a['stall_s']:.1f} + {a['one_host_missing_s']:.0f} / "
            f"{r['hosts']:,} = {a['total_s']:.1f} s | {r['kept']['a']:.2%} | {b['reschedule_s']:.0f} + "
            f"{b['restart_s']:.1f} + {b['load_s']:.0f} + {b['redo_s']:.0f} = {b['total_s']:.0f} s | "
            f"{r['kept']['b']:.1%} | {r['ratio_of_kept']:.3f}x |"
        )
    return lines


def render(out: dict) -> str:
    """The page of ``trainer_failures_scale.json`` (the docs render it with this function)."""
    m, cons = out["measured"], out["constants"]
    head = out["scenarios"][0]
    big = head["rows"][-1]
    lines = [
        describe(out["meta"]) + f"; measured costs from `{out['measured_from']}` ({out['measured_meta']['commit']}, "
        f"{out['measured_meta']['date']}).",
        "",
        f"**Share of its failure-free speed each side keeps at {big['hosts']:,} hosts with {head['host_mtbf_from']} "
        f"host MTBF: (a) cpr {big['kept']['a']:.2%}, (b) checkpoint-and-restart {big['kept']['b']:.1%}; ratio "
        f"{big['ratio_of_kept']:.2f}x** (" + ", ".join(
            f"{r['hosts']:,} hosts {r['ratio_of_kept']:.2f}x" for r in head["rows"][:-1]) + ").",
        "",
        f"Measured here, per trainer failure: (a) cpr's stall {m['a_cpr']['stall_s']:.2f} s (kill -> the survivors "
        f"step without it), its replacement training again after {m['a_cpr']['rejoin_s']:.2f} s; (b) the DDP "
        f"group's restart {m['b_ray_train_ddp']['restart_s']:.2f} s (kill -> the new group ready to train, less "
        "its checkpoint load, which is a constant here). Constants:",
        "",
        "| constant | value | source |",
        "|---|---:|---|",
        *[f"| `{k}` | {v['value']:,.1f} | {v['source']} |" for k, v in cons.items()],
        "",
    ]
    chk = out["model_check_here"]
    lines += [
        f"The model checked on this machine's runs ({out['measured_meta']['machine']['cores']} cores, N = the "
        f"run's trainers, no rescheduling): extra seconds per kill, model against measured: (a) "
        f"{chk['a_cpr']['model_s']:.1f} against {chk['a_cpr']['measured_s']:.1f}; (b) "
        f"{chk['b_ray_train_ddp']['model_s']:.1f} against {chk['b_ray_train_ddp']['measured_s']:.1f}.",
        "",
    ]
    for s in out["scenarios"]:
        lines += [f"**Host MTBF {s['host_mtbf_h']:,.0f} h** ({s['host_mtbf_from']}):", "", *_scenario_table(s["rows"]), ""]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--measured", default=str(ROOT / "benchmarks/results/trainer_failures.json"))
    parser.add_argument("--out", default=str(ROOT / "benchmarks/results/trainer_failures_scale.json"))
    args = parser.parse_args()
    tf = json.loads(Path(args.measured).read_text())
    measured = measured_inputs(tf)
    values = {k: v for k, (v, _) in CONSTANTS.items()}
    scenarios = []
    for key in MTBF_SCENARIOS:
        constants = {**values, "host_mtbf_h": values[key]}
        scenarios.append({"host_mtbf_h": values[key], "host_mtbf_from": MTBF_SCENARIOS[key],
                          "rows": scale_model(measured, constants)})
    out = {
        "meta": run_metadata(),
        "measured_from": str(Path(args.measured).resolve().relative_to(ROOT)),
        "measured_meta": tf["meta"],
        "measured": measured,
        "constants": {k: {"value": v, "source": s} for k, (v, s) in CONSTANTS.items()},
        "scenarios": scenarios,
        "model_check_here": check_here(tf),
    }
    path = Path(args.out)
    path.write_text(json.dumps(out, indent=2) + "\n")
    path.with_suffix(".md").write_text("# Trainer failures at production scale\n\n" + render(out))
    print(render(out))


if __name__ == "__main__":
    main()
