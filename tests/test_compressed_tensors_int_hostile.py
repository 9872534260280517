"""Hostile compressed-tensors `pack-quantized` checkpoints (a user's download: config.json and
the safetensors are untrusted): each is a ValueError naming the tensor or field and what is
allowed, never a bare TypeError / NotImplementedError, and never a model that loads and
serves a weight other than the one the checkpoint's tensors describe. The checkpoints are
written by `test_compressed_tensors_int`'s writer, then one tensor or field is made wrong.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import save_file

from test_compressed_tensors_int import ENGINE, pack_quantized_config, write_pack_quantized_checkpoint
from tiny_models import build_tiny_mixtral, build_tiny_model
from raylm.engine import LLM
from raylm.models.quantization import get_quant_config

DOWN = "model.layers.0.mlp.down_proj"  # a row-parallel layer of its own: [64, 128]
K_PROJ = "model.layers.0.self_attn.k_proj"  # one part of the fused qkv_proj: [32, 64]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, tuple[Path, dict[str, torch.Tensor]]]:
    """A symmetric and an asymmetric act-order (weight_g_idx, weight_zero_point) W4A16
    checkpoint of one tiny Llama, with their tensors."""
    root = tmp_path_factory.mktemp("ct_int_hostile")
    source = build_tiny_model(root / "llama", "llama", seed=13)
    return {name: (root / name, write_pack_quantized_checkpoint(source, root / name, root / f"{name}-ref", **options))
            for name, options in {"sym": dict(bits=4),
                                  "asym": dict(bits=4, symmetric=False, actorder="group")}.items()}


def _changed(tensor_name: str, change):
    return lambda tensors: {**tensors, tensor_name: change(tensors[tensor_name])}


# (checkpoint, the change, what the error must say). Each was, before its check, a bare
# exception or a model that loaded without a word.
HOSTILE_TENSORS = {
    # float codes: the unpacking shifts raised NotImplementedError ("rshift_cpu")
    "packed-float32": ("sym", _changed(f"{DOWN}.weight_packed", lambda t: t.float()),
                       rf"{DOWN}.weight_packed is F32; .* qweight tensors must be int32"),
    # uint8 / int64 codes were cast into the int32 parameter: other codes, garbage outputs
    "packed-uint8": ("sym", _changed(f"{DOWN}.weight_packed", lambda t: t.to(torch.uint8)),
                     rf"{DOWN}.weight_packed is U8; .* must be int32"),
    "zero-point-int64": ("asym", _changed(f"{DOWN}.weight_zero_point", lambda t: t.long()),
                         rf"{DOWN}.weight_zero_point is I64; .* qzeros tensors must be int32"),
    "scale-int32": ("sym", _changed(f"{DOWN}.weight_scale", lambda t: (t.float() * 1000).int()),
                    rf"{DOWN}.weight_scale is I32; .* scales tensors must be bfloat16, float16, float32"),
    "g-idx-float32": ("asym", _changed(f"{DOWN}.weight_g_idx", lambda t: t.float() + 0.5),
                      rf"{DOWN}.weight_g_idx is F32; .* g_idx tensors must be int32, int64"),
    # weight_shape's output count (and its dtype, rank) were not read at all
    "weight-shape-more-outputs": ("sym", _changed(f"{DOWN}.weight_shape", lambda t: t * torch.tensor([2, 1])),
                                  rf"{DOWN}.weight_shape is \[128, 128\] .* \[out, in\] = \[64, 128\]"),
    "weight-shape-negative": ("sym", _changed(f"{DOWN}.weight_shape", lambda t: t * torch.tensor([-1, 1])),
                              rf"{DOWN}.weight_shape is \[-64, 128\]"),
    "weight-shape-float": ("sym", _changed(f"{DOWN}.weight_shape", lambda t: t.float()),
                           rf"{DOWN}.weight_shape is F32; .* must be int32, int64"),
    "weight-shape-2d": ("sym", _changed(f"{DOWN}.weight_shape", lambda t: t.view(1, 2)),
                        rf"{DOWN}.weight_shape is \[\[64, 128\]\] \(shape \(1, 2\)\)"),
    "weight-shape-of-a-fused-part": ("sym", _changed(f"{K_PROJ}.weight_shape", lambda t: torch.tensor([64, 64])),
                                     rf"'{K_PROJ}.weight_shape'.*qkv_proj.weight_shape is \[64, 64\] .* the layer "
                                     rf"\(output 'k' of the fused layer\) is \[out, in\] = \[32, 64\]"),
    # a fused part's tensor longer than its outputs: its first columns were taken, the rest dropped
    "fused-part-packed-too-long": ("sym", _changed(f"{K_PROJ}.weight_packed", lambda t: torch.cat([t, t])),
                                   r"QKVParallelLinear shard k has 64 output columns .* expects 32"),
    "fused-part-zero-point-too-long": ("asym", _changed(f"{K_PROJ}.weight_zero_point", lambda t: torch.cat([t, t])),
                                       r"QKVParallelLinear shard k has 8 output columns .* expects 4"),
}


@pytest.mark.parametrize("case", list(HOSTILE_TENSORS))
def test_hostile_pack_quantized_tensor_is_an_error_naming_it(tmp_path, checkpoints, case):
    which, change, message = HOSTILE_TENSORS[case]
    folder, tensors = checkpoints[which]
    hostile = tmp_path / "hostile"
    shutil.copytree(folder, hostile, ignore=shutil.ignore_patterns("*.safetensors"))
    save_file({name: t.contiguous() for name, t in change(tensors).items()}, str(hostile / "model.safetensors"))
    with pytest.raises(ValueError, match=message):
        LLM(model=str(hostile), **ENGINE)


@pytest.mark.parametrize("tensor_name,tensor", [
    (f"{DOWN}.weight_zero_point", torch.full((8, 4), 0x88888888 - (1 << 32), dtype=torch.int32)),
    (f"{DOWN}.weight_g_idx", torch.arange(128, dtype=torch.int32) // 32),
], ids=["zero-point", "g-idx"])
def test_tensor_a_symmetric_config_without_actorder_has_no_place_for_is_an_error(tmp_path, checkpoints, tensor_name,
                                                                                  tensor):
    # As vLLM (CompressedTensorsWNA16 registers weight_zero_point only when not symmetric and
    # weight_g_idx only under actorder "group"; its loader refuses a tensor with no parameter):
    # config and tensors disagree, so neither is trusted. compressed-tensors has written no
    # zero point for symmetric schemes since 2024 (even one of the offset, as here).
    folder, tensors = checkpoints["sym"]
    hostile = tmp_path / "hostile"
    shutil.copytree(folder, hostile, ignore=shutil.ignore_patterns("*.safetensors"))
    save_file({**{k: t.contiguous() for k, t in tensors.items()}, tensor_name: tensor},
              str(hostile / "model.safetensors"))
    with pytest.raises(ValueError, match=rf"checkpoint tensor '{tensor_name}' matches no parameter"):
        LLM(model=str(hostile), **ENGINE)


def test_untouched_checkpoint_of_the_hostile_cases_loads(checkpoints):
    # The cases above fail by their change alone: the same checkpoints load as they are.
    for folder, _ in checkpoints.values():
        LLM(model=str(folder), **ENGINE).shutdown()


def _with(group_changes: dict | None = None, weights_changes: dict | None = None, **top) -> dict:
    config = pack_quantized_config()
    config["config_groups"]["group_0"]["weights"].update(weights_changes or {})
    config["config_groups"]["group_0"].update(group_changes or {})
    return {**config, **top}


# config.json values of the wrong JSON type: each was an AttributeError / TypeError (from
# parsing or from building the layers), or read as something else without a word.
@pytest.mark.parametrize("quantization_config,message", [
    (_with(weights_changes=dict(num_bits=4.0)), r"num_bits must be 4 or 8 .* got 4.0"),
    (_with(config_groups=[{"targets": ["Linear"]}]), r"config_groups must be an object of scheme objects"),
    (_with(config_groups={"group_0": None}), r"config_groups must be an object .* got \{'group_0': None\}"),
    (_with(group_changes=dict(weights=[4, "int"])), r"config_groups\['group_0'\] weights must be an object"),
    (_with(group_changes=dict(targets="re:.*Linear.*")), r"targets 're:.\*Linear.\*'; raylm reads schemes that "
                                                         r"target 'Linear'"),
    (_with(ignore="lm_head"), r"ignore must be a list of module names or 're:' patterns \(strings\), got 'lm_head'"),
    (_with(ignore=["lm_head", None, 3]), r"ignore must be a list .* got \['lm_head', None, 3\]"),
    ({"quant_method": "gptq", "bits": 4.0, "group_size": 32, "desc_act": False, "sym": True},
     r"bits must be 4 or 8, got 4.0"),
    ({"quant_method": "awq", "bits": 4, "group_size": 32, "version": "gemm", "zero_point": True,
      "modules_to_not_convert": "lm_head"}, r"modules_to_not_convert must be a list .* got 'lm_head'"),
], ids=["num-bits-float", "config-groups-list", "config-group-null", "weights-list", "targets-string",
        "ignore-string", "ignore-null-and-number", "gptq-bits-float", "awq-not-convert-string"])
def test_quantization_config_value_of_a_wrong_json_type_is_an_error_naming_the_field(quantization_config, message):
    with pytest.raises(ValueError, match=message):
        get_quant_config(SimpleNamespace(quantization_config=quantization_config), None)


EXPERTS = "model.layers.0.block_sparse_moe.experts"


@pytest.fixture(scope="module")
def mixtral_checkpoint(tmp_path_factory) -> tuple[Path, dict[str, torch.Tensor]]:
    root = tmp_path_factory.mktemp("ct_int_hostile_moe")
    mixtral = build_tiny_mixtral(root / "mixtral", seed=3)
    return root / "ct", write_pack_quantized_checkpoint(mixtral, root / "ct", root / "ref", bits=8)


# An expert's weight_shape was skipped unread: one of another shape, or of an expert the
# layer has not (7 experts), passed without a word.
@pytest.mark.parametrize("name,value,message", [
    (f"{EXPERTS}.1.w1.weight_shape", torch.tensor([96, 32]),
     r"experts.1.w1.weight_shape is \[96, 32\] .* expert 1 gate_proj \(w1\) is \[out, in\] = \[96, 64\]"),
    (f"{EXPERTS}.1.w2.weight_shape", torch.tensor([64.0, 96.0]),
     r"experts.1.w2.weight_shape is F32; .* must be int32, int64"),
    (f"{EXPERTS}.99.w2.weight_shape", torch.tensor([64, 96]),
     r"experts.99.w2.weight_shape'.*expert 99: the layer has experts 0 to 6"),
], ids=["wrong-shape", "float", "expert-out-of-range"])
def test_hostile_expert_weight_shape_is_an_error_naming_it(tmp_path, mixtral_checkpoint, name, value, message):
    folder, tensors = mixtral_checkpoint
    hostile = tmp_path / "hostile"
    shutil.copytree(folder, hostile, ignore=shutil.ignore_patterns("*.safetensors"))
    save_file({**{k: t.contiguous() for k, t in tensors.items()}, name: value}, str(hostile / "model.safetensors"))
    with pytest.raises(ValueError, match=message):
        LLM(model=str(hostile), **ENGINE)


def test_missing_expert_zero_point_is_named_as_the_checkpoint_names_it(tmp_path, mixtral_checkpoint):
    # The missing tensor was named by GPTQ's kind (`w2_qzeros`), which a compressed-tensors
    # checkpoint has not; the asymmetric writer's zero points are `weight_zero_point`.
    folder, tensors = mixtral_checkpoint
    asymmetric = write_pack_quantized_checkpoint(folder.parent / "mixtral", tmp_path / "ct", tmp_path / "ref", bits=8,
                                                 symmetric=False)
    del asymmetric[f"{EXPERTS}.2.w2.weight_zero_point"]
    save_file({k: t.contiguous() for k, t in asymmetric.items()}, str(tmp_path / "ct" / "model.safetensors"))
    with pytest.raises(ValueError, match=r"lacks 1 expert tensors of a MoE layer: expert 2 w2_weight_zero_point\."):
        LLM(model=str(tmp_path / "ct"), **ENGINE)
