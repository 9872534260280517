"""raylm's public API: `LLM`, `SamplingParams`, `PoolingParams`, `EngineArgs`, `LLMEngine`, `LoRARequest` and the
outputs."""

# First, before anything imports torch: OpenMP reads how its idle threads wait once, when
# torch loads (raylm's default: they sleep; see raylm.executors.cpu_threads).
from raylm.executors.cpu_threads import apply_openmp_defaults

apply_openmp_defaults()

from raylm.engine.beam_search import BeamSearchOutput, BeamSearchParams, BeamSearchSequence  # noqa: E402
from raylm.engine.lora_request import LoRARequest  # noqa: E402
from raylm.engine.outputs import (ClassificationOutput, ClassificationRequestOutput,  # noqa: E402
                                  CompletionOutput, EmbeddingOutput, EmbeddingRequestOutput, Logprob,
                                  PoolingOutput, PoolingRequestOutput, RequestOutput, ScoringOutput,
                                  ScoringRequestOutput)
from raylm.engine.pooling_params import PoolingParams  # noqa: E402
from raylm.engine.prompt_embeds import EmbedsPrompt  # noqa: E402
from raylm.engine.sampling_params import RequestOutputKind, SamplingParams  # noqa: E402
from raylm.engine.structured_output.params import StructuredOutputsParams  # noqa: E402

# Imported on first use, so that workers importing the plain step types do not pull in
# the engine, the scheduler and transformers.
_LAZY = {
    "LLM": "raylm.engine.llm",
    "LLMEngine": "raylm.engine.llm_engine",
    "EngineArgs": "raylm.engine.arg_utils",
    "AsyncLLMEngine": "raylm.engine.async_llm_engine",
}

__all__ = ["LLM", "LLMEngine", "AsyncLLMEngine", "EngineArgs", "SamplingParams", "RequestOutput", "CompletionOutput", "Logprob",
           "RequestOutputKind", "BeamSearchParams", "BeamSearchOutput", "BeamSearchSequence", "StructuredOutputsParams",
           "LoRARequest", "PoolingParams", "PoolingOutput", "PoolingRequestOutput", "EmbeddingOutput",
           "EmbeddingRequestOutput", "ClassificationOutput", "ClassificationRequestOutput", "ScoringOutput",
           "ScoringRequestOutput", "EmbedsPrompt"]


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'raylm.engine' has no attribute {name!r}")
