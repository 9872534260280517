"""A CPU decode step through every Llama decoder layer in one native call.

`LlamaModel.forward` hands each step to `CpuFusedDecode.run` first, with the step's
attention metadata and a check (the model's own) that a layer is the plain Llama layer. Where the step is
decode-only on the CPU and every layer is the plain Llama layer on the native kernels, it
runs `torch.ops.raylm.llama_decode_layers` (`kernels/csrc/cpu_decode_layers.cpp`): the same
kernels, in the same order, called from C++, so the results are bitwise those of the
modules. Elsewhere (prefill and mixed steps, tensor parallelism, other attention backends or
layer types, GPUs) `run` returns None and the modules run. With LoRA layers (enable_lora) the
op adds each token's adapter term after each projection, as the LoRA layers do
(`csrc/cpu_lora.cpp`). Models on these layers run it: Llama, Mistral, Qwen2, Phi-3 (partial
rotary and LongRoPE live in the rotary table), Granite (its attention_multiplier is the
softmax scale, its residual_multiplier the op's), Qwen3 (`qk_norms`: its per-head q/k
RMSNorms before the rotary) and OLMo 2 (`post_norms`: each block's output normalised before
its residual add, no norm before; its q/k norms over the whole projections); layers that
compute otherwise (Gemma 2 and 3's (1 + weight) norms and soft caps, gpt-oss's sinks, the
MoE models' experts: Qwen3-MoE's attention is Qwen3's, its sparse MLPs are not) run their
modules.

Why: a decode step streams every layer's weights through the caches, so the Python between a
layer's ~10 kernels runs with cold caches (25 us an op call instead of 2.4); in the ~100M
Llama's bf16 generate those gaps were ~0.27 s of ~8.4 s. For comparisons, "fused_decode" in
RAYLM_TEST_DISABLE_KERNELS (engine/envs.py) runs the modules instead.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from raylm.engine import envs
from raylm.kernels import cpu_attention, cpu_gemm, cpu_ops
from raylm.kernels.attention_metadata import AttentionMetadata
from raylm.kernels.native_build import load_native_library

_DTYPES = (torch.float32, torch.bfloat16)


@dataclass(frozen=True)
class _Shape:
    """What every layer shares, as the op takes it."""

    num_heads: int
    num_kv_heads: int
    head_size: int
    rotary_dim: int
    eps: float
    scale: float
    # Each block's output times this before its residual add (Granite's; 1 for Llama).
    residual_multiplier: float
    cos_sin_cache: torch.Tensor
    # Each layer's sliding window (0: none).
    sliding_windows: list[int]
    # Each layer's attention normalises q and k before the rotary (Qwen3's per head, OLMo 2's
    # over the whole projection).
    qk_norms: bool
    # Each block's output is normalised before its residual add, its input not (OLMo 2's).
    post_norms: bool


class CpuFusedDecode:
    """Runs a Llama model's decoder layers for decode steps on the CPU in one native call.

    What the op needs per batch size (each linear's kernel and weight copy, as
    `cpu_gemm.choose_linear` picks them) is gathered once per size and KV cache; `reset`
    forgets it, and the loader's `process_weights_after_loading` hook calls it.

    `is_plain_layer(layer)` says whether a layer is the plain Llama decoder layer this op
    computes (RMSNorms, rotary attention, SiLU-gated MLP, nothing more): the model knows its
    layer classes, this module knows none. Each layer's attention keeps its sliding window
    (Mistral's) and its softmax scale (Granite's attention_multiplier), the same in every
    layer; a layer's `residual_multiplier` (Granite's, 1 where a layer has none) scales each
    block's output before its residual add. A soft-capped attention is not such a layer.

    `qk_norms`: each layer's attention normalises q and k with its `q_norm` and `k_norm`
    (RMSNorms of the layers' eps, over each head or over the whole projection) before the
    rotary, as Qwen3's and OLMo 2's attention do. `post_norms`: the layers are OLMo 2's, whose
    `post_attention_layernorm` and `post_feedforward_layernorm` normalise each block's output
    before its residual add (and no norm precedes a block)."""

    def __init__(self, layers: nn.ModuleList, is_plain_layer: Callable[[nn.Module], bool],
                 qk_norms: bool = False, post_norms: bool = False) -> None:
        self.layers = layers
        self.is_plain_layer = is_plain_layer
        self.qk_norms = qk_norms
        self.post_norms = post_norms
        self._shape: _Shape | None | bool = None  # None: not checked yet; False: cannot run
        self._args: dict[tuple[int, torch.dtype], tuple[list, list[int]] | None] = {}
        self._kv_cache: tuple[torch.Tensor, torch.Tensor] | None = None
        self._first_attention: nn.Module | None = None
        # enable_lora: the LoRA layers' per-step batch, and per layer their stacked adapter
        # slots in the op's order (None: adapter steps are declined, the LoRA layers run them).
        self._lora_batch = None
        self._lora_tensors: list[torch.Tensor] | None = None

    def reset(self) -> None:
        self._shape = None
        self._args.clear()
        self._kv_cache = None  # sleep mode frees the caches: hold none of them

    def run(self, hidden_states: torch.Tensor, positions: torch.Tensor, md: AttentionMetadata | None
            ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(hidden_states, residual) after the last layer, as the layers' loop would return
        them; None where this step cannot run fused (the caller runs the modules)."""
        num_tokens = hidden_states.shape[0]
        if (md is None or md.max_query_len != 1 or len(md.seq_lens_list) != num_tokens
                or hidden_states.device.type != "cpu" or hidden_states.dtype not in _DTYPES
                or hidden_states.dim() != 2 or torch.is_grad_enabled()):
            return None
        shape = self._check_layers() if self._shape is None else self._shape
        if not shape:
            return None
        lora = self._lora_batch
        lora_args: tuple = (None, [], 0)  # none: the plain layers
        if lora is not None and lora.active:
            if self._lora_tensors is None or hidden_states.dtype != lora.dtype:
                return None  # the LoRA layers run the step
            lora_args = (lora.token_slots, self._lora_tensors, lora.max_rank)
        kv_cache = self._first_attention.kv_cache
        if kv_cache is not self._kv_cache:  # the runner allocated the caches (again)
            self._args.clear()
            self._kv_cache = kv_cache
        key = (num_tokens, hidden_states.dtype)
        if key not in self._args:
            self._args[key] = self._layer_args(num_tokens, hidden_states.dtype)
        args = self._args[key]
        if args is None:
            return None
        tensors, ints = args
        return torch.ops.raylm.llama_decode_layers(
            hidden_states.contiguous(), positions.to(torch.int64).contiguous(),
            md.slot_mapping.to(torch.int64).contiguous(), md.block_tables.to(torch.int32).contiguous(),
            md.seq_lens.to(torch.int32).contiguous(), shape.cos_sin_cache, tensors, ints, shape.num_heads,
            shape.num_kv_heads, shape.head_size, shape.rotary_dim, shape.eps, shape.scale, shape.residual_multiplier,
            shape.post_norms, shape.sliding_windows,
            *lora_args)

    def _check_layers(self) -> _Shape | bool:
        """What the layers share, or False where one is not the plain Llama layer on the
        native CPU kernels, or the kernels cannot be built."""
        self._shape = (_shape_of(self.layers, self.is_plain_layer, self.qk_norms, self.post_norms)
                       if not envs.kernel_switched_off("fused_decode") else False)
        if self._shape:
            self._first_attention = self.layers[0].self_attn.attn
            attn, mlp = self.layers[0].self_attn, self.layers[0].mlp
            self._lora_batch = next((linear.lora_batch for linear in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj,
                                                                       mlp.down_proj) if hasattr(linear, "lora_batch")),
                                    None)
            self._lora_tensors = _lora_tensors(self.layers) if self._lora_batch is not None else None
        return self._shape

    def _layer_args(self, num_tokens: int, dtype: torch.dtype) -> tuple[list, list[int]] | None:
        """The op's per-layer tensors and ints for this batch size and dtype; None where a
        layer's weights or caches do not suit it."""
        tensors: list[torch.Tensor | None] = []
        ints: list[int] = []
        for layer in self.layers:
            attn, mlp = layer.self_attn, layer.mlp
            kv_cache = attn.attn.kv_cache
            norms = tuple(norm.weight for norm in _block_norms(layer, self._shape.post_norms))
            if (kv_cache is None or any(c.dtype != dtype or not c.is_contiguous() for c in kv_cache)
                    or not cpu_ops.usable(*norms) or not all(w.is_contiguous() for w in norms)):
                return None
            tensors += norms
            for linear in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj):
                if getattr(linear, "quant_method", None) is not None:
                    return None  # FP8 weights: the layers' own GEMM dequantizes them
                gated = linear.silu_and_mul_weight if linear is mlp.gate_up_proj else None
                if gated is not None and gated.packed.dtype == dtype and gated.takes(num_tokens):
                    # The gate_up kernel that applies SiLU-and-mul itself (what MergedColumnParallelLinear.
                    # silu_and_mul runs): its output has half the projection's features.
                    tensors += (gated.packed, None)
                    ints += (gated.kind, linear.weight.shape[0] // 2)
                    continue
                kind, weight = cpu_gemm.choose_linear(linear.weight, linear.packed_weight, linear.decode_weight,
                                                      num_tokens, dtype)
                tensors += (weight, linear.bias)
                ints += (kind, linear.weight.shape[0])
            tensors += kv_cache
            qk_norms = (attn.q_norm.weight, attn.k_norm.weight) if self._shape.qk_norms else (None, None)
            if self._shape.qk_norms and not (cpu_ops.usable(*qk_norms) and all(w.is_contiguous() for w in qk_norms)):
                return None
            tensors += qk_norms
        return tensors, ints


def _lora_tensors(layers: nn.ModuleList) -> list[torch.Tensor] | None:
    """Per layer, each projection's stacked LoRA slots (lora_a, then lora_b of each output
    slice) in the op's order; None unless every projection is a LoRA layer of the expected
    slices and the native LoRA kernel is built."""
    from raylm.kernels.lora_ops import native_kernel_available

    if not native_kernel_available():
        return None
    tensors: list[torch.Tensor] = []
    for layer in layers:
        attn, mlp = layer.self_attn, layer.mlp
        for linear, slices in ((attn.qkv_proj, 3), (attn.o_proj, 1), (mlp.gate_up_proj, 2), (mlp.down_proj, 1)):
            if len(getattr(linear, "lora_b", ())) != slices or getattr(linear, "silu_and_mul_weight", None) is not None:
                return None
            tensors += [linear.lora_a, *linear.lora_b]
    return tensors


def _shape_of(layers: nn.ModuleList, is_plain_layer: Callable[[nn.Module], bool], qk_norms: bool,
              post_norms: bool) -> _Shape | bool:
    if len(layers) == 0 or not (cpu_ops.usable() and cpu_attention.is_available()
                                and load_native_library("cpu_decode_layers") is not None):
        return False
    if not is_plain_layer(layers[0]):
        return False
    first = layers[0].self_attn
    eps = _block_norms(layers[0], post_norms)[0].eps
    residual_multiplier = _residual_multiplier(layers[0])
    for layer in layers:
        attn = layer.self_attn
        if (not is_plain_layer(layer) or attn.attn.attn_backend.name != "cpu" or attn.o_proj.tp_size != 1
                or attn.attn.logits_soft_cap is not None):
            return False
        if (attn.rotary_emb is not first.rotary_emb or attn.attn.scale != first.attn.scale
                or (attn.num_heads, attn.num_kv_heads, attn.head_size) != (first.num_heads, first.num_kv_heads,
                                                                           first.head_size)
                or {norm.eps for norm in _block_norms(layer, post_norms)} != {eps}
                or _residual_multiplier(layer) != residual_multiplier
                or (qk_norms and not _has_qk_norms(attn, eps))):
            return False
    rotary = first.rotary_emb
    if rotary.cos_sin_cache.dtype not in _DTYPES or not rotary.cos_sin_cache.is_contiguous():
        return False
    return _Shape(first.num_heads, first.num_kv_heads, first.head_size, rotary.rotary_dim, float(eps),
                  float(first.attn.scale), residual_multiplier, rotary.cos_sin_cache,
                  [layer.self_attn.attn.sliding_window or 0 for layer in layers], qk_norms, post_norms)


def _block_norms(layer: nn.Module, post_norms: bool) -> tuple[nn.Module, nn.Module]:
    """The layer's two RMSNorms the op takes: of each block's input (Llama's), or with
    post_norms of each block's output (OLMo 2's)."""
    if post_norms:
        return layer.post_attention_layernorm, layer.post_feedforward_layernorm
    return layer.input_layernorm, layer.post_attention_layernorm


def _has_qk_norms(attn: nn.Module, eps: float) -> bool:
    """Whether attn's q_norm and k_norm (RMSNorms, as the model's `is_plain_layer` checks) are
    of the op's eps and over each head or over the whole projection: the op normalises rows of
    the weight's length."""
    norms = ((getattr(attn, "q_norm", None), attn.q_size), (getattr(attn, "k_norm", None), attn.kv_size))
    return all(norm is not None and norm.eps == eps and norm.weight.dim() == 1
               and norm.weight.shape[0] in (attn.head_size, size) for norm, size in norms)


def _residual_multiplier(layer: nn.Module) -> float:
    """What the layer multiplies each block's output by before its residual add."""
    return float(getattr(layer, "residual_multiplier", 1.0))
