"""Maps Hugging Face `architectures` names to raylm model classes."""

from __future__ import annotations

from torch import nn

from raylm.models.gemma2 import Gemma2ForCausalLM
from raylm.models.gpt2 import GPT2LMHeadModel
from raylm.models.llama import LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM
from raylm.models.mixtral import MixtralForCausalLM
from raylm.models.opt import OPTForCausalLM
from raylm.models.qwen3 import Qwen3ForCausalLM
from raylm.models.qwen_moe import Qwen2MoeForCausalLM, Qwen3MoeForCausalLM

_MODELS: dict[str, type[nn.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": MistralForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "MixtralForCausalLM": MixtralForCausalLM,
    "Qwen2MoeForCausalLM": Qwen2MoeForCausalLM,
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
    "Gemma2ForCausalLM": Gemma2ForCausalLM,
    "OPTForCausalLM": OPTForCausalLM,
    "GPT2LMHeadModel": GPT2LMHeadModel,
}


def supported_architectures() -> list[str]:
    return sorted(_MODELS)


def resolve_model_class(architectures: list[str] | None) -> type[nn.Module]:
    """The class of the first supported name in config.json's `architectures`."""
    for arch in architectures or []:
        if arch in _MODELS:
            return _MODELS[arch]
    raise ValueError(f"config.json architectures {architectures!r} name no supported model; raylm supports "
                     f"{', '.join(supported_architectures())}.")
