"""data.generate writes only into the generator's own directory, never over a file, and a
missing input it must not write is one error naming the field and the path (issue 42: a
user's train.tsv became synthetic rows when the eval path had a typo)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from app.dataprep import resolve_data
from core.config import config_from_dict
from core.errors import ConfigError

GEN = {"train_rows": 300, "eval_rows": 50, "seed": 0, "format": "tsv", "vocab_rows": 100}
LINE = "1\t" + "\t".join(["3"] * 13) + "\t" + "\t".join(["0a1b2c3d"] * 26) + "\n"


def _config(tmp_path: Path, train: list[str], eval_: list[str], **gen):
    return config_from_dict({"run_dir": str(tmp_path / "run"),
                             "data": {"train": train, "eval": eval_, "generate": {**GEN, **gen}}})


def _tree(root: Path) -> dict[str, int]:
    return {str(p.relative_to(root)): p.stat().st_ino for p in sorted(root.rglob("*"))}


def test_a_typo_in_the_eval_path_leaves_the_users_training_file_alone(tmp_path):
    mine = tmp_path / "mydata"
    mine.mkdir()
    (mine / "train.tsv").write_text(LINE * 1200)
    before = (mine / "train.tsv").read_bytes()
    cfg = _config(tmp_path, [str(mine / "train.tsv")], [str(mine / "evl.tsv")])
    with pytest.raises(ConfigError, match=r"^data.eval: .*/mydata/evl.tsv does not exist \(data.generate writes only"):
        resolve_data(cfg)
    assert (mine / "train.tsv").read_bytes() == before and sorted(os.listdir(mine)) == ["train.tsv"]


def test_a_missing_eval_beside_a_users_training_file_is_an_error_not_synthetic_data(tmp_path):
    mine = tmp_path / "mydata"
    mine.mkdir()
    (mine / "train.tsv").write_text(LINE * 10)
    cfg = _config(tmp_path, [str(mine / "train.tsv")], [str(mine / "eval.tsv")])
    with pytest.raises(ConfigError, match=r"^data.eval: .*/mydata/eval.tsv does not exist; data.generate writes "
                                          r"only into a directory of its own, and .*/mydata holds files it did not"):
        resolve_data(cfg)
    assert sorted(os.listdir(mine)) == ["train.tsv"]


def test_a_path_the_config_merely_names_is_never_created(tmp_path):
    cfg = _config(tmp_path, [str(tmp_path / "nope" / "x.tsv")], [str(tmp_path / "nope" / "eval.tsv")])
    with pytest.raises(ConfigError, match=r"^data.train: .*/nope/x.tsv does not exist"):
        resolve_data(cfg)
    assert not (tmp_path / "nope").exists()


def test_the_generator_writes_into_its_own_directory_once_and_file_uris_name_it(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    gen = tmp_path / "data" / "local"
    cfg = _config(tmp_path, [f"file://{gen}/train.tsv"], [f"file://{gen}/eval.tsv"])
    inputs = resolve_data(cfg)
    assert [f.name for f in inputs.train] == [f"{gen}/train.tsv"] and inputs.ceiling_auc is not None
    assert sorted(os.listdir(gen)) == ["datagen.json", "eval.tsv", "train.tsv"]
    assert not (tmp_path / "file:").exists()
    tree = _tree(gen)
    resolve_data(cfg)
    assert _tree(gen) == tree  # nothing written again


def test_a_missing_file_of_the_generators_directory_comes_back_without_touching_the_other(tmp_path):
    gen = tmp_path / "gen"
    cfg = _config(tmp_path, [str(gen / "train.tsv")], [str(gen / "eval.tsv")])
    resolve_data(cfg)
    whole = (gen / "eval.tsv").read_bytes()
    train_inode = (gen / "train.tsv").stat().st_ino
    (gen / "eval.tsv").unlink()
    resolve_data(cfg)
    assert (gen / "eval.tsv").read_bytes() == whole and (gen / "train.tsv").stat().st_ino == train_inode
    assert sorted(os.listdir(gen)) == ["datagen.json", "eval.tsv", "train.tsv"]


def test_a_generators_directory_made_with_other_parameters_is_used_whole_never_completed(tmp_path):
    gen = tmp_path / "gen"
    resolve_data(_config(tmp_path, [str(gen / "train.tsv")], [str(gen / "eval.tsv")]))
    tree = _tree(gen)
    # the files are there: used as they are (a config's data.generate left in place over other files)
    resolve_data(_config(tmp_path, [str(gen / "train.tsv")], [str(gen / "eval.tsv")], train_rows=400))
    assert _tree(gen) == tree
    (gen / "eval.tsv").unlink()  # one missing: generated now it would not match the other
    with pytest.raises(ConfigError, match=r"^data.generate: .*/gen holds data generated with train_rows=300 "
                                          r"\(config: 400\); remove .*/gen to generate it again"):
        resolve_data(_config(tmp_path, [str(gen / "train.tsv")], [str(gen / "eval.tsv")], train_rows=400))
    assert sorted(os.listdir(gen)) == ["datagen.json", "train.tsv"]


def test_another_runs_generation_in_progress_is_not_a_foreign_file(tmp_path):
    gen = tmp_path / "gen"
    (gen / ".generating-0123456789ab").mkdir(parents=True)  # another run generating at this moment
    resolve_data(_config(tmp_path, [str(gen / "train.tsv")], [str(gen / "eval.tsv")]))
    assert {"datagen.json", "eval.tsv", "train.tsv"} <= set(os.listdir(gen))


def test_half_a_directory_of_unknown_parameters_is_not_completed(tmp_path):
    """A datagen.json that does not record seed and vocabulary (cpr datagen before this, or by
    hand): a file generated now could come from another hidden model than the one left."""
    gen = tmp_path / "gen"
    cfg = _config(tmp_path, [str(gen / "train.tsv")], [str(gen / "eval.tsv")])
    resolve_data(cfg)
    summary = json.loads((gen / "datagen.json").read_text())
    del summary["parameters"]
    (gen / "datagen.json").write_text(json.dumps(summary))
    (gen / "eval.tsv").unlink()
    with pytest.raises(ConfigError, match=r"^data.eval: .*/gen/eval.tsv does not exist, and .*datagen.json does "
                                          r"not say how train.tsv was generated"):
        resolve_data(cfg)
    assert sorted(os.listdir(gen)) == ["datagen.json", "train.tsv"]


def test_cpr_datagen_never_writes_over_a_file(tmp_path):
    from click.testing import CliRunner

    from app.cli import main

    out = tmp_path / "mine"
    out.mkdir()
    (out / "train.tsv").write_text(LINE)
    result = CliRunner().invoke(main, ["datagen", "--rows", "50", "--out", str(out)])
    assert isinstance(result.exception, ConfigError) and f"{out / 'train.tsv'} exists" in str(result.exception)
    assert (out / "train.tsv").read_text() == LINE and sorted(os.listdir(out)) == ["train.tsv"]
    fresh = CliRunner().invoke(main, ["datagen", "--rows", "50", "--out", str(tmp_path / "new")])
    assert fresh.exit_code == 0, fresh.output
    assert sorted(os.listdir(tmp_path / "new")) == ["datagen.json", "eval.tsv", "train.tsv"]
    assert json.loads((tmp_path / "new" / "datagen.json").read_text())["parameters"]["train_rows"] == 50


@pytest.mark.parametrize("summary", ["{not json", "[1, 2]", '{"ceiling_auc": "high"}'])
def test_a_datagen_json_that_does_not_read_beside_a_users_data_costs_only_the_ceiling(tmp_path, summary):
    """Without data.generate, datagen.json beside the training file only lends the report its
    ceiling AUC: one that does not parse or holds something else is no ceiling, not a traceback
    (json.loads raised out of resolve_data before)."""
    mine = tmp_path / "mydata"
    mine.mkdir()
    for name in ("train.tsv", "eval.tsv"):
        (mine / name).write_text(LINE * 10)
    (mine / "datagen.json").write_text(summary)
    cfg = config_from_dict({"run_dir": str(tmp_path / "run"),
                            "data": {"train": [str(mine / "train.tsv")], "eval": [str(mine / "eval.tsv")]}})
    assert resolve_data(cfg).ceiling_auc is None
