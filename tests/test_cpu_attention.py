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


def attention_on_threads(num_threads: int, query, k_cache, v_cache, md) -> torch.Tensor:
    """cpu_attention.paged_attention run on this many threads (the process's count restored)."""
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(num_threads)
        return cpu_attention.paged_attention(query, k_cache, v_cache, md, 0.125)
    finally:
        torch.set_num_threads(threads)


def test_results_do_not_depend_on_the_thread_count(native):
    step = build_step([1] * 16, list(range(5, 85, 5)), 8, 2, 64, seed=7)
    assert torch.equal(attention_on_threads(1, *step), attention_on_threads(2, *step))


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


def float64_attention(query, k_cache, v_cache, md, scale, sliding_window=None, soft_cap=None, sinks=None):
    """Causal paged attention computed directly in float64, sequence by sequence: an oracle
    independent of the reference's SDPA path. With a sliding window w the query at p sees
    keys p - w + 1 .. p, and only the keys of the first query's window are gathered (the
    blocks before it may be poisoned, as freed ones are); soft_cap c maps scores s to
    c * tanh(s / c); sinks [Hq] are one more logit per head in the softmax, with no value
    (softmax over the scores and the sink, the sink's weight dropped)."""
    num_heads, block_size, num_kv_heads = query.shape[1], k_cache.shape[1], k_cache.shape[2]
    out = torch.zeros(query.shape, dtype=torch.float64)
    start = 0
    for i, (query_len, seq_len) in enumerate(zip(md.query_lens_list, md.seq_lens_list)):
        first = 0 if sliding_window is None else max(0, seq_len - query_len - sliding_window + 1)
        key_positions = torch.arange(first, seq_len)
        slots = md.block_tables[i].long()[key_positions // block_size] * block_size + key_positions % block_size
        group = num_heads // num_kv_heads
        keys = k_cache.flatten(0, 1)[slots].double().repeat_interleave(group, dim=1)
        values = v_cache.flatten(0, 1)[slots].double().repeat_interleave(group, dim=1)
        q = query[start:start + query_len].double()
        scores = torch.einsum("qhd,khd->hqk", q, keys) * scale
        if soft_cap is not None:
            scores = soft_cap * torch.tanh(scores / soft_cap)
        distance = torch.arange(seq_len - query_len, seq_len)[:, None] - key_positions[None, :]
        visible = (distance >= 0) & (distance < (sliding_window or seq_len + 1))
        scores.masked_fill_(~visible, float("-inf"))
        if sinks is None:
            probs = scores.softmax(dim=-1)
        else:
            sink = sinks.double().view(-1, 1, 1).expand(num_heads, query_len, 1)
            probs = torch.cat([scores, sink], dim=-1).softmax(dim=-1)[..., :-1]
        out[start:start + query_len] = torch.einsum("hqk,khd->qhd", probs, values)
        start += query_len
    return out


def compare_with_float64(query_lens, seq_lens, num_heads=8, num_kv_heads=4, head_size=32, block_size=16,
                         dtype=torch.float32, seed=0, padding_tokens=0, sliding_window=None, soft_cap=None):
    """The kernel's output for a step (fp32 queries) and the float64 oracle's. With a
    sliding window, the blocks before each sequence's window are poisoned (build_step)."""
    query, k_cache, v_cache, md = build_step(query_lens, seq_lens, num_heads, num_kv_heads, head_size, block_size,
                                             dtype, seed, padding_tokens, sliding_window)
    query = query.float()
    scale = 1.0 / math.sqrt(head_size)
    out = cpu_attention.paged_attention(query, k_cache, v_cache, md, scale, sliding_window=sliding_window,
                                        logits_soft_cap=soft_cap)
    assert out.shape == query.shape and out.dtype == torch.float32
    assert not out.isnan().any()
    return out, float64_attention(query, k_cache, v_cache, md, scale, sliding_window, soft_cap)


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
    step = build_step([200, 30, 1], [260, 30, 40], 8, 2, 64, seed=18)
    assert torch.equal(attention_on_threads(1, *step), attention_on_threads(2, *step))


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


# ---- Sliding windows and soft caps (both kernels) ----
# The blocks before each sequence's window point at a NaN block (as the engine's freed blocks
# point at someone else's): a kernel that read one would return NaN.


@pytest.mark.parametrize("window", [1, 5, 16, 37, 100])
@pytest.mark.parametrize("head_size,block_size", [(32, 16), (64, 16), (128, 32), (80, 16), (32, 8), (64, 1)])
def test_windowed_decode_matches_float64_and_reads_no_block_before_the_window(native, head_size, block_size, window):
    # Head sizes of 16k on blocks of 4k keys take the AVX-512 two-pass path (where the CPU has
    # it), the others the online softmax; windows start mid-block, on a block edge, or cover all.
    out, exact = compare_with_float64([1] * len(DECODE_LENS), DECODE_LENS, 8, 2, head_size, block_size,
                                      seed=window, sliding_window=window)
    assert relative_error(out, exact) < 1e-5


@pytest.mark.parametrize("window", [1, 9, 64, 150])
@pytest.mark.parametrize("block_size", [16, 8])
@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (8, 2)])
def test_windowed_prefill_matches_float64_and_reads_no_block_before_the_window(native_prefill, num_heads,
                                                                               num_kv_heads, block_size, window):
    # Whole prompts longer than the 64-key chunks and the 128-row tiles, a chunk after cached
    # tokens, a short chunk mid-block, and decode rows beside them.
    query_lens = [300, 200, 100, 5, 1, 1]
    seq_lens = [300, 200, 450, 38, 90, 3]
    out, exact = compare_with_float64(query_lens, seq_lens, num_heads, num_kv_heads, 64, block_size, seed=window,
                                      sliding_window=window)
    assert relative_error(out, exact) < 1e-5


@pytest.mark.parametrize("window", [None, 20])
@pytest.mark.parametrize("head_size", [32, 64, 80])
def test_soft_capped_scores_match_float64_in_decode_and_prefill(native_prefill, head_size, window):
    # Scores several times the cap, so that the cap changes the result.
    query_lens = [1, 1, 130, 7]
    seq_lens = [40, 200, 130, 60]
    query, k_cache, v_cache, md = build_step(query_lens, seq_lens, 8, 4, head_size, 16, torch.float32, 5, 0, window)
    scale = 3.0 / math.sqrt(head_size)
    out = cpu_attention.paged_attention(query, k_cache, v_cache, md, scale, sliding_window=window,
                                        logits_soft_cap=2.0)
    exact = float64_attention(query, k_cache, v_cache, md, scale, window, 2.0)
    uncapped = float64_attention(query, k_cache, v_cache, md, scale, window)
    assert relative_error(out, exact) < 1e-5
    assert relative_error(uncapped, exact) > 0.05  # the cap matters here


def test_windowed_bf16_cache_matches_the_reference(native_prefill):
    query_lens, seq_lens = [1, 1, 64, 1], [300, 17, 200, 64]
    query, k_cache, v_cache, md = build_step(query_lens, seq_lens, 8, 2, 64, 16, torch.bfloat16, 6, 0, 24)
    for q in (query, query.float()):
        out = cpu_attention.paged_attention(q, k_cache, v_cache, md, 0.125, sliding_window=24, logits_soft_cap=5.0)
        expected = torch_attention.paged_attention(q, k_cache, v_cache, md, 0.125, sliding_window=24,
                                                   logits_soft_cap=5.0)
        assert out.dtype == q.dtype and not out.isnan().any()
        assert relative_error(out, expected) < (1e-2 if q.dtype == torch.bfloat16 else 1e-5)


def test_windowed_prefill_rows_whose_window_starts_past_a_chunk_keep_fp32_precision(native_prefill):
    # A tile of up to 128 query rows over 64-key chunks: with a window of 5 most rows see no
    # key of the tile's first chunk. Every score is shifted by -120 (channel 0: 1 in the
    # queries, -400 in the keys; -173 in log2 units, below exp2's range): only a running
    # maximum that stays -inf until a row's first key (not a stand-in 0) keeps the softmax
    # exact. (fp32 scores near -120 keep ~1e-5 of their differences: hence 1e-4.)
    query, k_cache, v_cache, md = build_step([300], [300], 4, 4, 32, 16, torch.float32, 9, 0, 5)
    query[..., 0] = 1.0
    k_cache[..., 0] = torch.where(k_cache[..., 0].isnan(), k_cache[..., 0], torch.full_like(k_cache[..., 0], -400.0))
    out = cpu_attention.paged_attention(query, k_cache, v_cache, md, 0.3, sliding_window=5)
    exact = float64_attention(query, k_cache, v_cache, md, 0.3, 5)
    assert not out.isnan().any()
    assert relative_error(out, exact) < 1e-4
