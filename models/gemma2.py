"""Gemma 2, on the Llama pieces where they fit (attention projections, rotary, weight
loading, the model's forward).

What differs from Llama: embeddings scaled by sqrt(hidden_size) in the model dtype; RMSNorm
with (1 + weight) in fp32 (`GemmaRMSNorm`); norms before and after both attention and MLP;
a GeGLU MLP; attention scaled by query_pre_attn_scalar ** -0.5 with scores soft-capped at
`attn_logit_softcapping` (every attention backend implements the cap); final logits
soft-capped at `final_logit_softcapping`; tied embeddings. The layers `layer_types` names
"sliding_attention" (the even ones by default) attend within `sliding_window`, the others
to the whole context.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from raylm.kernels.mlp_row_chunks import mlp_in_row_chunks
from raylm.models.activation import GeluAndMul
from raylm.models.attention import Attention
from raylm.models.forward_context import select_rows
from raylm.models.llama import LlamaAttention, LlamaForCausalLM, LlamaModel
from raylm.models.rmsnorm import GemmaRMSNorm, norm_with_residual
from raylm.models.rotary_embedding import RotaryEmbedding
from raylm.parallel import MergedColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding

# Hugging Face activation names -> F.gelu's `approximate`.
_GELU_APPROXIMATIONS = {"gelu_pytorch_tanh": "tanh", "gelu": "none"}


class Gemma2Attention(LlamaAttention):
    """Llama's projections and rotary; Gemma's scale and score soft-cap."""

    def __init__(self, config: Any, rotary_emb: RotaryEmbedding, sliding_window: int | None) -> None:
        bias = bool(getattr(config, "attention_bias", False))
        super().__init__(config, rotary_emb, qkv_bias=bias, o_bias=bias)
        scalar = config.query_pre_attn_scalar
        if isinstance(scalar, bool) or not isinstance(scalar, (int, float)) or not 0 < scalar < math.inf:
            raise ValueError(f"config.query_pre_attn_scalar must be a positive finite number (the attention "
                             f"scale is its inverse square root), got {scalar!r}.")
        self.attn = Attention(self.num_heads, self.head_size, float(scalar) ** -0.5,
                              self.num_kv_heads, sliding_window=sliding_window,
                              logits_soft_cap=getattr(config, "attn_logit_softcapping", None) or None)


class Gemma2MLP(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        act = getattr(config, "hidden_activation", None) or getattr(config, "hidden_act", "gelu_pytorch_tanh")
        if act not in _GELU_APPROXIMATIONS:
            raise ValueError(f"hidden_activation must be one of {sorted(_GELU_APPROXIMATIONS)} for Gemma 2, "
                             f"got {act!r}.")
        self.gate_up_proj = MergedColumnParallelLinear(config.hidden_size, [config.intermediate_size] * 2)
        self.down_proj = RowParallelLinear(config.intermediate_size, config.hidden_size)
        self.act_fn = GeluAndMul(_GELU_APPROXIMATIONS[act])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return mlp_in_row_chunks(self._mlp, x, self.gate_up_proj.weight.shape[0])

    def _mlp(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


class Gemma2DecoderLayer(nn.Module):
    attention_class: type[Gemma2Attention] = Gemma2Attention

    def __init__(self, config: Any, rotary_emb: RotaryEmbedding, sliding_window: int | None = None) -> None:
        super().__init__()
        self.self_attn = self.attention_class(config, rotary_emb, sliding_window)
        self.mlp = Gemma2MLP(config)
        self.input_layernorm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor, residual: torch.Tensor | None,
                output_rows: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        # The residual add of each block is fused into the next block's pre-norm (as in
        # Llama); the post-norms act on the block's output alone, before that add.
        hidden_states, residual = norm_with_residual(self.input_layernorm, hidden_states, residual)
        hidden_states = self.post_attention_layernorm(self.self_attn(positions, hidden_states, output_rows))
        residual = select_rows(residual, output_rows)
        hidden_states, residual = self.pre_feedforward_layernorm(hidden_states, residual)
        return self.post_feedforward_layernorm(self.mlp(hidden_states)), residual


class ScaledVocabParallelEmbedding(VocabParallelEmbedding):
    """Embeddings times sqrt(hidden_size), the factor rounded to the model dtype first (as
    Hugging Face does: in bf16 sqrt(3072) is 55.5, not 55.43)."""

    def __init__(self, num_embeddings: int, embedding_dim: int) -> None:
        super().__init__(num_embeddings, embedding_dim)
        self.register_buffer("normalizer", torch.tensor(embedding_dim ** 0.5, dtype=self.weight.dtype),
                             persistent=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return super().forward(input_ids) * self.normalizer


class Gemma2Model(LlamaModel):
    """Llama's forward (embed, layers with the residual fused into the norms, final norm)
    over Gemma 2's modules."""

    default_tie_word_embeddings = True  # Gemma2Config's default
    decoder_layer_class: type[Gemma2DecoderLayer] = Gemma2DecoderLayer

    def __init__(self, config: Any) -> None:
        nn.Module.__init__(self)  # LlamaModel.__init__ would build Llama layers
        if getattr(config, "use_bidirectional_attention", None):
            raise ValueError("use_bidirectional_attention=True is not supported; raylm's attention is causal.")
        self._build_modules(config, lambda rotary_emb, window: self.decoder_layer_class(config, rotary_emb, window),
                            embedding_type=ScaledVocabParallelEmbedding, norm_type=GemmaRMSNorm)


class Gemma2ForCausalLM(LlamaForCausalLM):
    """Llama's forward and weight loading (same checkpoint names) over Gemma 2's model, and
    soft-capped logits."""

    def __init__(self, config: Any) -> None:
        super().__init__(config)
        self.final_logit_softcapping = getattr(config, "final_logit_softcapping", None)

    def _init_model(self, config: Any) -> Gemma2Model:
        return Gemma2Model(config)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor | None:
        """[N, hidden] -> [N, vocab] fp32 logits, soft-capped; None on ranks other than 0."""
        logits = super().compute_logits(hidden_states)
        cap = self.final_logit_softcapping
        if logits is None or not cap:
            return logits
        return torch.tanh(logits / cap) * cap
