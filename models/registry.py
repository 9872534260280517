"""Maps Hugging Face `architectures` names to raylm model classes, and says which runner
an architecture runs by default (vLLM's `--runner auto`).

Every registered class is a causal LM. An architecture not registered is read by its
suffix, as vLLM reads it (Transformers' auto classes): `*ForCausalLM` and the like
generate, a bare `*Model` (`LlamaModel`, `MistralModel`, `Qwen2Model`, ...: a decoder saved
without its LM head, what embedding checkpoints such as e5-mistral-7b-instruct are) pools.
Such a name runs the registered causal LM of the same family (`LlamaModel` ->
`LlamaForCausalLM`), adapted for pooling (models/adapters.py). `*ForSequenceClassification`
of the families in CLASSIFICATION_FAMILIES pools too, as a classifier: the same decoder
with transformers' `score` head (vLLM's "classify" pooling task).
"""

from __future__ import annotations

from torch import nn

from raylm.models.adapters import as_classification_model, as_embedding_model
from raylm.models.gemma2 import Gemma2ForCausalLM
from raylm.models.gemma3 import Gemma3ForCausalLM
from raylm.models.gemma3_mm import Gemma3ForConditionalGeneration
from raylm.models.gpt2 import GPT2LMHeadModel
from raylm.models.gpt_oss import GptOssForCausalLM
from raylm.models.granite import GraniteForCausalLM
from raylm.models.llama import LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM
from raylm.models.llava import LlavaForConditionalGeneration
from raylm.models.mixtral import MixtralForCausalLM
from raylm.models.olmo2 import Olmo2ForCausalLM
from raylm.models.opt import OPTForCausalLM
from raylm.models.phi3 import Phi3ForCausalLM
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
    "GptOssForCausalLM": GptOssForCausalLM,
    "Gemma2ForCausalLM": Gemma2ForCausalLM,
    "Gemma3ForCausalLM": Gemma3ForCausalLM,
    "Olmo2ForCausalLM": Olmo2ForCausalLM,
    "OPTForCausalLM": OPTForCausalLM,
    "GPT2LMHeadModel": GPT2LMHeadModel,
    "Phi3ForCausalLM": Phi3ForCausalLM,
    "GraniteForCausalLM": GraniteForCausalLM,
    # Vision-language (images with the prompt: engine/multimodal/).
    "LlavaForConditionalGeneration": LlavaForConditionalGeneration,
    "Gemma3ForConditionalGeneration": Gemma3ForConditionalGeneration,
}


# vLLM's defaults by an architecture's suffix, the first that matches winning: (suffix,
# runner, convert). raylm pools by "embed", and by "classify" for the sequence classifiers
# of CLASSIFICATION_FAMILIES; token classification and reward heads are named so that
# their `*Model` suffixes are not read as bare decoders.
_SUFFIX_DEFAULTS: tuple[tuple[str, str, str], ...] = (
    ("ForCausalLM", "generate", "none"),
    ("ForConditionalGeneration", "generate", "none"),
    ("ChatModel", "generate", "none"),
    ("LMHeadModel", "generate", "none"),
    ("ForTextEncoding", "pooling", "embed"),
    ("EmbeddingModel", "pooling", "embed"),
    ("ForSequenceClassification", "pooling", "classify"),
    ("ForTokenClassification", "pooling", "classify"),
    ("ClassificationModel", "pooling", "classify"),
    ("ForRewardModeling", "pooling", "reward"),
    ("RewardModel", "pooling", "reward"),
    ("Model", "pooling", "embed"),
)


def _suffix_defaults(architecture: str) -> tuple[str, str, str] | None:
    return next((entry for entry in _SUFFIX_DEFAULTS if architecture.endswith(entry[0])), None)


# The `*ForSequenceClassification` checkpoints raylm loads (transformers' classes: the
# decoder under `model.`, a bias-free `score` linear layer of num_labels outputs).
CLASSIFICATION_FAMILIES = ("Llama", "Mistral", "Qwen2", "Qwen3")
_SEQUENCE_CLASSIFICATION = "ForSequenceClassification"


def _registered_name(architecture: str) -> str | None:
    """The registered architecture `architecture` runs as: itself, or for an embedding
    suffix (or a sequence classifier of CLASSIFICATION_FAMILIES) the generating
    architecture of the same family (vLLM's `_normalize_arch`)."""
    if architecture in _MODELS:
        return architecture
    defaults = _suffix_defaults(architecture)
    if defaults is None:
        return None
    if defaults[2] == "classify":
        if architecture.removesuffix(_SEQUENCE_CLASSIFICATION) not in CLASSIFICATION_FAMILIES:
            return None
    elif defaults[2] != "embed":
        return None
    stem = architecture.removesuffix(defaults[0])
    return next((stem + suffix for suffix, runner, _ in _SUFFIX_DEFAULTS
                 if runner == "generate" and stem + suffix in _MODELS), None)


def default_runner_type(architectures: list[str] | None) -> str:
    """The runner `runner="auto"` picks (vLLM's rule): "generate" for a registered
    architecture (all are causal LMs), else what the first name's suffix says, else
    "generate"."""
    for architecture in architectures or []:
        if architecture in _MODELS:
            return "generate"
        defaults = _suffix_defaults(architecture)
        if defaults is not None:
            return defaults[1]
    return "generate"


def pooling_task(architectures: list[str] | None) -> str:
    """What a pooling engine of these architectures returns (vLLM's pooling task): "classify"
    for a supported `*ForSequenceClassification` (its head's num_labels logits), else
    "embed" (the pooled hidden state)."""
    name = next((arch for arch in architectures or [] if _registered_name(arch) is not None), None)
    return "classify" if name is not None and name.endswith(_SEQUENCE_CLASSIFICATION) else "embed"


def is_multimodal_model(architectures: list[str] | None) -> bool:
    """Whether the first registered name of `architectures` takes images (`supports_multimodal`)."""
    name = next((arch for arch in architectures or [] if arch in _MODELS), None)
    return name is not None and getattr(_MODELS[name], "supports_multimodal", False)


def has_bidirectional_image_attention(architectures: list[str] | None) -> bool:
    """Whether the first registered name of `architectures` lets the tokens of one image attend
    to each other both ways (`bidirectional_image_attention`: Gemma 3)."""
    name = next((arch for arch in architectures or [] if arch in _MODELS), None)
    return name is not None and getattr(_MODELS[name], "bidirectional_image_attention", False)


def supported_architectures() -> list[str]:
    return sorted(_MODELS)


def pipeline_parallel_architectures() -> list[str]:
    """The architectures that split into pipeline stages (`supports_pipeline_parallel`)."""
    return sorted(name for name, cls in _MODELS.items() if getattr(cls, "supports_pipeline_parallel", False))


def resolve_model_class(architectures: list[str] | None, runner_type: str = "generate") -> type[nn.Module]:
    """The class of the first supported name in config.json's `architectures`: a registered
    causal LM, or the one a bare `*Model` name belongs to; for runner_type "pooling" that
    class adapted to pool (no LM head; `*Model` checkpoints load)."""
    for arch in architectures or []:
        name = _registered_name(arch)
        if name is not None:
            model_class = _MODELS[name]
            if arch.endswith(_SEQUENCE_CLASSIFICATION):
                return as_classification_model(model_class)
            return as_embedding_model(model_class) if runner_type == "pooling" else model_class
    raise ValueError(f"config.json architectures {architectures!r} name no supported model; raylm supports "
                     f"{', '.join(supported_architectures())}, their bare decoders (LlamaModel, "
                     f"Qwen2Model, ...) as embedding models, and "
                     f"{', '.join(f + _SEQUENCE_CLASSIFICATION for f in CLASSIFICATION_FAMILIES)} as classifiers.")
