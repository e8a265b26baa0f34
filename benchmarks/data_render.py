"""The tables and targets of benchmarks/results/data.json (written by benchmarks/data.py):
ratios and the issue's targets computed from the measurements, and the markdown the docs
render (benchmarks/render_docs.py)."""

from __future__ import annotations

from benchmarks.meta import describe

DRIVER_TARGET_MB = 1024.0  # "driver memory under 1 GB"
PYARROW_TARGET = 0.8  # "at least 0.8x of the plain pyarrow read"
ONE_PROCESS_TARGET = 1.0  # "not slower than today (one process)"
SECTIONS = ("pyarrow_read", "pyarrow_read_strings", "one_process", "ray_data")
LABELS = {"pyarrow_read": "plain pyarrow read, types inferred", "pyarrow_read_strings": "pyarrow read, every column a string",
          "one_process": "store build, one process", "ray_data": "store build, Ray Data"}


def summarize(result: dict) -> None:
    """The ratios and the issue's targets, from the measurements (None where one is missing)."""
    def rate(name: str) -> float | None:
        return (result.get(name) or {}).get("rows_per_s")

    ray_rate, pa_rate, one_rate = rate("ray_data"), rate("pyarrow_read"), rate("one_process")
    pa_strings = rate("pyarrow_read_strings")

    def ratio(a, b):
        return round(a / b, 3) if a and b else None

    ratios = {"ray_data_vs_pyarrow_read": ratio(ray_rate, pa_rate), "ray_data_vs_one_process": ratio(ray_rate, one_rate),
              "one_process_vs_pyarrow_read": ratio(one_rate, pa_rate),
              "ray_data_vs_pyarrow_read_strings": ratio(ray_rate, pa_strings)}
    driver = (result.get("ray_data") or {}).get("driver_peak_rss_mb")

    def check(value, target, below=False):
        ok = None if value is None else (value < target if below else value >= target)
        return {"value": value, "target": target, "pass": ok}

    result["ratios"] = ratios
    result["targets"] = {
        "not_slower_than_one_process": check(ratios["ray_data_vs_one_process"], ONE_PROCESS_TARGET),
        "at_least_0.8x_pyarrow_read": check(ratios["ray_data_vs_pyarrow_read"], PYARROW_TARGET),
        "driver_peak_rss_under_1gb": check(driver, DRIVER_TARGET_MB, below=True),
    }


def _mem(r: dict, name: str) -> str:
    if name != "ray_data":
        return f"{r['peak_rss_mb']:,.0f} MB"
    return f"driver {r['driver_peak_rss_mb']:,.0f} MB; each worker at most {r.get('worker_peak_rss_mb') or 0:,.0f} MB"


def render(result: dict) -> str:
    """The table of data.json, as markdown (docs pages through benchmarks/render_docs.py)."""
    meta = result.get("meta")
    source = describe(meta) if meta else "not recorded"
    pa_rate = (result.get("pyarrow_read") or {}).get("rows_per_s")
    lines = ["# Data preprocessing: Criteo-sized TSV into the microbatch store", "",
             f"Rendered from `data.json`: {source}.", "",
             "| path | rows/s | seconds | peak memory (RSS) | vs pyarrow read |", "|---|---:|---:|---|---:|"]
    for name in SECTIONS:
        r = result.get(name)
        if not r or "error" in r:
            lines.append(f"| {LABELS[name]} | failed | | | |" if r else f"| {LABELS[name]} | not run | | | |")
            continue
        vs = f"{r['rows_per_s'] / pa_rate:.2f}x" if pa_rate else "-"
        label = f"{LABELS[name]} ({r['threads']} thread{'s' if r['threads'] > 1 else ''})" if "threads" in r else LABELS[name]
        lines.append(f"| {label} | {r['rows_per_s']:,} | {r['seconds']:,.1f} | {_mem(r, name)} | {vs} |")
    cluster = result.get("cluster") or {}
    if cluster.get("rows_per_s"):
        vs = f"{cluster['rows_per_s'] / pa_rate:.2f}x" if pa_rate else "-"
        lines.append(f"| store build, Ray Data, {cluster['hosts_total']}-host cluster | {cluster['rows_per_s']:,} | "
                     f"{cluster['seconds']:,.1f} | {_mem(cluster, 'ray_data')} | {vs} |")
    m = (meta or {}).get("machine") or {}
    data = result.get("data") or {}
    fs = result.get("first_step") or {}
    wall = fs.get("wall_time_s") or {}
    first = (f"{fs['first_step_s']:,.1f} s from launching `cpr train` to its first committed step (data "
             f"{wall.get('data_prep_s', 0):,.1f} s, startup {wall.get('startup_s', 0):,.1f} s)"
             if "first_step_s" in fs else "first step: not measured")
    lines += ["", f"{result.get('rows', 0):,} train rows, {data.get('train_bytes', 0) / 1e9:,.2f} GB of TSV; "
              f"{m.get('cpu', 'machine not recorded')}, {m.get('cores', '?')} cores, {m.get('memory_gib', '?')} GiB; "
              f"{first}."]
    if cluster.get("hosts"):
        shares = ", ".join(f"{ip}: {h['chunks']} chunks, {h['rows']:,} rows, {h['task_s']:,.0f} task-s"
                           for ip, h in sorted(cluster["hosts"].items()))
        lines += ["", f"On the cluster (a head without CPUs for tasks, where the driver runs, and "
                      f"{cluster['hosts_total'] - 1} worker hosts of {cluster['worker_cpus']} CPU each, sharing this "
                      f"machine's cores), the work by host: {shares}."]
    elif result.get("cluster_note"):
        lines += ["", result["cluster_note"]]
    verdicts = [f"{k.replace('_', ' ')}: {t['value']} ({'pass' if t['pass'] else 'fail' if t['pass'] is False else 'n/a'})"
                for k, t in (result.get("targets") or {}).items()]
    if verdicts:
        lines += ["", "Targets: " + "; ".join(verdicts) + "."]
    lines.append("")
    return "\n".join(lines)
