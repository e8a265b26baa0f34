"""Bad input from a plain shell: `cpr train` with a mistake in its config or its --set values
says so in one line on stderr (``error: ...``), exits 2, shows no traceback and writes
nothing (no run directory, no cache, no checkpoint directory, nothing in the working
directory or in HOME), within seconds: every case is refused before Ray starts."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from app.cli import _parse_set
from core.errors import ConfigError

pytestmark = pytest.mark.timeout(120)

CPR = str(Path(sys.executable).parent / "cpr")
FILES = {"c.yaml", "data/train.tsv", "data/eval.tsv"}


def _criteo_line(i: int) -> str:
    """A valid Criteo TSV line: label, 13 integer features, 26 categorical ids (8 hex digits)."""
    ints = [str((i * 7 + k) % 50) for k in range(13)]
    ids = [f"{(i * 2654435761 + k * 40503) % 2**32:08x}" for k in range(26)]
    return "\t".join([str(i % 2), *ints, *ids])


@pytest.fixture(scope="module")
def dead_port() -> int:
    """A port on 127.0.0.1 that nobody listens on."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def work(tmp_path: Path, dead_port: int) -> Path:
    """A working directory with tiny real inputs and a config shaped like configs/local.yaml
    (no ``generate``; run_dir, cache and checkpoints inside it)."""
    work = tmp_path / "work"
    (work / "data").mkdir(parents=True)
    (work / "data" / "train.tsv").write_text("".join(_criteo_line(i) + "\n" for i in range(8)))
    (work / "data" / "eval.tsv").write_text("".join(_criteo_line(100 + i) + "\n" for i in range(4)))
    config = {
        "seed": 0,
        "run_dir": "run",
        "data": {"train": ["data/train.tsv"], "eval": ["data/eval.tsv"], "cache_dir": "cache"},
        "model": {"embedding_dim": 8, "table_rows": 100, "dense_arch": [16, 8], "over_arch": [16, 1]},
        "embeddings": {"num_shards": 2, "sharding": "table_wise"},
        "training": {"num_trainers": 1, "microbatch_rows": 4, "microbatches_per_step": 1, "max_steps": 2},
        "checkpoint": {"every_steps": 1, "keep_last": 3, "storage": "ckpt"},
        "recovery": "partial",
        # A guard, not part of any case: should a check let a case through, the run fails to join
        # a cluster nobody runs instead of starting a Ray of its own.
        "ray": {"address": f"127.0.0.1:{dead_port}"},
    }
    (work / "c.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
    return work


def _s3(path: str, port: int) -> str:
    return f"s3://{path}?endpoint_override=127.0.0.1:{port}&scheme=http"


def _refused(work: Path, *sets: str, files: set[str] = FILES) -> str:
    """Runs `cpr train --config c.yaml --set ...` in ``work`` as a user's shell would (only PATH
    and HOME set); checks the refusal and that nothing was written; returns its one line."""
    home = work.parent / "home"
    home.mkdir(exist_ok=True)
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(home)}
    argv = [CPR, "train", "--no-progress", "--config", "c.yaml"] + [a for s in sets for a in ("--set", s)]
    began = time.monotonic()
    # A session of its own: should a case get past its check and start a Ray, all of it ends here.
    proc = subprocess.Popen(argv, cwd=work, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
    done = subprocess.CompletedProcess(argv, proc.returncode, out, err)
    took = time.monotonic() - began
    shown = f"exit {done.returncode} after {took:.1f} s\nstdout:\n{done.stdout}\nstderr:\n{done.stderr}"
    assert done.returncode == 2, shown
    assert "Traceback" not in done.stdout + done.stderr, shown
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), shown
    assert not done.stdout.strip(), shown
    written = {str(p.relative_to(work)) for p in work.rglob("*") if not p.is_dir()}
    dirs = {str(p.relative_to(work)) for p in work.rglob("*") if p.is_dir()}
    assert written == files and dirs == {"data"}, (written, dirs)
    assert not list(home.iterdir()), list(home.iterdir())
    assert took < 20, shown  # Ray never started; about 1 s each
    return lines[0]


def test_an_unquoted_s3_uri_in_a_set_list_says_how_to_quote_it(work, dead_port):
    uri = _s3("b/*.tsv", dead_port)
    line = _refused(work, f"data.train=[{uri}]")
    assert line.startswith(f"error: --set data.train: cannot read [{uri}] as YAML ("), line
    hint = f"""quote each item holding ?, &, :, # or * inside the list: --set 'data.train=["{uri}"]'"""
    assert line.endswith(hint), line


@pytest.mark.parametrize("value,says", [
    ("runs/a #2", "YAML reads #2 in runs/a #2 as a comment; quote the value: --set 'run_dir=\"runs/a #2\"'"),
    ("runs/a: b", "YAML reads runs/a: b as a mapping (a ': ' inside); quote the value: --set 'run_dir=\"runs/a: b\"', "
                  "or write a mapping as {key: value}"),
    ("\truns/a", "cannot read '\\truns/a' as YAML (found character '\\t' that cannot start any token); "
                 "quote the value: --set 'run_dir=\"runs/a\"'"),
])
def test_set_values_that_yaml_reads_otherwise_are_refused_with_how_to_quote_them(work, value, says):
    assert _refused(work, f"run_dir={value}") == f"error: --set run_dir: {says}"


def test_a_field_that_moved_names_its_new_place(work):
    line = _refused(work, "training.max_trainer_failures=5")
    assert line == "error: invalid config: training.max_trainer_failures: moved to budgets.max_trainer_failures"


def test_a_value_of_the_wrong_type_names_the_field_and_what_to_type(work):
    line = _refused(work, "training.epochs=two")
    assert "training.epochs: Input should be a valid number" in line and "(got 'two')" in line, line


@pytest.mark.parametrize("field,key", [("checkpoint.storage", "ckpt"), ("data.cache_dir", "cache")])
def test_an_object_store_nobody_answers_at_is_refused_naming_field_and_uri(work, dead_port, field, key):
    line = _refused(work, f"{field}={_s3(f'cpr/{key}', dead_port)}")
    assert line.startswith(f"error: {field}: cannot list s3://cpr/{key}: "), line
    assert "endpoint_override" not in line, line  # the URI without its options


def test_a_local_cache_dir_under_a_regular_file_is_refused(work):
    line = _refused(work, "data.cache_dir=data/train.tsv/cache")
    below = work / "data" / "train.tsv"
    assert line == f"error: data.cache_dir: cannot create {below / 'cache'}: {below} is not a directory"


def test_a_missing_input_file_is_refused_by_name(work):
    line = _refused(work, "data.train=[data/nope.tsv]")
    assert line.startswith("error: ") and "data/nope.tsv" in line, line


def test_a_glob_that_matches_nothing_is_refused_by_name(work):
    line = _refused(work, "data.train=[data/day_*.tsv]")
    assert line == "error: data.train: data/day_*.tsv matches no file"


@pytest.mark.parametrize("item,says", [
    ("novalue", "--set: expected KEY=VALUE, e.g. --set training.epochs=2, got 'novalue'"),
    ("=3", "--set: expected KEY=VALUE, e.g. --set training.epochs=2, got '=3'"),
    ("x=*a", "--set x: cannot read *a as YAML (found undefined alias 'a'); quote the value: --set 'x=\"*a\"'"),
    ("run_dir=#b", "--set run_dir: YAML reads #b in #b as a comment; quote the value: --set 'run_dir=\"#b\"'"),
])
def test_parse_set_refusals(item, says):
    with pytest.raises(ConfigError) as refused:
        _parse_set((item,))
    assert str(refused.value) == says


def test_parse_set_reads_yaml_values():
    assert _parse_set(("training.epochs=2", "data.train=[a.tsv, b.tsv]", "faults.at_steps={trainer: [30]}",
                       'run_dir="a #b"', "data.cache_dir=s3://b/c?endpoint_override=h:9000&scheme=http")) == {
        "training.epochs": 2, "data.train": ["a.tsv", "b.tsv"], "faults.at_steps": {"trainer": [30]},
        "run_dir": "a #b", "data.cache_dir": "s3://b/c?endpoint_override=h:9000&scheme=http",
    }


def _cfg(tmp_path: Path, **changes) -> object:
    from core.config import config_from_dict

    raw = {"run_dir": str(tmp_path / "run"), "data": {"train": ["t.tsv"], "eval": ["e.tsv"]}}
    for dotted, value in changes.items():
        *parents, leaf = dotted.split("__")
        node = raw
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value
    return config_from_dict(raw)


def test_local_places_are_checked_without_creating_them(tmp_path):
    from app.preflight import check_places, places, probe_writes

    cfg = _cfg(tmp_path, data__cache_dir=str(tmp_path / "a" / "cache"), checkpoint__storage=str(tmp_path / "b" / "c"))
    assert [field for field, _ in places(cfg)] == ["run_dir", "checkpoint.storage", "data.cache_dir"]
    check_places(cfg)
    probe_writes(cfg)
    assert not list(tmp_path.iterdir())  # nothing created

    (tmp_path / "f").write_text("a file")
    for field, key, where in (("run_dir", "run_dir", "f/run"), ("checkpoint.storage", "checkpoint__storage", "f/c/d"),
                              ("data.cache_dir", "data__cache_dir", "f/cache")):
        with pytest.raises(ConfigError) as refused:
            check_places(_cfg(tmp_path, **{key: str(tmp_path / where)}))
        assert str(refused.value) == f"{field}: cannot create {tmp_path / where}: {tmp_path / 'f'} is not a directory"
    with pytest.raises(ConfigError, match=r"^data.cache_dir: .*/f is not a directory$"):
        check_places(_cfg(tmp_path, data__cache_dir=str(tmp_path / "f")))


def test_the_cache_beside_an_object_store_checkpoint_is_a_place_and_uris_are_shown_without_options(tmp_path):
    from app.preflight import _shown, places

    uri = "s3://bkt/x/ckpt?endpoint_override=127.0.0.1:9000&scheme=http"
    assert places(_cfg(tmp_path, checkpoint__storage=uri)) == [
        ("run_dir", str(tmp_path / "run")), ("checkpoint.storage", uri),
        ("data.cache_dir (default: beside checkpoint.storage)",
         "s3://bkt/x/cache?endpoint_override=127.0.0.1:9000&scheme=http"),
    ]
    assert _shown(uri) == "s3://bkt/x/ckpt"
    assert _shown("s3://KEY:SECRET@bkt/x?region=eu") == "s3://bkt/x"


def test_an_object_store_nobody_answers_at_fails_in_seconds(tmp_path, dead_port):
    from app.preflight import check_places

    began = time.monotonic()
    with pytest.raises(ConfigError, match=r"^checkpoint.storage: cannot list s3://bkt/ckpt: .*(connect|Connect)"):
        check_places(_cfg(tmp_path, checkpoint__storage=_s3("bkt/ckpt", dead_port)))
    assert time.monotonic() - began < 10
    with pytest.raises(ConfigError, match=r"^checkpoint.storage: cannot open s3://bkt/ckpt: .*'nope'"):
        check_places(_cfg(tmp_path, checkpoint__storage="s3://bkt/ckpt?nope=1"))


# --- bad data: refused while it is preprocessed, and what the run made removed again -----------


def _refused_data(work: Path, *sets: str, files: set[str] = FILES) -> str:
    """As ``_refused``, for input that only preprocessing finds: the run's own Ray is not needed
    for it (data of one chunk is built before Ray starts), so the config joins no cluster here.
    The process runs in a session of its own, ended whole should it run on."""
    config = yaml.safe_load((work / "c.yaml").read_text())
    config.pop("ray")
    (work / "c.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
    return _refused(work, *sets, files=files)


def _write_parquet(path: Path, columns: dict) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table(columns), path)


def _parquet_columns(rows: int) -> dict:
    import pyarrow as pa

    columns = {"label": pa.array([i % 2 for i in range(rows)], pa.int64())}
    columns.update({f"I{k}": pa.array([k + i for i in range(rows)], pa.int64()) for k in range(1, 14)})
    columns.update({f"C{k}": pa.array([f"{k * 1000 + i:08x}" for i in range(rows)]) for k in range(1, 27)})
    return columns


def test_a_file_cut_inside_its_last_id_is_refused_naming_file_and_line(work):
    text = (work / "data" / "train.tsv").read_text()
    (work / "data" / "train.tsv").write_text(text[:-5])  # the last id cut to 3 of its 8 digits
    line = _refused_data(work)
    assert line.startswith("error: ") and "train.tsv:8: column C26: " in line and "is not 8-digit hex" in line, line


@pytest.mark.parametrize("damage,says", [
    ("duplicate", "column label appears 2 times"),
    ("uint64", "column I3: 18446744073709551615 does not fit a 64-bit signed integer"),
    ("footer", "not a Parquet file"),
])
def test_bad_parquet_is_refused_in_one_line(work, damage, says):
    import pyarrow as pa

    path = work / "data" / "train.parquet"
    columns = _parquet_columns(8)
    if damage == "uint64":
        columns["I3"] = pa.array([2**64 - 1] + list(range(7)), pa.uint64())
    if damage == "duplicate":
        import pyarrow.parquet as pq

        table = pa.table(columns)
        pq.write_table(table.append_column("label", columns["label"]), path)
    else:
        _write_parquet(path, columns)
    if damage == "footer":
        raw = path.read_bytes()
        path.write_bytes(raw[:-12] + b"\xff" * 8 + raw[-4:])
    (work / "data" / "train.tsv").unlink()
    line = _refused_data(work, "data.train=[data/train.parquet]", files={"c.yaml", "data/train.parquet", "data/eval.tsv"})
    assert line.startswith("error: ") and "train.parquet" in line and says in line, line


def test_a_file_in_both_train_and_eval_is_refused(work):
    line = _refused(work, "data.eval=[data/*.tsv]")
    assert line.startswith("error: data.eval: ") and "train.tsv (matched by data/*.tsv) is also in data.train" in line, line


def test_data_generate_never_writes_over_a_users_file(work):
    config = yaml.safe_load((work / "c.yaml").read_text())
    config["data"]["generate"] = {"train_rows": 100, "eval_rows": 10}
    (work / "c.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
    before = (work / "data" / "train.tsv").read_bytes()
    line = _refused(work, "data.eval=[data/evl.tsv]")
    assert line.startswith("error: data.eval: ") and "evl.tsv does not exist" in line, line
    assert (work / "data" / "train.tsv").read_bytes() == before
