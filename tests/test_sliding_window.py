"""Sliding-window attention outside the kernels: which layers are windowed (against the masks
Hugging Face actually applies), the context length, and the KV-cache blocks released as a
request's window slides, counted by hand (blocks of 4 tokens)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from raylm.engine.config import derive_max_model_len, max_blocks_per_request
from raylm.engine.kv_cache_manager import NULL_BLOCK_ID, KVCacheManager
from raylm.engine.request import Request
from raylm.engine.sampling_params import SamplingParams
from raylm.models.sliding_window import kv_cache_sliding_window, layer_sliding_windows

BLOCK_SIZE = 4

_COMMON = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_attention_heads=2, num_key_value_heads=1,
               head_dim=16, max_position_embeddings=256)


def _hf_configs():
    from transformers import Gemma2Config, Gemma3TextConfig, MistralConfig, Qwen2Config

    return {
        "mistral": MistralConfig(**_COMMON, num_hidden_layers=2, sliding_window=5),
        "gemma2": Gemma2Config(**_COMMON, num_hidden_layers=4, sliding_window=5, query_pre_attn_scalar=16),
        "gemma3": Gemma3TextConfig(**_COMMON, num_hidden_layers=6, sliding_window=5, query_pre_attn_scalar=16),
        "qwen2": Qwen2Config(**_COMMON, num_hidden_layers=4, sliding_window=5, use_sliding_window=True,
                             max_window_layers=2),
        "qwen2-off": Qwen2Config(**_COMMON, num_hidden_layers=4, sliding_window=5, use_sliding_window=False,
                                 max_window_layers=2),
        "mistral-wide": MistralConfig(**_COMMON, num_hidden_layers=2, sliding_window=256),
    }


def _keys_each_query_attends_to(config) -> list[list[int]]:
    """Per layer, how many keys each of 12 query positions attends to in Hugging Face's own
    forward (eager attention: the softmax weights, zero exactly where masked)."""
    from transformers import AutoModelForCausalLM

    config._attn_implementation = "eager"
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        out = model(torch.randint(4, 64, (1, 12)), output_attentions=True)
    return [(weights[0, 0] > 0).sum(-1).tolist() for weights in out.attentions]


@pytest.mark.parametrize("arch", ["mistral", "gemma2", "gemma3", "qwen2", "qwen2-off", "mistral-wide"])
def test_layer_windows_are_the_ones_hugging_face_masks_apply(arch):
    config = _hf_configs()[arch]
    windows = layer_sliding_windows(config)
    observed = _keys_each_query_attends_to(config)
    assert len(windows) == len(observed)
    for window, counts in zip(windows, observed):
        # Query p sees min(p + 1, w) keys: w with itself, not w - 1 or w + 1.
        assert counts == [min(p + 1, window or p + 1) for p in range(12)]
    expected = {"mistral": [5, 5], "gemma2": [5, None, 5, None], "gemma3": [5, 5, 5, 5, 5, None],
                "qwen2": [None, None, 5, 5], "qwen2-off": [None] * 4, "mistral-wide": [None, None]}
    assert windows == expected[arch]


def test_configs_without_layer_types_follow_transformers_defaults():
    base = dict(num_hidden_layers=4, sliding_window=8, max_position_embeddings=64)
    qwen2 = SimpleNamespace(model_type="qwen2", use_sliding_window=True, max_window_layers=3, **base)
    gemma2 = SimpleNamespace(model_type="gemma2", **base)
    gemma3 = SimpleNamespace(model_type="gemma3_text", sliding_window_pattern=3, **base)
    assert layer_sliding_windows(qwen2) == [None, None, None, 8]
    assert layer_sliding_windows(gemma2) == [8, None, 8, None]
    assert layer_sliding_windows(gemma3) == [8, 8, None, 8]
    assert layer_sliding_windows(SimpleNamespace(model_type="llama", num_hidden_layers=2)) == [None, None]


def test_layer_types_of_the_wrong_length_is_an_error_naming_both():
    config = SimpleNamespace(model_type="gemma2", num_hidden_layers=3, sliding_window=8,
                             layer_types=["sliding_attention", "full_attention"])
    with pytest.raises(ValueError, match="2 layers.*num_hidden_layers is 3"):
        layer_sliding_windows(config)


def test_blocks_are_freed_only_when_every_layer_is_windowed():
    assert kv_cache_sliding_window([5, 5]) == 5
    assert kv_cache_sliding_window([4, 9]) == 9  # the widest window decides
    assert kv_cache_sliding_window([5, None, 5, None]) is None  # Gemma 2: global layers read everything
    assert kv_cache_sliding_window([None, None]) is None


def test_context_length_is_max_position_embeddings_whatever_the_window():
    config = SimpleNamespace(max_position_embeddings=32768, sliding_window=4096)
    assert derive_max_model_len(config, None) == 32768
    assert derive_max_model_len(config, 20000) == 20000


@pytest.mark.parametrize("max_model_len,window,budget,expected", [
    (100, None, 8, 25),  # whole context: ceil(100 / 4)
    (100, 6, 1, 3),      # decode: the window's 6 keys straddle at most 3 blocks
    (100, 6, 8, 5),      # ceil((5 + 8) / 4) + 1
    (12, 6, 8, 3),       # never more than the whole context
])
def test_max_blocks_per_request(max_model_len, window, budget, expected):
    assert max_blocks_per_request(max_model_len, BLOCK_SIZE, window, budget) == expected


# ---- blocks released as the window slides (window 6, blocks of 4) ----

def make_request(request_id: str, num_tokens: int) -> Request:
    return Request(request_id, list(range(100, 100 + num_tokens)), SamplingParams(max_tokens=64), 0.0)


def table(kv: KVCacheManager, request: Request) -> list[int | None]:
    """The request's block table, None for the null entries of freed blocks."""
    return [None if block is kv.null_block else block.block_id for block in kv.req_to_blocks[request.request_id]]


def decode_one(kv: KVCacheManager, request: Request) -> None:
    """One decode step as the scheduler and engine run it: allocate, compute, append."""
    assert kv.allocate_slots(request, 1) is not None
    request.num_computed_tokens += 1
    request.append_output_token(7)
    kv.check_invariants([request])


def test_blocks_before_the_window_are_freed_as_a_request_decodes():
    kv = KVCacheManager(num_blocks=10, block_size=BLOCK_SIZE, sliding_window=6)
    request = make_request("a", 10)
    # The prompt's 10 queries read back to position 0: all of its 3 blocks.
    assert kv.allocate_slots(request, 10) is not None
    request.num_computed_tokens = 10
    assert table(kv, request) == [0, 1, 2]
    # Decoding position p reads keys p - 5 .. p: blocks (p - 5) // 4 .. p // 4.
    expected = {
        10: ([None, 1, 2], 8),             # keys 5..10: block 0 (0..3) freed
        11: ([None, 1, 2], 8),             # keys 6..11
        12: ([None, 1, 2, 3], 7),          # keys 7..12: position 12 takes block 3
        13: ([None, None, 2, 3], 8),       # keys 8..13: block 1 (4..7) freed
        14: ([None, None, 2, 3], 8),
        15: ([None, None, 2, 3], 8),
        16: ([None, None, 2, 3, 4], 7),    # position 16 takes block 4
        17: ([None, None, None, 3, 4], 8),  # keys 12..17: block 2 freed
    }
    for position, (expected_table, free) in expected.items():
        assert request.num_computed_tokens == position
        decode_one(kv, request)
        assert table(kv, request) == expected_table
        assert kv.get_num_free_blocks() == free
    # Freed blocks went to the back of the free queue, oldest last: 0 and 1 behind 5..9.
    assert list(kv.block_pool.free_queue) == [5, 6, 7, 8, 9, 0, 1, 2]
    assert kv.get_block_ids("a") == [NULL_BLOCK_ID] * 3 + [3, 4]
    kv.free(request)
    assert kv.get_num_free_blocks() == 10
    kv.check_invariants()


def test_a_long_request_holds_at_most_what_its_window_and_step_span():
    kv = KVCacheManager(num_blocks=8, block_size=BLOCK_SIZE, sliding_window=6)
    request = make_request("a", 3)
    assert kv.allocate_slots(request, 3) is not None
    request.num_computed_tokens = 3
    held = []
    for _ in range(200):  # 200 tokens in a pool of 32 token slots
        decode_one(kv, request)
        held.append(8 - kv.get_num_free_blocks())
    assert max(held) == max_blocks_per_request(10_000, BLOCK_SIZE, 6, 1) == 3
    assert min(held[10:]) == 2


def test_without_a_window_every_block_is_kept():
    kv = KVCacheManager(num_blocks=10, block_size=BLOCK_SIZE)
    request = make_request("a", 10)
    kv.allocate_slots(request, 10)
    request.num_computed_tokens = 10
    for _ in range(8):
        decode_one(kv, request)
    assert table(kv, request) == [0, 1, 2, 3, 4]


def test_a_chunked_prefill_frees_what_its_next_chunk_no_longer_reads():
    kv = KVCacheManager(num_blocks=10, block_size=BLOCK_SIZE, sliding_window=6)
    request = make_request("a", 20)
    for start, chunk, expected_table in [(0, 8, [0, 1]),                  # queries 0..7 read from 0
                                         (8, 8, [0, 1, 2, 3]),            # query 8 reads from 3: block 0 stays
                                         (16, 4, [None, None, 2, 3, 4])]:  # query 16 reads from 11: block 2 on
        assert request.num_computed_tokens == start
        assert kv.allocate_slots(request, chunk) is not None
        request.num_computed_tokens += chunk
        assert table(kv, request) == expected_table
    kv.check_invariants([request])


def test_a_prefix_hit_takes_only_the_blocks_its_window_reaches_and_freed_blocks_stay_cached():
    kv = KVCacheManager(num_blocks=12, block_size=BLOCK_SIZE, sliding_window=6)
    first = make_request("a", 20)
    assert kv.allocate_slots(first, 20) is not None
    first.num_computed_tokens = 20
    decode_one(kv, first)  # position 20 reads 15..20: blocks 0, 1, 2 freed, still cached
    assert table(kv, first) == [None, None, None, 3, 4, 5]
    assert len(kv.block_pool.cached_blocks) == 5

    # The same 20 tokens and one more: a hit of all 5 full blocks (the 21st token is computed),
    # of which the first new token, 20, reads blocks 3 and 4 (keys 15..20) only.
    second = make_request("b", 21)
    hit_blocks, num_hit_tokens = kv.get_computed_blocks(second)
    assert [None if b is kv.null_block else b.block_id for b in hit_blocks] == [None, None, None, 3, 4]
    assert num_hit_tokens == 20
    free_before = kv.get_num_free_blocks()
    assert kv.allocate_slots(second, 1, hit_blocks, num_hit_tokens) is not None
    second.num_computed_tokens = 21
    assert table(kv, second) == [None, None, None, 3, 4, 6]
    # Blocks 0-2 were not taken back: only the new block 6 left the free queue.
    assert kv.get_num_free_blocks() == free_before - 1
    assert [kv.block_pool.blocks[i].ref_cnt for i in range(5)] == [0, 0, 0, 2, 2]
    kv.check_invariants([first, second])
    kv.free(first)
    kv.free(second)
    assert kv.get_num_free_blocks() == 12
    kv.check_invariants()


def test_a_preempted_request_frees_what_it_holds_and_takes_its_cached_blocks_back():
    kv = KVCacheManager(num_blocks=10, block_size=BLOCK_SIZE, sliding_window=6)
    request = make_request("a", 10)
    kv.allocate_slots(request, 10)
    request.num_computed_tokens = 10
    for _ in range(7):
        decode_one(kv, request)
    assert table(kv, request) == [None, None, 2, 3, 4]
    kv.free(request)  # preemption by recompute
    request.num_computed_tokens = 0
    assert kv.get_num_free_blocks() == 10
    # The 4 full blocks of its 17 tokens are still cached (freed by the window or now): a hit
    # of 16 tokens, of which token 16's window needs blocks 2 and 3 only.
    hit_blocks, num_hit_tokens = kv.get_computed_blocks(request)
    assert num_hit_tokens == 16 and hit_blocks[2:] == [kv.block_pool.blocks[2], kv.block_pool.blocks[3]]
    assert kv.allocate_slots(request, 1, hit_blocks, num_hit_tokens) is not None
    assert table(kv, request) == [None, None, 2, 3, 5]
    kv.check_invariants([request])


def test_a_hit_needs_only_the_blocks_its_window_reaches_to_be_cached():
    kv = KVCacheManager(num_blocks=6, block_size=BLOCK_SIZE, sliding_window=6)
    first = make_request("a", 16)
    for _ in range(4):  # chunks of 4: each frees what the next no longer reads
        assert kv.allocate_slots(first, 4) is not None
        first.num_computed_tokens += 4
    assert table(kv, first) == [None, 1, 2, 3]  # chunk 12..15 read from 7 on
    kv.free(first)
    # A request of 4 blocks evicts blocks 4, 5, 0 and 3 (queue: 4, 5, 0, 3, 2, 1), taking the
    # first one of the prefix and its last: left cached are blocks 1 and 2 (positions 4..11).
    other = Request("b", list(range(500, 516)), SamplingParams(max_tokens=64), 0.0)  # another prefix
    assert kv.allocate_slots(other, 16) is not None
    assert kv.get_block_ids("b") == [4, 5, 0, 3]
    kv.free(other)
    # The same 16 tokens again: block 0 is gone, so no prefix of blocks from 0 is cached; but
    # token 12 reads keys 7..12, and blocks 1 and 2 (keys 4..11) are: a hit of 12 tokens.
    again = make_request("c", 16)
    hit_blocks, num_hit_tokens = kv.get_computed_blocks(again)
    assert num_hit_tokens == 12
    assert [None if b is kv.null_block else b.block_id for b in hit_blocks] == [None, 1, 2]
    assert kv.allocate_slots(again, 4, hit_blocks, num_hit_tokens) is not None
    assert table(kv, again) == [None, 1, 2, 3]
    kv.check_invariants([again])
