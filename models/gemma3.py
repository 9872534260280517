"""Gemma 3 (text: `Gemma3ForCausalLM`, gemma-3-1b and the like), on Gemma 2's pieces.

What differs from Gemma 2: an RMSNorm with Gemma's (1 + weight) over each head of q and k
before rotary (q_norm, k_norm, as Qwen3 has them); five local layers to one global by
default (`layer_types`, or `sliding_window_pattern` = 6 in older configs); and two rotary
tables, the local layers' of base `rope_local_base_freq` (10k) and the global layers' of
base `rope_theta` (1M) with the config's `rope_scaling` (linear, factor 8, for the 4B and
larger). Soft caps only where the config sets them (Gemma 3's are None).
"""

from __future__ import annotations

from typing import Any

from raylm.models.gemma2 import Gemma2Attention, Gemma2DecoderLayer, Gemma2ForCausalLM, Gemma2Model
from raylm.models.qwen3 import Qwen3Attention
from raylm.models.rmsnorm import GemmaRMSNorm
from raylm.models.rotary_embedding import RotaryEmbedding, get_rope
from raylm.models.sliding_window import SLIDING, sliding_attention_layers

FULL = "full_attention"
# Gemma3TextConfig's bases where a config leaves them out (its `default_theta`).
_DEFAULT_THETA = {FULL: 1_000_000.0, SLIDING: 10_000.0}


def gemma3_rope_parameters(config: Any) -> dict[str, dict[str, Any]]:
    """The rope settings of each layer type ("sliding_attention", "full_attention"), each a
    dict with at least "rope_type" and "rope_theta".

    transformers 5 nests them in `config.rope_parameters` by layer type; 4.x configs hold
    the global layers' `rope_theta` and `rope_scaling` and the local layers'
    `rope_local_base_freq` (local layers are never scaled)."""
    params = getattr(config, "rope_parameters", None)
    if isinstance(params, dict) and (FULL in params or SLIDING in params):
        by_type = {kind: dict(params.get(kind) or {}) for kind in (FULL, SLIDING)}
    else:
        full = dict(params) if isinstance(params, dict) else dict(getattr(config, "rope_scaling", None) or {})
        if getattr(config, "rope_theta", None) is not None:
            full.setdefault("rope_theta", config.rope_theta)
        local_theta = getattr(config, "rope_local_base_freq", None)
        by_type = {FULL: full, SLIDING: {"rope_theta": local_theta} if local_theta is not None else {}}
    for kind, kind_params in by_type.items():
        kind_params["rope_type"] = kind_params.pop("type", None) or kind_params.get("rope_type") or "default"
        # Only a missing base takes the default: a 0 is the config's (refused by get_rope).
        if kind_params.get("rope_theta") is None:
            kind_params["rope_theta"] = _DEFAULT_THETA[kind]
    return by_type


class Gemma3Attention(Gemma2Attention):
    """Gemma 2's projections, scale and soft cap; per-head q and k norms before rotary."""

    def __init__(self, config: Any, rotary_emb: RotaryEmbedding, sliding_window: int | None) -> None:
        super().__init__(config, rotary_emb, sliding_window)
        # One weight of head_dim shared by all heads, so no tensor-parallel sharding.
        self.q_norm = GemmaRMSNorm(self.head_size, config.rms_norm_eps)
        self.k_norm = GemmaRMSNorm(self.head_size, config.rms_norm_eps)

    # Qwen3's forward: it norms each head of q and k with self.q_norm, self.k_norm, rotates,
    # attends (its fused CUDA kernel takes plain RMSNorms only; Gemma's run the separate ops).
    forward = Qwen3Attention.forward


class Gemma3DecoderLayer(Gemma2DecoderLayer):
    attention_class = Gemma3Attention


class Gemma3Model(Gemma2Model):
    decoder_layer_class = Gemma3DecoderLayer

    def _layer_rotary_embs(self, config: Any) -> list[RotaryEmbedding]:
        """The local table for the sliding layers, the global one for the others, chosen by
        layer type: a window as long as the context still rotates by the local base."""
        head_size = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        params = gemma3_rope_parameters(config)
        local = get_rope(head_size, config.max_position_embeddings, params[SLIDING])
        global_ = get_rope(head_size, config.max_position_embeddings, params[FULL])
        return [local if sliding else global_ for sliding in sliding_attention_layers(config)]


class Gemma3ForCausalLM(Gemma2ForCausalLM):
    """Gemma 2's weight loading (same checkpoint names, q_norm / k_norm by their own) and
    final soft cap (when set) over Gemma 3's model."""

    def _init_model(self, config: Any) -> Gemma3Model:
        return Gemma3Model(config)
