"""Checks `ray up` cluster configurations with Ray's own validation, before a launch.

`ray up` fills a config out with its provider's defaults (`prepare_config`) and checks the
result against Ray's cluster schema (`validate_config`); this runs the same two steps, so
an unknown key, a missing head node type or a bad resource value fails here, not on a
cloud bill. On top, raylm's own rules for shipped configs: the dashboard/job endpoint is
bound to the head's loopback and every node starts Ray with token authentication.

    python -m raylm.cluster.validate_config cluster/configs/*.yaml
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import yaml

CONFIG_DIR = Path(__file__).parent / "configs"


class ClusterConfigError(ValueError):
    """A cluster config that `ray up` would reject, or that breaks raylm's security rules."""


def shipped_configs() -> list[Path]:
    """The cluster configs this package ships (cluster/configs/*.yaml)."""
    return sorted(CONFIG_DIR.glob("*.yaml"))


def validate_cluster_config(config: dict[str, Any], name: str = "config") -> dict[str, Any]:
    """Returns the config as `ray up` would fill it out; raises ClusterConfigError if Ray's
    validation or raylm's rules reject it."""
    from ray.autoscaler._private.util import prepare_config, validate_config

    if not isinstance(config, dict):
        raise ClusterConfigError(f"{name}: a cluster config must be a YAML mapping, got {type(config).__name__}")
    try:
        prepared = prepare_config(config)
        validate_config(prepared)
    # jsonschema's ValidationError is a ValueError subclass in spirit only; the local
    # provider aborts through click; missing keys surface as KeyError.
    except Exception as error:  # noqa: BLE001 - every rejection becomes one error type
        message = getattr(error, "message", None) or str(error) or type(error).__name__
        path = "/".join(str(p) for p in getattr(error, "absolute_path", []) or [])
        where = f" at {path}" if path else ""
        raise ClusterConfigError(f"{name}: Ray rejects this cluster config{where}: {message}") from error
    check_security(prepared, name)
    return prepared


def check_security(config: dict[str, Any], name: str = "config") -> None:
    """raylm's rules: the head binds the dashboard to 127.0.0.1 and every `ray start`
    runs with RAY_AUTH_MODE=token."""
    head = " ".join(config.get("head_start_ray_commands", []))
    if "--dashboard-host=127.0.0.1" not in head:
        raise ClusterConfigError(f"{name}: head_start_ray_commands must start Ray with --dashboard-host=127.0.0.1; "
                                 "the job endpoint runs arbitrary code and must stay on the head's loopback")
    for key in ("head_start_ray_commands", "worker_start_ray_commands"):
        for command in config.get(key, []):
            if "ray start" in command and "RAY_AUTH_MODE=token" not in command:
                raise ClusterConfigError(f"{name}: {key} runs {command!r} without RAY_AUTH_MODE=token; "
                                         "every node must start Ray with token authentication")


def validate_file(path: str | Path) -> dict[str, Any]:
    """Loads a YAML cluster config and validates it (see validate_cluster_config)."""
    path = Path(path)
    try:
        config = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as error:
        raise ClusterConfigError(f"{path}: cannot read it as YAML: {error}") from error
    return validate_cluster_config(config, str(path))


def main(argv: list[str] | None = None) -> int:
    paths = (sys.argv[1:] if argv is None else argv) or [str(p) for p in shipped_configs()]
    failed = 0
    for path in paths:
        try:
            validate_file(path)
            print(f"ok      {path}")
        except ClusterConfigError as error:
            failed += 1
            print(f"invalid {error}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
