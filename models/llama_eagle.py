"""`EagleLlamaForCausalLM`: an EAGLE-1 head over a Llama-family target (vLLM's class name).

An EAGLE head checkpoint (`yuhuili/EAGLE-LLaMA3-Instruct-8B` and the like) holds `fc`
(Linear 2H -> H) and one or a few Llama decoder layers. At position i it reads the target's
final hidden state h_i (after the target's final norm: what the target's LM head reads, as
in the EAGLE paper's code and vLLM) and the embedding of the token at i + 1:

    x = fc(cat(embed(token_{i+1}), h_i));  g_i = layers(x) (+ the last residual, no norm)

and lm_head(g_i) guesses the token at i + 2. The next proposal feeds g_i back in place of
the target's hidden state. The first layer has no input norm (the original checkpoints
carry none; vLLM replaces it by the identity, and so do we, ignoring one if present). The
token embedding and the LM head are the target's, shared, not copied (vLLM's choice for
EAGLE-1): a head checkpoint's own `embed_tokens` / `lm_head`, when it carries them, are
skipped.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn

from raylm.models.llama import LlamaDecoderLayer, LlamaForCausalLM
from raylm.models.rotary_embedding import get_rope, rope_parameters_from_config
from raylm.models.sliding_window import layer_sliding_windows
from raylm.models.weight_utils import load_stacked_weights


class EagleLlamaForCausalLM(nn.Module):
    stacked_params_mapping = LlamaForCausalLM.stacked_params_mapping

    def __init__(self, config: Any, target: nn.Module) -> None:
        super().__init__()
        self.config = config
        hidden = config.hidden_size
        # Original EAGLE heads have a bias on fc, vLLM's converted ones may not: a head
        # whose checkpoint has no fc.bias keeps it at zero (`load_weights`).
        self.fc = nn.Linear(2 * hidden, hidden, bias=True)
        nn.init.zeros_(self.fc.bias)
        head_size = getattr(config, "head_dim", None) or hidden // config.num_attention_heads
        rotary_emb = get_rope(head_size, config.max_position_embeddings, rope_parameters_from_config(config))
        qkv_bias = bool(getattr(config, "attention_bias", False))
        # Windows as the head's config gives them: the engine frees KV blocks by the windows
        # of the target's and the head's layers together (`EngineArgs`).
        windows = layer_sliding_windows(config)
        self.layers = nn.ModuleList(LlamaDecoderLayer(config, rotary_emb, qkv_bias, sliding_window=windows[i])
                                    for i in range(config.num_hidden_layers))
        self.layers[0].input_layernorm = nn.Identity()
        # The target's modules, not registered as ours: they load and sleep with the target.
        self.__dict__["target"] = target

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, hidden_states: torch.Tensor
                ) -> torch.Tensor:
        """input_ids, positions [T]; hidden_states [T, H], the target's (or the head's own
        from the previous proposal) -> the head's hidden states [T, H]."""
        embeds = self.target.get_input_embeddings(input_ids)
        x = self.fc(torch.cat((embeds, hidden_states.to(embeds.dtype)), dim=-1))
        residual = None
        for layer in self.layers:
            x, residual = layer(positions, x, residual)
        return x + residual

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor | None:
        return self.target.compute_logits(hidden_states)

    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> set[str]:
        loaded = load_stacked_weights(self, _head_tensors(weights), self.stacked_params_mapping)
        # Without fc.bias in the checkpoint the bias stays zero: the same as no bias.
        return loaded | {"fc.bias"}


def _head_tensors(weights: Iterable[tuple[str, Any]]) -> Iterator[tuple[str, Any]]:
    """The head's own tensors under our names: a `model.` prefix dropped, the target's
    shared modules and the first layer's input norm (the identity here) skipped."""
    for name, tensor in weights:
        name = name.removeprefix("model.")
        if name.startswith(("embed_tokens.", "lm_head.")) or name == "layers.0.input_layernorm.weight":
            continue
        if "rotary_emb." in name:
            continue
        yield name, tensor
