"""cluster.yaml is a valid Ray cluster-launcher config by Ray's own schema, and it installs
this project on every node."""

from pathlib import Path

import pytest
import yaml

pytestmark = pytest.mark.timeout(60)

ROOT = Path(__file__).resolve().parents[2]


def _validate(config: dict) -> None:
    from ray.autoscaler._private.util import prepare_config, validate_config

    validate_config(prepare_config(config))


def test_cluster_yaml_validates_against_rays_schema():
    config = yaml.safe_load((ROOT / "cluster.yaml").read_text())
    _validate(config)
    assert any("dev.sh setup" in c for c in config["setup_commands"])
    assert config["file_mounts"]["~/cpr"] == "."


def test_the_schema_check_catches_a_broken_config():
    config = yaml.safe_load((ROOT / "cluster.yaml").read_text())
    del config["available_node_types"]["trainer"]["node_config"]
    with pytest.raises(Exception, match="node_config"):
        _validate(config)


def test_shipped_run_configs_validate():
    from core.config import load_config

    for path in sorted((ROOT / "configs").glob("*.yaml")):
        load_config(path)
