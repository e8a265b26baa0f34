"""What every host must see (app.storage), checked in this process: the probe and the cache."""

from __future__ import annotations

from pathlib import Path

from core.checkpoint import local_path
from core.storage import expected_files, problems


def test_the_driver_sees_what_it_wrote_and_a_host_with_other_files_does_not(tmp_path):
    cache = tmp_path / "cache.arrow"
    cache.write_bytes(b"x" * 100)
    want = expected_files([str(cache)], str(tmp_path / "ckpt"), "run1")
    probe = next(p for p, w in want.items() if w["field"] == "checkpoint.storage")
    assert Path(probe).parent == tmp_path / "ckpt" and Path(probe).exists()
    assert problems(want) == []

    Path(probe).write_text("another host's file of the same name")
    cache.write_bytes(b"x" * 99)
    found = problems(want)
    assert len(found) == 2
    assert any(f.startswith("checkpoint.storage: ") and "another file here" in f for f in found)
    assert any(f.startswith("data.cache_dir: ") and "99 bytes, the driver's has 100" in f for f in found)

    Path(probe).unlink()
    cache.unlink()
    assert all("is not there" in f for f in problems(want))


def test_object_store_checkpoints_are_not_probed(tmp_path):
    cache = tmp_path / "c.arrow"
    cache.write_bytes(b"1")
    assert local_path("s3://bucket/run") is None
    assert local_path("file:///mnt/x") == "/mnt/x" and local_path("/mnt/x") == "/mnt/x"
    assert list(expected_files([str(cache)], "s3://bucket/run", "r")) == [str(cache)]
