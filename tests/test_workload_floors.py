"""The workload floors' bookkeeping, against counts done by hand."""

from __future__ import annotations

import pytest
import torch

from raylm.cluster.benchmarks.workload_floors import (copy_bandwidth, kv_bytes_read,
                                                      linear_shapes, matmul_flops, nominal_peak_flops,
                                                      prefill_batches, time_matmul, weight_bytes_per_step,
                                                      weight_bytes_read, workload_matmuls)

CONFIG = dict(hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
              num_hidden_layers=3, vocab_size=100)


def test_linear_shapes_are_the_fused_llama_projections():
    # head_dim 16: q 4 heads + k, v 2 heads each = 128 outputs; gate and up stacked = 192.
    assert linear_shapes(CONFIG) == [(64, 128), (64, 64), (64, 192), (96, 64)]


def test_prefill_packs_whole_prompts_first_come_first_served():
    assert prefill_batches([5, 4, 3, 9, 1], 10) == [[5, 4], [3], [9, 1]]
    assert prefill_batches([12], 10) == [[12]]  # a prompt over the budget still runs, alone


def test_workload_counts_every_matmul_once_per_layer_and_the_lm_head_once_per_step():
    prefill, decode = workload_matmuls(CONFIG, [5, 4, 3], output_len=4, max_num_batched_tokens=9)
    # Prefill steps: [5, 4] (9 tokens, 2 logit rows) and [3] (3 tokens, 1 row). Every
    # projection runs on every token in layers 1-2; in layer 3 k/v (64 -> 64) on every token,
    # q (64 -> 64), the output projection and the MLP on the logit rows.
    assert prefill == {(9, 64, 128): 2, (9, 64, 64): 2 + 1, (9, 64, 192): 2, (9, 96, 64): 2,
                       (2, 64, 64): 2, (2, 64, 192): 1, (2, 96, 64): 1, (2, 64, 100): 1,
                       (3, 64, 128): 2, (3, 64, 64): 2 + 1, (3, 64, 192): 2, (3, 96, 64): 2,
                       (1, 64, 64): 2, (1, 64, 192): 1, (1, 96, 64): 1, (1, 64, 100): 1}
    # Three decode steps of 3 rows each: every row is a logit row.
    assert decode == {(3, 64, 128): 9, (3, 64, 64): 9, (3, 64, 192): 9, (3, 96, 64): 9, (3, 64, 100): 3}


def test_kv_bytes_cover_each_decode_steps_context_in_every_layer():
    # One prompt of 10, output 3: the prefill draws token 1; decode step 1 feeds it (context
    # 11), step 2 feeds token 2 (context 12) and draws the third and last.
    per_token = 2 * 2 * 16 * 4 * 3  # K and V, 2 KV heads of 16, fp32, 3 layers
    assert kv_bytes_read(CONFIG, [10], 3, 4) == (11 + 12) * per_token


def test_matmul_flops_are_two_per_weight_element_per_row():
    prefill, decode = workload_matmuls(CONFIG, [5, 4, 3], output_len=4, max_num_batched_tokens=9)
    per_layer = 64 * 128 + 64 * 64 + 64 * 192 + 96 * 64  # 30720 weights
    only_read_rows = 64 * 64 + 64 * 64 + 64 * 192 + 96 * 64  # 26624 of them: q, o, gate/up, down
    lm_head = 64 * 100
    # Prefill: 9 + 3 tokens through 3 layers, but the last layer's query and output
    # projections and MLP on the 2 + 1 logit rows only; decode: 3 steps of 3 rows.
    assert matmul_flops(prefill) == 2 * (12 * per_layer * 3 - (12 - 3) * only_read_rows + 3 * lm_head)
    assert matmul_flops(decode) == 2 * 3 * (3 * per_layer * 3 + 3 * lm_head)
    assert matmul_flops(prefill + decode) == matmul_flops(prefill) + matmul_flops(decode)


def test_weight_bytes_are_every_weight_once_per_step():
    # 2 prefill steps ([5, 4] and [3]) and 3 decode steps; 3 layers of 30720 weights and an
    # LM head of 6400, 4 bytes each.
    assert weight_bytes_per_step(CONFIG, 4) == (3 * 30720 + 6400) * 4
    assert weight_bytes_read(CONFIG, [5, 4, 3], 4, 9, 4) == 5 * (3 * 30720 + 6400) * 4
    assert weight_bytes_read(CONFIG, [5, 4, 3], 1, 9, 2) == 2 * (3 * 30720 + 6400) * 2  # prefill only


SAPPHIRE_RAPIDS = dict(flags={"fma", "avx2", "avx512f", "avx512_bf16", "amx_bf16"}, mhz=2600.0, physical_cores=2)
EPYC_AVX2 = dict(flags={"fma", "avx2"}, mhz=2000.0, physical_cores=2)


def test_nominal_peak_is_cores_times_flops_per_cycle_times_clock():
    fp32, basis = nominal_peak_flops(torch.float32, SAPPHIRE_RAPIDS, threads=2)
    assert fp32 == 2 * 64 * 2.6e9 and "2 cores" in basis and "2.60 GHz" in basis  # 2 FMA ports x 16 lanes x 2
    assert nominal_peak_flops(torch.bfloat16, SAPPHIRE_RAPIDS, threads=2)[0] == 2 * 1024 * 2.6e9  # AMX
    no_amx = dict(SAPPHIRE_RAPIDS, flags=SAPPHIRE_RAPIDS["flags"] - {"amx_bf16"})
    assert nominal_peak_flops(torch.bfloat16, no_amx, threads=2)[0] == 2 * 128 * 2.6e9  # AVX512-BF16


def test_nominal_peak_of_bf16_without_bf16_instructions_is_the_fp32_rate():
    assert nominal_peak_flops(torch.bfloat16, EPYC_AVX2, threads=2)[0] == 2 * 32 * 2.0e9
    assert nominal_peak_flops(torch.float32, EPYC_AVX2, threads=2)[0] == 2 * 32 * 2.0e9


def test_nominal_peak_counts_only_the_cores_torch_uses_and_is_none_when_unknown():
    assert nominal_peak_flops(torch.float32, SAPPHIRE_RAPIDS, threads=1)[0] == 64 * 2.6e9
    assert nominal_peak_flops(torch.float32, {}, threads=2) is None  # no /proc/cpuinfo
    assert nominal_peak_flops(torch.float16, SAPPHIRE_RAPIDS, threads=2) is None


def test_packed_matmul_and_copy_bandwidth_time_something():
    assert time_matmul(8, 64, 64, torch.float32, "cpu", min_seconds=0.0, packed=True) > 0
    assert copy_bandwidth("cpu", 2**20) > 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_decode_kernel_is_timed_up_to_the_rows_it_takes(dtype):
    from raylm.parallel import cpu_gemm

    streaming = cpu_gemm.pack_streaming_weight(torch.zeros(64, 64, dtype=dtype))
    if streaming is None:  # no streaming kernel for this dtype here: never the fastest
        assert time_matmul(8, 64, 64, dtype, "cpu", min_seconds=0.0, decode=True) == float("inf")
        return
    assert 0 < time_matmul(streaming.max_rows, 64, 64, dtype, "cpu", min_seconds=0.0, decode=True) < float("inf")
    assert time_matmul(streaming.max_rows + 1, 64, 64, dtype, "cpu", min_seconds=0.0, decode=True) == float("inf")


def test_time_matmul_is_positive_and_grows_with_the_work():
    torch.manual_seed(0)
    small = time_matmul(8, 64, 64, torch.float32, "cpu", min_seconds=0.01)
    large = time_matmul(512, 512, 512, torch.float32, "cpu", min_seconds=0.01)
    assert 0 < small < large
