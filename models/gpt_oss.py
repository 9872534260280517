"""OpenAI's gpt-oss (gpt-oss-20b, gpt-oss-120b): `GptOssForCausalLM`, on the Llama pieces
where they fit (projections, RMSNorm, residual flow, forward, weight loading).

What differs from Llama:
- attention with biases on q/k/v/o and per-head learned attention sinks (`self_attn.sinks`:
  one more logit per query head in each softmax's denominator, with no value; see
  `raylm.kernels.torch_attention`), layers alternating between a sliding window
  (`layer_types` "sliding_attention", `sliding_window` wide) and full attention, YaRN rope;
- every layer's MLP a Mixture of Experts: a router with bias (`mlp.router`) picks the top-k
  logits and softmaxes over those k; each expert has biases and a clamped SwiGLU
  ((up + 1) * gate * sigmoid(1.702 gate), gate clamped above at `swiglu_limit`, up to
  [-limit, limit]). The experts run the Triton fused-MoE kernel on CUDA and the native CPU
  op's ATen-GEMM form on the CPU (`FusedMoE` with activation "swigluoai"); the CPU's fused
  decode op (Llama layers only) does not run these layers.

Checkpoints store the experts stacked per layer, as transformers' GptOssExperts holds them:
`mlp.experts.gate_up_proj` [E, H, 2I] with gate and up interleaved on the last dim (gate at
even columns), `gate_up_proj_bias` [E, 2I] alike, `down_proj` [E, I, H], `down_proj_bias`
[E, H]; the released checkpoints hold the two weights in MXFP4 instead (`*_blocks`,
`*_scales`, see `raylm.models.mxfp4`), dequantized at load to the model dtype.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn

from raylm.models.attention import Attention
from raylm.models.fused_moe import FusedMoE
from raylm.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM, LlamaModel
from raylm.models.mxfp4 import MXFP4_EXPERT_WEIGHTS, check_quantization_config, dequantize_mxfp4
from raylm.models.rmsnorm import RMSNorm
from raylm.models.rotary_embedding import RotaryEmbedding
from raylm.models.weight_utils import load_stacked_weights
from raylm.parallel import ReplicatedLinear


class GptOssAttention(LlamaAttention):
    """Llama's projections (with biases) and rotary; attention with sinks."""

    def __init__(self, config: Any, rotary_emb: RotaryEmbedding, sliding_window: int | None) -> None:
        bias = bool(getattr(config, "attention_bias", True))
        super().__init__(config, rotary_emb, qkv_bias=bias, o_bias=bias, sliding_window=sliding_window)
        self.attn = Attention(self.num_heads, self.head_size, self.head_size ** -0.5, self.num_kv_heads,
                              sliding_window=sliding_window, has_sinks=True)


class GptOssMLP(nn.Module):
    """The router (`router`, with bias) and the experts (`experts`), Hugging Face's names."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        num_experts, top_k = config.num_local_experts, config.num_experts_per_tok
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"num_experts_per_tok must be in [1, {num_experts}] (num_local_experts), got {top_k}.")
        self.router = ReplicatedLinear(config.hidden_size, num_experts, bias=True)
        self.router.keep_unquantized = True  # as vLLM builds it: FP8 quantizes the experts, not the router
        self.experts = FusedMoE(num_experts, top_k, config.hidden_size, config.intermediate_size, renormalize=False,
                                has_bias=True, activation="swigluoai", softmax_after_topk=True,
                                # transformers releases before these config fields fixed the
                                # clamp at 7.0 and alpha at 1.702 in the experts' code.
                                swiglu_limit=float(getattr(config, "swiglu_limit", 7.0)),
                                swiglu_alpha=float(getattr(config, "swiglu_alpha", 1.702)))

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """[T, H] -> [T, H], summed over the tensor-parallel ranks."""
        return self.experts(hidden_states, self.router(hidden_states))


class GptOssDecoderLayer(LlamaDecoderLayer):
    """Llama's layer (pre-norms, residual fused into them) over gpt-oss's attention and MoE."""

    def __init__(self, config: Any, rotary_emb: RotaryEmbedding, sliding_window: int | None) -> None:
        nn.Module.__init__(self)  # LlamaDecoderLayer.__init__ would build a dense MLP
        self.self_attn = GptOssAttention(config, rotary_emb, sliding_window)
        self.mlp = GptOssMLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class GptOssModel(LlamaModel):
    def __init__(self, config: Any) -> None:
        nn.Module.__init__(self)  # LlamaModel.__init__ would build Llama layers
        hidden_act = getattr(config, "hidden_act", "silu")
        if hidden_act != "silu":
            raise ValueError(f"hidden_act must be 'silu' for gpt-oss (its experts' SwiGLU), got {hidden_act!r}.")
        self._build_modules(config, lambda rotary_emb, window: GptOssDecoderLayer(config, rotary_emb, window))


# A layer's stacked expert tensor in a checkpoint: `<prefix>.experts.<name>`.
_EXPERT_TENSORS = ("gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias")


class GptOssForCausalLM(LlamaForCausalLM):
    """Llama's forward and LM head over gpt-oss's model; the experts' stacked (or MXFP4)
    checkpoint tensors go to FusedMoE's per-expert loaders."""

    # Reads MXFP4 checkpoints (quantization_config quant_method "mxfp4"; `raylm.models.mxfp4`).
    supports_quantization = True

    def __init__(self, config: Any) -> None:
        check_quantization_config(config)
        super().__init__(config)

    def _init_model(self, config: Any) -> GptOssModel:
        return GptOssModel(config)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        params = dict(self.named_parameters())
        loaded: set[str] = set()

        def other_tensors() -> Iterator[tuple[str, torch.Tensor]]:
            for name, tensor in self._expert_tensors(self._checkpoint_tensors(weights)):
                prefix, _, kind = name.rpartition(".experts.")
                if prefix and kind in _EXPERT_TENSORS:
                    loaded.add(self._load_experts(params, f"{prefix}.experts", kind, tensor))
                else:
                    yield name.replace(".self_attn.sinks", ".self_attn.attn.sinks"), tensor

        stacked = load_stacked_weights(self, other_tensors(), self.stacked_params_mapping)
        return stacked | loaded

    @staticmethod
    def _expert_tensors(weights: Iterable[tuple[str, Any]]) -> Iterator[tuple[str, Any]]:
        """The checkpoint's tensors with each MXFP4 pair (`<w>_blocks`, `<w>_scales`) replaced by
        the dequantized `<w>` (as transformers stores it unquantized: [E, in, out])."""
        pending: dict[str, dict[str, Any]] = {}
        for name, tensor in weights:
            stem, _, part = name.rpartition("_")
            if part in ("blocks", "scales") and stem.rpartition(".")[2] in MXFP4_EXPERT_WEIGHTS:
                pair = pending.setdefault(stem, {})
                pair[part] = tensor
                if len(pair) == 2:
                    del pending[stem]
                    yield stem, dequantize_mxfp4(pair["blocks"], pair["scales"], torch.get_default_dtype(),
                                                 name=stem).transpose(1, 2)
                continue
            yield name, tensor
        if pending:
            stem, pair = next(iter(pending.items()))
            missing = "scales" if "blocks" in pair else "blocks"
            raise ValueError(f"checkpoint tensor {stem}_{next(iter(pair))} has no {stem}_{missing}: MXFP4 weights "
                             f"come in pairs.")

    @staticmethod
    def _load_experts(params: dict[str, nn.Parameter], prefix: str, kind: str, tensor: Any) -> str:
        """Sends each expert's slice of one stacked checkpoint tensor to the layer's FusedMoE
        loader (gate = even columns, up = odd ones); returns the parameter's name."""
        from raylm.parallel.checkpoint_slice import read_weight

        full = read_weight(tensor)
        projection = "w13" if kind.startswith("gate_up") else "w2"
        target = f"{prefix}.{projection}_{'bias' if kind.endswith('bias') else 'weight'}"
        if target not in params:
            raise ValueError(f"checkpoint tensor {prefix}.{kind} maps to {target!r}, which the model lacks.")
        param = params[target]
        for expert in range(full.shape[0]):
            one = full[expert]
            if kind == "gate_up_proj":  # [H, 2I] -> gate, up [I, H]
                param.weight_loader(param, one[:, 0::2].t(), (expert, "w1"))
                param.weight_loader(param, one[:, 1::2].t(), (expert, "w3"))
            elif kind == "gate_up_proj_bias":  # [2I]
                param.weight_loader(param, one[0::2], (expert, "w1"))
                param.weight_loader(param, one[1::2], (expert, "w3"))
            elif kind == "down_proj":  # [I, H] -> [H, I]
                param.weight_loader(param, one.t(), (expert, "w2"))
            else:  # down_proj_bias [H]
                param.weight_loader(param, one, (expert, "w2"))
        return target

