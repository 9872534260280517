"""GPTQ and AWQ checkpoints written from a tiny model, packed bit by bit in each format's
order, each with its reference: a plain fp32 checkpoint of the weights they stand for,
`(code - zero) * scale` of each element's group, computed from the integer codes here (never
from the packed tensors).

- GPTQ (AutoGPTQ / GPTQModel): `qweight` int32 [in / (32 / bits), out], code k of row r is
  input row r * (32 / bits) + k; `qzeros` int32 [groups, out / (32 / bits)], code j of column c
  is output column c * (32 / bits) + j, stored as zero - 1 in the v1 "gptq" format; `scales`
  fp16 [groups, out]; `g_idx` int32 [in].
- AWQ (AutoAWQ GEMM): `qweight` int32 [in, out / 8] and `qzeros` [groups, out / 8], code k of
  an int32 holding column ORDER[k] of its eight; `scales` fp16 [groups, out].
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file

# Phi-3's checkpoints store qkv_proj and gate_up_proj fused; each is quantized as one tensor.
# Mixtral's experts are w1 (gate), w3 (up), w2 (down); MoE routers (`gate`) are never quantized.
LINEAR_NAMES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "qkv_proj",
                "gate_up_proj", "w1", "w2", "w3")
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
# Checkpoint names that share their input (and so GPTQ's act order): one g_idx per group.
SAME_INPUT = {"q_proj": "attn_in", "k_proj": "attn_in", "v_proj": "attn_in", "gate_proj": "mlp_in",
               "up_proj": "mlp_in", "o_proj": "o_in", "down_proj": "down_in", "qkv_proj": "attn_in",
               "gate_up_proj": "mlp_in", "w1": "mlp_in", "w3": "mlp_in", "w2": "down_in"}


def quantize_groups(weight: torch.Tensor, g_idx: torch.Tensor, groups: int, bits: int, sym: bool,
                    min_zero: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(codes [out, in], zeros [groups, out], fp16 scales [groups, out]) by min/max of each
    group of input features and output row."""
    maxq = 2**bits - 1
    w = weight.float()
    zeros = torch.empty(groups, w.shape[0], dtype=torch.int64)
    scales = torch.empty(groups, w.shape[0], dtype=torch.float16)
    for g in range(groups):
        part = w[:, g_idx == g]
        low, high = part.amin(1).clamp(max=0), part.amax(1).clamp(min=0)
        if sym:
            scale = torch.maximum(low.abs(), high) * 2 / maxq
            zero = torch.full_like(scale, (maxq + 1) // 2, dtype=torch.int64)
        else:
            scale = (high - low) / maxq
            zero = torch.round(-low / scale).long().clamp(min_zero, maxq)
        scales[g] = scale.clamp(min=1e-6).half()
        zeros[g] = zero
    expanded_scale, expanded_zero = scales.float()[g_idx].t(), zeros[g_idx].t()
    codes = (torch.round(w / expanded_scale) + expanded_zero).clamp(0, maxq).long()
    return codes, zeros, scales


def dequantize_codes(codes: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor,
                     g_idx: torch.Tensor) -> torch.Tensor:
    """The format's definition: (code - zero) * scale of each element's group, fp32 [out, in]."""
    return (codes - zeros[g_idx].t()).float() * scales.float()[g_idx].t()


def _to_int32(values: np.ndarray) -> torch.Tensor:
    return torch.from_numpy((values & 0xFFFFFFFF).astype(np.uint32).view(np.int32).copy())


def pack_gptq_rows(codes_in_out: torch.Tensor, bits: int) -> torch.Tensor:
    """[in, out] codes -> [in / per, out] int32: code k of row r is input row r * per + k."""
    per = 32 // bits
    c = codes_in_out.numpy().astype(np.int64).reshape(-1, per, codes_in_out.shape[1])
    packed = np.zeros((c.shape[0], c.shape[2]), dtype=np.int64)
    for k in range(per):
        packed |= c[:, k, :] << (bits * k)
    return _to_int32(packed)


def pack_columns(codes: torch.Tensor, bits: int, order: tuple[int, ...] | None = None) -> torch.Tensor:
    """[r, c] codes -> [r, c / per] int32: code k of column j holds column j * per + order[k]."""
    per = 32 // bits
    order = order or tuple(range(per))
    c = codes.numpy().astype(np.int64).reshape(codes.shape[0], -1, per)
    packed = np.zeros(c.shape[:2], dtype=np.int64)
    for k in range(per):
        packed |= c[:, :, order[k]] << (bits * k)
    return _to_int32(packed)


def gptq_config(bits: int, group_size: int, sym: bool, desc_act: bool, checkpoint_format: str) -> dict:
    return {"quant_method": "gptq", "bits": bits, "group_size": group_size, "desc_act": desc_act, "sym": sym,
            "damp_percent": 0.01, "static_groups": False, "true_sequential": True, "lm_head": False,
            "checkpoint_format": checkpoint_format, "model_name_or_path": None, "model_file_base_name": None}


def awq_config(group_size: int) -> dict:
    return {"quant_method": "awq", "bits": 4, "group_size": group_size, "zero_point": True, "version": "gemm",
            "modules_to_not_convert": None}


def write_int4_checkpoint(source: Path, quantized: Path, dequantized: Path, method: str, bits: int = 4,
                          group_size: int = 32, sym: bool = False, desc_act: bool = False,
                          checkpoint_format: str = "gptq", seed: int = 0,
                          module_options: dict[str, dict | None] | None = None,
                          config_extra: dict | None = None) -> dict[str, torch.Tensor]:
    """Writes the GPTQ or AWQ checkpoint of `source`'s linear layers into `quantized` and the
    fp32 weights they stand for into `dequantized`; returns the quantized tensors.
    `module_options` (checkpoint module name -> bits / group_size / desc_act for it, or None:
    left a plain `.weight`) writes modules other than the rest (what GPTQModel's `dynamic`
    and `modules_in_block_to_quantize` describe, which `config_extra` adds to the config)."""
    generator = torch.Generator().manual_seed(seed)
    tensors = load_file(str(source / "model.safetensors"))
    out_tensors, reference = {}, {}
    orders: dict[tuple[str, str], torch.Tensor] = {}
    defaults = dict(bits=bits, group_size=group_size, desc_act=desc_act)
    for name, tensor in tensors.items():
        linear = next((n for n in LINEAR_NAMES if name.endswith(f".{n}.weight")), None)
        prefix = name[:-len(".weight")]
        options = (module_options or {}).get(prefix, {})
        if linear is None or options is None:
            out_tensors[name] = reference[name] = tensor
            continue
        options = {**defaults, **options}
        bits, group_size, desc_act = options["bits"], options["group_size"], options["desc_act"]
        in_features = tensor.shape[1]
        size = in_features if group_size == -1 else group_size
        groups = in_features // size
        g_idx = torch.arange(in_features) // size
        if desc_act:
            # One act order per input (as GPTQ's Hessian is of the input), shuffled groups:
            # per module (attention, MLP, each expert).
            key = (prefix.rsplit(".", 1)[0], SAME_INPUT[linear])
            if key not in orders:
                orders[key] = g_idx[torch.randperm(in_features, generator=generator)]
            g_idx = orders[key]
        # v1 stores zero - 1: a zero of 0 would not pack (AutoGPTQ's own overflow).
        min_zero = 1 if method == "gptq" and checkpoint_format == "gptq" else 0
        codes, zeros, scales = quantize_groups(tensor, g_idx, groups, bits, sym, min_zero)
        reference[name] = dequantize_codes(codes, zeros, scales, g_idx)
        if method == "gptq":
            stored_zeros = zeros - 1 if checkpoint_format == "gptq" else zeros
            out_tensors[prefix + ".qweight"] = pack_gptq_rows(codes.t().contiguous(), bits)
            out_tensors[prefix + ".qzeros"] = pack_columns(stored_zeros, bits)
            out_tensors[prefix + ".g_idx"] = g_idx.to(torch.int32)
        else:
            out_tensors[prefix + ".qweight"] = pack_columns(codes.t().contiguous(), 4, AWQ_ORDER)
            out_tensors[prefix + ".qzeros"] = pack_columns(zeros, 4, AWQ_ORDER)
        out_tensors[prefix + ".scales"] = scales
    config = json.loads((source / "config.json").read_text())
    config["quantization_config"] = {**(gptq_config(defaults["bits"], defaults["group_size"], sym,
                                                    defaults["desc_act"], checkpoint_format)
                                        if method == "gptq" else awq_config(defaults["group_size"])),
                                     **(config_extra or {})}
    write_checkpoint_pair(source, (quantized, out_tensors, config), (dequantized, reference))
    return out_tensors


def write_checkpoint_pair(source: Path, quantized: tuple[Path, dict[str, torch.Tensor], dict],
                          dequantized: tuple[Path, dict[str, torch.Tensor]]) -> None:
    """Writes a quantized checkpoint (folder, tensors, config.json's content) and its fp32
    reference (folder, tensors; `source`'s config), each with `source`'s other files."""
    for folder, weights, config in (quantized, (*dequantized, None)):
        shutil.copytree(source, folder, ignore=shutil.ignore_patterns("*.safetensors"))
        save_file({k: v.contiguous() for k, v in weights.items()}, str(folder / "model.safetensors"))
        if config is not None:
            (folder / "config.json").write_text(json.dumps(config, indent=2))


def held_tensor_bytes(layer: torch.nn.Module) -> int:
    """Bytes of every tensor a linear layer holds: its parameters, tensor attributes and the
    fields of its CPU kernel's repacked copy (`cpu_int4_weight`), each storage counted once."""
    tensors = [value for value in vars(layer).values() if isinstance(value, torch.Tensor)]
    tensors += list(layer.parameters())
    packed = getattr(layer, "cpu_int4_weight", None)
    if packed is not None:
        tensors += [value for value in vars(packed).values() if isinstance(value, torch.Tensor)]
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors if not t.is_meta}
    return sum(storages.values())
