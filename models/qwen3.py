"""Qwen3: Llama with an RMSNorm over each head of q and k before rotary (q_norm, k_norm),
`head_dim` free of hidden_size / num_heads, and no qkv bias unless `attention_bias`.

CPU decode steps run through the fused op of Llama's layers (`kernels/cpu_fused_decode.py`),
which applies the q/k norms as this attention does; Qwen3-MoE's sparse layers are not its
layers, so that model runs its modules.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from raylm.kernels.cpu_fused_decode import CpuFusedDecode
from raylm.models.llama import LlamaAttention, LlamaForCausalLM, is_plain_llama_layer
from raylm.models.rmsnorm import RMSNorm
from raylm.models.rotary_embedding import RotaryEmbedding


class Qwen3Attention(LlamaAttention):
    def __init__(self, config: Any, rotary_emb: RotaryEmbedding, sliding_window: int | None = None) -> None:
        bias = bool(getattr(config, "attention_bias", False))
        super().__init__(config, rotary_emb, qkv_bias=bias, o_bias=bias, sliding_window=sliding_window)
        # One weight of head_dim shared by all heads, so no tensor-parallel sharding.
        self.q_norm = RMSNorm(self.head_size, config.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_size, config.rms_norm_eps)

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor,
                output_rows: torch.Tensor | None = None) -> torch.Tensor:
        q, k, v = self.qkv_proj(hidden_states).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        kv_cache = self.fused_kv_cache()
        if self.rotary_emb.rotate_and_cache(positions, q, k, v, kv_cache, qk_norm=(self.q_norm, self.k_norm)):
            # One launch on CUDA: the norms, rotary and the KV write, in place in the QKV output.
            return self.o_proj(self.attn(q, k, v, output_rows, kv_cached=kv_cache is not None))
        q = self.q_norm(q.reshape(-1, self.head_size)).view(-1, self.q_size)
        k = self.k_norm(k.reshape(-1, self.head_size)).view(-1, self.kv_size)
        q, k = self.rotary_emb(positions, q, k)
        return self.o_proj(self.attn(q, k, v, output_rows))


class Qwen3ForCausalLM(LlamaForCausalLM):
    def __init__(self, config: Any) -> None:
        super().__init__(config)
        # The Llama layers build LlamaAttention by name; swapping each for Qwen3's frees the
        # old one (empty, never loaded), so this costs one layer's projections of memory at
        # most. The rest of the layer (MLP, norms, residual order) is Llama's.
        for layer in self.model.stage_layers:
            layer.self_attn = Qwen3Attention(config, layer.self_attn.rotary_emb, layer.self_attn.attn.sliding_window)
        self.model.fused_decode = CpuFusedDecode(self.model.stage_layers, is_plain_qwen3_layer, qk_norms=True)


def is_plain_qwen3_layer(layer: nn.Module) -> bool:
    """Whether a layer is Llama's over Qwen3's attention with plain RMSNorms for q and k:
    what the fused CPU decode op computes with its q/k norms."""
    return (is_plain_llama_layer(layer, attention_class=Qwen3Attention)
            and type(layer.self_attn.q_norm) is RMSNorm and type(layer.self_attn.k_norm) is RMSNorm)
