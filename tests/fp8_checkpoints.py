"""FP8 checkpoints written from a tiny model, in the layouts real ones carry, each with its
reference: a plain fp32 checkpoint holding the weights they stand for (`fp8.float() * scale`
of each element's tensor, row or block, by the format's definition), for Hugging Face.

Layouts (what `quantization_config` and the tensors look like):
- "fp8-tensor": quant_method "fp8" (AutoFP8 / vLLM's Fp8Config): 0-d `weight_scale`, and a
  0-d `input_scale` per layer under activation_scheme "static";
- "fp8-block": quant_method "fp8" with weight_block_size: `weight_scale_inv` per block
  (DeepSeek-V3, Qwen3-FP8);
- "ct-tensor", "ct-channel", "ct-block": compressed-tensors (llm-compressor's FP8 /
  FP8_DYNAMIC): `weight_scale` of shape [1], [out, 1] or per block, `input_scale` [1] when static.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
LINEAR_NAMES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "w1", "w2", "w3")


def is_linear_weight(name: str) -> bool:
    return any(name.endswith(f".{linear}.weight") for linear in LINEAR_NAMES)


def quantize(weight: torch.Tensor, strategy: str, block: tuple[int, int] | None = None
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(fp8 weight, scale, dequantized fp32 weight) by amax / 448 over the tensor, each row
    or each block."""
    w = weight.float()
    if strategy == "tensor":
        scale = w.abs().amax() / FP8_MAX
        expanded = scale
    elif strategy == "channel":
        scale = w.abs().amax(dim=1, keepdim=True) / FP8_MAX
        expanded = scale
    else:
        rows, columns = block
        grid = (-(-w.shape[0] // rows), -(-w.shape[1] // columns))
        scale = torch.empty(grid)
        for i in range(grid[0]):
            for j in range(grid[1]):
                scale[i, j] = w[i * rows:(i + 1) * rows, j * columns:(j + 1) * columns].abs().amax() / FP8_MAX
        expanded = scale.repeat_interleave(rows, 0)[:w.shape[0]].repeat_interleave(columns, 1)[:, :w.shape[1]]
    q = (w / expanded).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return q, scale, q.float() * expanded


def _compressed_tensors_config(strategy: str, block: tuple[int, int] | None, static: bool,
                               ignore: list[str]) -> dict:
    weights = {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": False, "strategy": strategy,
               "group_size": None, "block_structure": list(block) if block else None, "observer": "minmax"}
    activations = ({"num_bits": 8, "type": "float", "symmetric": True, "dynamic": False, "strategy": "tensor",
                    "observer": "minmax"} if static else
                   {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": True, "strategy": "token",
                    "observer": None})
    return {"quant_method": "compressed-tensors", "format": "float-quantized", "quantization_status": "compressed",
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": activations,
                                          "output_activations": None, "format": "float-quantized"}},
            "ignore": ignore, "kv_cache_scheme": None}


def write_fp8_checkpoint(source: Path, quantized: Path, dequantized: Path, layout: str,
                         block: tuple[int, int] | None = None, static: bool = False,
                         weight_multipliers: dict[str, float] | None = None) -> dict[str, torch.Tensor]:
    """Writes `quantized` (the FP8 checkpoint) and `dequantized` (its fp32 reference) from
    the tiny model in `source`; `weight_multipliers` scales the weights whose name holds a
    key first (so that, say, k_proj's scale differs from q_proj's). Returns the FP8
    checkpoint's tensors."""
    tensors = load_file(str(source / "model.safetensors"))
    strategy = {"fp8-tensor": "tensor", "fp8-block": "block", "ct-tensor": "tensor", "ct-channel": "channel",
                "ct-block": "block"}[layout]
    fp8_tensors: dict[str, torch.Tensor] = {}
    plain: dict[str, torch.Tensor] = {}
    for name, tensor in tensors.items():
        for key, factor in (weight_multipliers or {}).items():
            if key in name and is_linear_weight(name):
                tensor = tensor * factor
        if not is_linear_weight(name):
            fp8_tensors[name] = plain[name] = tensor
            continue
        q, scale, reference = quantize(tensor, strategy, block)
        prefix = name.removesuffix(".weight")
        fp8_tensors[name] = q
        plain[name] = reference
        if layout == "fp8-block":
            fp8_tensors[prefix + ".weight_scale_inv"] = scale
        else:
            fp8_tensors[prefix + ".weight_scale"] = scale.reshape(1) if layout == "ct-tensor" else scale
        if static:
            # Any positive value: the CPU multiplies in the activations' dtype (W8A16).
            input_scale = torch.tensor(0.01 * (1 + len(prefix) % 3))
            fp8_tensors[prefix + ".input_scale"] = input_scale.reshape(1) if layout.startswith("ct") else input_scale
    config = json.loads((source / "config.json").read_text())
    if layout.startswith("fp8"):
        quantization_config = {"quant_method": "fp8", "activation_scheme": "static" if static else "dynamic",
                               "fmt": "e4m3"}
        if block:
            quantization_config["weight_block_size"] = list(block)
    else:
        quantization_config = _compressed_tensors_config(strategy, block, static, ["lm_head"])
    for folder, weights, extra in ((quantized, fp8_tensors, {"quantization_config": quantization_config}),
                                   (dequantized, plain, {})):
        shutil.copytree(source, folder, ignore=shutil.ignore_patterns("*.safetensors"))
        (folder / "config.json").write_text(json.dumps({**config, **extra}, indent=2))
        save_file({k: v.contiguous() for k, v in weights.items()}, str(folder / "model.safetensors"))
    return fp8_tensors


def write_config_only(source: Path, folder: Path, quantization_config: dict | None, **config_overrides) -> Path:
    """A model folder with config.json (and the tokenizer) but no weights at all: an error
    raised from it was raised before any weight was read."""
    shutil.copytree(source, folder, ignore=shutil.ignore_patterns("*.safetensors"))
    config = {**json.loads((source / "config.json").read_text()), **config_overrides}
    if quantization_config is not None:
        config["quantization_config"] = quantization_config
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    return folder
