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

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from raylm.models.gemma3 import Gemma3ForCausalLM
from raylm.models.rmsnorm import GemmaRMSNorm
from raylm.models.vision_tower import load_vision_language_weights, vision_tower_config
from raylm.parallel.pipeline import IntermediateTensors

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


class Gemma3ForConditionalGeneration(nn.Module):
    """One image -> mm_tokens_per_image image tokens (between `<start_of_image>` and
    `<end_of_image>`), each replaced by its projected pooled feature."""

    supports_multimodal = True
    supports_pipeline_parallel = False
    # The tokens of one image attend to each other both ways (see the module docstring).
    bidirectional_image_attention = True

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

    def get_input_embeddings(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The decoder's (scaled) token embeddings of input_ids, image tokens included (to be
        overwritten: the image features are not scaled, as in Hugging Face's)."""
        return self.language_model.model.embed_tokens(input_ids)

    # ---- the decoder -----------------------------------------------------------------------

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                intermediate_tensors: IntermediateTensors | None = None,
                inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        return self.language_model.model(input_ids, positions, intermediate_tensors, inputs_embeds=inputs_embeds)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor | None:
        return self.language_model.compute_logits(hidden_states)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """The text model's tensors go through its own loader (stacked q/k/v, gate/up, tied
        head); the vision tower's and the projector's are copied as they are."""
        # The pooling head (head.*) is weights that nothing reads (see __init__).
        return load_vision_language_weights(self, weights, unused_tower_prefixes=("head.",))
