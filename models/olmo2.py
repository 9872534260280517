"""OLMo 2 (`Olmo2ForCausalLM`), on the Llama pieces where they fit (projections, rotary,
SiLU MLP, weight loading, the model's forward).

What differs from Llama: no norm before attention or the MLP; instead each block's output
is normalised before its residual add (`post_attention_layernorm`,
`post_feedforward_layernorm`); and q and k are normalised over the whole projection, all
heads together (q_norm of num_heads * head_dim, k_norm of num_kv_heads * head_dim), before
rotary. Under tensor parallelism a rank holds some of the heads, so the mean square of
those norms is summed over the ranks (one all-reduce for q and k together).

CPU decode steps on one rank run through the fused op of Llama's layers
(`kernels/cpu_fused_decode.py`) in its post-norm layout, with the q/k norms over the whole
projections.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from raylm.kernels.cpu_fused_decode import CpuFusedDecode
from raylm.models.activation import SiluAndMul
from raylm.models.forward_context import select_rows
from raylm.models.llama import LlamaAttention, LlamaForCausalLM, LlamaMLP, LlamaModel
from raylm.models.rmsnorm import RMSNorm
from raylm.models.rotary_embedding import RotaryEmbedding
from raylm.parallel import (get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size,
                            tensor_model_parallel_all_reduce)
from raylm.parallel.checkpoint_slice import read_weight


class ShardedRMSNorm(RMSNorm):
    """An RMSNorm over a vector of `total_size` sharded across the tensor-parallel ranks:
    this rank holds the weight of elements shard_start .. shard_start + shard_size - 1.
    Called alone it normalises its input as a whole vector (tensor parallel size 1);
    `scale` takes the mean square of the whole vector, computed across ranks."""

    def __init__(self, total_size: int, shard_size: int, shard_start: int, eps: float) -> None:
        super().__init__(shard_size, eps)
        self.total_size = total_size
        self.shard_start = shard_start
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: Any = None) -> None:
        if tuple(loaded_weight.shape) != (self.total_size,):
            raise ValueError(f"checkpoint norm weight has shape {tuple(loaded_weight.shape)}, the model expects "
                             f"({self.total_size},).")
        param.data.copy_(read_weight(loaded_weight.narrow(0, self.shard_start, param.shape[0])))

    def scale(self, x: torch.Tensor, mean_square: torch.Tensor) -> torch.Tensor:
        """x [T, shard_size] normalised by mean_square [T, 1] (fp32), times this rank's weight,
        in fp32 and rounded to x's dtype once, as Hugging Face's Olmo2RMSNorm."""
        return (x.float() * torch.rsqrt(mean_square + self.eps) * self.weight.float()).to(x.dtype)


class Olmo2Attention(LlamaAttention):
    def __init__(self, config: Any, rotary_emb: RotaryEmbedding, sliding_window: int | None = None) -> None:
        bias = bool(getattr(config, "attention_bias", False))
        super().__init__(config, rotary_emb, qkv_bias=bias, o_bias=bias, sliding_window=sliding_window)
        self.tp_size = get_tensor_model_parallel_world_size()
        rank = get_tensor_model_parallel_rank()
        eps = config.rms_norm_eps
        self.q_norm = ShardedRMSNorm(self.total_num_heads * self.head_size, self.q_size, rank * self.q_size, eps)
        # Replicas of one KV head sit on consecutive ranks (QKVParallelLinear).
        kv_shard = rank // self.qkv_proj.num_kv_head_replicas
        self.k_norm = ShardedRMSNorm(self.total_num_kv_heads * self.head_size, self.kv_size,
                                     kv_shard * self.kv_size, eps)

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor,
                output_rows: torch.Tensor | None = None) -> torch.Tensor:
        q, k, v = self.qkv_proj(hidden_states).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q, k = self._qk_norm(q, k)
        kv_cache = self.fused_kv_cache()
        if self.rotary_emb.rotate_and_cache(positions, q, k, v, kv_cache):  # one launch on CUDA
            return self.o_proj(self.attn(q, k, v, output_rows, kv_cached=kv_cache is not None))
        q, k = self.rotary_emb(positions, q, k)
        return self.o_proj(self.attn(q, k, v, output_rows))

    def _qk_norm(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.tp_size == 1:
            return self.q_norm(q.contiguous()), self.k_norm(k.contiguous())
        # Each rank's mean square over its part; their mean is the whole vector's, replicated
        # KV heads included (every head counts tp / num_kv_heads times, in sum and count alike).
        mean_squares = torch.stack([q.float().pow(2).mean(-1), k.float().pow(2).mean(-1)], dim=-1)
        mean_squares = tensor_model_parallel_all_reduce(mean_squares) / self.tp_size
        return self.q_norm.scale(q, mean_squares[:, :1]), self.k_norm.scale(k, mean_squares[:, 1:])


class Olmo2DecoderLayer(nn.Module):
    def __init__(self, config: Any, rotary_emb: RotaryEmbedding, sliding_window: int | None = None) -> None:
        super().__init__()
        self.self_attn = Olmo2Attention(config, rotary_emb, sliding_window)
        self.mlp = LlamaMLP(config.hidden_size, config.intermediate_size, getattr(config, "hidden_act", "silu"))
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_feedforward_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor, residual: torch.Tensor | None,
                output_rows: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(the MLP block's normalised output, the residual stream before its add): the add
        waits for the next layer (or the model's final norm), as in Llama's layout."""
        if residual is not None:
            hidden_states = hidden_states + residual
        attn_output = self.self_attn(positions, hidden_states, output_rows)
        hidden_states = select_rows(hidden_states, output_rows) + self.post_attention_layernorm(attn_output)
        return self.post_feedforward_layernorm(self.mlp(hidden_states)), hidden_states


class Olmo2Model(LlamaModel):
    """Llama's forward (embed, layers, final norm with the last residual add) over OLMo 2's
    layers."""

    def __init__(self, config: Any) -> None:
        nn.Module.__init__(self)  # LlamaModel.__init__ would build Llama layers
        self._build_modules(config, lambda rotary_emb, window: Olmo2DecoderLayer(config, rotary_emb, window))
        self.fused_decode = CpuFusedDecode(self.stage_layers, is_plain_olmo2_layer, qk_norms=True, post_norms=True)


def is_plain_olmo2_layer(layer: nn.Module) -> bool:
    """Whether a layer computes exactly what the fused CPU decode op does in its post-norm
    layout with whole-projection q/k norms (the op checks the tensor-parallel size is 1, where
    ShardedRMSNorm is a plain RMSNorm of the rank's whole projection)."""
    if type(layer) is not Olmo2DecoderLayer:
        return False
    attn, mlp = layer.self_attn, layer.mlp
    return (type(attn) is Olmo2Attention and type(attn.q_norm) is ShardedRMSNorm
            and type(attn.k_norm) is ShardedRMSNorm and type(attn.rotary_emb) is RotaryEmbedding
            and type(mlp) is LlamaMLP and type(mlp.act_fn) is SiluAndMul
            and type(layer.post_attention_layernorm) is RMSNorm and type(layer.post_feedforward_layernorm) is RMSNorm)


class Olmo2ForCausalLM(LlamaForCausalLM):
    """Llama's forward and weight loading (same checkpoint names) over OLMo 2's model."""

    def _init_model(self, config: Any) -> Olmo2Model:
        return Olmo2Model(config)
