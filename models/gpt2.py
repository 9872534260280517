"""GPT-2, written against the parallel layers so the same code runs sharded under tensor
parallelism.

Differences from Llama: learned absolute positions, LayerNorm, a GELU MLP (c_fc, c_proj)
without a gate, and one fused q/k/v projection (`c_attn`). Hugging Face stores GPT-2's
projections as `Conv1D`, whose weight is [in, out], the transpose of `nn.Linear`'s;
`load_weights` hands their weight loaders a transposed view. Module names equal Hugging
Face's, so checkpoints load by name.
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
from raylm.parallel import (ColumnParallelLinear, ParallelLMHead, QKVParallelLinear, RowParallelLinear,
                            VocabParallelEmbedding, get_tensor_model_parallel_world_size)
from raylm.parallel.checkpoint_slice import CheckpointSlice, read_weight

# Conv1D modules: their 2-D weights are stored [in, out].
_CONV1D_WEIGHTS = (".attn.c_attn.weight", ".attn.c_proj.weight", ".mlp.c_fc.weight", ".mlp.c_proj.weight")


class TransposedWeight(CheckpointSlice):
    """A 2-D checkpoint tensor (a `CheckpointSlice` or a tensor) seen transposed. `narrow`
    cuts the underlying dimension, so a tensor-parallel rank still reads only its shard;
    `read_weight` returns the transpose of what was cut."""

    def __init__(self, weight: CheckpointSlice | torch.Tensor) -> None:
        assert weight.dim() == 2, "only 2-D Conv1D weights are transposed"
        self._weight = weight
        self.shape = torch.Size(reversed(weight.shape))

    def narrow(self, dim: int, start: int, length: int) -> "TransposedWeight":
        return TransposedWeight(self._weight.narrow(1 - dim, start, length))

    def __getitem__(self, rows: slice) -> "TransposedWeight":
        start, stop, _ = rows.indices(self.shape[0])
        return self.narrow(0, start, max(0, stop - start))

    def read(self) -> torch.Tensor:
        return read_weight(self._weight).t()


class GPT2Attention(nn.Module):
    def __init__(self, config: Any, layer_idx: int) -> None:
        super().__init__()
        tp_size = get_tensor_model_parallel_world_size()
        self.total_num_heads = config.num_attention_heads
        self.head_size = config.hidden_size // self.total_num_heads
        self.c_attn = QKVParallelLinear(config.hidden_size, self.head_size, self.total_num_heads, bias=True)
        self.c_proj = RowParallelLinear(config.hidden_size, config.hidden_size, bias=True)
        self.num_heads = self.total_num_heads // tp_size
        self.q_size = self.num_heads * self.head_size
        scale = self.head_size ** -0.5 if getattr(config, "scale_attn_weights", True) else 1.0
        if getattr(config, "scale_attn_by_inverse_layer_idx", False):
            scale /= float(layer_idx + 1)
        self.attn = Attention(self.num_heads, self.head_size, scale)

    def forward(self, hidden_states: torch.Tensor, output_rows: torch.Tensor | None = None) -> torch.Tensor:
        q, k, v = self.c_attn(hidden_states).split([self.q_size] * 3, dim=-1)
        return self.c_proj(self.attn(q, k, v, output_rows))


class GPT2MLP(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        inner_size = getattr(config, "n_inner", None) or 4 * config.hidden_size
        self.c_fc = ColumnParallelLinear(config.hidden_size, inner_size, bias=True)
        self.act = get_act_fn(config.activation_function)
        self.c_proj = RowParallelLinear(inner_size, config.hidden_size, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return mlp_in_row_chunks(self._mlp, x, self.c_fc.weight.shape[0])

    def _mlp(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(self.act(self.c_fc(x)))


class GPT2Block(nn.Module):
    def __init__(self, config: Any, layer_idx: int) -> None:
        super().__init__()
        if getattr(config, "add_cross_attention", False):
            raise ValueError("add_cross_attention=True (GPT-2 as an encoder-decoder's decoder) is not supported; "
                             "raylm runs decoder-only GPT-2.")
        self.ln_1 = LayerNorm(config.hidden_size, eps=config.layer_norm_epsilon)
        self.attn = GPT2Attention(config, layer_idx)
        self.ln_2 = LayerNorm(config.hidden_size, eps=config.layer_norm_epsilon)
        self.mlp = GPT2MLP(config)

    def forward(self, hidden_states: torch.Tensor, output_rows: torch.Tensor | None = None) -> torch.Tensor:
        hidden_states = select_rows(hidden_states, output_rows) + self.attn(self.ln_1(hidden_states), output_rows)
        return hidden_states + self.mlp(self.ln_2(hidden_states))


class GPT2Model(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        self.wte = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.wpe = LearnedPositionalEmbedding(config.max_position_embeddings, config.hidden_size)
        self.h = nn.ModuleList(GPT2Block(config, i) for i in range(config.num_hidden_layers))
        self.ln_f = LayerNorm(config.hidden_size, eps=config.layer_norm_epsilon)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        hidden_states = self.wte(input_ids) + self.wpe(positions)
        for i, block in enumerate(self.h):
            hidden_states = block(hidden_states, last_layer_rows(i, len(self.h)))
        return self.ln_f(hidden_states)


class GPT2LMHeadModel(CausalLM):
    base_model_prefix = "transformer"

    def __init__(self, config: Any) -> None:
        super().__init__()
        self.config = config
        self.transformer = GPT2Model(config)
        # GPT-2 ties the LM head to the token embedding (GPT2Config's default).
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", True))
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size)
        if self.tie_word_embeddings:
            self.lm_head.weight = self.transformer.wte.weight
        self.logits_processor = LogitsProcessor(config.vocab_size)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """input_ids, positions [T] int64 (absolute positions) -> final hidden states [T, hidden]
        (only the rows ForwardContext.output_rows when it is set)."""
        return self.transformer(input_ids, positions)

    def _checkpoint_tensors(self, weights: Iterable[tuple[str, torch.Tensor]]
                            ) -> Iterator[tuple[str, torch.Tensor]]:
        """c_attn's fused q/k/v tensor goes whole to QKVParallelLinear's loader, which splits
        it (shard id None); Conv1D weights go transposed."""
        for name, tensor in super()._checkpoint_tensors(weights):
            if name.endswith((".attn.bias", ".attn.masked_bias")):
                continue  # causal-mask buffers that older checkpoints saved
            if not name.startswith(("transformer.", "lm_head.")):
                name = "transformer." + name  # saved from GPT2Model (e.g. the original gpt2)
            if name.endswith(_CONV1D_WEIGHTS):
                tensor = TransposedWeight(tensor)
            yield name, tensor
