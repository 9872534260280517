"""config.json values of the Phi-3, Granite and Gemma 3 checkpoints that transformers' config
takes but the model cannot run (a division by zero, a complex attention scale, an odd
rotary width) are ValueErrors naming the field when the model is built, not a crash in a
kernel or NaN logits at the first request."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from raylm.engine.arg_utils import EngineArgs
from raylm.models import get_model
from tiny_models import build_tiny_gemma3, build_tiny_granite, build_tiny_phi3

BUILDERS: dict[str, Callable[[Path], Path]] = {
    "phi3": lambda path: build_tiny_phi3(path, longrope=False),
    "granite": build_tiny_granite,
    "gemma3": build_tiny_gemma3,
}


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("config_values")
    return {arch: build(root / arch) for arch, build in BUILDERS.items()}


def _with_config(model_dir: Path, path: Path, values: dict) -> Path:
    """A copy of model_dir whose config.json sets `values` (partial_rotary_factor also
    inside rope_parameters, where transformers 5 reads it; a key "rope_parameters.<layer
    type>.<key>" inside that layer type's rope settings)."""
    shutil.copytree(model_dir, path)
    config = json.loads((path / "config.json").read_text())
    for key, value in values.items():
        if key.startswith("rope_parameters."):
            _, layer_type, rope_key = key.split(".")
            config["rope_parameters"][layer_type][rope_key] = value
        else:
            config[key] = value
    if "partial_rotary_factor" in values and isinstance(config.get("rope_parameters"), dict):
        config["rope_parameters"]["partial_rotary_factor"] = values["partial_rotary_factor"]
    (path / "config.json").write_text(json.dumps(config))
    return path


@pytest.mark.parametrize("arch, values, message", [
    ("phi3", {"partial_rotary_factor": 0.3125}, "partial_rotary_factor 0.3125 rotates 5 of each head's 16"),
    ("granite", {"logits_scaling": 0.0}, "config.logits_scaling must be a finite non-zero number"),
    ("gemma3", {"query_pre_attn_scalar": 0}, "config.query_pre_attn_scalar must be a positive finite number"),
    ("gemma3", {"query_pre_attn_scalar": -4}, "config.query_pre_attn_scalar must be a positive finite number"),
    # A zero base was replaced by the default one (10k) where transformers' model makes NaN.
    ("gemma3", {"rope_parameters.sliding_attention.rope_theta": 0}, "rope_theta must be a positive finite number"),
])
def test_config_values_the_model_cannot_run_are_errors_naming_the_field(model_dirs, tmp_path, arch, values,
                                                                      message):
    model_dir = _with_config(model_dirs[arch], tmp_path / arch, values)
    model_config = EngineArgs(model=str(model_dir), dtype="float32", device="cpu").create_engine_config().model_config
    with pytest.raises(ValueError, match=message):
        get_model(model_config, torch.device("cpu"))
