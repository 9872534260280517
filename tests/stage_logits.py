"""A model's logits computed outside the engine: no attention metadata (the PyTorch causal
attention over one sequence), its layers in one model or split into pipeline stages run
in turn, each stage's hand-off passed to the next."""

from __future__ import annotations

from pathlib import Path

import torch

from raylm.engine.arg_utils import EngineArgs
from raylm.models import get_model
from raylm.models.forward_context import set_forward_context
from raylm.parallel.parallel_state import override_pipeline_parallel


def logits_in_stages(model_dir: Path, prompt: list[int], pp_size: int = 1) -> torch.Tensor:
    """[len(prompt), vocab] fp32 logits of the checkpoint in model_dir split into pp_size stages."""
    config = EngineArgs(model=str(model_dir), dtype="float32", device="cpu").create_engine_config().model_config
    stages = []
    for rank in range(pp_size):
        with override_pipeline_parallel(rank, pp_size):
            stages.append(get_model(config, torch.device("cpu")))
    input_ids, positions = torch.tensor(prompt), torch.arange(len(prompt))
    with torch.no_grad(), set_forward_context(None):
        handed_on = None
        for stage in stages[:-1]:
            handed_on = stage(input_ids, positions, handed_on)
        return stages[-1].compute_logits(stages[-1](input_ids, positions, handed_on))
