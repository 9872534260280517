"""Phi-3 (Phi-3, Phi-3.5-mini, Phi-4, Phi-4-mini): Llama's layers under other checkpoint
names and rope settings.

What differs from Llama: the checkpoints store q/k/v as one `qkv_proj` and gate/up as one
`gate_up_proj`, which load whole through the fused layers' `weight_loader`s (shard_id
None: each cuts this rank's q, k and v heads, or gate and up rows, out of the fused
tensor); rotary may cover part of each head (`partial_rotary_factor`, 0.75 in
Phi-4-mini) and scale as LongRoPE (`rope_type` "longrope": short and long factors, an
attention factor on cos and sin; `models/rotary_embedding.py` says which factor set
raylm uses); every layer attends within `sliding_window` where the config sets one
(Phi-3-mini); Phi-4-mini ties its embeddings.
"""

from __future__ import annotations

from typing import Any

from raylm.models.llama import LlamaForCausalLM


class Phi3ForCausalLM(LlamaForCausalLM):
    # The checkpoint's names are the fused parameters' own: nothing to stack.
    stacked_params_mapping: list[tuple[str, str, Any]] = []
