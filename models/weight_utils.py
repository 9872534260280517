"""Reading Hugging Face safetensors checkpoints. Models map names to parameters in their
own `load_weights`; parameters cut their shards in their `weight_loader`."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from raylm.parallel.checkpoint_slice import CheckpointSlice, read_weight


def safetensors_weights_iterator(model_dir: str | Path) -> Iterator[tuple[str, CheckpointSlice]]:
    """(name, checkpoint slice) for every tensor of every *.safetensors file in
    model_dir. Nothing is read until a weight loader copies its part, so a
    tensor-parallel worker reads only its shard."""
    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise ValueError(f"model folder {str(model_dir)!r} has no *.safetensors files; raylm loads only safetensors "
                         f"checkpoints.")
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                source = f.get_slice(name)
                yield name, CheckpointSlice(source, tuple(source.get_shape()))


# vLLM's dummy weights: uniform in [low, high), which keeps activations finite through any
# number of layers, each parameter drawn from a generator seeded alike (so a weight's values
# depend only on its size and dtype, the same every run and on every rank).
DUMMY_WEIGHT_LOW = -1e-3
DUMMY_WEIGHT_HIGH = 1e-3
DUMMY_WEIGHT_SEED = 1234


@torch.no_grad()
def initialize_dummy_weights(model: torch.nn.Module, low: float = DUMMY_WEIGHT_LOW, high: float = DUMMY_WEIGHT_HIGH,
                             seed: int = DUMMY_WEIGHT_SEED) -> None:
    """Gives every floating-point parameter of `model` (this rank's shards) random values
    uniform in [low, high), what load_format="dummy" loads instead of a checkpoint.
    Buffers (rotary tables, scales computed from the config) keep their values: they come
    from the config, not the checkpoint. A quantized checkpoint's scale parameters (FP8's
    `weight_scale`, `weight_scale_inv`, `input_scale`) take the magnitude of their draw: the
    loader refuses a scale that is not positive, as a real checkpoint's never is."""
    for name, param in model.named_parameters():
        if not param.is_floating_point():
            continue
        generator = torch.Generator(device=param.device).manual_seed(seed)
        if param.element_size() < 2:  # 8-bit floats have no uniform_: drawn in fp16
            param.copy_(torch.empty(param.shape, dtype=torch.float16, device=param.device)
                        .uniform_(low, high, generator=generator))
        else:
            param.uniform_(low, high, generator=generator)
        if "scale" in name.rsplit(".", 1)[-1]:
            param.abs_().clamp_min_(torch.finfo(param.dtype).tiny)


def default_weight_loader(param: torch.nn.Parameter, loaded_weight: torch.Tensor, shard_id=None) -> None:
    """For unsharded parameters (norms): the whole checkpoint tensor, dtype-converted."""
    if param.shape != loaded_weight.shape:
        raise ValueError(f"checkpoint tensor has shape {tuple(loaded_weight.shape)}, the model expects "
                         f"{tuple(param.shape)}.")
    param.data.copy_(read_weight(loaded_weight))


def num_weight_loads(model: torch.nn.Module) -> int:
    """How many times `load_stacked_weights` loaded into `model`."""
    return model.__dict__.get("num_weight_loads", 0)


def load_stacked_weights(model: torch.nn.Module, weights: Iterable[tuple[str, torch.Tensor]],
                         stacked_params_mapping: Iterable[tuple[str, str, Any]]) -> set[str]:
    """The loading loop every model shares: a checkpoint tensor whose name holds a
    `checkpoint_suffix` of `stacked_params_mapping` goes to the stacked parameter
    (`param_suffix`) with its shard id (q/k/v into qkv_proj, gate/up into gate_up_proj);
    any other goes to the parameter of its own name. Each parameter's `weight_loader`
    cuts its rank's shard. Returns the names of the parameters loaded; a tensor that
    matches no parameter is an error naming it. Models rename or skip tensors before
    handing them here."""
    # Counted on the model: a model runner that sees the count change since it last ran the
    # `process_weights_after_loading` hooks (the CPU GEMM's packed copies) runs them again
    # before its next step, so that weights an RLHF worker extension loads with
    # `model.load_weights` (as vLLM's examples do) take effect.
    model.num_weight_loads = num_weight_loads(model) + 1
    params = dict(model.named_parameters())
    mapping = list(stacked_params_mapping)
    loaded: set[str] = set()
    for name, tensor in weights:
        for param_suffix, checkpoint_suffix, shard_id in mapping:
            if checkpoint_suffix in name:
                target = name.replace(checkpoint_suffix, param_suffix)
                if target not in params:
                    raise ValueError(f"checkpoint tensor {name!r} maps to {target!r}, which the model lacks.")
                param = params[target]
                param.weight_loader(param, tensor, shard_id)
                break
        else:
            target = name
            if target not in params:
                raise ValueError(f"checkpoint tensor {name!r} matches no parameter of {type(model).__name__}.")
            param = params[target]
            getattr(param, "weight_loader", default_weight_loader)(param, tensor)
        loaded.add(target)
    return loaded
