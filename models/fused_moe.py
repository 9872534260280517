"""vLLM's FusedMoE: a Mixture-of-Experts layer's experts, routed per config.

Routing is top-k over the softmax of the router's logits, renormalised over the chosen k
or not (`renormalize`: always for Mixtral, `norm_topk_prob` for Qwen's MoE models). The
experts' gated MLPs then run fused over the tokens routed to each (tokens grouped by
expert, grouped GEMMs): the Triton kernel on CUDA, the native CPU op on the CPU
(`kernels/cpu_fused_moe.py`), the PyTorch reference elsewhere.

FP8, GPTQ and AWQ experts (`quantization`, docs/quantization.md) are held by `Fp8MoEMethod`
or `Int4MoEMethod` (`parallel/fp8_moe_method.py`, `parallel/int4_moe_method.py`), which
dequantize a chunk of them at a time and run the same kernels on it (`run_experts`).

Its weights are `FusedMoEWeights` (`parallel/fused_moe_weights.py`): sharded per expert
under tensor parallelism, whole experts per rank under expert parallelism. Either way this
rank's output is a partial sum, summed over the ranks by one all-reduce (here with
`reduce_results`, else by the caller).

gpt-oss's experts (`activation="swigluoai"`, `has_bias`, routed by softmax over the top-k
logits: `softmax_after_topk`) run the Triton kernel on CUDA and the native CPU op's ATen-GEMM
form (`dense_fused_moe`) on the CPU, which take both; the AVX-512 panels take neither.
"""

from __future__ import annotations

import torch

from raylm.kernels import cpu_fused_moe, torch_moe
from raylm.parallel.communication import tensor_model_parallel_all_reduce
from raylm.parallel.fused_moe_weights import FusedMoEWeights


class FusedMoE(FusedMoEWeights):
    def __init__(self, num_experts: int, top_k: int, hidden_size: int, intermediate_size: int,
                 renormalize: bool, reduce_results: bool = True, params_dtype: torch.dtype | None = None,
                 has_bias: bool = False, activation: str = "silu", swiglu_limit: float | None = None,
                 swiglu_alpha: float = torch_moe.SWIGLUOAI_ALPHA, softmax_after_topk: bool = False) -> None:
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"num_experts_per_tok must be in [1, num_experts={num_experts}], got {top_k}.")
        if activation not in torch_moe.ACTIVATIONS:
            raise ValueError(f"MoE activation must be one of {torch_moe.ACTIVATIONS}, got {activation!r}.")
        super().__init__(num_experts, hidden_size, intermediate_size, params_dtype, has_bias=has_bias)
        self.top_k = top_k
        self.renormalize = renormalize
        self.reduce_results = reduce_results
        self.activation = activation
        self.swiglu_limit = swiglu_limit
        self.swiglu_alpha = swiglu_alpha
        self.softmax_after_topk = softmax_after_topk

    def forward(self, hidden_states: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        """hidden_states [T, H], router_logits [T, num_experts] -> [T, H]: each token's
        experts' outputs weighted by the router (this rank's partial sum unless
        reduce_results)."""
        if self.softmax_after_topk:
            topk_weights, topk_ids = torch_moe.fused_topk_softmax_after(router_logits, self.top_k)
        else:
            topk_weights, topk_ids = torch_moe.fused_topk(router_logits, self.top_k, self.renormalize)
        out = self.fused_experts(hidden_states, topk_weights, topk_ids)
        return tensor_model_parallel_all_reduce(out) if self.reduce_results else out

    def fused_experts(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        if self.quant_method is not None:  # quantized experts: dequantized a chunk at a time into `run_experts`
            return self.quant_method.apply(self, x, topk_weights, topk_ids)
        return self.run_experts(x, self.w13_weight, self.w2_weight, topk_weights, topk_ids, self.expert_map,
                                self.w13_bias, self.w2_bias if self.adds_w2_bias else None, self.packed)

    def run_experts(self, x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                    topk_ids: torch.Tensor, expert_map: torch.Tensor | None, w13_bias: torch.Tensor | None = None,
                    w2_bias: torch.Tensor | None = None, packed: cpu_fused_moe.PackedExperts | None = None
                    ) -> torch.Tensor:
        """The fused-experts kernel of x's device over these weights (this layer's, or a chunk
        of them dequantized) with this layer's activation."""
        args = (x, w13, w2, topk_weights, topk_ids, expert_map)
        # Biases, activation: what every path but the CPU op takes (defaults: Mixtral's).
        options = dict(w13_bias=w13_bias, w2_bias=w2_bias, activation=self.activation,
                       swiglu_limit=self.swiglu_limit, swiglu_alpha=self.swiglu_alpha)
        if x.device.type == "cuda":
            from raylm.kernels import triton_fused_moe  # imports triton: GPU machines only

            return triton_fused_moe.fused_experts(*args, **options)
        if x.device.type == "cpu":
            return cpu_fused_moe.fused_experts(*args, packed=packed, **options)
        return torch_moe.fused_experts(*args, **options)
