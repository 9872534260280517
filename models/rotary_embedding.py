"""Rotary position embeddings (GPT-NeoX layout: the two halves of each head rotate
together), with the Llama-3, linear, LongRoPE (Phi-3) and YaRN (gpt-oss) frequency scalings.

cos/sin for every position up to max_position are computed once in fp32 (as Hugging
Face does), times the scaling's attention factor (LongRoPE's), and stored in the model
dtype; a forward only indexes them.

LongRoPE has two sets of per-frequency factors: short ones for contexts within
`original_max_position_embeddings`, long ones beyond. transformers picks per forward
(long once the sequence passes that length) and drops its KV cache to recompute every
key when a sequence crosses it. raylm, as vLLM, picks once per engine: the long factors
when max_model_len exceeds original_max_position_embeddings, the short ones otherwise,
so a cached key never needs recomputing and prefix-cache blocks are valid for every
request. The two agree for every sequence when max_model_len is within the original
length, and for sequences longer than it otherwise; shorter sequences of an engine whose
max_model_len passes it get the long factors where transformers uses the short ones.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from types import ModuleType
from typing import Any

import torch
from torch import nn

from raylm.kernels import cpu_ops, cuda_ops
from raylm.kernels.kv_cache_dtype import is_fp8
from raylm.models.rmsnorm import RMSNorm

logger = logging.getLogger(__name__)

_SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "longrope", "yarn")

# The engine's max_model_len while the loader builds a model (vLLM reads it from its
# current config): LongRoPE picks its factor set by it. None: max_position_embeddings.
_max_model_len: ContextVar[int | None] = ContextVar("max_model_len", default=None)


@contextmanager
def max_model_len_context(max_model_len: int) -> Iterator[None]:
    """Models built inside see the engine's context length (`longrope_uses_long_factors`)."""
    token = _max_model_len.set(max_model_len)
    try:
        yield
    finally:
        _max_model_len.reset(token)


def rope_parameters_from_config(config: Any) -> dict[str, Any]:
    """The rope settings as one dict with at least "rope_type" and "rope_theta".

    transformers 5.x keeps them in `config.rope_parameters`; 4.x in `config.rope_theta`
    plus an optional `config.rope_scaling` dict whose type key was "type" before "rope_type".
    """
    params = getattr(config, "rope_parameters", None)
    if isinstance(params, dict) and "rope_theta" in params:
        params = dict(params)
    else:
        params = dict(getattr(config, "rope_scaling", None) or {})
        theta = getattr(config, "rope_theta", None)  # a 0 is the config's (refused by get_rope)
        params["rope_theta"] = 10000.0 if theta is None else theta
    rope_type = params.get("rope_type") or params.get("type") or "default"
    params["rope_type"] = rope_type
    params.pop("type", None)
    # transformers 4.x kept these beside the rope settings; 5.x moves them in.
    for key in ("partial_rotary_factor", "original_max_position_embeddings"):
        if params.get(key) is None and getattr(config, key, None) is not None:
            params[key] = getattr(config, key)
    return params


def longrope_uses_long_factors(params: dict[str, Any], max_position: int) -> bool:
    """Whether LongRoPE rotates with its long factors: where the engine's max_model_len
    (`max_model_len_context`; max_position without one) exceeds
    original_max_position_embeddings (vLLM's rule; see the module docstring)."""
    missing = [key for key in ("short_factor", "long_factor", "original_max_position_embeddings")
               if params.get(key) is None]
    if missing:
        raise ValueError(f"rope_type 'longrope' needs rope_parameters {', '.join(missing)} (or "
                         f"config.original_max_position_embeddings); the config has none.")
    max_model_len = _max_model_len.get() or max_position
    return max_model_len > _original_max_position(params)


def _original_max_position(params: dict[str, Any]) -> int:
    original = params["original_max_position_embeddings"]
    if isinstance(original, bool) or not isinstance(original, (int, float)) or original < 1:
        raise ValueError(f"rope_parameters original_max_position_embeddings must be a positive number of "
                         f"positions, got {original!r}.")
    return int(original)


def _positive(params: dict[str, Any], key: str) -> float:
    """params[key] as a float, which must be finite and above zero (a rotary base, a scaling
    factor: zero or less makes cos and sin NaN or meaningless)."""
    value = params.get(key)
    number = float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else math.nan
    if not (math.isfinite(number) and number > 0):
        raise ValueError(f"rope_parameters {key} must be a positive finite number, got {value!r}.")
    return number


def _attention_factor(params: dict[str, Any], max_position: int) -> float:
    """What cos and sin are multiplied by: 1 but for LongRoPE, whose `attention_factor`
    defaults, as transformers computes it, to sqrt(1 + ln(factor) / ln(original length))
    with factor max_position_embeddings / original_max_position_embeddings unless given,
    and YaRN (`_yarn_attention_factor`)."""
    if params["rope_type"] == "yarn":
        return _yarn_attention_factor(params, max_position)
    if params["rope_type"] != "longrope":
        return 1.0
    if params.get("attention_factor") is not None:
        return _positive(params, "attention_factor")
    original = _original_max_position(params)
    factor = float(params.get("factor") or max_position / original)
    if factor <= 1.0:
        return 1.0
    if original < 2:
        raise ValueError("rope_parameters original_max_position_embeddings must be at least 2 where LongRoPE's "
                         "attention_factor is left to its default (it divides by the logarithm), got 1.")
    return math.sqrt(1 + math.log(factor) / math.log(original))


def _inverse_frequencies(rotary_dim: int, params: dict[str, Any], max_position: int) -> torch.Tensor:
    base = _positive(params, "rope_theta")
    inv_freq = 1.0 / (base ** (torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim))
    rope_type = params["rope_type"]
    if rope_type == "default":
        return inv_freq
    if rope_type == "linear":
        # Scaling positions by 1/factor is the same as scaling the frequencies.
        return inv_freq / _positive(params, "factor")
    if rope_type == "llama3":
        factor = _positive(params, "factor")
        low_freq_factor = _positive(params, "low_freq_factor")
        high_freq_factor = _positive(params, "high_freq_factor")
        old_context_len = float(params.get("original_max_position_embeddings") or max_position)
        low_freq_wavelen = old_context_len / low_freq_factor
        high_freq_wavelen = old_context_len / high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        # Long wavelengths are stretched by factor, short ones kept, the band in between
        # interpolated smoothly (Meta's reference, as transformers writes it).
        scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
        return torch.where(is_medium, smoothed, scaled)
    if rope_type == "longrope":
        key = "long_factor" if longrope_uses_long_factors(params, max_position) else "short_factor"
        for name in ("short_factor", "long_factor"):  # both checked, whichever this engine uses
            factors = params[name]
            if not (isinstance(factors, (list, tuple)) and len(factors) == inv_freq.numel()
                    and all(_is_positive_number(f) for f in factors)):
                raise ValueError(f"rope_parameters {name} must hold rotary_dim / 2 = {inv_freq.numel()} positive "
                                 f"finite numbers, got {factors!r}.")
        return inv_freq / torch.tensor(params[key], dtype=torch.float32)
    if rope_type == "yarn":
        return _yarn_inverse_frequencies(rotary_dim, params, max_position)
    raise ValueError(f"rope_type {rope_type!r} is not supported; supported: {', '.join(_SUPPORTED_ROPE_TYPES)}.")


def _yarn_factor(params: dict[str, Any], max_position: int) -> float:
    """YaRN's `factor`, or where the config gives none max_position_embeddings over
    original_max_position_embeddings (transformers' rule)."""
    if params.get("original_max_position_embeddings") is None:
        raise ValueError("rope_type 'yarn' needs rope_parameters original_max_position_embeddings; the config has "
                         "none.")
    factor = params.get("factor")
    return float(factor) if factor is not None else max_position / int(params["original_max_position_embeddings"])


def _yarn_attention_factor(params: dict[str, Any], max_position: int) -> float:
    """YaRN's `attention_factor`, or as transformers infers it: 0.1 ln(factor) + 1 (each
    term times `mscale` and `mscale_all_dim`, their ratio taken, where both are given)."""
    if params.get("attention_factor") is not None:
        return float(params["attention_factor"])
    factor = _yarn_factor(params, max_position)

    def mscale(scale: float) -> float:
        return 1.0 if factor <= 1 else 0.1 * scale * math.log(factor) + 1.0

    if params.get("mscale") and params.get("mscale_all_dim"):
        return float(mscale(float(params["mscale"])) / mscale(float(params["mscale_all_dim"])))
    return mscale(1.0)


def _yarn_inverse_frequencies(rotary_dim: int, params: dict[str, Any], max_position: int) -> torch.Tensor:
    """YaRN (arXiv 2309.00071), as transformers computes it: frequencies that turn more than
    beta_fast times over the original context are kept (extrapolated), those turning fewer
    than beta_slow times are divided by `factor` (interpolated), with a linear ramp between
    over the dimensions; `truncate` (default True) rounds the ramp's ends to whole dimensions."""
    base = float(params["rope_theta"])
    factor = _yarn_factor(params, max_position)
    original = int(params["original_max_position_embeddings"])
    beta_fast = params.get("beta_fast") or 32
    beta_slow = params.get("beta_slow") or 1

    def correction_dim(num_rotations: float) -> float:
        return (rotary_dim * math.log(original / (num_rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, rotary_dim - 1)
    if low == high:
        high += 0.001  # a ramp of no width
    ramp = ((torch.arange(rotary_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos_freqs = base ** (torch.arange(0, rotary_dim, 2).float() / rotary_dim)
    extrapolation = 1 - ramp
    return (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation


def _is_positive_number(value: Any) -> bool:
    return (isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
            and value > 0)


class RotaryEmbedding(nn.Module):
    def __init__(self, head_size: int, rotary_dim: int, max_position: int, rope_parameters: dict[str, Any]) -> None:
        super().__init__()
        self.head_size = head_size
        self.rotary_dim = rotary_dim
        self.max_position = max_position
        inv_freq = _inverse_frequencies(rotary_dim, rope_parameters, max_position)
        # No position reaches max_model_len (the scheduler stops requests, drafts and dummy
        # runs there): a table past it is memory for nothing, GBs where max_position_embeddings
        # is huge (hf_overrides' 1e12 would ask for terabytes).
        table_len = min(max_position, _max_model_len.get() or max_position)
        freqs = torch.arange(table_len, dtype=torch.float32)[:, None] * inv_freq[None, :]
        # [table_len, rotary_dim]: cos of every frequency, then sin.
        cache = torch.cat([freqs.cos(), freqs.sin()], dim=-1) * _attention_factor(rope_parameters, max_position)
        cache = cache.to(torch.get_default_dtype())
        self.register_buffer("cos_sin_cache", cache, persistent=False)

    def forward(self, positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotates query [T, Hq * D] and key [T, Hkv * D] by their tokens' positions (in
        place, in one launch, by the Triton kernel on CUDA)."""
        ops = self._cuda_ops(query, key)
        if ops is not None:
            ops.rotary_embedding_(positions, query, key, self.cos_sin_cache, self.head_size, self.rotary_dim)
            return query, key
        return self.rotate(positions, query), self.rotate(positions, key)

    def rotate_and_cache(self, positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                         kv_cache: tuple[torch.Tensor, torch.Tensor, torch.Tensor, float, float] | None,
                         qk_norm: tuple[nn.Module, nn.Module] | None = None) -> bool:
        """In one Triton launch on CUDA: normalises each head of query [T, Hq * D] and key
        [T, Hkv * D] with qk_norm's two RMSNorms (Qwen3's q_norm, k_norm), rotates them,
        all in place, and stores the keys and value [T, Hkv * D] in kv_cache (k_cache,
        v_cache, slot_mapping, k_scale, v_scale: `Attention.fused_kv_cache`) when given. True if it did;
        False, having done nothing, where the kernel does not take these tensors (the
        caller runs the separate ops)."""
        tensors = [query, key, value]
        norm_args = None
        if qk_norm is not None:
            q_norm, k_norm = qk_norm
            if (type(q_norm) is not RMSNorm or type(k_norm) is not RMSNorm or q_norm.eps != k_norm.eps
                    or q_norm.weight.shape != (self.head_size,)):
                return False
            tensors += [q_norm.weight, k_norm.weight]
            norm_args = (q_norm.weight, k_norm.weight, q_norm.eps)
        if kv_cache is not None:
            # An fp8 cache (kv_cache_dtype) is one the kernel rounds into itself.
            if any(is_fp8(cache.dtype) and cache.device != query.device for cache in kv_cache[:2]):
                return False
            tensors += [cache for cache in kv_cache[:2] if not is_fp8(cache.dtype)]
        ops = self._cuda_ops(*tensors[:3])
        if ops is None or cuda_ops.usable(*tensors[3:]) is None or value.shape != key.shape:
            return False
        cache_args, scales = None, (1.0, 1.0)
        if kv_cache is not None:
            cache_args, scales = (value, *kv_cache[:3]), kv_cache[3:]
        ops.rotary_embedding_(positions, query, key, self.cos_sin_cache, self.head_size, self.rotary_dim,
                              qk_norm=norm_args, kv_cache=cache_args, k_scale=scales[0], v_scale=scales[1])
        return True

    def _cuda_ops(self, *tensors: torch.Tensor) -> ModuleType | None:
        """The Triton kernels' module where they take these [T, H * D] tensors, else None:
        cos and sin in the tensors' dtype, as the PyTorch path computes in."""
        ops = cuda_ops.usable(*tensors, self.cos_sin_cache)
        if ops is None or any(x.dim() != 2 or x.stride(1) != 1 or x.dtype != self.cos_sin_cache.dtype
                              for x in tensors):
            return None
        return ops

    def rotate(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """Rotates every head of x [T, H * D]; the layers pass q and k as one tensor, which
        halves the number of (small, overhead-bound) ops per layer. On the CPU in fp32 the
        fused op rotates x in place and returns it, as does the Triton kernel on CUDA."""
        ops = self._cuda_ops(x)
        if ops is not None:
            ops.rotary_embedding_(positions, x, None, self.cos_sin_cache, self.head_size, self.rotary_dim)
            return x
        if x.dim() == 2 and x.stride(1) == 1 and cpu_ops.usable(x, self.cos_sin_cache):
            return cpu_ops.rotary_embedding_(x, positions, self.cos_sin_cache, self.head_size, self.rotary_dim)
        cos, sin = self.cos_sin_cache.index_select(0, positions).unsqueeze(1).chunk(2, dim=-1)
        shape = x.shape
        x = x.view(shape[0], -1, self.head_size)
        if self.rotary_dim == self.head_size:
            x1, x2 = x.chunk(2, dim=-1)
            return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).view(shape)
        x1, x2 = x[..., :self.rotary_dim].chunk(2, dim=-1)
        rotated = [x1 * cos - x2 * sin, x2 * cos + x1 * sin, x[..., self.rotary_dim:]]
        return torch.cat(rotated, dim=-1).view(shape)


def get_rope(head_size: int, max_position: int, rope_parameters: dict[str, Any]) -> RotaryEmbedding:
    partial = rope_parameters.get("partial_rotary_factor")
    partial = 1.0 if partial is None else float(partial)
    rotary_dim = int(head_size * partial)  # as transformers rounds it
    # The kernels rotate pairs of a head's first rotary_dim dimensions (the rest pass through).
    if not (2 <= rotary_dim <= head_size and rotary_dim % 2 == 0):
        raise ValueError(f"partial_rotary_factor {partial} rotates {rotary_dim} of each head's {head_size} "
                         f"dimensions; it must rotate an even number of them, at least 2 and at most head_dim.")
    return RotaryEmbedding(head_size, rotary_dim, max_position, rope_parameters)
