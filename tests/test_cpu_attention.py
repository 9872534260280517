"""The native CPU paged attention kernels against the PyTorch reference and an exact float64
computation, on NaN-poisoned caches."""

from __future__ import annotations

import logging
import math

import pytest
import torch

from raylm.kernels import cpu_attention, native_build, torch_attention
from raylm.kernels.backend import get_attention_backend
from paged_steps import build_cached_step as build_step


@pytest.fixture(scope="module")
def native():
    if not cpu_attention.is_available():
        pytest.skip("the native CPU attention kernel cannot be built here (no compiler or ninja?)")


@pytest.fixture(scope="module")
def native_prefill(native):
    if cpu_attention.load_prefill_kernel() is None:
        pytest.skip("the native CPU prefill attention kernel cannot be built here")


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return float((actual.double() - expected.double()).norm() / expected.double().norm())


def compare_with_reference(query_lens, seq_lens, num_heads=8, num_kv_heads=4, head_size=32, block_size=16,
                           dtype=torch.float32, seed=0, padding_tokens=0, query_dtype=None):
    query, k_cache, v_cache, md = build_step(query_lens, seq_lens, num_heads, num_kv_heads, head_size, block_size,
                                             dtype, seed, padding_tokens)
    query = query.to(query_dtype or dtype)
    scale = 1.0 / math.sqrt(head_size)
    out = cpu_attention.paged_attention(query, k_cache, v_cache, md, scale)
    expected = torch_attention.paged_attention(query, k_cache, v_cache, md, scale)
    assert out.shape == expected.shape and out.dtype == expected.dtype
    assert not out.isnan().any()
    return out, expected


# Lengths 1 .. several blocks of 16, on and off block boundaries.
DECODE_LENS = [1, 2, 15, 16, 17, 31, 32, 33, 100, 130, 257]


@pytest.mark.parametrize("head_size", [32, 64, 128, 80])
@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (8, 4), (8, 2)])
def test_fp32_decode_matches_reference_for_each_gqa_ratio_and_head_size(native, num_heads, num_kv_heads,
                                                                           head_size):
    out, expected = compare_with_reference([1] * len(DECODE_LENS), DECODE_LENS, num_heads, num_kv_heads, head_size)
    assert relative_error(out, expected) < 1e-5


@pytest.mark.parametrize("block_size", [1, 8, 32])
def test_fp32_decode_matches_reference_for_other_block_sizes(native, block_size):
    out, expected = compare_with_reference([1] * len(DECODE_LENS), DECODE_LENS, block_size=block_size, seed=1)
    assert relative_error(out, expected) < 1e-5


@pytest.mark.parametrize("head_size", [32, 64, 128])
@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (8, 4), (8, 2)])
def test_bf16_cache_with_fp32_queries_matches_reference_in_fp32_precision(native, num_heads, num_kv_heads,
                                                                           head_size):
    # Both read the same bf16 values and accumulate in fp32, so they agree to fp32 rounding.
    out, expected = compare_with_reference([1] * len(DECODE_LENS), DECODE_LENS, num_heads, num_kv_heads, head_size,
                                           dtype=torch.bfloat16, seed=2, query_dtype=torch.float32)
    assert relative_error(out, expected) < 1e-5


def test_bf16_queries_give_bf16_outputs_within_one_rounding(native):
    out, expected = compare_with_reference([1] * len(DECODE_LENS), DECODE_LENS, dtype=torch.bfloat16, seed=3)
    assert out.dtype == torch.bfloat16
    assert relative_error(out, expected) < 1e-2


@pytest.mark.parametrize("head_size", [32, 64, 128, 80])
@pytest.mark.parametrize("num_heads,num_kv_heads", [(8, 4), (8, 1), (12, 2)])
def test_bf16_queries_and_cache_match_float64_within_the_output_rounding(native, num_heads, num_kv_heads, head_size):
    """bf16 end to end (on AVX512-BF16 CPUs the scores are vdpbf16ps products of the raw bf16
    queries and keys), against the same bf16 values in float64: only fp32 sums and the output's
    rounding to bf16 (2^-9 relative) separate them. Groups of 4, 8 and 6 query heads per KV head
    cover the kernel's 4-head tiles, whole and partial; head size 80 its 16-channel tail."""
    query, k_cache, v_cache, md = build_step([1] * len(DECODE_LENS), DECODE_LENS, num_heads, num_kv_heads, head_size,
                                             16, torch.bfloat16, 4)
    scale = 1.0 / math.sqrt(head_size)
    out = cpu_attention.paged_attention(query, k_cache, v_cache, md, scale)
    exact = torch_attention.paged_attention(query.double(), k_cache.double(), v_cache.double(), md, scale)
    assert out.dtype == torch.bfloat16
    assert relative_error(out, exact) < 4e-3


@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (8, 4), (8, 2)])
def test_mixed_prefill_and_decode_batch_matches_reference(native, num_heads, num_kv_heads):
    # Decode rows between a full prefill (6 of 6) and chunked prefills reading earlier chunks.
    query_lens = [1, 6, 1, 5, 1, 20]
    seq_lens = [40, 6, 17, 37, 1, 52]
    out, expected = compare_with_reference(query_lens, seq_lens, num_heads, num_kv_heads, seed=4)
    assert relative_error(out, expected) < 1e-5


def test_mixed_batch_with_bf16_cache_matches_reference(native):
    out, expected = compare_with_reference([3, 1, 1], [19, 33, 8], dtype=torch.bfloat16, seed=5,
                                           query_dtype=torch.float32)
    assert relative_error(out, expected) < 1e-5


@pytest.mark.parametrize("query_lens,seq_lens", [([1, 1, 1], [5, 18, 40]), ([4, 1], [20, 9])])
def test_padding_rows_past_the_last_sequence_are_zero(native, query_lens, seq_lens):
    out, expected = compare_with_reference(query_lens, seq_lens, seed=6, padding_tokens=3)
    assert torch.equal(out[-3:], torch.zeros_like(out[-3:]))
    assert relative_error(out, expected) < 1e-5


def test_results_do_not_depend_on_the_thread_count(native):
    query, k_cache, v_cache, md = build_step([1] * 16, list(range(5, 85, 5)), 8, 2, 64, seed=7)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = cpu_attention.paged_attention(query, k_cache, v_cache, md, 0.125)
        torch.set_num_threads(2)
        two = cpu_attention.paged_attention(query, k_cache, v_cache, md, 0.125)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, two)


def test_block_table_too_short_for_its_sequence_is_an_error_not_a_read_out_of_bounds(native):
    query, k_cache, v_cache, md = build_step([1], [20], 4, 2, 32, seed=8)
    with pytest.raises(ValueError, match="block table"):
        cpu_attention.paged_decode_attention(query, k_cache, v_cache, md.block_tables[:, :1], md.seq_lens, 0.5)


def test_cpu_backend_is_the_default_on_a_cpu_machine(native):
    if torch.cuda.is_available():
        pytest.skip("CUDA machines default to the Triton backend")
    backend = get_attention_backend()
    assert backend.name == "cpu" and backend.paged_attention is cpu_attention.paged_attention
    assert get_attention_backend("torch").name == "torch"


def test_failed_build_warns_once_and_falls_back_to_the_reference(monkeypatch, caplog, tmp_path):
    # A real failed compile: the kernel's source, broken, in a fresh source folder.
    (tmp_path / "cpu_attention.cpp").write_text("this is not C++\n")
    monkeypatch.setattr(native_build, "CSRC_DIR", tmp_path)
    monkeypatch.setattr(native_build, "_libraries", {})
    monkeypatch.setattr(cpu_attention, "_kernel", None)
    query, k_cache, v_cache, md = build_step([1, 3], [9, 3], 4, 2, 32, seed=9)
    with caplog.at_level(logging.WARNING, logger="raylm.kernels.native_build"):
        outs = [cpu_attention.paged_attention(query, k_cache, v_cache, md, 0.5) for _ in range(2)]
        assert not cpu_attention.is_available()
    assert len([r for r in caplog.records if r.levelno == logging.WARNING]) == 1
    expected = torch_attention.paged_attention(query, k_cache, v_cache, md, 0.5)
    assert all(torch.equal(out, expected) for out in outs)


# ---- Prefill rows (query_len > 1): the prefill kernel ----


def float64_attention(query, k_cache, v_cache, md, scale):
    """Causal paged attention computed directly in float64, sequence by sequence: an oracle
    independent of the reference's SDPA path."""
    num_heads, block_size, num_kv_heads = query.shape[1], k_cache.shape[1], k_cache.shape[2]
    out = torch.zeros(query.shape, dtype=torch.float64)
    start = 0
    for i, (query_len, seq_len) in enumerate(zip(md.query_lens_list, md.seq_lens_list)):
        blocks = md.block_tables[i, :-(-seq_len // block_size)].long()
        keys = k_cache[blocks].flatten(0, 1)[:seq_len].double().repeat_interleave(num_heads // num_kv_heads, dim=1)
        values = v_cache[blocks].flatten(0, 1)[:seq_len].double().repeat_interleave(num_heads // num_kv_heads, dim=1)
        q = query[start:start + query_len].double()
        scores = torch.einsum("qhd,khd->hqk", q, keys) * scale
        positions = torch.arange(seq_len - query_len, seq_len)
        scores.masked_fill_(torch.arange(seq_len)[None, :] > positions[:, None], float("-inf"))
        out[start:start + query_len] = torch.einsum("hqk,khd->qhd", scores.softmax(dim=-1), values)
        start += query_len
    return out


def compare_with_float64(query_lens, seq_lens, num_heads=8, num_kv_heads=4, head_size=32, block_size=16,
                         dtype=torch.float32, seed=0, padding_tokens=0):
    """The kernel's output for a step (fp32 queries) and the float64 oracle's."""
    query, k_cache, v_cache, md = build_step(query_lens, seq_lens, num_heads, num_kv_heads, head_size, block_size,
                                             dtype, seed, padding_tokens)
    query = query.float()
    scale = 1.0 / math.sqrt(head_size)
    out = cpu_attention.paged_attention(query, k_cache, v_cache, md, scale)
    assert out.shape == query.shape and out.dtype == torch.float32
    assert not out.isnan().any()
    return out, float64_attention(query, k_cache, v_cache, md, scale)


# Whole prompts (query_len == seq_len) of 2 .. several 64-key chunks, on and off boundaries.
PROMPT_LENS = [2, 15, 64, 65, 200]


@pytest.mark.parametrize("head_size", [32, 64, 128, 80, 36])
@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (8, 4), (8, 2)])
def test_full_prompts_match_float64_for_each_gqa_ratio_and_head_size(native_prefill, num_heads, num_kv_heads,
                                                                      head_size):
    out, exact = compare_with_float64(PROMPT_LENS, PROMPT_LENS, num_heads, num_kv_heads, head_size, seed=10)
    assert relative_error(out, exact) < 1e-5


@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (8, 4), (8, 2)])
def test_extends_after_cached_tokens_match_float64(native_prefill, block_size, num_heads, num_kv_heads):
    # 100 new tokens after 700 cached (prefix caching), a chunk starting mid-block after an
    # earlier chunk, and a chunk ending mid-block.
    query_lens = [100, 37, 2, 64]
    seq_lens = [800, 37 + 93, 2 + 21, 64 + 200]
    out, exact = compare_with_float64(query_lens, seq_lens, num_heads, num_kv_heads, 64, block_size, seed=11)
    assert relative_error(out, exact) < 1e-5


@pytest.mark.parametrize("block_size", [1, 8])
def test_prefill_works_with_small_blocks(native_prefill, block_size):
    out, exact = compare_with_float64([9, 70], [30, 70], block_size=block_size, seed=12)
    assert relative_error(out, exact) < 1e-5


@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (8, 4), (8, 2)])
def test_decode_rows_between_long_prefill_rows_match_reference(native_prefill, num_heads, num_kv_heads):
    query_lens = [1, 300, 1, 1, 128, 1]
    seq_lens = [500, 300, 17, 1, 1028, 64]
    out, expected = compare_with_reference(query_lens, seq_lens, num_heads, num_kv_heads, 64, seed=13)
    assert relative_error(out, expected) < 1e-5


@pytest.mark.parametrize("head_size", [32, 64, 128])
@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (8, 4), (8, 2)])
def test_prefill_with_bf16_cache_and_fp32_queries_matches_reference_in_fp32_precision(
        native_prefill, num_heads, num_kv_heads, head_size):
    out, expected = compare_with_reference([100, 1, 40], [700, 90, 40], num_heads, num_kv_heads, head_size,
                                           dtype=torch.bfloat16, seed=14, query_dtype=torch.float32)
    assert relative_error(out, expected) < 1e-5


def test_prefill_with_bf16_queries_gives_bf16_outputs_within_one_rounding(native_prefill):
    out, expected = compare_with_reference([100, 1, 40], [700, 90, 40], dtype=torch.bfloat16, seed=15)
    assert out.dtype == torch.bfloat16
    assert relative_error(out, expected) < 1e-2


def test_padding_rows_after_prefill_rows_are_zero(native_prefill):
    out, expected = compare_with_reference([100, 1], [150, 9], seed=16, padding_tokens=5)
    assert torch.equal(out[-5:], torch.zeros_like(out[-5:]))
    assert relative_error(out, expected) < 1e-5


def test_prefill_kernel_alone_zeroes_the_rows_of_sequences_it_skips(native_prefill):
    query, k_cache, v_cache, md = build_step([3, 1, 4], [10, 20, 4], 8, 4, 32, seed=17, padding_tokens=2)
    out = cpu_attention.paged_prefill_attention(query, k_cache, v_cache, md, 0.2, min_query_len=2)
    expected = torch_attention.paged_attention(query, k_cache, v_cache, md, 0.2)
    assert torch.equal(out[3], torch.zeros_like(out[3])) and torch.equal(out[8:], torch.zeros_like(out[8:]))
    assert relative_error(out[:3], expected[:3]) < 1e-5 and relative_error(out[4:8], expected[4:8]) < 1e-5


def test_prefill_results_do_not_depend_on_the_thread_count(native_prefill):
    query, k_cache, v_cache, md = build_step([200, 30, 1], [260, 30, 40], 8, 2, 64, seed=18)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = cpu_attention.paged_attention(query, k_cache, v_cache, md, 0.125)
        torch.set_num_threads(2)
        two = cpu_attention.paged_attention(query, k_cache, v_cache, md, 0.125)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, two)


def test_prefill_block_table_too_short_is_an_error_not_a_read_out_of_bounds(native_prefill):
    query, k_cache, v_cache, md = build_step([5, 30], [5, 40], 4, 2, 32, seed=19)
    md.block_tables = md.block_tables[:, :2]  # 32 tokens of the second sequence's 40
    with pytest.raises(ValueError, match=r"seq_lens\[1\] = 40 does not fit its block table"):
        cpu_attention.paged_attention(query, k_cache, v_cache, md, 0.5)


def test_more_queries_than_seq_len_is_an_error(native_prefill):
    query, k_cache, v_cache, md = build_step([6, 3], [6, 3], 4, 2, 32, seed=20)
    md.seq_lens = torch.tensor([6, 2], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"seq_lens\[1\] = 2"):
        cpu_attention.paged_attention(query, k_cache, v_cache, md, 0.5)


def test_prefill_falls_back_to_the_reference_when_only_its_kernel_fails_to_build(native, monkeypatch, caplog,
                                                                                  tmp_path):
    (tmp_path / "cpu_prefill_attention.cpp").write_text("this is not C++\n")
    for header in native_build.CSRC_DIR.glob("*.h"):
        (tmp_path / header.name).write_text(header.read_text())
    monkeypatch.setattr(native_build, "CSRC_DIR", tmp_path)
    monkeypatch.setattr(native_build, "_libraries", {"cpu_attention": native_build._libraries["cpu_attention"]})
    monkeypatch.setattr(cpu_attention, "_prefill_kernel", None)
    query, k_cache, v_cache, md = build_step([1, 30], [9, 40], 4, 2, 32, seed=23)
    with caplog.at_level(logging.WARNING, logger="raylm.kernels.native_build"):
        out = cpu_attention.paged_attention(query, k_cache, v_cache, md, 0.5)
    assert [r.levelno for r in caplog.records].count(logging.WARNING) == 1
    expected = torch_attention.paged_attention(query, k_cache, v_cache, md, 0.5)
    assert relative_error(out, expected) < 1e-5
