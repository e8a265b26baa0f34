"""What every host must see (app.storage), checked in this process: the probes in the local
directories a run shares (the microbatch store's and the checkpoints')."""

from __future__ import annotations

from pathlib import Path

from core.checkpoint import local_path
from core.storage import expected_files, problems


def test_the_driver_sees_what_it_wrote_and_a_host_with_other_files_does_not(tmp_path):
    want = expected_files(str(tmp_path / "cache"), str(tmp_path / "ckpt"), "run1")
    probes = {w["field"]: Path(p) for p, w in want.items()}
    assert set(probes) == {"data.cache_dir", "checkpoint.storage"}
    assert probes["checkpoint.storage"].parent == tmp_path / "ckpt" and probes["data.cache_dir"].parent == tmp_path / "cache"
    assert problems(want) == []

    probes["checkpoint.storage"].write_text("another host's file of the same name")
    found = problems(want)
    assert len(found) == 1 and found[0].startswith("checkpoint.storage: ") and "another file here" in found[0]

    for p in probes.values():
        p.unlink()
    found = problems(want)
    assert len(found) == 2 and all("is not there" in f for f in found)
    assert any(f.startswith("data.cache_dir: ") for f in found)


def test_object_store_uris_are_not_probed(tmp_path):
    assert local_path("s3://bucket/run") is None
    assert local_path("file:///mnt/x") == "/mnt/x" and local_path("/mnt/x") == "/mnt/x"
    assert expected_files("s3://bucket/cache", "s3://bucket/run", "r") == {}
    only_local = expected_files(str(tmp_path / "cache"), "gs://bucket/run", "r")
    assert [w["field"] for w in only_local.values()] == ["data.cache_dir"]


def test_local_input_files_must_be_the_same_on_every_host(tmp_path):
    day = tmp_path / "day_0"
    day.write_text("x" * 10)
    want = expected_files("s3://b/cache", "s3://b/ckpt", "r", (("data.train", str(day), 10),))
    assert problems(want) == []
    day.write_text("another host's day_0")
    (found,) = problems(want)
    assert found.startswith("data.train: ") and "the driver's has 10" in found
