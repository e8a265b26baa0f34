"""Config validation: a bad value fails at start, naming the field and the allowed range."""

import pytest

from core.config import MOVED_FIELDS, RunConfig, config_from_dict, load_config
from core.errors import ConfigError

pytestmark = pytest.mark.timeout(60)

BASE = {"data": {"train": ["t.tsv"], "eval": ["e.tsv"]}}


def _with(section, key, value):
    raw = {**BASE, section: {key: value}}
    return raw


def test_defaults_are_valid():
    cfg = config_from_dict(BASE)
    assert cfg.embeddings.num_shards == 2
    assert cfg.model.rows_per_table == [100_000] * 26


@pytest.mark.parametrize(
    "section,key,value,expect",
    [
        ("training", "num_trainers", 0, r"training\.num_trainers: .*greater than or equal to 1"),
        ("training", "microbatches_per_step", -3, r"training\.microbatches_per_step"),
        ("embeddings", "learning_rate", 0, r"embeddings\.learning_rate: .*greater than 0"),
        ("embeddings", "sharding", "diagonal", r"embeddings\.sharding: .*'table_wise' or 'row_wise'"),
        ("model", "embedding_dim", 0, r"model\.embedding_dim"),
        ("model", "table_rows", [10] * 25, r"model\.table_rows: .*list of 26"),
        ("model", "max_ind_range", 0, r"model\.max_ind_range: .*greater than or equal to 1"),
        ("model", "max_ind_range", 2**32 + 1, r"model\.max_ind_range: .*less than or equal to 4294967296"),
        ("training", "epochs", "many", r"training\.epochs"),
        ("training", "microbatch_rowz", 5, r"training\.microbatch_rowz: Extra inputs"),
    ],
)
def test_bad_value_names_field_and_range(section, key, value, expect):
    with pytest.raises(ConfigError, match=expect):
        config_from_dict(_with(section, key, value))


def test_dense_arch_must_end_with_embedding_dim():
    with pytest.raises(ConfigError, match="dense_arch must end with embedding_dim=8"):
        config_from_dict({**BASE, "model": {"embedding_dim": 8, "dense_arch": [32, 16]}})


def test_max_ind_range_caps_every_table():
    rows = [10, 5_000] + [100] * 24
    cfg = config_from_dict({**BASE, "model": {"table_rows": rows, "max_ind_range": 1_000}})
    assert cfg.model.table_rows == rows  # as written; the cap applies where tables are sized
    assert cfg.model.rows_per_table == [10, 1_000] + [100] * 24
    assert config_from_dict({**BASE, "model": {"table_rows": 7, "max_ind_range": 5}}).model.rows_per_table == [5] * 26
    with pytest.raises(ConfigError, match=r"needs every table to have >= num_shards=4 rows; the smallest has 3"):
        config_from_dict(
            {**BASE, "model": {"max_ind_range": 3}, "embeddings": {"num_shards": 4, "sharding": "row_wise"}}
        )


def test_table_wise_shards_limited_by_tables():
    with pytest.raises(ConfigError, match="num_shards=27 exceeds 26 tables"):
        config_from_dict({**BASE, "embeddings": {"num_shards": 27}})


def test_connect_timeout_at_most_collective_timeout():
    with pytest.raises(ConfigError, match=r"training: .*connect_timeout_s=90.0 must be at most collective_timeout_s=60.0"):
        config_from_dict({**BASE, "training": {"connect_timeout_s": 90}})


def test_missing_data_section():
    with pytest.raises(ConfigError, match=r"data: Field required"):
        config_from_dict({})


def test_yaml_file_and_overrides(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("data: {train: [a.tsv], eval: [b.tsv]}\ntraining: {epochs: 2}\n")
    cfg = load_config(p, {"training.num_trainers": 3, "embeddings.sharding": "row_wise"})
    assert cfg.training.epochs == 2 and cfg.training.num_trainers == 3
    assert cfg.embeddings.sharding == "row_wise"
    with pytest.raises(ConfigError, match="config file not found"):
        load_config(tmp_path / "nope.yaml")


def test_shipped_configs_validate():
    for name in ["configs/local.yaml", "configs/criteo_kaggle.yaml", "configs/object_storage.yaml"]:
        load_config(name)


def _has_field(dotted: str) -> bool:
    model = RunConfig
    for name in dotted.split("."):
        field = getattr(model, "model_fields", {}).get(name)
        if field is None:
            return False
        model = field.annotation
    return True


def test_every_moved_field_lives_at_its_new_place_only():
    assert MOVED_FIELDS  # the history has at least training.max_trainer_failures
    for old, new in MOVED_FIELDS.items():
        assert _has_field(new) and not _has_field(old), (old, new)


def test_a_moved_field_names_its_new_place():
    with pytest.raises(ConfigError) as refused:
        config_from_dict(_with("training", "max_trainer_failures", 5))
    assert str(refused.value) == "invalid config: training.max_trainer_failures: moved to budgets.max_trainer_failures"
    with pytest.raises(ConfigError, match="training.max_trainer_failures: moved to budgets.max_trainer_failures"):
        load_config("configs/local.yaml", {"training.max_trainer_failures": 5})
    cfg = load_config("configs/local.yaml", {"budgets.max_trainer_failures": 5})  # the new place takes it
    assert cfg.budgets.max_trainer_failures == 5


def test_an_override_below_a_value_that_is_no_section_is_refused(tmp_path):
    with pytest.raises(ConfigError, match=r"--set recovery.mode: recovery is 'partial', not a section with fields"):
        load_config("configs/local.yaml", {"recovery.mode": "full"})
    with pytest.raises(ConfigError, match=r"--set data.train.x: data.train is \['data/local/train.tsv'\], not a sect"):
        load_config("configs/local.yaml", {"data.train.x": 1})
    p = tmp_path / "c.yaml"
    p.write_text("data: {train: [a.tsv], eval: [b.tsv]}\nfaults:\n")  # a section left empty
    assert load_config(p, {"faults.max_failures": 1}).faults.max_failures == 1


def test_a_config_that_cannot_be_read_is_refused(tmp_path):
    with pytest.raises(ConfigError, match="cannot read the config"):
        load_config(tmp_path)
    (tmp_path / "bin.yaml").write_bytes(b"\xff\xfe\x00")
    with pytest.raises(ConfigError, match="cannot read the config"):
        load_config(tmp_path / "bin.yaml")


def test_a_config_that_is_not_yaml_is_refused_in_one_line(tmp_path):
    p = tmp_path / "bad.yaml"
    p.write_text("data: {train: [a\nmodel: x: y\n")
    with pytest.raises(ConfigError) as refused:
        load_config(p)
    assert str(refused.value) == f"{p}: not valid YAML at line 2, column 6: expected ',' or ']', but got ':'"
