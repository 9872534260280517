"""Pipeline parallelism's two shared pieces: which layers a stage holds, and what one stage
hands the next.

A stage is a tensor-parallel group holding a contiguous run of the decoder layers; the
executor chains the stages (`executors/pipeline_stages.py`), and the models build only their
stage's layers (`models/pipeline.py`). Nothing here talks to another process.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def get_pp_indices(num_layers: int, pp_rank: int, pp_size: int) -> tuple[int, int]:
    """[start, end) of the layers stage `pp_rank` of `pp_size` holds (vLLM's rule and name).

    The layers split evenly; the remainder goes one layer each to the stages just before
    the last, which also runs the final norm, the LM head and the sampler: 5 layers over 2
    stages are 3 + 2, 7 over 3 are 2 + 3 + 2, 10 over 4 are 2 + 3 + 3 + 2."""
    if pp_size < 1 or not 0 <= pp_rank < pp_size:
        raise ValueError(f"pipeline stage {pp_rank} of {pp_size} does not exist.")
    if num_layers < pp_size:
        raise ValueError(f"pipeline_parallel_size {pp_size} is larger than the model's {num_layers} layers: every "
                         f"stage needs at least one layer.")
    sizes = [num_layers // pp_size] * pp_size
    for stage in range(pp_size - 1 - num_layers % pp_size, pp_size - 1):
        sizes[stage] += 1
    start = sum(sizes[:pp_rank])
    return start, start + sizes[pp_rank]


@dataclass
class IntermediateTensors:
    """What a stage hands the next one (vLLM's name): the hidden states after its last layer,
    one row per token of the step. The residual stream is added in before sending (the
    next stage's first layer adds it first thing anyway, rounding the sum to the model
    dtype exactly so), which halves what crosses between stages."""

    tensors: dict[str, torch.Tensor]

    def __getitem__(self, key: str) -> torch.Tensor:
        return self.tensors[key]

    @classmethod
    def of_hidden_states(cls, hidden_states: torch.Tensor, residual: torch.Tensor | None) -> "IntermediateTensors":
        """The stream after a layer that returned (hidden_states, residual)."""
        return cls({"hidden_states": hidden_states if residual is None else hidden_states + residual})
