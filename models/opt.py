"""OPT (Meta's Open Pre-trained Transformers, 125m to 66b), written against the parallel
layers so the same code runs sharded under tensor parallelism.

Differences from Llama: learned absolute positions (offset by 2), LayerNorm with bias,
ReLU MLP (fc1, fc2) without a gate, biases on every projection, and two layer orders:
norm before each block (most sizes) or after the residual add (`do_layer_norm_before`
False, opt-350m), which also has a narrower word embedding projected in and out
(`word_embed_proj_dim`). Module names equal Hugging Face's, so checkpoints load by name.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn

from raylm.kernels.mlp_row_chunks import mlp_in_row_chunks
from raylm.models.activation import get_act_fn
from raylm.models.attention import Attention
from raylm.models.causal_lm import CausalLM
from raylm.models.forward_context import last_layer_rows, select_rows
from raylm.models.layernorm import LayerNorm
from raylm.models.learned_positional_embedding import LearnedPositionalEmbedding
from raylm.models.logits_processor import LogitsProcessor
from raylm.parallel import (ColumnParallelLinear, ParallelLMHead, QKVParallelLinear, ReplicatedLinear,
                            RowParallelLinear, VocabParallelEmbedding, get_tensor_model_parallel_world_size)

# OPT's position table keeps two unused rows in front (fairseq's padding offset).
OPT_POSITION_OFFSET = 2


def _layer_norm(config: Any) -> LayerNorm:
    return LayerNorm(config.hidden_size, elementwise_affine=getattr(config, "layer_norm_elementwise_affine", True))


class OPTAttention(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        tp_size = get_tensor_model_parallel_world_size()
        self.total_num_heads = config.num_attention_heads
        self.head_size = config.hidden_size // self.total_num_heads
        bias = getattr(config, "enable_bias", True)
        self.qkv_proj = QKVParallelLinear(config.hidden_size, self.head_size, self.total_num_heads, bias=bias)
        self.out_proj = RowParallelLinear(config.hidden_size, config.hidden_size, bias=bias)
        self.num_heads = self.total_num_heads // tp_size
        self.q_size = self.num_heads * self.head_size
        # Hugging Face multiplies q_proj's output (bias included) by head_size**-0.5; the
        # same factor applied to the scores is the attention scale.
        self.attn = Attention(self.num_heads, self.head_size, self.head_size ** -0.5)

    def forward(self, hidden_states: torch.Tensor, output_rows: torch.Tensor | None = None) -> torch.Tensor:
        q, k, v = self.qkv_proj(hidden_states).split([self.q_size] * 3, dim=-1)
        return self.out_proj(self.attn(q, k, v, output_rows))


class OPTDecoderLayer(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        self.do_layer_norm_before = config.do_layer_norm_before
        bias = getattr(config, "enable_bias", True)
        self.self_attn = OPTAttention(config)
        self.self_attn_layer_norm = _layer_norm(config)
        self.fc1 = ColumnParallelLinear(config.hidden_size, config.ffn_dim, bias=bias)
        self.activation_fn = get_act_fn(config.activation_function)
        self.fc2 = RowParallelLinear(config.ffn_dim, config.hidden_size, bias=bias)
        self.final_layer_norm = _layer_norm(config)

    def forward(self, hidden_states: torch.Tensor, output_rows: torch.Tensor | None = None) -> torch.Tensor:
        # Pre-norm: x + f(norm(x)). Post-norm (opt-350m): norm(x + f(x)).
        residual = select_rows(hidden_states, output_rows)
        if self.do_layer_norm_before:
            hidden_states = self.self_attn_layer_norm(hidden_states)
        hidden_states = residual + self.self_attn(hidden_states, output_rows)
        if not self.do_layer_norm_before:
            hidden_states = self.self_attn_layer_norm(hidden_states)

        residual = hidden_states
        if self.do_layer_norm_before:
            hidden_states = self.final_layer_norm(hidden_states)
        hidden_states = residual + mlp_in_row_chunks(self._mlp, hidden_states, self.fc1.weight.shape[0])
        if not self.do_layer_norm_before:
            hidden_states = self.final_layer_norm(hidden_states)
        return hidden_states

    def _mlp(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.activation_fn(self.fc1(x)))


class OPTDecoder(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        embed_dim = config.word_embed_proj_dim
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, embed_dim)
        self.embed_positions = LearnedPositionalEmbedding(config.max_position_embeddings, config.hidden_size,
                                                          offset=OPT_POSITION_OFFSET)
        # Replicated: these are small, and keep the layers' input and output whole.
        projected = embed_dim != config.hidden_size
        self.project_in = ReplicatedLinear(embed_dim, config.hidden_size) if projected else None
        self.project_out = ReplicatedLinear(config.hidden_size, embed_dim) if projected else None
        keep_final_norm = config.do_layer_norm_before and not getattr(config, "_remove_final_layer_norm", False)
        self.final_layer_norm = _layer_norm(config) if keep_final_norm else None
        self.layers = nn.ModuleList(OPTDecoderLayer(config) for _ in range(config.num_hidden_layers))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        inputs_embeds = self.embed_tokens(input_ids)
        if self.project_in is not None:
            inputs_embeds = self.project_in(inputs_embeds)
        hidden_states = inputs_embeds + self.embed_positions(positions)
        for i, layer in enumerate(self.layers):
            hidden_states = layer(hidden_states, last_layer_rows(i, len(self.layers)))
        if self.final_layer_norm is not None:
            hidden_states = self.final_layer_norm(hidden_states)
        if self.project_out is not None:
            hidden_states = self.project_out(hidden_states)
        return hidden_states


class OPTModel(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        self.decoder = OPTDecoder(config)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.decoder(input_ids, positions)


class OPTForCausalLM(CausalLM):
    stacked_params_mapping = [
        (".qkv_proj", ".q_proj", "q"),
        (".qkv_proj", ".k_proj", "k"),
        (".qkv_proj", ".v_proj", "v"),
    ]

    def __init__(self, config: Any) -> None:
        super().__init__()
        self.config = config
        self.model = OPTModel(config)
        # Every released OPT ties the LM head to the word embedding (OPTConfig's default).
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", True))
        self.lm_head = ParallelLMHead(config.vocab_size, config.word_embed_proj_dim)
        if self.tie_word_embeddings:
            self.lm_head.weight = self.model.decoder.embed_tokens.weight
        self.logits_processor = LogitsProcessor(config.vocab_size)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """input_ids, positions [T] int64 (absolute positions) -> final hidden states
        [T, word_embed_proj_dim] (only the rows ForwardContext.output_rows when it is set)."""
        return self.model(input_ids, positions)

    def _checkpoint_tensors(self, weights: Iterable[tuple[str, torch.Tensor]]
                            ) -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in super()._checkpoint_tensors(weights):
            if not name.startswith(("model.", "lm_head.")):
                name = "model." + name  # saved from OPTModel rather than OPTForCausalLM
            yield name, tensor
