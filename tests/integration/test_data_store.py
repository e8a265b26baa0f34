"""Builds of one store in processes of their own, at once, and a reader of it that lives through
another build: none crashes, each gets the whole store, and nothing is left that no manifest
names. No Ray (the product's LocalEngine builds in the calling process), so these need no
cluster of their own; each process is a real one, started and ended by the test."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

from core.data import generate

ROOT = Path(__file__).resolve().parents[2]

_CONFIG = textwrap.dedent("""
    import json, sys
    from core.config import config_from_dict
    def config(base, verify=False):
        return config_from_dict({
            "run_dir": f"{base}/run", "seed": 1,
            "data": {"train": [f"{base}/gen/train.tsv"], "eval": [f"{base}/gen/eval.tsv"], "cache_dir": f"{base}/cache",
                     "mapping": "vocab", "min_count": 2, "verify_data": verify},
            "training": {"microbatch_rows": 64, "microbatches_per_step": 2, "epochs": 1},
        })
""")

_BUILD = _CONFIG + textwrap.dedent("""
    from app.dataengines import LocalEngine
    from app.dataprep import prepare_data
    built = prepare_data(config(sys.argv[1], verify=sys.argv[2] == "verify"), LocalEngine())
    print(json.dumps({k: [built[k].uri, built[k].microbatches, built[k].reused] for k in ("train", "eval")}))
""")

_READ = textwrap.dedent("""
    import sys, time
    import numpy as np
    from core.store import MicrobatchStore
    store = MicrobatchStore(sys.argv[1])
    first = [store.get(i)[0].copy() for i in range(len(store))]
    print("ready", flush=True)
    deadline, passes = time.monotonic() + float(sys.argv[2]), 0
    while time.monotonic() < deadline:
        for i in range(len(store)):
            labels, dense, rows = store.get(i)
            assert np.array_equal(labels, first[i]) and float(dense.sum()) == float(dense.sum())
        passes += 1
    print("passes", passes, flush=True)
""")


def _python(code: str, *args: str, **kw) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.Popen([sys.executable, "-c", code, *args], env=env, cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, **kw)


def _data(tmp_path: Path, rows: int = 40_000) -> None:
    generate(str(tmp_path / "gen"), rows, 2_000, fmt="tsv", seed=5, vocab_rows=3_000)


def _leftovers(cache: Path) -> list[str]:
    """Build directories no manifest names (a store's build, or one it replaced and keeps for its
    readers), and half-written manifests."""
    manifests = [json.loads(m.read_text()) for m in cache.glob("*/store.json")]
    named = {m["dir"] for m in manifests} | {r["dir"] for m in manifests for r in m["replaced"]}
    return sorted([p.name for p in cache.glob("*/b-*") if p.name not in named]
                  + [p.name for p in cache.glob("*/store.json.tmp*")])


def test_three_runs_building_one_store_at_once_get_the_same_store(tmp_path):
    _data(tmp_path)
    procs = [_python(_BUILD, str(tmp_path), "") for _ in range(3)]
    outs = []
    for p in procs:
        out, err = p.communicate(timeout=300)
        assert p.returncode == 0, err[-3000:]
        outs.append(json.loads(out.strip().splitlines()[-1]))
    assert len({json.dumps({k: v[:2] for k, v in o.items()}) for o in outs}) == 1
    assert sum(not o["train"][2] for o in outs) == 1  # one built it, the others waited and reused it
    assert _leftovers(tmp_path / "cache") == []
    assert len(list((tmp_path / "cache").glob("*/b-*"))) == 2


def test_a_reader_of_a_store_lives_through_its_rebuild(tmp_path):
    """The store is rebuilt (its input changed in the middle, found by verify_data) while another
    process reads it memory-mapped: the reader keeps the rows it opened, without a bus error,
    and the next reader gets the new ones."""
    _data(tmp_path)
    first = _python(_BUILD, str(tmp_path), "")
    out, err = first.communicate(timeout=300)
    assert first.returncode == 0, err[-3000:]
    uri = json.loads(out.strip().splitlines()[-1])["train"][0]
    reader = _python(_READ, uri, "8")
    assert reader.stdout.readline().strip() == "ready"
    train = tmp_path / "gen" / "train.tsv"
    st = train.stat()
    raw = bytearray(train.read_bytes())
    at = raw.index(b"\n", len(raw) // 2) + 1
    raw[at] = ord("1") if raw[at] == ord("0") else ord("0")
    train.write_bytes(bytes(raw))
    os.utime(train, ns=(st.st_atime_ns, st.st_mtime_ns))
    t0 = time.monotonic()
    rebuild = _python(_BUILD, str(tmp_path), "verify")
    out, err = rebuild.communicate(timeout=300)
    assert rebuild.returncode == 0, err[-3000:]
    assert "its bytes changed" in err and json.loads(out.strip().splitlines()[-1])["train"][2] is False
    assert time.monotonic() - t0 < 8, "the rebuild must finish while the reader still reads"
    rest, err = reader.communicate(timeout=60)
    assert reader.returncode == 0, f"reader died ({reader.returncode}): {err[-2000:]}"
    assert int(rest.split()[-1]) >= 1
    assert _leftovers(tmp_path / "cache") == []
    assert json.loads(out.strip().splitlines()[-1])["train"][0] != uri  # the next run reads the new build


def test_a_file_copied_over_with_its_size_and_time_kept_makes_another_store(tmp_path):
    """`cp -p` of other data of the same size over an input (its time restored, as rsync -a and
    tar leave it): the next run builds a store of the new bytes, it does not reuse the old one."""
    _data(tmp_path, rows=20_000)
    first = _python(_BUILD, str(tmp_path), "")
    out, err = first.communicate(timeout=300)
    assert first.returncode == 0, err[-3000:]
    before = json.loads(out.strip().splitlines()[-1])["train"]
    train = tmp_path / "gen" / "train.tsv"
    other = tmp_path / "other.tsv"
    text = train.read_text().splitlines(keepends=True)
    other.write_text("".join(("1" if line[0] == "0" else "0") + line[1:] for line in text))  # every label flipped
    st = train.stat()
    os.utime(other, ns=(st.st_atime_ns, st.st_mtime_ns))
    subprocess.run(["cp", "-p", str(other), str(train)], check=True)
    assert train.stat().st_size == st.st_size and train.stat().st_mtime_ns == st.st_mtime_ns
    second = _python(_BUILD, str(tmp_path), "")
    out, err = second.communicate(timeout=300)
    assert second.returncode == 0, err[-3000:]
    after = json.loads(out.strip().splitlines()[-1])["train"]
    assert after[2] is False and after[0] != before[0]
    code = ("import sys, numpy as np\nfrom core.store import MicrobatchStore\n"
            "a, b = MicrobatchStore(sys.argv[1]), MicrobatchStore(sys.argv[2])\n"
            "print(all(np.array_equal(a.get(i)[0], 1 - b.get(i)[0]) for i in range(len(a))))")
    check = _python(code, before[0], after[0])
    out, err = check.communicate(timeout=120)
    assert out.strip() == "True", err[-2000:]
