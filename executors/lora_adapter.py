"""Reading LoRA adapters in PEFT's format, with safetensors and json only (no peft at run time).

A PEFT LoRA adapter is a folder with `adapter_config.json` (rank `r`, `lora_alpha`,
`use_rslora`, ...) and `adapter_model.safetensors`, whose tensors are named
`base_model.model.<module>.lora_A.weight` ([r, in_features]) and `...lora_B.weight`
([out_features, r]) for each adapted linear `<module>` of the base model. The adapted layer
computes `base(x) + scaling * (x A^T) B^T`, scaling = lora_alpha / r (lora_alpha / sqrt(r)
with rsLoRA).

`inspect_adapter` checks an adapter from its config and the safetensors header alone (no
tensor is read), against the base model's config: what the engine runs on the driver before
it accepts a request, so that a bad adapter is a clear error and never reaches the workers.
`read_adapter` then reads the tensors (on each worker).
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

ADAPTER_CONFIG_FILE = "adapter_config.json"
ADAPTER_WEIGHTS_FILE = "adapter_model.safetensors"
# PEFT's names of the projections raylm's LoRA layers cover (fused into qkv_proj and
# gate_up_proj by the model's stacked_params_mapping).
PEFT_TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# Config fields that change what the adapter computes in ways raylm does not implement; each
# is unused when empty or false (PEFT writes False, None, {} or [] for them).
_UNSUPPORTED_FIELDS = ("use_dora", "fan_in_fan_out", "lora_bias", "modules_to_save", "rank_pattern", "alpha_pattern",
                       "layer_replication", "trainable_token_indices", "use_qalora", "alora_invocation_tokens")
# Module path segments of Mixture-of-Experts layers' experts (Qwen-MoE's `mlp.experts` and
# `shared_expert`, Mixtral's `block_sparse_moe`): raylm's FusedMoE takes no LoRA term.
_MOE_MODULE = re.compile(r"\.(experts|shared_experts?|block_sparse_moe)(\.|$)")
# PEFT writes about 1 KB; anything near this is not an adapter config.
MAX_ADAPTER_CONFIG_BYTES = 1 << 20
# lora_alpha beyond this cannot be a float exactly (and past ~1.8e308 not at all).
_MAX_EXACT_FLOAT_INT = 2 ** 53
_TENSOR_NAME = re.compile(r"^base_model\.model\.(?P<module>.+)\.lora_(?P<kind>[AB])(?:\.[^.]+)?\.weight$")
_LAYER_INDEX = re.compile(r"\.layers\.(\d+)\.")


class LoRAAdapterError(ValueError):
    """An adapter raylm cannot serve: the message names the adapter, the field and what is
    allowed. `param` is the request field it is about (for the server's error body)."""

    param = "lora_path"


class LoRAAdapterNotFoundError(LoRAAdapterError):
    """The adapter's folder or one of its files does not exist (the server answers 404)."""


@dataclass(frozen=True)
class PeftLoRAConfig:
    """What raylm reads of adapter_config.json."""

    rank: int
    lora_alpha: float
    use_rslora: bool = False
    base_model_name_or_path: str | None = None

    @property
    def scaling(self) -> float:
        """PEFT's factor on the adapter's product: lora_alpha / r, or lora_alpha / sqrt(r) (rsLoRA)."""
        return self.lora_alpha / (math.sqrt(self.rank) if self.use_rslora else self.rank)


@dataclass(frozen=True)
class AdapterTensor:
    """One lora_A or lora_B tensor of the file: `module` is the base model's module path
    (`model.layers.0.self_attn.q_proj`), `target` its PEFT name (`q_proj`)."""

    name: str
    module: str
    target: str
    kind: str  # "A" or "B"
    layer: int


@dataclass(frozen=True)
class AdapterSummary:
    config: PeftLoRAConfig
    tensors: tuple[AdapterTensor, ...]

    @property
    def targets(self) -> set[str]:
        return {tensor.target for tensor in self.tensors}


def _clip(value: Any, limit: int = 80) -> str:
    """repr(value), cut to `limit` characters (a config's value can be arbitrarily long)."""
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


def _is(path: Path, kind: str) -> bool:
    """path.is_dir() / is_file(), False where the path cannot be looked at (a name too long
    for the file system, a loop of links), where pathlib raises."""
    try:
        return path.is_dir() if kind == "dir" else path.is_file()
    except OSError:
        return False


def _describe(lora_name: str, lora_path: str) -> str:
    return f"LoRA adapter {lora_name!r} at {lora_path!r}"


def read_adapter_config(lora_name: str, lora_path: str, max_lora_rank: int) -> PeftLoRAConfig:
    """adapter_config.json, checked: a LoRA adapter of rank at most max_lora_rank that uses
    nothing raylm does not implement."""
    what = _describe(lora_name, lora_path)
    if "\x00" in lora_path:
        raise LoRAAdapterError(f"{what}: lora_path must not contain a NUL character.")
    folder = Path(lora_path)
    if not _is(folder, "dir"):
        raise LoRAAdapterNotFoundError(f"{what}: lora_path is not a folder (a PEFT adapter is a folder with "
                                       f"{ADAPTER_CONFIG_FILE} and {ADAPTER_WEIGHTS_FILE}).")
    config_file = folder / ADAPTER_CONFIG_FILE
    if not _is(config_file, "file"):
        raise LoRAAdapterNotFoundError(f"{what}: the folder has no {ADAPTER_CONFIG_FILE}.")
    size = config_file.stat().st_size
    if size > MAX_ADAPTER_CONFIG_BYTES:  # read whole, it would be held in memory whole
        raise LoRAAdapterError(f"{what}: {ADAPTER_CONFIG_FILE} is {size} bytes; an adapter config is about a "
                               f"thousand (at most {MAX_ADAPTER_CONFIG_BYTES} are read).")
    try:
        raw = json.loads(config_file.read_text())
    except (OSError, ValueError) as exc:  # ValueError: bad UTF-8, bad JSON, an integer of over 4300 digits
        raise LoRAAdapterError(f"{what}: {ADAPTER_CONFIG_FILE} is not valid JSON ({exc}).") from None
    except RecursionError:  # arrays or objects nested thousands deep
        raise LoRAAdapterError(f"{what}: {ADAPTER_CONFIG_FILE} nests too deep to be an adapter config.") from None
    if not isinstance(raw, dict):
        raise LoRAAdapterError(f"{what}: {ADAPTER_CONFIG_FILE} must hold a JSON object.")
    peft_type = raw.get("peft_type", "LORA")
    if peft_type != "LORA":
        raise LoRAAdapterError(f"{what}: peft_type must be 'LORA', got {peft_type!r}.")
    rank = raw.get("r")
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise LoRAAdapterError(f"{what}: r (the rank) must be a positive integer, got {_clip(rank)}.")
    if rank > max_lora_rank:
        raise LoRAAdapterError(f"{what}: its rank r={_clip(rank)} is above the engine's "
                               f"max_lora_rank={max_lora_rank} (start the engine with max_lora_rank >= r).")
    alpha = raw.get("lora_alpha", 8)
    # JSON integers are unbounded: one past float's range is as unusable as an infinity.
    if (isinstance(alpha, bool) or not isinstance(alpha, (int, float))
            or (isinstance(alpha, int) and abs(alpha) > _MAX_EXACT_FLOAT_INT) or not math.isfinite(alpha)):
        raise LoRAAdapterError(f"{what}: lora_alpha must be a finite number, got {_clip(alpha)}.")
    use_rslora = raw.get("use_rslora", False)
    if not isinstance(use_rslora, bool):  # bool("false") would silently switch rsLoRA on
        raise LoRAAdapterError(f"{what}: use_rslora must be true or false, got {_clip(use_rslora)}.")
    if raw.get("target_parameters"):
        # PEFT's LoRA on stacked parameters: in practice a MoE layer's experts.
        modules = _moe_modules(folder / ADAPTER_WEIGHTS_FILE)
        raise LoRAAdapterError(f"{what}: target_parameters={raw['target_parameters']!r} adapts the stacked expert "
                               f"weights of Mixture-of-Experts layers ({', '.join(modules) or 'named there'}); raylm "
                               f"serves LoRA on {', '.join(PEFT_TARGET_MODULES)} of attention and dense MLP layers, "
                               f"not on MoE experts.")
    for key in _UNSUPPORTED_FIELDS:
        value = raw.get(key)
        if value:
            raise LoRAAdapterError(f"{what}: {key}={value!r} is not supported (raylm serves plain LoRA on "
                                   f"{', '.join(PEFT_TARGET_MODULES)}).")
    bias = raw.get("bias", "none")
    if bias != "none":
        raise LoRAAdapterError(f"{what}: bias={bias!r} is not supported (only 'none': the base model's biases "
                               f"unchanged).")
    return PeftLoRAConfig(rank=rank, lora_alpha=float(alpha), use_rslora=use_rslora,
                          base_model_name_or_path=raw.get("base_model_name_or_path"))


def _moe_modules(weights: Path) -> list[str]:
    """The MoE modules the adapter's tensors adapt (for the error that refuses them)."""
    from safetensors import safe_open

    try:
        with safe_open(str(weights), framework="pt") as handle:
            names = list(handle.keys())
    except Exception:  # noqa: BLE001 - only the message loses the names
        return []
    modules = {match["module"] for match in map(_TENSOR_NAME.match, names) if match is not None}
    return sorted({module[:found.end(1)] for module in modules if (found := _MOE_MODULE.search(module))})


def expected_shapes(hf_config: Any) -> dict[str, tuple[int, int]]:
    """(in_features, out_features) of each PEFT target projection of a Llama-family model."""
    hidden = hf_config.hidden_size
    heads = hf_config.num_attention_heads
    kv_heads = getattr(hf_config, "num_key_value_heads", None) or heads
    head_dim = getattr(hf_config, "head_dim", None) or hidden // heads
    intermediate = hf_config.intermediate_size
    return {"q_proj": (hidden, heads * head_dim), "k_proj": (hidden, kv_heads * head_dim),
            "v_proj": (hidden, kv_heads * head_dim), "o_proj": (heads * head_dim, hidden),
            "gate_proj": (hidden, intermediate), "up_proj": (hidden, intermediate), "down_proj": (intermediate, hidden)}


def _parse_tensor_name(what: str, name: str, num_layers: int) -> AdapterTensor:
    match = _TENSOR_NAME.match(name)
    if match is None:
        raise LoRAAdapterError(f"{what}: tensor {name!r} is not a LoRA weight of a linear layer "
                               f"(base_model.model.<module>.lora_A.weight / lora_B.weight); raylm serves "
                               f"LoRA on {', '.join(PEFT_TARGET_MODULES)} only.")
    module = match["module"]
    target = module.rsplit(".", 1)[-1]
    if _MOE_MODULE.search(module):
        raise LoRAAdapterError(f"{what}: it adapts {module!r}, a projection of a Mixture-of-Experts layer's experts; "
                               f"raylm serves LoRA on {', '.join(PEFT_TARGET_MODULES)} of attention and dense MLP "
                               f"layers, not on MoE experts.")
    if target not in PEFT_TARGET_MODULES:
        raise LoRAAdapterError(f"{what}: it adapts {target!r} ({module}); raylm serves LoRA on "
                               f"{', '.join(PEFT_TARGET_MODULES)} only.")
    layer = _LAYER_INDEX.search(f".{module}.")
    if layer is None or int(layer.group(1)) >= num_layers:
        raise LoRAAdapterError(f"{what}: tensor {name!r} names a layer the base model does not have (it has "
                               f"{num_layers} layers): the adapter was made for another base model.")
    return AdapterTensor(name, module, target, match["kind"], int(layer.group(1)))


def _check_shape(what: str, tensor: AdapterTensor, shape: tuple[int, ...], rank: int,
                 shapes: dict[str, tuple[int, int]]) -> None:
    in_features, out_features = shapes[tensor.target]
    expected = (rank, in_features) if tensor.kind == "A" else (out_features, rank)
    if tuple(shape) != expected:
        raise LoRAAdapterError(f"{what}: tensor {tensor.name} has shape {tuple(shape)}, but the base model's "
                               f"{tensor.target} with rank r={rank} needs {expected}: the adapter was made for "
                               f"another base model (or its r does not match its tensors).")


def inspect_adapter(lora_name: str, lora_path: str, hf_config: Any, max_lora_rank: int) -> AdapterSummary:
    """Checks an adapter against the base model from its config and the safetensors header
    (no tensor data is read); raises LoRAAdapterError naming what is wrong."""
    from safetensors import safe_open

    config = read_adapter_config(lora_name, lora_path, max_lora_rank)
    what = _describe(lora_name, lora_path)
    weights = Path(lora_path) / ADAPTER_WEIGHTS_FILE
    if not _is(weights, "file"):
        hint = " (adapter_model.bin is not read: save the adapter with safetensors)" if _is(
            Path(lora_path) / "adapter_model.bin", "file") else ""
        raise LoRAAdapterNotFoundError(f"{what}: the folder has no {ADAPTER_WEIGHTS_FILE}{hint}.")
    shapes = expected_shapes(hf_config)
    num_layers = hf_config.num_hidden_layers
    tensors: list[AdapterTensor] = []
    try:
        with safe_open(str(weights), framework="pt") as handle:
            for name in handle.keys():
                tensor = _parse_tensor_name(what, name, num_layers)
                view = handle.get_slice(name)
                if view.get_dtype() not in ("F32", "F16", "BF16", "F64"):
                    raise LoRAAdapterError(f"{what}: tensor {name} has dtype {view.get_dtype()}; LoRA weights "
                                           f"must be floating point.")
                _check_shape(what, tensor, view.get_shape(), config.rank, shapes)
                tensors.append(tensor)
    except LoRAAdapterError:
        raise
    except Exception as exc:  # noqa: BLE001 - safetensors' errors for a corrupt or truncated file
        raise LoRAAdapterError(f"{what}: {ADAPTER_WEIGHTS_FILE} cannot be read ({type(exc).__name__}: {exc}).") \
            from None
    if not tensors:
        raise LoRAAdapterError(f"{what}: {ADAPTER_WEIGHTS_FILE} holds no LoRA weights.")
    pairs: dict[str, set[str]] = {}
    named: dict[tuple[str, str], str] = {}
    for tensor in tensors:
        # `...lora_A.weight` and `...lora_A.<adapter>.weight` of one module: which is meant?
        other = named.setdefault((tensor.module, tensor.kind), tensor.name)
        if other != tensor.name:
            raise LoRAAdapterError(f"{what}: tensors {other} and {tensor.name} are both the lora_{tensor.kind} of "
                                   f"{tensor.module}; an adapter file holds one.")
        pairs.setdefault(tensor.module, set()).add(tensor.kind)
    lonely = sorted(module for module, kinds in pairs.items() if kinds != {"A", "B"})
    if lonely:
        raise LoRAAdapterError(f"{what}: modules {lonely} have lora_A or lora_B but not both.")
    return AdapterSummary(config, tuple(tensors))


def read_adapter(lora_name: str, lora_path: str, hf_config: Any, max_lora_rank: int
                 ) -> tuple[PeftLoRAConfig, dict[str, dict[str, torch.Tensor]]]:
    """The adapter's config and its tensors, checked as `inspect_adapter` does, grouped by the
    base model's module: {module path: {"A": [r, in], "B": [out, r]}} (as stored)."""
    from safetensors import safe_open

    summary = inspect_adapter(lora_name, lora_path, hf_config, max_lora_rank)
    modules: dict[str, dict[str, torch.Tensor]] = {}
    try:
        with safe_open(str(Path(lora_path) / ADAPTER_WEIGHTS_FILE), framework="pt") as handle:
            for tensor in summary.tensors:
                modules.setdefault(tensor.module, {})[tensor.kind] = handle.get_tensor(tensor.name)
    except Exception as exc:  # noqa: BLE001 - the file changed or broke since it was inspected
        raise LoRAAdapterError(f"{_describe(lora_name, lora_path)}: {ADAPTER_WEIGHTS_FILE} cannot be read "
                               f"({type(exc).__name__}: {exc}).") from None
    return summary.config, modules


def lora_error_from_worker(class_name: str, message: str) -> LoRAAdapterError:
    """The exception a worker returned as (class name, message) (see Worker.add_lora)."""
    kind = LoRAAdapterNotFoundError if class_name == LoRAAdapterNotFoundError.__name__ else LoRAAdapterError
    return kind(message)
