"""IBM Granite 3.x: Llama with four scalars from the config, as transformers applies them:
token embeddings times `embedding_multiplier`, each block's output (attention and MLP)
times `residual_multiplier` before its residual add, `attention_multiplier` as the
softmax scale (in place of head_dim ** -0.5), and the logits divided by `logits_scaling`.
CPU decode steps run through the fused op of Llama's layers (`kernels/cpu_fused_decode.py`),
which takes the attention's scale and the residual multiplier.
"""

from __future__ import annotations

import math
from functools import partial
from typing import Any

import torch
from torch import nn

from raylm.models.attention import Attention
from raylm.models.forward_context import select_rows
from raylm.kernels.cpu_fused_decode import CpuFusedDecode
from raylm.models.llama import LlamaDecoderLayer, LlamaForCausalLM, LlamaModel, is_plain_llama_layer
from raylm.models.rmsnorm import norm_with_residual
from raylm.models.rotary_embedding import RotaryEmbedding
from raylm.parallel import VocabParallelEmbedding


def config_number(config: Any, key: str, nonzero: bool = False) -> float:
    """config.<key> as a float: a finite number (non-zero where the model divides by it), or
    a ValueError naming the field (transformers' strict config only checks its type)."""
    value = getattr(config, key)
    number = float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else math.nan
    if not math.isfinite(number) or (nonzero and number == 0):
        allowed = "a finite non-zero number (the logits are divided by it)" if nonzero else "a finite number"
        raise ValueError(f"config.{key} must be {allowed}, got {value!r}.")
    return number


class MultipliedVocabParallelEmbedding(VocabParallelEmbedding):
    """Embeddings times a constant (the Python float, as transformers multiplies by it)."""

    def __init__(self, num_embeddings: int, embedding_dim: int, multiplier: float = 1.0) -> None:
        super().__init__(num_embeddings, embedding_dim)
        self.multiplier = multiplier

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return super().forward(input_ids) * self.multiplier


class GraniteDecoderLayer(LlamaDecoderLayer):
    """Llama's layer with the blocks' outputs scaled before the residual adds (fused into
    the next norm, as in Llama) and the attention scaled by attention_multiplier."""

    def __init__(self, config: Any, rotary_emb: RotaryEmbedding, sliding_window: int | None = None) -> None:
        super().__init__(config, rotary_emb, qkv_bias=bool(getattr(config, "attention_bias", False)),
                         sliding_window=sliding_window)
        attn = self.self_attn.attn
        self.self_attn.attn = Attention(attn.num_heads, attn.head_size, config_number(config, "attention_multiplier"),
                                        attn.num_kv_heads, sliding_window=sliding_window)
        self.residual_multiplier = config_number(config, "residual_multiplier")

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor, residual: torch.Tensor | None,
                output_rows: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        hidden_states, residual = norm_with_residual(self.input_layernorm, hidden_states, residual)
        hidden_states = self.self_attn(positions, hidden_states, output_rows) * self.residual_multiplier
        residual = select_rows(residual, output_rows)
        hidden_states, residual = self.post_attention_layernorm(hidden_states, residual)
        return self.mlp(hidden_states) * self.residual_multiplier, residual


class GraniteModel(LlamaModel):
    """Llama's forward over Granite's layers and multiplied embeddings."""

    def __init__(self, config: Any) -> None:
        nn.Module.__init__(self)  # LlamaModel.__init__ would build Llama layers
        embedding = partial(MultipliedVocabParallelEmbedding, multiplier=config_number(config, "embedding_multiplier"))
        self._build_modules(config, lambda rotary_emb, window: GraniteDecoderLayer(config, rotary_emb, window),
                            embedding_type=embedding)
        self.fused_decode = CpuFusedDecode(self.stage_layers,
                                           partial(is_plain_llama_layer, layer_class=GraniteDecoderLayer))


class GraniteForCausalLM(LlamaForCausalLM):
    """Llama's checkpoint names and loading over Granite's model; logits / logits_scaling."""

    def __init__(self, config: Any) -> None:
        self.logits_scaling = config_number(config, "logits_scaling", nonzero=True)
        super().__init__(config)

    def _init_model(self, config: Any) -> GraniteModel:
        return GraniteModel(config)

    def prompt_embeds_as_inputs(self, prompt_embeds: torch.Tensor) -> torch.Tensor:
        """Hugging Face multiplies given inputs_embeds by embedding_multiplier as it does its
        table's rows (which our embedding module multiplies itself)."""
        return prompt_embeds * self.model.embed_tokens.multiplier

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor | None:
        """[N, hidden] -> [N, vocab] fp32 logits divided by logits_scaling; None on ranks other than 0."""
        logits = super().compute_logits(hidden_states)
        return None if logits is None else logits / self.logits_scaling
