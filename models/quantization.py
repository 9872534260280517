"""Weight quantization (vLLM's `quantization` engine argument): which checkpoints raylm
reads, and the model's linear layers turned into quantized ones before the checkpoint loads.

Three sources, as in vLLM (docs/quantization.md):
- `quantization="fp8"` over a 16/32-bit checkpoint: every linear layer's weight quantized
  at load, one scale per tensor (amax / 448), activations quantized per token (on GPUs that
  multiply in fp8);
- a checkpoint whose config.json `quantization_config` has `quant_method: "fp8"`: per-tensor
  `weight_scale` (with static `input_scale` under `activation_scheme: "static"`), or
  block-wise `weight_scale_inv` under `weight_block_size` (DeepSeek-V3, Qwen3-FP8);
- `quant_method: "compressed-tensors"` with FP8 weights (llm-compressor's FP8_DYNAMIC and
  FP8 schemes): strategy "tensor", "channel" or "block", activations dynamic per token,
  static per tensor, or none (weight only), and its `ignore` list.

and 4-bit (GPTQ also 8-bit) integer weights with a scale and zero per group of input features:
- `quant_method: "gptq"` (AutoGPTQ / GPTQModel): `bits`, `group_size` (-1: one group),
  `desc_act`, `sym`, `checkpoint_format` "gptq" (v1: zeros stored minus one) or "gptq_v2",
  and per module `dynamic` and `modules_in_block_to_quantize` (`models/gptq_config.py`);
- `quant_method: "awq"` (AutoAWQ, `version: "gemm"`), `zero_point: true`,
  `modules_to_not_convert`;
- `quant_method: "compressed-tensors"` with `format: "pack-quantized"` (llm-compressor's
  W4A16 and W8A16 schemes): `type: "int"`, 4 or 8 bits, strategy "group" or "channel",
  symmetric or not (`weight_zero_point`), actorder "group" (`weight_g_idx`) or "weight",
  weights only (`input_activations: null`); read through the GPTQ machinery
  (`parallel/int4_linear_method.py` turns its tensors into GPTQ's layout as they load).

Embeddings and the LM head are never quantized (they are no linear layers here, as in
vLLM). MoE experts take every source above: FP8 (`parallel/fp8_moe_method.py`), GPTQ and
AWQ and compressed-tensors' integer schemes (`parallel/int4_moe_method.py`); their routers stay
unquantized. Anything else (other
int4/int8 methods, FP8, GPTQ or AWQ checkpoints of gpt-oss) is an error naming what is
supported, raised from the config alone, before any weight is read. gpt-oss's MXFP4 experts
(`quant_method: "mxfp4"`) are read by its model class, which dequantizes them at load
(`models/mxfp4.py`): no linear layer is quantized here for them.
"""

from __future__ import annotations

import functools
from typing import Any

from torch import nn

from raylm.models.gptq_config import GptqLayerRules, check_group_size, parse_gptq_config
from raylm.models.module_patterns import Pattern, compile_module_pattern, matches_module
from raylm.models.mxfp4 import MXFP4_ARCHITECTURES
from raylm.parallel.fp8_linear_method import WEIGHT_STRATEGIES, Fp8LinearMethod, Fp8LinearScheme
from raylm.parallel.fp8_moe_method import Fp8MoEMethod
from raylm.parallel.fused_moe_weights import FusedMoEWeights
from raylm.parallel.int4_linear_method import Int4LinearMethod, Int4LinearScheme
from raylm.parallel.int4_moe_method import Int4MoEMethod
from raylm.parallel.linear import LinearBase

QUANTIZATION_METHODS = ("fp8", "compressed-tensors", "gptq", "awq")

_SUPPORTED = ("raylm reads FP8 weights (quantization='fp8' over a 16/32-bit checkpoint, or an FP8 checkpoint "
              "whose quantization_config has quant_method 'fp8' (per-tensor, or block-wise weight_block_size) or "
              "'compressed-tensors' (float 8-bit weights, strategy 'tensor', 'channel' or 'block'; input "
              "activations dynamic per token, static per tensor, or none)); compressed-tensors integer weights "
              "(format 'pack-quantized': type 'int', num_bits 4 or 8, strategy 'group' or 'channel', symmetric or "
              "not, actorder 'group' or 'weight', input_activations null); GPTQ (quant_method 'gptq': bits 4 or "
              "8, any group_size, desc_act, checkpoint_format 'gptq' or 'gptq_v2', per-module dynamic and "
              "modules_in_block_to_quantize) and AWQ (quant_method 'awq': "
              "4-bit, version 'gemm', zero_point) checkpoints, of dense and MoE models; and gpt-oss's MXFP4 experts "
              f"(quant_method 'mxfp4', {', '.join(MXFP4_ARCHITECTURES)} only)")


class QuantizationConfig:
    """The scheme (FP8, GPTQ or AWQ) of a model's linear layers and the layers left unquantized."""

    def __init__(self, method: str, scheme: Fp8LinearScheme | Int4LinearScheme, ignore: tuple[str, ...] = (),
                 layer_rules: GptqLayerRules | None = None) -> None:
        self.method = method  # one of QUANTIZATION_METHODS (vLLM's name of the method)
        self.scheme = scheme  # every quantized layer's, unless layer_rules choose another
        self.ignore = ignore  # module names, or "re:<pattern>" regular expressions
        self.layer_rules = layer_rules  # GPTQ's dynamic and modules_in_block_to_quantize

    def scheme_for(self, module_name: str, shard_names: list[str]) -> Fp8LinearScheme | Int4LinearScheme | None:
        """The scheme of layer `module_name` (None: it stays unquantized), whose checkpoint
        names are `shard_names` (a fused layer's; empty: its own). Raises ValueError when
        the parts of a fused layer are not quantized alike."""
        if self.is_ignored(module_name, shard_names):
            return None
        if self.layer_rules is None:
            return self.scheme
        return self.layer_rules.scheme_for(module_name, shard_names)

    def is_ignored(self, module_name: str, shard_names: list[str]) -> bool:
        """Whether the layer `module_name` stays unquantized; a fused layer is when all its
        checkpoint shards (`shard_names`) are, and is an error when some are."""
        names = shard_names or [module_name]
        ignored = [any(_matches(name, entry) for entry in self.ignore) for name in names]
        if any(ignored) and not all(ignored):
            raise ValueError(f"quantization_config ignores {[n for n, i in zip(names, ignored) if i]} but not "
                             f"{[n for n, i in zip(names, ignored) if not i]}, which raylm fuses into "
                             f"{module_name}: a fused layer is quantized whole or not at all.")
        return all(ignored)


def _matches(name: str, entry: str) -> bool:
    if entry.startswith("re:"):
        where = f"quantization_config's ignore-list entry '{entry}'"
        return matches_module(_ignore_pattern(entry[3:], where), name, where)
    return name == entry or name.endswith("." + entry)


def get_quant_config(hf_config: Any, quantization: str | None) -> QuantizationConfig | None:
    """The model's quantization (FP8, GPTQ, AWQ) from the `quantization` argument and config.json's
    `quantization_config` (None: auto-detect from it), or None for an unquantized model.
    Raises ValueError for a method raylm does not read or a mismatch between the two."""
    if quantization is not None and quantization not in QUANTIZATION_METHODS:
        raise ValueError(f"quantization must be one of {', '.join(map(repr, QUANTIZATION_METHODS))} or None "
                         f"(auto-detect from config.json), got {quantization!r}; {_SUPPORTED}.")
    checkpoint = getattr(hf_config, "quantization_config", None)
    if checkpoint is not None and not isinstance(checkpoint, dict):
        checkpoint = checkpoint.to_dict()
    if checkpoint is None:
        if quantization is None:
            return None
        if quantization != "fp8":
            raise ValueError(f"quantization {quantization!r} needs a checkpoint quantized so (config.json's "
                             f"quantization_config); this one has none. quantization='fp8' quantizes a 16/32-bit "
                             f"checkpoint at load.")
        return QuantizationConfig("fp8", Fp8LinearScheme(checkpoint_is_fp8=False, weight_strategy="tensor"))
    method = checkpoint.get("quant_method")
    if method == "mxfp4":
        return _mxfp4_checkpoint(hf_config, quantization)
    if method not in QUANTIZATION_METHODS:
        raise ValueError(f"the checkpoint is quantized with quant_method {method!r} (config.json's "
                         f"quantization_config), which raylm does not read; {_SUPPORTED}.")
    if quantization is not None and quantization != method:
        raise ValueError(f"quantization {quantization!r} does not match the checkpoint's quant_method {method!r} "
                         f"(config.json's quantization_config); pass quantization={method!r} or leave it unset "
                         f"(None) to auto-detect.")
    if set(getattr(hf_config, "architectures", None) or []) & set(MXFP4_ARCHITECTURES):
        # Its stacked expert tensors have no FP8 layout raylm knows; its bf16 ones load into FusedMoE.
        raise ValueError(f"gpt-oss checkpoints quantized with quant_method {method!r} are not read: "
                         f"{', '.join(MXFP4_ARCHITECTURES)} reads MXFP4 (quant_method 'mxfp4') and 16/32-bit "
                         f"checkpoints, which quantization='fp8' quantizes at load; {_SUPPORTED}.")
    if method == "fp8":
        return _fp8_config(checkpoint)
    if method == "gptq":
        return _gptq_config(checkpoint)
    if method == "awq":
        return _awq_config(checkpoint)
    return _compressed_tensors_config(checkpoint)


def _mxfp4_checkpoint(hf_config: Any, quantization: str | None) -> None:
    """gpt-oss's MXFP4 experts: its model class dequantizes them at load (`models/mxfp4.py`),
    so no linear layer is quantized here (None); any other architecture refuses them."""
    architectures = list(getattr(hf_config, "architectures", None) or [])
    if not set(architectures) & set(MXFP4_ARCHITECTURES):
        raise ValueError(f"the checkpoint is quantized with quant_method 'mxfp4' (config.json's quantization_config), "
                         f"which raylm reads for {', '.join(MXFP4_ARCHITECTURES)} only, not architectures "
                         f"{architectures}; {_SUPPORTED}.")
    if quantization is not None:
        raise ValueError(f"quantization {quantization!r} does not match the checkpoint's quant_method 'mxfp4' "
                         f"(config.json's quantization_config); leave quantization unset (None) to read it.")
    return None


def _fp8_config(config: dict[str, Any]) -> QuantizationConfig:
    """quant_method "fp8" (vLLM's Fp8Config): activation_scheme, weight_block_size, ignored_layers."""
    activation_scheme = config.get("activation_scheme", "dynamic")
    if activation_scheme not in ("dynamic", "static"):
        raise ValueError(f"quantization_config activation_scheme must be 'dynamic' or 'static', got "
                         f"{activation_scheme!r}.")
    fmt = config.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise ValueError(f"quantization_config fmt must be 'e4m3' (float8_e4m3fn weights), got {fmt!r}.")
    block = config.get("weight_block_size")
    ignore = _ignore_list(config, "ignored_layers", "modules_to_not_convert")
    if block is None:
        scheme = Fp8LinearScheme(True, "tensor", None, activation_scheme, "weight_scale")
    else:
        if activation_scheme != "dynamic":
            raise ValueError("quantization_config weight_block_size needs activation_scheme 'dynamic' (as vLLM), "
                             f"got {activation_scheme!r}.")
        scheme = Fp8LinearScheme(True, "block", _block_size(block, "weight_block_size"), activation_scheme,
                                 "weight_scale_inv")
    return QuantizationConfig("fp8", scheme, ignore)


def _block_size(block: Any, field: str) -> tuple[int, int]:
    if (not isinstance(block, (list, tuple)) or len(block) != 2
            or not all(isinstance(n, int) and not isinstance(n, bool) and n > 0 for n in block)):
        raise ValueError(f"quantization_config {field} must be two positive integers [rows, columns], got {block!r}.")
    return int(block[0]), int(block[1])


def _compressed_tensors_config(config: dict[str, Any]) -> QuantizationConfig:
    """llm-compressor's compressed-tensors format: FP8 schemes, and integer weights packed
    in int32s (W4A16 / W8A16, `pack-quantized`)."""
    groups = config.get("config_groups") or {}
    if not groups:
        raise ValueError(f"quantization_config (compressed-tensors) has no config_groups; {_SUPPORTED}.")
    # config.json is the user's download: a list or a null where an object belongs is named
    # here, not an AttributeError from `.get` below.
    if not isinstance(groups, dict) or not all(isinstance(group, dict) for group in groups.values()):
        raise ValueError(f"quantization_config (compressed-tensors) config_groups must be an object of scheme "
                         f"objects ({{name: {{targets, weights, ...}}}}), got {groups!r}.")
    schemes = {_compressed_tensors_scheme(name, group, config.get("format")) for name, group in groups.items()}
    if len(schemes) != 1:
        raise ValueError(f"quantization_config (compressed-tensors) has config_groups of different schemes "
                         f"({sorted(groups)}); raylm reads one scheme for every Linear layer.")
    return QuantizationConfig("compressed-tensors", schemes.pop(), _ignore_list(config, "ignore"))


def _ignore_list(config: dict[str, Any], *fields: str) -> tuple[str, ...]:
    """The module names (or "re:" patterns) of the first of `fields` that config.json sets, a
    list of strings: a bare string would be read as its characters (and so ignore nothing),
    and a number or null would fail in the matching with an AttributeError."""
    field = next((f for f in fields if config.get(f)), fields[0])
    entries = config.get(field) or []
    if not isinstance(entries, list) or not all(isinstance(entry, str) for entry in entries):
        raise ValueError(f"quantization_config {field} must be a list of module names or 're:' patterns (strings), "
                         f"got {entries!r}.")
    return tuple(entries)


def _compressed_tensors_scheme(name: str, group: dict[str, Any],
                               top_format: str | None) -> Fp8LinearScheme | Int4LinearScheme:
    where = f"quantization_config config_groups[{name!r}]"
    targets = group.get("targets") or []
    if not isinstance(targets, list) or "Linear" not in targets:  # a string would match any that contains it
        raise ValueError(f"{where} targets {targets!r}; raylm reads schemes that target 'Linear'. {_SUPPORTED}.")
    if not isinstance(group.get("weights") or {}, dict):
        raise ValueError(f"{where} weights must be an object (type, num_bits, strategy, ...), got "
                         f"{group.get('weights')!r}.")
    fmt = group.get("format") or top_format
    if fmt == "pack-quantized":
        return _pack_quantized_scheme(where, group)
    if fmt not in (None, "float-quantized"):
        raise ValueError(f"{where} has format {fmt!r}; raylm reads 'float-quantized' (FP8) and 'pack-quantized' "
                         f"(integer weights, 16/32-bit activations). {_SUPPORTED}.")
    weights = group.get("weights") or {}
    if (weights.get("type") != "float" or weights.get("num_bits") != 8 or not weights.get("symmetric", True)
            or weights.get("dynamic", False)):
        raise ValueError(f"{where} weights are {weights.get('type')!r} {weights.get('num_bits')}-bit "
                         f"(symmetric {weights.get('symmetric', True)}, dynamic {weights.get('dynamic', False)}); "
                         f"{_SUPPORTED}.")
    strategy = weights.get("strategy")
    if strategy not in WEIGHT_STRATEGIES:
        raise ValueError(f"{where} weights strategy must be one of {list(WEIGHT_STRATEGIES)}, got {strategy!r}.")
    block = _block_size(weights.get("block_structure"), "weights block_structure") if strategy == "block" else None
    if group.get("output_activations"):
        raise ValueError(f"{where} quantizes output activations, which raylm does not; {_SUPPORTED}.")
    activations = group.get("input_activations")
    if activations is None:
        activation_scheme = None
    else:
        kind = (activations.get("type"), activations.get("num_bits"), bool(activations.get("dynamic")),
                activations.get("strategy"))
        if kind == ("float", 8, True, "token"):
            activation_scheme = "dynamic"
        elif kind == ("float", 8, False, "tensor"):
            activation_scheme = "static"
        else:
            raise ValueError(f"{where} input_activations are {kind[0]!r} {kind[1]}-bit, dynamic {kind[2]}, "
                             f"strategy {kind[3]!r}; {_SUPPORTED}.")
        if strategy == "block" and activation_scheme != "dynamic":
            raise ValueError(f"{where}: block-wise weights need dynamic input activations.")
    return Fp8LinearScheme(True, strategy, block, activation_scheme, "weight_scale")


# compressed-tensors' ActivationOrdering: "group" stores each input feature's group
# (`weight_g_idx`, GPTQ's desc_act); "weight" quantized in act order but kept the groups
# contiguous (no g_idx, as vLLM reads it); older configs wrote true for "group".
_ACTORDERS = {None: False, False: False, "static": False, "weight": False, "group": True, True: True}


def _pack_quantized_scheme(where: str, group: dict[str, Any]) -> Int4LinearScheme:
    """A `pack-quantized` group (W4A16 / W8A16) as the GPTQ scheme its tensors turn into."""
    weights = group.get("weights") or {}
    kind, bits = weights.get("type"), weights.get("num_bits")
    if kind != "int":
        raise ValueError(f"{where} has format 'pack-quantized' with weights type {kind!r}; that format packs "
                         f"integer weights (type 'int').")
    # 4.0 == 4 in Python, but a float width breaks the packing arithmetic (shifts) later.
    if isinstance(bits, bool) or not isinstance(bits, int) or bits not in (4, 8):
        raise ValueError(f"{where} weights num_bits must be 4 or 8 for format 'pack-quantized', got {bits!r}.")
    if weights.get("dynamic", False):
        raise ValueError(f"{where} weights are dynamic; format 'pack-quantized' stores static weight scales.")
    strategy = weights.get("strategy")
    if strategy == "group":
        group_size = check_group_size(weights.get("group_size"), f"{where} weights")
    elif strategy == "channel":
        group_size = -1  # one scale (and zero) per output row: one group over all input features
    else:
        raise ValueError(f"{where} weights strategy must be 'group' or 'channel' for format 'pack-quantized', got "
                         f"{strategy!r}.")
    symmetric = weights.get("symmetric", True)
    if not isinstance(symmetric, bool):
        raise ValueError(f"{where} weights symmetric must be true or false, got {symmetric!r}.")
    actorder = weights.get("actorder")
    if not isinstance(actorder, (str, bool, type(None))) or actorder not in _ACTORDERS:  # a list is unhashable
        raise ValueError(f"{where} weights actorder must be 'group', 'weight', 'static' or null, got {actorder!r}.")
    if _ACTORDERS[actorder] and strategy != "group":
        raise ValueError(f"{where} weights actorder {actorder!r} needs strategy 'group', got {strategy!r}.")
    if group.get("input_activations") is not None:
        raise ValueError(f"{where} quantizes input activations ({group.get('input_activations')!r}); raylm reads "
                         f"format 'pack-quantized' weight-only (input_activations null: W4A16, W8A16), not W8A8 "
                         f"or W4A8 integer schemes.")
    if group.get("output_activations"):
        raise ValueError(f"{where} quantizes output activations, which raylm does not; {_SUPPORTED}.")
    return Int4LinearScheme("compressed-tensors", bits, group_size, desc_act=_ACTORDERS[actorder],
                            has_zero_point=not symmetric)


def _gptq_config(config: dict[str, Any]) -> QuantizationConfig:
    """quant_method "gptq" (vLLM's GPTQConfig), with its per-module rules (`models/gptq_config.py`)."""
    scheme, layer_rules = parse_gptq_config(config)
    return QuantizationConfig("gptq", scheme, layer_rules=layer_rules)


def _awq_config(config: dict[str, Any]) -> QuantizationConfig:
    """quant_method "awq" (vLLM's AWQConfig): AutoAWQ's GEMM layout only."""
    bits = config.get("bits", config.get("w_bit"))
    if bits != 4:
        raise ValueError(f"quantization_config (awq) bits must be 4, got {bits!r}.")
    group_size = check_group_size(config.get("group_size", config.get("q_group_size")), "quantization_config (awq)")
    version = str(config.get("version", "gemm")).lower()
    if version != "gemm":
        raise ValueError(f"quantization_config (awq) version must be 'gemm' (AutoAWQ's GEMM layout), got "
                         f"{config.get('version')!r}; 'gemv', 'gemv_fast' and other layouts are not read.")
    if config.get("zero_point", True) is not True:
        raise ValueError(f"quantization_config (awq) zero_point must be true, got {config.get('zero_point')!r}.")
    ignore = _ignore_list(config, "modules_to_not_convert")
    return QuantizationConfig("awq", Int4LinearScheme("awq", 4, group_size), ignore)


def apply_quantization(model: nn.Module, quant_config: QuantizationConfig,
                       stacked_params_mapping: list[tuple[str, str, Any]]) -> None:
    """Makes every linear layer of `model` that the config quantizes a quantized one
    (`Fp8LinearMethod` / `Int4LinearMethod.create_weights`), and every MoE layer's experts
    (`Fp8MoEMethod` / `Int4MoEMethod`), before its checkpoint loads, each with its own scheme
    (`QuantizationConfig.scheme_for`). The config names modules as the checkpoint does
    (`CausalLM.checkpoint_module_name`); a fused layer's parts come from
    `stacked_params_mapping` (ours, checkpoint's, shard id)."""
    checkpoint_name = getattr(model, "checkpoint_module_name", None) or (lambda name: name)
    for name, module in list(model.named_modules()):
        theirs = checkpoint_name(name)
        if isinstance(module, FusedMoEWeights):
            # Experts are matched by the layer's own name (`...mlp.experts`), as vLLM does.
            scheme = quant_config.scheme_for(theirs, []) if module.quant_method is None else None
            if scheme is not None:
                moe_method = Int4MoEMethod(scheme) if isinstance(scheme, Int4LinearScheme) else Fp8MoEMethod(scheme)
                moe_method.create_weights(module, name)
            continue
        if (not isinstance(module, LinearBase) or module.quant_method is not None
                or getattr(module, "keep_unquantized", False)):  # MoE routers
            continue
        part_names = [theirs[:-len(ours)] + part for ours, part, _ in stacked_params_mapping if theirs.endswith(ours)]
        scheme = quant_config.scheme_for(theirs, part_names)
        if scheme is None:
            continue
        method = Int4LinearMethod(scheme) if isinstance(scheme, Int4LinearScheme) else Fp8LinearMethod(scheme)
        method.create_weights(module, name)


@functools.lru_cache(maxsize=256)
def _ignore_pattern(text: str, where: str) -> Pattern:
    """An ignore entry's pattern, compiled once (every layer of the model asks)."""
    return compile_module_pattern(text, where)
