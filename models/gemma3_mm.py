"""Gemma 3 with images (transformers' `Gemma3ForConditionalGeneration`: gemma-3-4b-it, 12b-it,
27b-it): a SigLIP vision tower, a projector that average-pools its patch grid to
`mm_tokens_per_image` (256) soft tokens, and the Gemma 3 text model (`models/gemma3.py`),
whose image tokens take the projected features as their input embeddings.

The vision tower is transformers' own `SiglipVisionModel` (as LLaVA runs CLIP's: replicated,
once per image, in prefill only). Gemma 3's one attention rule beyond the text model's: the
tokens of one image attend to each other both ways (Hugging Face's token_type_ids mask) while
text stays causal. The model says so by `bidirectional_image_attention`: the runner passes each
step's image spans to the attention layers (`ForwardContext.bidirectional_spans`), and the
scheduler never ends a prefill chunk inside an image, so every key of an image is in the cache
when its queries attend.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from raylm.models.gemma3 import Gemma3ForCausalLM
from raylm.models.rmsnorm import GemmaRMSNorm
from raylm.models.vision_tower import VisionLanguageModel, vision_tower_config


class Gemma3MultiModalProjector(nn.Module):
    """SigLIP patch features [N, patches, vision_hidden] -> [N, mm_tokens_per_image, text_hidden]:
    the patch grid average-pooled to a sqrt(mm_tokens_per_image)-sided grid, Gemma's RMSNorm,
    then one matrix (`mm_input_projection_weight` [vision_hidden, text_hidden], no bias)."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        vision_config, text_config = config.vision_config, config.text_config
        self.mm_input_projection_weight = nn.Parameter(
            torch.zeros(vision_config.hidden_size, text_config.hidden_size), requires_grad=False)
        self.mm_soft_emb_norm = GemmaRMSNorm(vision_config.hidden_size, vision_config.layer_norm_eps)
        self.patches_per_side = vision_config.image_size // vision_config.patch_size
        tokens_per_side = round(config.mm_tokens_per_image ** 0.5)
        if tokens_per_side ** 2 != config.mm_tokens_per_image or self.patches_per_side % tokens_per_side:
            raise ValueError(f"Gemma3ForConditionalGeneration: mm_tokens_per_image ({config.mm_tokens_per_image}) "
                             f"must be a square whose side divides the vision tower's {self.patches_per_side} "
                             f"patches a side.")
        self.kernel_size = self.patches_per_side // tokens_per_side

    def forward(self, vision_outputs: torch.Tensor) -> torch.Tensor:
        batch, _, hidden = vision_outputs.shape
        grid = vision_outputs.transpose(1, 2).reshape(batch, hidden, self.patches_per_side, self.patches_per_side)
        pooled = nn.functional.avg_pool2d(grid.contiguous(), self.kernel_size, self.kernel_size)
        normed = self.mm_soft_emb_norm(pooled.flatten(2).transpose(1, 2))
        return torch.matmul(normed, self.mm_input_projection_weight).type_as(vision_outputs)


class Gemma3ForConditionalGeneration(VisionLanguageModel):
    """One image -> mm_tokens_per_image image tokens (between `<start_of_image>` and
    `<end_of_image>`), each replaced by its projected pooled feature."""

    # The tokens of one image attend to each other both ways (see the module docstring).
    bidirectional_image_attention = True
    # The SigLIP pooling head: Gemma 3 reads the last hidden state (see __init__).
    unused_tower_prefixes = ("head.",)

    def __init__(self, config: Any) -> None:
        super().__init__()
        from transformers import SiglipVisionConfig, SiglipVisionModel

        self.config = config
        vision_config = vision_tower_config(config, type(self).__name__, "SigLIP", SiglipVisionConfig)
        # Gemma 3 reads the last hidden state, never the pooling head (released configs set
        # vision_use_head False; a head would be weights that nothing reads).
        vision_config.vision_use_head = False
        self.vision_tower = SiglipVisionModel(vision_config)
        self.multi_modal_projector = Gemma3MultiModalProjector(config)
        self.language_model = Gemma3ForCausalLM(config.text_config)

    # ---- vLLM V1's multi-modal interface --------------------------------------------------

    def get_multimodal_embeddings(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """pixel_values [N, 3, H, W] -> the N images' embeddings [N, mm_tokens_per_image, hidden]."""
        pixel_values = pixel_values.to(self.multi_modal_projector.mm_input_projection_weight.dtype)
        hidden = self.vision_tower(pixel_values=pixel_values, return_dict=True).last_hidden_state
        return self.multi_modal_projector(hidden)
