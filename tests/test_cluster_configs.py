"""The shipped `ray up` configs pass Ray's own cluster-config validation, and broken ones do not.

The reference is Ray's schema and `prepare_config`, the checks `ray up` itself applies.
"""

from __future__ import annotations

import copy

import pytest
import yaml

from raylm.cluster.validate_config import (ClusterConfigError, main, shipped_configs, validate_cluster_config,
                                           validate_file)

SHIPPED = shipped_configs()


@pytest.fixture()
def aws_config() -> dict:
    return yaml.safe_load(next(p for p in SHIPPED if p.name == "aws-gpu.yaml").read_text())


def test_the_aws_gcp_and_onprem_configs_are_shipped():
    assert {p.name for p in SHIPPED} >= {"aws-gpu.yaml", "gcp-gpu.yaml", "local-onprem.yaml"}


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.name)
def test_every_shipped_config_validates(path):
    prepared = validate_file(path)
    assert prepared["head_node_type"] in prepared["available_node_types"]


@pytest.mark.parametrize("path", [p for p in SHIPPED if p.name != "local-onprem.yaml"], ids=lambda p: p.name)
def test_cloud_head_nodes_have_no_gpu_and_workers_do(path):
    config = yaml.safe_load(path.read_text())
    types = config["available_node_types"]
    assert types[config["head_node_type"]]["resources"].get("GPU", 0) == 0
    assert any(t["resources"].get("GPU", 0) > 0 for name, t in types.items() if name != config["head_node_type"])


def test_an_unknown_top_level_key_is_rejected(aws_config):
    aws_config["max_wrokers"] = 4
    with pytest.raises(ClusterConfigError, match="max_wrokers"):
        validate_cluster_config(aws_config)


def test_an_unknown_node_type_key_is_rejected(aws_config):
    aws_config["available_node_types"]["gpu_worker_8x"]["resorces"] = {"GPU": 8}
    with pytest.raises(ClusterConfigError, match="resorces"):
        validate_cluster_config(aws_config)


def test_a_missing_head_node_type_is_rejected(aws_config):
    del aws_config["head_node_type"]
    with pytest.raises(ClusterConfigError, match="head_node_type"):
        validate_cluster_config(aws_config)


def test_a_head_node_type_that_is_not_a_node_type_is_rejected(aws_config):
    aws_config["head_node_type"] = "gpu_head"
    with pytest.raises(ClusterConfigError, match="head_node_type"):
        validate_cluster_config(aws_config)


@pytest.mark.parametrize("value", ["eight", -1, 0.5])
def test_a_bad_resource_value_is_rejected(aws_config, value):
    aws_config["available_node_types"]["gpu_worker_8x"]["resources"]["GPU"] = value
    with pytest.raises(ClusterConfigError, match="GPU"):
        validate_cluster_config(aws_config)


def test_a_dashboard_open_to_the_network_is_rejected(aws_config):
    aws_config["head_start_ray_commands"] = [c.replace("--dashboard-host=127.0.0.1", "--dashboard-host=0.0.0.0")
                                             for c in aws_config["head_start_ray_commands"]]
    with pytest.raises(ClusterConfigError, match="dashboard-host"):
        validate_cluster_config(aws_config)


def test_a_worker_without_token_auth_is_rejected(aws_config):
    aws_config["worker_start_ray_commands"] = [c.replace("RAY_AUTH_MODE=token ", "")
                                               for c in aws_config["worker_start_ray_commands"]]
    with pytest.raises(ClusterConfigError, match="RAY_AUTH_MODE=token"):
        validate_cluster_config(aws_config)


def test_validation_leaves_the_callers_config_untouched(aws_config):
    original = copy.deepcopy(aws_config)
    validate_cluster_config(aws_config)
    assert aws_config == original


def test_the_cli_exits_nonzero_on_a_broken_file_and_names_it(tmp_path, aws_config, capsys):
    aws_config["available_node_types"]["head"]["resources"]["CPU"] = "lots"
    broken = tmp_path / "broken.yaml"
    broken.write_text(yaml.safe_dump(aws_config))
    assert main([str(SHIPPED[0]), str(broken)]) == 1
    out = capsys.readouterr().out
    assert f"ok      {SHIPPED[0]}" in out and f"invalid {broken}" in out
