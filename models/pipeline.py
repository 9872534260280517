"""What a model needs to run as one stage of a pipeline: placeholders for the parts other
stages hold, the checkpoint tensors that belong to those parts, and the check that a model
can be split at all.

A stage's model keeps the full module tree's names (`model.layers.7` is layer 7 on every
stage), so checkpoint names map as they do without pipeline parallelism; the layers,
embedding and LM head another stage holds are `PPMissingLayer`s, which own no parameters,
and their checkpoint tensors are skipped at load.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn

from raylm.parallel.parallel_state import get_pipeline_model_parallel_rank, get_pipeline_model_parallel_world_size
from raylm.parallel.pipeline import get_pp_indices


class PPMissingLayer(nn.Identity):
    """Stands where a module of another pipeline stage would be (vLLM's name)."""


def stage_layer_range(num_layers: int) -> tuple[int, int]:
    """[start, end) of the decoder layers this process's stage holds (all of them without
    pipeline parallelism)."""
    return get_pp_indices(num_layers, get_pipeline_model_parallel_rank(), get_pipeline_model_parallel_world_size())


def is_first_stage() -> bool:
    return get_pipeline_model_parallel_rank() == 0


def is_last_stage() -> bool:
    return get_pipeline_model_parallel_rank() == get_pipeline_model_parallel_world_size() - 1


def make_layers(num_layers: int, build: Any) -> tuple[int, int, nn.ModuleList]:
    """(start, end, layers): the stage's layers built by `build(index)`, the others
    `PPMissingLayer`s, so that every layer keeps its index."""
    start, end = stage_layer_range(num_layers)
    layers = nn.ModuleList(build(i) if start <= i < end else PPMissingLayer() for i in range(num_layers))
    return start, end, layers


def missing_prefixes(model: nn.Module) -> tuple[str, ...]:
    """The dotted names (with a trailing dot) of the model's `PPMissingLayer`s."""
    return tuple(name + "." for name, module in model.named_modules() if isinstance(module, PPMissingLayer))


def skip_other_stages(model: nn.Module, weights: Iterable[tuple[str, Any]]) -> Iterator[tuple[str, Any]]:
    """The checkpoint tensors of the parts this stage holds (every one without pipeline
    parallelism). Nothing of a skipped tensor is read: they are lazy slices."""
    prefixes = missing_prefixes(model)
    if not prefixes:
        yield from weights
        return
    for name, tensor in weights:
        if not name.startswith(prefixes):
            yield name, tensor


def check_pipeline_parallel(hf_config: Any, pipeline_parallel_size: int) -> None:
    """Raises, naming the architecture, where the model cannot be split into
    `pipeline_parallel_size` stages: its class does not say `supports_pipeline_parallel`,
    or it has fewer layers than stages."""
    from raylm.models.registry import resolve_model_class

    architectures = getattr(hf_config, "architectures", None)
    model_class = resolve_model_class(architectures)
    if not getattr(model_class, "supports_pipeline_parallel", False):
        from raylm.models.registry import pipeline_parallel_architectures

        raise ValueError(f"pipeline_parallel_size {pipeline_parallel_size} is not supported for "
                         f"{model_class.__name__} (config.json architectures {architectures!r}): raylm splits "
                         f"{', '.join(pipeline_parallel_architectures())} into pipeline stages. Use "
                         f"pipeline_parallel_size 1 (tensor_parallel_size shards every model).")
    num_layers = hf_config.num_hidden_layers
    if num_layers < pipeline_parallel_size:
        raise ValueError(f"pipeline_parallel_size {pipeline_parallel_size} is larger than the model's {num_layers} "
                         f"layers (num_hidden_layers in config.json): every stage needs at least one layer.")


def stage_input(intermediate_tensors: Any, embed: Any, input_ids: torch.Tensor) -> torch.Tensor:
    """The hidden states a stage starts from: the embedding on the first stage, what the
    previous stage handed on elsewhere."""
    if intermediate_tensors is None:
        if isinstance(embed, PPMissingLayer):
            raise RuntimeError("A pipeline stage after the first ran a step without the previous stage's hidden "
                               "states.")
        return embed(input_ids)
    return intermediate_tensors["hidden_states"]
