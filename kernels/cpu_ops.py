"""Fused CPU versions of a decoder layer's small ops (`csrc/cpu_ops.cpp`), as PyTorch
operators: `torch.ops.raylm.fused_add_rms_norm`, `rms_norm`, `silu_and_mul`,
`rotary_embedding`, `write_kv_cache`, and `random_sample`, `random_sample_truncated` and
`truncated_probs` (the sampler's draws), `argmax_rows` (its greedy tokens), `apply_penalties`,
`count_greater` (logprob ranks); and
`zeros_on_huge_pages`, the KV cache's allocation.

At decode batch sizes a layer's RMSNorms, SiLU-and-multiply, rotary embedding and KV write
are each a handful of PyTorch elementwise ops whose dispatch costs more than their
arithmetic; one C++ pass each saves about 1.5 ms of a 10 ms decode step of the benchmark
Llama. They take fp32 or bf16 tensors and compute in fp32, rounding once to the output's
dtype. The layers call `usable(...)` and keep their PyTorch code for everything it rejects:
non-CPU tensors, dtypes other than fp32 and bf16, autograd, a machine where the library
cannot be built.
"""

from __future__ import annotations

import torch

from raylm.engine import envs
from raylm.kernels.native_build import load_native_library


_DTYPES = (torch.float32, torch.bfloat16)

# None: not tried yet; False: unavailable; True: the ops are registered.
_available: bool | None = None


def _load() -> bool:
    global _available
    if _available is None:
        _available = not envs.kernel_switched_off("fused_ops") and load_native_library("cpu_ops") is not None
    return _available


def usable(*tensors: torch.Tensor) -> bool:
    """Whether the fused ops can take these tensors: all fp32 or bf16 on the CPU, none
    needing gradients, and the library built."""
    for tensor in tensors:
        if tensor.device.type != "cpu" or tensor.dtype not in _DTYPES or tensor.requires_grad:
            return False
    return _load()


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """In place: residual += x, then x = rms_norm(residual) * weight; returns (x, residual).
    x, residual [T, H] contiguous, of one dtype; weight [H] fp32 or bf16."""
    torch.ops.raylm.fused_add_rms_norm(x, residual, weight, eps)
    return x, residual


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """rms_norm(x) * weight over the last dimension, in a new tensor."""
    return torch.ops.raylm.rms_norm(x, weight, eps)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """silu(x[..., :d]) * x[..., d:] for x [..., 2d], in a new tensor."""
    return torch.ops.raylm.silu_and_mul(x)


def silu_and_mul_any(x: torch.Tensor) -> torch.Tensor:
    """silu_and_mul where the fused op takes x (`usable`), PyTorch's ops elsewhere: what
    SiluAndMul runs, and what the gated GEMM's timing at load compares against."""
    if usable(x):
        return silu_and_mul(x)
    gate, up = x.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up


def rotary_embedding_(x: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor, head_size: int,
                      rotary_dim: int) -> torch.Tensor:
    """Rotates x [T, H * head_size] in place (GPT-NeoX layout, the first rotary_dim channels
    of each head) by positions [T]; x may be a column slice of a wider tensor. Returns x.
    A position beyond cos_sin_cache's rows is a ValueError."""
    if positions.dtype != torch.int64:
        positions = positions.to(torch.int64)
    torch.ops.raylm.rotary_embedding(x, positions.contiguous(), cos_sin_cache, head_size, rotary_dim)
    return x


def write_kv_cache(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                   slot_mapping: torch.Tensor) -> None:
    """Stores key, value [T, Hkv, D] (rows may be strided, heads contiguous) at their flat
    slots of the caches [num_blocks, block_size, Hkv, D] of the same dtype; slot -1 skips a
    row. A slot outside the cache is a ValueError, and nothing is written."""
    if slot_mapping.dtype != torch.int64:
        slot_mapping = slot_mapping.to(torch.int64)
    torch.ops.raylm.write_kv_cache(key, value, k_cache, v_cache, slot_mapping.contiguous())


def random_sample(logits: torch.Tensor, temperatures: torch.Tensor, uniforms: torch.Tensor,
                  rows: torch.Tensor | None = None) -> torch.Tensor:
    """Per row of fp32 logits [N, V] (rows contiguous): the first token whose cumulative
    softmax(logits / temperature) exceeds the row's uniform (fp32 in [0, 1)) times the
    total, as the sampler's `inverse_cdf` of that softmax draws it; int64, one per row. A row
    holding NaN or no finite logit draws -1 (its request fails; the others' rows are drawn).
    A temperature that is not positive or a uniform outside [0, 1) is a ValueError. rows
    (int64 [n], each a row of logits): draw only those rows, in that order, read in place
    (temperatures and uniforms are then [n]): a mixed batch's random rows without a copy."""
    return torch.ops.raylm.random_sample(logits, temperatures.float().contiguous(), uniforms.float().contiguous(),
                                         _row_index(rows))


def random_sample_truncated(logits: torch.Tensor, temperatures: torch.Tensor, uniforms: torch.Tensor,
                            top_ks: torch.Tensor, top_ps: torch.Tensor, min_ps: torch.Tensor,
                            rows: torch.Tensor | None = None) -> torch.Tensor:
    """`random_sample` with each row cut first, in vLLM's (v1) order: min-p (fp32 in
    [0, 1]; 0 keeps all), then top-k over what is left (int64; V or more keeps all), then
    top-p over what top-k keeps (fp32 in (0, 1]; 1 keeps all); one of each a row drawn. No
    sort: a radix select finds each row's cut in a few passes. A row that cuts nothing draws
    what `random_sample` draws; a row holding NaN or no finite logit draws -1. rows: as
    `random_sample`'s."""
    return torch.ops.raylm.random_sample_truncated(
        logits, temperatures.float().contiguous(), uniforms.float().contiguous(), top_ks.long().contiguous(),
        top_ps.float().contiguous(), min_ps.float().contiguous(), _row_index(rows))


def _row_index(rows: torch.Tensor | None) -> torch.Tensor | None:
    return None if rows is None else rows.long().contiguous()


def truncated_probs(logits: torch.Tensor, temperatures: torch.Tensor, top_ks: torch.Tensor, top_ps: torch.Tensor,
                    min_ps: torch.Tensor) -> torch.Tensor:
    """The distribution `random_sample_truncated` draws from: fp32 [N, V], each row
    softmax(logits / temperature) cut by its min-p, top-k and top-p (cut tokens 0); a row
    holding NaN or no finite logit comes out NaN."""
    return torch.ops.raylm.truncated_probs(logits, temperatures.float().contiguous(), top_ks.long().contiguous(),
                                           top_ps.float().contiguous(), min_ps.float().contiguous())


def apply_penalties(logits: torch.Tensor, rows: torch.Tensor, histories: list[torch.Tensor], lengths: torch.Tensor,
                    prompt_lens: torch.Tensor, repetition: torch.Tensor, frequency: torch.Tensor,
                    presence: torch.Tensor) -> None:
    """vLLM's repetition, frequency and presence penalties, in place on fp32 logits [*, V]
    (rows contiguous), touching only the tokens each row has seen. Entry j penalises logits
    row rows[j] (int64 [n]) from its tokens histories[j][:lengths[j]] (contiguous int64
    vectors, read where they lie: the prompt's first prompt_lens[j] of them, then the
    output's) with repetition[j], frequency[j] and presence[j] (fp32 [n]). A token id
    outside the vocabulary is a ValueError, and nothing is written."""
    torch.ops.raylm.apply_penalties(logits, rows.long().contiguous(), histories, lengths.long().contiguous(),
                                    prompt_lens.long().contiguous(), repetition.float().contiguous(),
                                    frequency.float().contiguous(), presence.float().contiguous())


def count_greater(values: torch.Tensor, thresholds: torch.Tensor) -> torch.Tensor:
    """int64 [N]: for each row of fp32 values [N, V] (rows contiguous), how many of its values
    are greater than the row's threshold (fp32 [N]): what (values > thresholds[:, None]).sum(-1)
    counts, in one read and without its bool and int64 [N, V] intermediates."""
    return torch.ops.raylm.count_greater(values, thresholds.float().contiguous())


def argmax_rows(logits: torch.Tensor, rows: torch.Tensor | None = None) -> torch.Tensor:
    """int64: logits.max(dim=-1).indices of fp32 logits [N, V] (any strides), exactly: the
    first index of each row's largest value, a NaN counting as the largest (its first index).
    With rows (int64 [n], each a row of logits) only those rows, in that order, read in
    place: what logits[rows].max(dim=-1).indices gives, without the gather's copy. One read
    of each row in L1-sized blocks; torch's reduction took 5-11 ms for 64 rows of a 152k
    vocabulary on a shared 2-core EPYC, several times one read of them."""
    return torch.ops.raylm.argmax_rows(logits, _row_index(rows))


def zeros_on_huge_pages(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """torch.zeros(shape, dtype=dtype) on the CPU, on transparent huge pages where the
    library is built (csrc/huge_pages.h; RAYLM_CPU_HUGE_PAGES=0 opts out): for the KV
    cache, whose blocks a decode step reads scattered. The pages are mapped on first touch.
    Not turned off with the fused ops ("fused_ops" in RAYLM_TEST_DISABLE_KERNELS): it is an
    allocation, not one of them."""
    if load_native_library("cpu_ops") is None:
        return torch.zeros(shape, dtype=dtype)
    return torch.ops.raylm.zeros_on_huge_pages(list(shape), dtype)
