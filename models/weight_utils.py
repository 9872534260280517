"""Reading Hugging Face safetensors checkpoints. Models map names to parameters in their
own `load_weights`; parameters cut their shards in their `weight_loader`."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

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


def default_weight_loader(param: torch.nn.Parameter, loaded_weight: torch.Tensor, shard_id=None) -> None:
    """For unsharded parameters (norms): the whole checkpoint tensor, dtype-converted."""
    if param.shape != loaded_weight.shape:
        raise ValueError(f"checkpoint tensor has shape {tuple(loaded_weight.shape)}, the model expects "
                         f"{tuple(param.shape)}.")
    param.data.copy_(read_weight(loaded_weight))
