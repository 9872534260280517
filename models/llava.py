"""LLaVA (transformers' `LlavaForConditionalGeneration`): a CLIP vision tower, a two-layer
projector, and a Llama-family decoder whose image placeholder tokens take the projected image
features as their input embeddings.

The vision tower is transformers' own `CLIPVisionModel` (replicated, not sharded: it runs once
per image, in prefill only); the decoder is raylm's, with its paged attention and kernels.
The model runner calls `get_multimodal_embeddings` once per image and scatters slices of the
result into `get_input_embeddings`' rows (vLLM V1's interface), so a chunk of a prompt that
holds part of an image's placeholders takes the matching part of its features.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from raylm.models.llama import LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM
from raylm.models.vision_tower import VisionLanguageModel, vision_tower_config

# The decoders a LLaVA checkpoint's text_config may name (its model_type).
_LANGUAGE_MODELS: dict[str, type[LlamaForCausalLM]] = {
    "llama": LlamaForCausalLM,
    "mistral": MistralForCausalLM,
    "qwen2": Qwen2ForCausalLM,
}

class LlavaMultiModalProjector(nn.Module):
    """Vision features [..., vision_hidden * layers] -> the decoder's hidden size (linear, act, linear)."""

    def __init__(self, vision_hidden_size: int, text_hidden_size: int, act: str, bias: bool) -> None:
        super().__init__()
        from transformers.activations import ACT2FN

        self.linear_1 = nn.Linear(vision_hidden_size, text_hidden_size, bias=bias)
        self.act = ACT2FN[act]
        self.linear_2 = nn.Linear(text_hidden_size, text_hidden_size, bias=bias)

    def forward(self, image_features: torch.Tensor) -> torch.Tensor:
        return self.linear_2(self.act(self.linear_1(image_features)))


class LlavaForConditionalGeneration(VisionLanguageModel):
    """The LLaVA-1.5 family: one image -> (patches, less CLS under the "default" strategy)
    placeholder tokens, each replaced by its projected patch feature."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        from transformers import CLIPVisionConfig, CLIPVisionModel

        self.config = config
        vision_config = vision_tower_config(config, type(self).__name__, "CLIP", CLIPVisionConfig)
        text_config = config.text_config
        language_model_class = _LANGUAGE_MODELS.get(text_config.model_type)
        if language_model_class is None:
            raise ValueError(f"LlavaForConditionalGeneration: text_config model_type {text_config.model_type!r} is "
                             f"not supported; one of {', '.join(_LANGUAGE_MODELS)}.")
        self.feature_layers = config.vision_feature_layer
        if config.vision_feature_select_strategy not in ("default", "full"):
            raise ValueError(f"vision_feature_select_strategy must be 'default' or 'full', got "
                             f"{config.vision_feature_select_strategy!r}.")
        self.drops_cls = config.vision_feature_select_strategy == "default"
        num_feature_layers = 1 if isinstance(self.feature_layers, int) else len(self.feature_layers)
        self.vision_tower = CLIPVisionModel(vision_config)
        self.multi_modal_projector = LlavaMultiModalProjector(
            vision_config.hidden_size * num_feature_layers, text_config.hidden_size,
            getattr(config, "projector_hidden_act", "gelu"), bool(getattr(config, "multimodal_projector_bias", True)))
        self.language_model = language_model_class(text_config)

    # ---- vLLM V1's multi-modal interface --------------------------------------------------

    def get_multimodal_embeddings(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """pixel_values [N, 3, H, W] -> the N images' embeddings [N, tokens per image, hidden]."""
        pixel_values = pixel_values.to(self.multi_modal_projector.linear_1.weight.dtype)
        outputs = self.vision_tower(pixel_values, output_hidden_states=True, return_dict=True)
        layers = [self.feature_layers] if isinstance(self.feature_layers, int) else list(self.feature_layers)
        selected = [outputs.hidden_states[layer] for layer in layers]
        if self.drops_cls:
            selected = [hidden[:, 1:] for hidden in selected]
        return self.multi_modal_projector(torch.cat(selected, dim=-1))
