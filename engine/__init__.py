"""raylm's public API: `LLM`, `SamplingParams`, `EngineArgs`, `LLMEngine` and the outputs."""

from raylm.engine.beam_search import BeamSearchOutput, BeamSearchParams, BeamSearchSequence
from raylm.engine.outputs import CompletionOutput, Logprob, RequestOutput
from raylm.engine.sampling_params import RequestOutputKind, SamplingParams
from raylm.engine.structured_output.params import StructuredOutputsParams

# Imported on first use, so that workers importing the plain step types do not pull in
# the engine, the scheduler and transformers.
_LAZY = {
    "LLM": "raylm.engine.llm",
    "LLMEngine": "raylm.engine.llm_engine",
    "EngineArgs": "raylm.engine.arg_utils",
    "AsyncLLMEngine": "raylm.engine.async_llm_engine",
}

__all__ = ["LLM", "LLMEngine", "AsyncLLMEngine", "EngineArgs", "SamplingParams", "RequestOutput", "CompletionOutput", "Logprob",
           "RequestOutputKind", "BeamSearchParams", "BeamSearchOutput", "BeamSearchSequence", "StructuredOutputsParams"]


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'raylm.engine' has no attribute {name!r}")
