"""The workload floors' bookkeeping, against counts done by hand."""

from __future__ import annotations

import torch

from raylm.cluster.benchmarks.workload_floors import (kv_bytes_read, linear_shapes, prefill_batches, time_matmul,
                                                      workload_matmuls)

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
    # Prefill steps: [5, 4] (9 tokens, 2 logit rows) and [3] (3 tokens, 1 row).
    assert prefill == {(9, 64, 128): 3, (9, 64, 64): 3, (9, 64, 192): 3, (9, 96, 64): 3, (2, 64, 100): 1,
                       (3, 64, 128): 3, (3, 64, 64): 3, (3, 64, 192): 3, (3, 96, 64): 3, (1, 64, 100): 1}
    # Three decode steps of 3 rows each.
    assert decode == {(3, 64, 128): 9, (3, 64, 64): 9, (3, 64, 192): 9, (3, 96, 64): 9, (3, 64, 100): 3}


def test_kv_bytes_cover_each_decode_steps_context_in_every_layer():
    # One prompt of 10, output 3: the prefill draws token 1; decode step 1 feeds it (context
    # 11), step 2 feeds token 2 (context 12) and draws the third and last.
    per_token = 2 * 2 * 16 * 4 * 3  # K and V, 2 KV heads of 16, fp32, 3 layers
    assert kv_bytes_read(CONFIG, [10], 3, 4) == (11 + 12) * per_token


def test_time_matmul_is_positive_and_grows_with_the_work():
    torch.manual_seed(0)
    small = time_matmul(8, 64, 64, torch.float32, "cpu", min_seconds=0.01)
    large = time_matmul(512, 512, 512, torch.float32, "cpu", min_seconds=0.01)
    assert 0 < small < large
