"""BlockPool and KVCacheManager, checked by hand-worked block arithmetic.

Every test uses blocks of 4 tokens, so a prompt of t tokens needs ceil(t / 4) blocks and
its first t // 4 blocks are full (and so cacheable). Block ids are handed out from the
front of the free queue, which starts as 0, 1, 2, ...
"""

from __future__ import annotations

import pytest

from raylm.engine.block_pool import BlockPool, hash_block_tokens
from raylm.engine.kv_cache_manager import KVCacheManager
from raylm.engine.request import Request
from raylm.engine.sampling_params import SamplingParams

BLOCK_SIZE = 4


def make_request(request_id: str, prompt: list[int], prompt_logprobs: int | None = None) -> Request:
    return Request(request_id, list(prompt), SamplingParams(max_tokens=8, prompt_logprobs=prompt_logprobs), 0.0)


def admit(kv: KVCacheManager, request: Request) -> list[int]:
    """What the scheduler does on admission, with the whole rest of the prompt scheduled
    and computed: look up the cached prefix, allocate, advance. Returns the block ids."""
    blocks, num_cached = kv.get_computed_blocks(request)
    assert kv.allocate_slots(request, request.num_tokens - num_cached, blocks, num_cached) is not None
    kv.record_admission(request, num_cached)
    request.num_computed_tokens = request.num_tokens
    return kv.get_block_ids(request.request_id)


def pool_state(kv: KVCacheManager) -> tuple:
    pool = kv.block_pool
    return (list(pool.free_queue), [(b.block_id, b.ref_cnt, b.block_hash) for b in pool.blocks],
            dict(pool.cached_blocks), {rid: [b.block_id for b in bs] for rid, bs in kv.req_to_blocks.items()})


# ------------------------------------------------------------------- allocation
@pytest.mark.parametrize("num_tokens, num_blocks", [(1, 1), (4, 1), (5, 2), (8, 2), (9, 3), (16, 4)])
def test_allocation_covers_ceil_of_tokens_over_block_size(num_tokens: int, num_blocks: int) -> None:
    kv = KVCacheManager(num_blocks=10, block_size=BLOCK_SIZE)
    request = make_request("a", range(100, 100 + num_tokens))
    new_blocks = kv.allocate_slots(request, num_tokens)
    assert [b.block_id for b in new_blocks] == list(range(num_blocks))
    assert kv.get_block_ids("a") == list(range(num_blocks))
    assert kv.get_num_free_blocks() == 10 - num_blocks
    kv.check_invariants([request])


@pytest.mark.parametrize("num_computed, num_new_blocks", [(5, 0), (7, 0), (8, 1)])
def test_decode_adds_a_block_only_when_its_token_starts_a_new_block(num_computed: int, num_new_blocks: int) -> None:
    kv = KVCacheManager(num_blocks=10, block_size=BLOCK_SIZE)
    request = make_request("a", range(num_computed + 1))
    kv.allocate_slots(request, num_computed)
    request.num_computed_tokens = num_computed
    assert len(kv.allocate_slots(request, 1)) == num_new_blocks
    assert len(kv.get_block_ids("a")) == -(-(num_computed + 1) // BLOCK_SIZE)


# ---------------------------------------------------------------- prefix cache
def test_request_with_same_prefix_gets_the_same_block_ids() -> None:
    kv = KVCacheManager(num_blocks=10, block_size=BLOCK_SIZE)
    a = make_request("a", list(range(10)))
    assert admit(kv, a) == [0, 1, 2]
    b = make_request("b", list(range(8)) + [50, 51, 52])
    blocks, num_cached = kv.get_computed_blocks(b)
    assert [block.block_id for block in blocks] == [0, 1]
    assert num_cached == 8


def test_prefix_cache_counts_queries_and_hits_in_tokens() -> None:
    kv = KVCacheManager(num_blocks=10, block_size=BLOCK_SIZE)
    admit(kv, make_request("a", list(range(10))))  # 10 queried, nothing cached yet
    admit(kv, make_request("b", list(range(8)) + [50, 51, 52]))  # 11 queried, 2 blocks = 8 hit
    assert (kv.prefix_cache_queries, kv.prefix_cache_hits) == (21, 8)


def test_shared_prefix_blocks_are_held_once_per_request() -> None:
    kv = KVCacheManager(num_blocks=10, block_size=BLOCK_SIZE)
    a, b = make_request("a", list(range(10))), make_request("b", list(range(8)) + [50, 51, 52])
    admit(kv, a)
    assert admit(kv, b) == [0, 1, 3]
    assert [kv.block_pool.blocks[i].ref_cnt for i in range(4)] == [2, 2, 1, 1]
    # 10 blocks, 4 distinct ones held.
    assert kv.get_num_free_blocks() == 6
    kv.check_invariants([a, b])


@pytest.mark.parametrize("num_tokens, num_hit_blocks", [(11, 2), (12, 2), (13, 3)])
def test_at_least_one_token_is_left_to_compute(num_tokens: int, num_hit_blocks: int) -> None:
    # Three full blocks are cached; a prompt of exactly those 12 tokens still computes its
    # last block, since the last token's logits are what the step samples from.
    kv = KVCacheManager(num_blocks=10, block_size=BLOCK_SIZE)
    admit(kv, make_request("a", list(range(12)) + [99]))
    blocks, num_cached = kv.get_computed_blocks(make_request("b", list(range(num_tokens))))
    assert len(blocks) == num_hit_blocks
    assert num_cached == num_hit_blocks * BLOCK_SIZE
    assert num_cached < num_tokens


def test_request_wanting_prompt_logprobs_gets_no_hit() -> None:
    kv = KVCacheManager(num_blocks=10, block_size=BLOCK_SIZE)
    admit(kv, make_request("a", list(range(12))))
    assert kv.get_computed_blocks(make_request("b", list(range(12)), prompt_logprobs=1)) == ([], 0)
    assert kv.get_computed_blocks(make_request("c", list(range(12)), prompt_logprobs=0)) == ([], 0)


def test_request_whose_prompt_logprobs_are_all_returned_hits_again() -> None:
    # A request preempted after its prefill: its prompt logprobs were already sent.
    kv = KVCacheManager(num_blocks=10, block_size=BLOCK_SIZE)
    admit(kv, make_request("a", list(range(12))))
    b = make_request("b", list(range(12)), prompt_logprobs=1)
    b.num_prompt_logprobs_done = 11
    blocks, num_cached = kv.get_computed_blocks(b)
    assert [block.block_id for block in blocks] == [0, 1]
    assert num_cached == 8


def test_block_hash_depends_on_every_token_before_the_block() -> None:
    same_tokens = [1, 2, 3, 4]
    after_a = hash_block_tokens(hash_block_tokens(None, [5, 6, 7, 8]), same_tokens)
    after_b = hash_block_tokens(hash_block_tokens(None, [0, 0, 0, 0]), same_tokens)
    first = hash_block_tokens(None, same_tokens)
    assert len({after_a, after_b, first}) == 3
    assert after_a == hash_block_tokens(hash_block_tokens(None, [5, 6, 7, 8]), same_tokens)
    assert hash_block_tokens(None, same_tokens, b"lora-1") != first


def test_cache_salt_shares_cached_blocks_only_between_requests_of_the_same_salt() -> None:
    # 13 tokens: 3 full blocks, of which a later request can hit (13 - 1) // 4 = 3.
    kv = KVCacheManager(num_blocks=40, block_size=BLOCK_SIZE)
    prompt = list(range(100, 113))

    def admit_salted(request_id: str, salt: str | None) -> int:
        """Admits and finishes the request; the tokens the prefix cache gave it."""
        request = Request(request_id, list(prompt), SamplingParams(max_tokens=8), 0.0, cache_salt=salt)
        hits_before = kv.prefix_cache_hits
        admit(kv, request)
        kv.check_invariants([request])
        kv.free(request)
        return kv.prefix_cache_hits - hits_before

    assert admit_salted("tenant-a", "a") == 0
    assert admit_salted("tenant-b", "b") == 0  # another salt: nothing shared
    assert admit_salted("unsalted", None) == 0  # no salt is a salt of its own
    assert admit_salted("tenant-a-again", "a") == 12  # the same salt: all three full blocks
    assert admit_salted("tenant-b-again", "b") == 12
    assert admit_salted("unsalted-again", None) == 12
    assert kv.prefix_cache_queries == 6 * len(prompt)
    kv.check_invariants()


def test_equal_block_after_a_different_prefix_is_not_a_hit() -> None:
    kv = KVCacheManager(num_blocks=10, block_size=BLOCK_SIZE)
    admit(kv, make_request("a", [5, 6, 7, 8, 1, 2, 3, 4, 9]))
    assert kv.get_computed_blocks(make_request("b", [0, 0, 0, 0, 1, 2, 3, 4, 9])) == ([], 0)


def test_caching_disabled_never_hits() -> None:
    kv = KVCacheManager(num_blocks=10, block_size=BLOCK_SIZE, enable_caching=False)
    a = make_request("a", list(range(12)))
    admit(kv, a)
    kv.free(a)
    assert kv.get_computed_blocks(make_request("b", list(range(13)))) == ([], 0)
    assert kv.prefix_cache_hits == 0
    assert kv.block_pool.cached_blocks == {}
    assert all(block.block_hash is None for block in kv.block_pool.blocks)


def test_block_computed_twice_stays_cached_under_the_first_and_the_second_is_private() -> None:
    # Two requests with the same prompt looked up before either allocated: both miss and
    # compute the same blocks; the first one allocated is the cached one.
    kv = KVCacheManager(num_blocks=10, block_size=BLOCK_SIZE)
    a, b = make_request("a", list(range(9))), make_request("b", list(range(9)))
    assert kv.get_computed_blocks(a) == ([], 0) and kv.get_computed_blocks(b) == ([], 0)
    kv.allocate_slots(a, 9)
    kv.allocate_slots(b, 9)
    assert kv.get_block_ids("a") == [0, 1, 2] and kv.get_block_ids("b") == [3, 4, 5]
    assert [b.block_id for b in kv.block_pool.cached_blocks.values()] == [0, 1]
    assert kv.block_pool.blocks[3].block_hash is None
    a.num_computed_tokens = b.num_computed_tokens = 9
    kv.check_invariants([a, b])
    kv.free(a)
    kv.free(b)
    blocks, _ = kv.get_computed_blocks(make_request("c", list(range(9))))
    assert [block.block_id for block in blocks] == [0, 1]


# ------------------------------------------------------- free, reuse, eviction
def test_freed_full_blocks_stay_cached_and_are_reused() -> None:
    kv = KVCacheManager(num_blocks=10, block_size=BLOCK_SIZE)
    a = make_request("a", list(range(10)))
    admit(kv, a)
    kv.free(a)
    assert kv.get_num_free_blocks() == 10
    # Blocks 0 and 1 are full; block 2 holds 2 tokens and is not cached.
    assert sorted(b.block_id for b in kv.block_pool.cached_blocks.values()) == [0, 1]
    b = make_request("b", list(range(9)))
    # 0 and 1 come back; the fresh block is the queue's front, 3 (a's went to the tail).
    assert admit(kv, b) == [0, 1, 3]
    assert kv.get_num_free_blocks() == 7
    kv.check_invariants([b])


def test_cached_blocks_are_evicted_only_when_no_uncached_free_block_is_left() -> None:
    kv = KVCacheManager(num_blocks=4, block_size=BLOCK_SIZE)
    a = make_request("a", list(range(8)))
    assert admit(kv, a) == [0, 1]
    kv.free(a)
    # Free queue: 2, 3 (never used), then a's blocks 1, 0.
    assert list(kv.block_pool.free_queue) == [2, 3, 1, 0]
    other = make_request("other", [50] * 8)
    assert kv.allocate_slots(other, 8) is not None
    assert kv.get_block_ids("other") == [2, 3]
    blocks, _ = kv.get_computed_blocks(make_request("a2", list(range(9))))
    assert [block.block_id for block in blocks] == [0, 1]


def test_freed_request_tail_is_evicted_before_its_head() -> None:
    kv = KVCacheManager(num_blocks=4, block_size=BLOCK_SIZE)
    a = make_request("a", list(range(8)))
    admit(kv, a)
    kv.free(a)
    # Three fresh blocks: the two never-used ones, then a's last block (1), not its first.
    other = make_request("other", [50] * 12)
    kv.allocate_slots(other, 12)
    assert kv.get_block_ids("other") == [2, 3, 1]
    blocks, num_cached = kv.get_computed_blocks(make_request("a2", list(range(9))))
    assert [block.block_id for block in blocks] == [0]
    assert num_cached == 4


def test_least_recently_freed_request_is_evicted_first() -> None:
    kv = KVCacheManager(num_blocks=4, block_size=BLOCK_SIZE)
    a, b = make_request("a", [1] * 8), make_request("b", [2] * 8)
    assert admit(kv, a) == [0, 1] and admit(kv, b) == [2, 3]
    kv.free(b)
    kv.free(a)
    other = make_request("other", [3] * 8)
    kv.allocate_slots(other, 8)
    assert kv.get_block_ids("other") == [3, 2]
    assert kv.get_computed_blocks(make_request("b2", [2] * 9)) == ([], 0)
    assert [blk.block_id for blk in kv.get_computed_blocks(make_request("a2", [1] * 9))[0]] == [0, 1]


def test_hit_on_free_cached_block_takes_it_out_of_the_free_queue() -> None:
    kv = KVCacheManager(num_blocks=4, block_size=BLOCK_SIZE)
    a = make_request("a", list(range(8)))
    admit(kv, a)
    kv.free(a)
    b = make_request("b", list(range(9)))
    # Hits 0 and 1 (free), needs 1 fresh block: 2.
    assert admit(kv, b) == [0, 1, 2]
    assert list(kv.block_pool.free_queue) == [3]


def test_allocate_slots_returns_none_and_changes_nothing_when_the_pool_is_short() -> None:
    kv = KVCacheManager(num_blocks=4, block_size=BLOCK_SIZE)
    a = make_request("a", list(range(12)))
    admit(kv, a)
    before = pool_state(kv)
    # 12 computed tokens in 3 blocks; 13 more tokens need ceil(25 / 4) = 7 blocks: 4 more, 1 free.
    assert kv.allocate_slots(a, 13) is None
    assert pool_state(kv) == before
    assert kv.allocate_slots(make_request("b", [7] * 5), 5) is None
    assert pool_state(kv) == before


def test_hits_on_free_cached_blocks_count_as_unavailable_for_fresh_blocks() -> None:
    kv = KVCacheManager(num_blocks=4, block_size=BLOCK_SIZE)
    a = make_request("a", list(range(8)))
    admit(kv, a)
    kv.free(a)
    other = make_request("other", [50] * 8)
    kv.allocate_slots(other, 8)  # takes 2 and 3: only a's cached blocks 0 and 1 are free
    b = make_request("b", list(range(9)))
    blocks, num_cached = kv.get_computed_blocks(b)
    assert [block.block_id for block in blocks] == [0, 1]
    # 2 free blocks, both taken by the hit: none left for the third block b needs.
    before = pool_state(kv)
    assert kv.allocate_slots(b, 9 - num_cached, blocks, num_cached) is None
    assert pool_state(kv) == before


def test_hits_on_held_blocks_take_nothing_from_the_free_queue() -> None:
    kv = KVCacheManager(num_blocks=4, block_size=BLOCK_SIZE)
    a = make_request("a", list(range(8)))
    admit(kv, a)  # holds 0 and 1
    other = make_request("other", [50] * 4)
    kv.allocate_slots(other, 4)  # holds 2: one block free
    b = make_request("b", list(range(9)))
    assert admit(kv, b) == [0, 1, 3]
    assert kv.get_num_free_blocks() == 0
    kv.check_invariants([a, b])


def test_pool_refuses_more_blocks_than_are_free() -> None:
    pool = BlockPool(num_blocks=2, enable_caching=True)
    with pytest.raises(RuntimeError, match="Out of KV-cache blocks"):
        pool.get_new_blocks(3)


def test_double_free_of_a_block_raises() -> None:
    pool = BlockPool(num_blocks=2, enable_caching=True)
    [block] = pool.get_new_blocks(1)
    pool.free_blocks([block])
    with pytest.raises(RuntimeError, match="Double free"):
        pool.free_blocks([block])


def test_freeing_a_request_twice_leaves_the_pool_unchanged() -> None:
    kv = KVCacheManager(num_blocks=4, block_size=BLOCK_SIZE)
    a = make_request("a", list(range(8)))
    admit(kv, a)
    kv.free(a)
    before = pool_state(kv)
    kv.free(a)
    assert pool_state(kv) == before


def test_reset_prefix_cache_only_when_no_block_is_held() -> None:
    kv = KVCacheManager(num_blocks=4, block_size=BLOCK_SIZE)
    a = make_request("a", list(range(8)))
    admit(kv, a)
    assert not kv.reset_prefix_cache()
    kv.free(a)
    assert kv.reset_prefix_cache()
    assert kv.get_computed_blocks(make_request("b", list(range(9)))) == ([], 0)


def test_check_invariants_catches_a_ref_count_that_disagrees_with_the_block_tables() -> None:
    kv = KVCacheManager(num_blocks=4, block_size=BLOCK_SIZE)
    a = make_request("a", list(range(8)))
    admit(kv, a)
    kv.check_invariants([a])
    kv.block_pool.blocks[0].ref_cnt += 1
    with pytest.raises(AssertionError, match="ref_cnt"):
        kv.check_invariants([a])


# ------------------------------------------------------------------- block tables sent
def _held_ids(kv: KVCacheManager, request_id: str) -> list[int]:
    return [block.block_id for block in kv.req_to_blocks.get(request_id, ())]


@pytest.mark.parametrize("sliding_window", [None, 6])
def test_block_ids_follow_every_change_of_a_requests_blocks(sliding_window: int | None) -> None:
    """get_block_ids keeps its answer between calls: a table cut back and grown again to
    its old length, null entries of a sliding window, and a request freed and admitted
    again must each show in the next answer."""
    kv = KVCacheManager(num_blocks=32, block_size=BLOCK_SIZE, sliding_window=sliding_window)
    request = make_request("a", range(100, 110))
    assert admit(kv, request) == _held_ids(kv, "a")
    # Speculative decoding: one token and 5 proposals take a fourth block...
    request.append_output_token(7)
    kv.allocate_slots(request, 6)
    request.num_computed_tokens += 6
    assert kv.get_block_ids("a") == _held_ids(kv, "a")
    first_tables = _held_ids(kv, "a")
    # ...all rejected: the block goes back, and the next step's proposals take another one
    # (the table has its old length again, and another last block).
    request.num_computed_tokens = 11
    kv.free_blocks_beyond(request, 11)
    kv.allocate_slots(request, 5)
    request.num_computed_tokens += 5
    assert len(_held_ids(kv, "a")) == 4 and _held_ids(kv, "a") != first_tables
    assert kv.get_block_ids("a") == _held_ids(kv, "a")
    # Plain decoding, asking every step: with a window, leading entries turn null blocks.
    request.num_computed_tokens = 11
    kv.free_blocks_beyond(request, 11)
    for token in range(20):
        request.append_output_token(token)
        kv.allocate_slots(request, 1)
        request.num_computed_tokens += 1
        assert kv.get_block_ids("a") == _held_ids(kv, "a")
    # Freed (a preemption) and admitted again under the same id.
    kv.free(request)
    assert kv.get_block_ids("a") == []
    request.num_computed_tokens = 0
    assert admit(kv, request) == _held_ids(kv, "a")
    kv.check_invariants([request])
