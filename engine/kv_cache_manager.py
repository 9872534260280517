"""`KVCacheManager`: which blocks each request holds, and which of its prefix is cached.

The scheduler's only view of KV-cache memory. A request's block table covers its computed
tokens plus the ones scheduled this step: token p lives in block ``blocks[p // block_size]``
at offset ``p % block_size``. With prefix caching on, every block that fills with known
tokens is registered in the pool under the hash of its tokens and everything before them,
and stays cached after its request ends, until the pool evicts it for a fresh block.

With a sliding window on every layer (`sliding_window`, vLLM's), a step whose first new
token sits at position s reads no key before s - window + 1, and no later step of the
request does either: the blocks wholly before that are freed as the request grows and their
entries in the block table become `NULL_BLOCK_ID`, which no kernel reads (the kernels start
at a window's first block). A long request then holds about (window + one step's tokens) /
block_size blocks. A freed block stays cached until evicted, like any other: its KV depends
only on the tokens up to it, so a later request with that prefix may still take it back.
A prefix-cache hit takes only the hit blocks its first new token's window reaches; the
earlier ones stay free and are NULL_BLOCK_ID in its table from the start.
"""

from __future__ import annotations

import hashlib

from collections import Counter
from collections.abc import Iterable

from raylm.engine.block_pool import BlockPool, KVCacheBlock, first_block_extra_key, hash_block_tokens
from raylm.engine.prompt_embeds import prompt_embeds_digest
from raylm.engine.request import Request

# Stands in a block table for a block every layer's window has passed (freed, or never taken
# from a prefix-cache hit). Any valid id would do, as kernels never read it; 0 keeps every
# entry a valid index for code that checks them.
NULL_BLOCK_ID = 0


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True,
                 sliding_window: int | None = None) -> None:
        if sliding_window is not None and sliding_window < 1:
            raise ValueError(f"sliding_window must be at least 1 or None, got {sliding_window}.")
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.sliding_window = sliding_window
        self.block_pool = BlockPool(num_blocks, enable_caching)
        # Each request's block table: block p // block_size holds token p. Entries before the
        # window are `null_block`, which belongs to no pool and is never freed.
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        # get_block_ids' answers, kept while the request's blocks only grow: a decode step
        # sends every running request's table, which changes once every block_size tokens.
        # A cached list is never changed in place (steps already sent hold it): it is
        # replaced when its length is stale, and dropped where blocks are freed or replaced.
        self._block_ids: dict[str, list[int]] = {}
        self.null_block = KVCacheBlock(NULL_BLOCK_ID)
        # How many leading entries of each request's table are null_block.
        self._num_null_blocks: dict[str, int] = {}
        # How many leading blocks of each request are registered in the prefix cache.
        self._num_cached_blocks: dict[str, int] = {}
        # Prefix-cache statistics since start, in tokens (vLLM's queries and hits).
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0

    # ----------------------------------------------------------------- lookups
    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """The longest cached prefix of the request, as blocks and a token count.

        At least one token is always left to compute: its logits are what the step samples
        from. Requests that want prompt logprobs they have not received yet skip the cache,
        since cached tokens produce no logits, and so do pooling requests that pool every
        token (token_classify), since cached tokens have no hidden states.

        With a sliding window on every layer, a hit of k blocks needs only the blocks that
        the window of token k * block_size reaches (vLLM's sliding-window lookup): the longest
        such hit is taken even where earlier blocks were evicted, and `null_block` stands in
        for the blocks before its window (`allocate_slots` never takes those).
        """
        if not self.enable_caching or _needs_prompt_logprobs(request) or _pools_every_token(request):
            return [], 0
        self._update_block_hashes(request)
        max_hit_blocks = (request.num_tokens - 1) // self.block_size
        hashes = request.block_hashes[:max_hit_blocks]
        if self.sliding_window is not None:
            return self._longest_windowed_hit(hashes)
        computed: list[KVCacheBlock] = []
        for block_hash in hashes:
            block = self.block_pool.get_cached_block(block_hash)
            if block is None:
                break
            computed.append(block)
        return computed, len(computed) * self.block_size

    def _longest_windowed_hit(self, hashes: list[bytes]) -> tuple[list[KVCacheBlock], int]:
        """The largest k such that blocks _num_blocks_outside_window(k * block_size) .. k - 1
        are all cached: the first k blocks as a hit, null_block before that window."""
        cached = [self.block_pool.get_cached_block(block_hash) for block_hash in hashes]
        best, run_start = 0, 0  # run_start: where the run of cached blocks ending at i began
        for index, block in enumerate(cached):
            if block is None:
                run_start = index + 1
            elif run_start <= self._num_blocks_outside_window((index + 1) * self.block_size):
                best = index + 1
        skipped = self._num_blocks_outside_window(best * self.block_size)
        return [self.null_block] * skipped + cached[skipped:best], best * self.block_size

    def record_admission(self, request: Request, num_computed_tokens: int) -> None:
        """Counts a lookup that led to admission (a request that waits and looks again
        next step is counted once, when it gets in)."""
        if self.enable_caching and not (_needs_prompt_logprobs(request) or _pools_every_token(request)):
            self.prefix_cache_queries += request.num_tokens
            self.prefix_cache_hits += num_computed_tokens

    def get_block_ids(self, request_id: str) -> list[int]:
        """The request's block table (null entries included). The caller must not change it."""
        blocks = self.req_to_blocks.get(request_id, ())
        ids = self._block_ids.get(request_id)
        if ids is None or len(ids) != len(blocks):
            ids = self._block_ids[request_id] = [block.block_id for block in blocks]
        return ids

    def get_num_free_blocks(self) -> int:
        return self.block_pool.get_num_free_blocks()

    @property
    def usage(self) -> float:
        """Fraction of blocks held by requests, in [0, 1] (cached free blocks count as free)."""
        return 1.0 - self.block_pool.get_num_free_blocks() / self.num_blocks

    # -------------------------------------------------------------- allocation
    def allocate_slots(self, request: Request, num_new_tokens: int,
                       new_computed_blocks: list[KVCacheBlock] | None = None,
                       num_new_computed_tokens: int = 0) -> list[KVCacheBlock] | None:
        """Makes the request's blocks cover its computed tokens, the cache hit
        `new_computed_blocks` (from `get_computed_blocks`, on admission) and `num_new_tokens`
        more. Returns the fresh blocks, or None when the pool is short (nothing is allocated
        then; with a sliding window, the blocks it has passed are freed either way)."""
        first_new_token = request.num_computed_tokens + num_new_computed_tokens
        total_tokens = first_new_token + num_new_tokens
        num_outside_window = 0
        if self.sliding_window is not None:
            # Blocks before the window of the first new token: no step reads them any more.
            num_outside_window = self._num_blocks_outside_window(first_new_token)
            if num_outside_window > self._num_null_blocks.get(request.request_id, 0):
                self._free_blocks_outside_window(request.request_id, num_outside_window)
        if not new_computed_blocks and self._covers(request, total_tokens):
            return []  # a decode step inside its last block: most calls, on the driver's critical path
        new_computed_blocks = new_computed_blocks or []
        held = self.req_to_blocks.get(request.request_id, [])
        assert not (held and new_computed_blocks), "prefix-cache hits are taken on admission only"
        num_new_blocks = -(-total_tokens // self.block_size) - len(held) - len(new_computed_blocks)
        # Hit blocks before the window are not taken: the table gets null entries instead.
        num_skipped_hits = min(num_outside_window, len(new_computed_blocks)) if new_computed_blocks else 0
        taken_hits = new_computed_blocks[num_skipped_hits:]
        # A hit on a free block takes it out of the free queue: it cannot also be handed out.
        num_hits_on_free = sum(1 for block in taken_hits if block.ref_cnt == 0)
        if num_new_blocks > self.block_pool.get_num_free_blocks() - num_hits_on_free:
            return None
        self.block_pool.touch(taken_hits)
        new_blocks = self.block_pool.get_new_blocks(max(0, num_new_blocks))
        held = self.req_to_blocks.setdefault(request.request_id, held)
        if num_skipped_hits:
            held.extend([self.null_block] * num_skipped_hits)
            self._num_null_blocks[request.request_id] = num_skipped_hits
        held.extend(taken_hits)
        held.extend(new_blocks)
        if self.enable_caching:
            # The step being scheduled writes these tokens' KV, before any later step reads
            # it; within the step, every layer writes all new KV before it attends.
            self._cache_full_blocks(request, held, min(total_tokens, request.num_tokens) // self.block_size)
        return new_blocks

    def _covers(self, request: Request, total_tokens: int) -> bool:
        """Whether the request's blocks already hold total_tokens and caching has nothing new
        to register: what allocate_slots would find, with no block to hand out or cache."""
        held = self.req_to_blocks.get(request.request_id)
        if held is None or total_tokens > len(held) * self.block_size:
            return False
        return (not self.enable_caching or min(total_tokens, request.num_tokens) // self.block_size
                <= self._num_cached_blocks.get(request.request_id, 0))

    def _num_blocks_outside_window(self, first_new_token: int) -> int:
        """How many leading blocks of a request hold only keys before the window of its token
        at first_new_token (and so before every later token's): none without a window."""
        if self.sliding_window is None:
            return 0
        return max(0, first_new_token - self.sliding_window + 1) // self.block_size

    def _free_blocks_outside_window(self, request_id: str, num_blocks: int) -> None:
        """Frees the request's blocks before index num_blocks and puts null entries in their
        place. Oldest last into the free queue: the prompt's first blocks, the most likely
        shared prefix, are then the last of them evicted."""
        held = self.req_to_blocks.get(request_id)
        if not held:
            return
        start = self._num_null_blocks.get(request_id, 0)
        end = min(num_blocks, len(held))
        if end <= start:
            return
        self.block_pool.free_blocks(reversed(held[start:end]))
        held[start:end] = [self.null_block] * (end - start)
        self._block_ids.pop(request_id, None)
        self._num_null_blocks[request_id] = end

    def free(self, request: Request) -> None:
        """Returns the request's blocks, last first (see `BlockPool.free_blocks`); a request
        holding none is left alone, so freeing twice is harmless."""
        blocks = self.req_to_blocks.pop(request.request_id, None)
        self._block_ids.pop(request.request_id, None)
        self._num_cached_blocks.pop(request.request_id, None)
        num_null = self._num_null_blocks.pop(request.request_id, 0)
        if blocks is not None:
            self.block_pool.free_blocks(reversed(blocks[num_null:]))

    def free_blocks_beyond(self, request: Request, num_tokens: int) -> None:
        """Returns the request's blocks past those holding its first num_tokens tokens, last
        first: the slots of proposals its verification rejected (speculative decoding).
        Cached blocks hold verified tokens only, all among the first num_tokens."""
        blocks = self.req_to_blocks.get(request.request_id)
        keep = -(-num_tokens // self.block_size)
        if blocks is None or keep >= len(blocks):
            return
        assert self._num_cached_blocks.get(request.request_id, 0) <= keep, (
            f"{request} would free a block registered in the prefix cache")
        # Blocks the sliding window freed lie before the first verified token's window.
        assert self._num_null_blocks.get(request.request_id, 0) <= keep, (
            f"{request} would free a block the sliding window already freed")
        extra = blocks[keep:]
        del blocks[keep:]
        self._block_ids.pop(request.request_id, None)
        self.block_pool.free_blocks(reversed(extra))

    def evict_cached_blocks(self, request: Request) -> None:
        """Drops the blocks of the request's tokens from the prefix cache (vLLM evicts block
        hashes so when their KV turned out wrong): every hash of its prompt and output so far,
        whoever computed the block, and whether the request still holds it (a preempted one
        does not). Call it for requests whose step computed KV that must not be reused; free
        them as usual."""
        if self.enable_caching:
            self.block_pool.evict_cached_hashes(request.block_hashes)

    def reset_prefix_cache(self) -> bool:
        return self.block_pool.reset_prefix_cache()

    def recent_cached_block_hashes(self, limit: int) -> list[bytes]:
        """Up to `limit` hashes of the prefix cache's blocks, most recently used first
        (`BlockPool.recent_cached_hashes`); none with prefix caching off."""
        return self.block_pool.recent_cached_hashes(limit) if self.enable_caching else []

    # ----------------------------------------------------------------- caching
    def _update_block_hashes(self, request: Request) -> None:
        """Hashes the request's full blocks not hashed yet (each block once, ever)."""
        hashes = request.block_hashes
        tokens = request.all_token_ids
        size = self.block_size
        for index in range(len(hashes), len(tokens) // size):
            start, end = index * size, (index + 1) * size
            extra_key = _mm_extra_key(request, start, end) + _prompt_embeds_extra_key(request, start, end)
            if index:
                hashes.append(hash_block_tokens(hashes[index - 1], tokens[start:end], extra_key))
            else:
                # The salt and the adapter go into the first block; every later hash chains on it.
                hashes.append(hash_block_tokens(None, tokens[:size], _first_block_extra_key(request) + extra_key))

    def _cache_full_blocks(self, request: Request, blocks: list[KVCacheBlock], num_full_blocks: int) -> None:
        already = self._num_cached_blocks.get(request.request_id, 0)
        if num_full_blocks <= already:
            return
        self._update_block_hashes(request)
        for index in range(max(already, self._num_null_blocks.get(request.request_id, 0)), num_full_blocks):
            # (A block freed by the window before its last token was known is not cached.)
            self.block_pool.cache_full_block(blocks[index], request.block_hashes[index])
        self._num_cached_blocks[request.request_id] = num_full_blocks

    # -------------------------------------------------------------- invariants
    def check_invariants(self, requests: Iterable[Request] = ()) -> None:
        """Raises AssertionError if the bookkeeping is inconsistent: every ref count equals
        the number of block tables holding the block, free blocks are exactly those nobody
        holds (each once), every cached block is the one its hash maps to, and the cached
        blocks of the given requests hold the hashes of those requests' tokens."""
        pool = self.block_pool
        holders: Counter[int] = Counter()
        for request_id, blocks in self.req_to_blocks.items():
            num_null = self._num_null_blocks.get(request_id, 0)
            assert all(block is self.null_block for block in blocks[:num_null]), (
                f"request {request_id} has a freed entry that is not the null block")
            assert all(block is not self.null_block for block in blocks[num_null:]), (
                f"request {request_id} has a null entry after its first {num_null}")
            ids = [block.block_id for block in blocks[num_null:]]
            assert len(ids) == len(set(ids)), f"request {request_id} holds a block twice: {ids}"
            holders.update(ids)
        for block in pool.blocks:
            assert block.ref_cnt == holders[block.block_id], (
                f"block {block.block_id} has ref_cnt {block.ref_cnt} but {holders[block.block_id]} holders")
            in_queue = block.block_id in pool.free_queue
            assert in_queue == (block.ref_cnt == 0), f"block {block.block_id}: ref_cnt {block.ref_cnt}, " \
                                                     f"{'in' if in_queue else 'not in'} the free queue"
            if block.block_hash is not None:
                assert pool.cached_blocks.get(block.block_hash) is block, (
                    f"block {block.block_id} carries a hash that maps to another block")
        for block_hash, block in pool.cached_blocks.items():
            assert block.block_hash == block_hash, f"cached block {block.block_id} lost its hash"
        for request in requests:
            blocks = self.req_to_blocks.get(request.request_id, [])
            self._update_block_hashes(request)
            num_full = min(request.num_computed_tokens, request.num_tokens) // self.block_size
            for index, block in enumerate(blocks[:num_full]):
                if block is not self.null_block and block.block_hash is not None:
                    assert block.block_hash == request.block_hashes[index], (
                        f"block {block.block_id} of request {request.request_id} is cached under a hash "
                        f"that is not its tokens'")


def _first_block_extra_key(request: Request) -> bytes:
    """The request's cache_salt and LoRA adapter, as the first block's hash takes them. The
    adapter is its id, name and path and the SHA-256 of its files as the engine checked them:
    an adapter removed and added again under the same names with other files computes other
    KV, and must not find the old one."""
    lora = request.lora_request
    if lora is None:
        return first_block_extra_key(request.cache_salt)
    digest = request.lora_digest
    files = b"" if digest is None else f"\x00{digest.config_sha256}\x00{digest.weights_sha256}".encode()
    return first_block_extra_key(request.cache_salt, lora.cache_key() + files)


def _mm_extra_key(request: Request, start: int, end: int) -> bytes:
    """What the images whose placeholder tokens fall in [start, end) add to the block's
    extra key (vLLM hashes the image into the blocks that hold its tokens): the same
    placeholder ids with another image must not find this KV; later blocks chain on it
    through their parent. Empty without images; else a 0xfe byte (which no UTF-8 salt holds)
    and the SHA-256 of the images' content hashes, a fixed 33 bytes at the key's end, so no
    salt or adapter key can pose as an image."""
    if not request.mm_features:
        return b""
    identifiers = [feature.identifier for feature in request.mm_features if feature.overlap(start, end) is not None]
    return b"\xfe" + hashlib.sha256(b"".join(identifiers)).digest() if identifiers else b""


def _prompt_embeds_extra_key(request: Request, start: int, end: int) -> bytes:
    """What an embeddings prompt's rows in [start, end) add to the block's extra key: the
    block's placeholder ids say nothing of its KV, its embeddings do, so the block is hashed
    with their content (vLLM hashes the embeddings too, rather than not caching them). Two
    requests with the same embeddings share the block (the n samples of one request, a
    prompt sent again); no token prompt, whose keys never hold this part, can take it or
    give it. Empty past the prompt (later blocks chain on it through their parent); else a
    0xfd byte (in no UTF-8 salt) and the rows' SHA-256, a fixed 33 bytes at the key's end.
    A model takes images or prompt embeddings, never both (EngineArgs), so this never sits
    beside `_mm_extra_key`'s part."""
    embeds = request.prompt_embeds
    if embeds is None or start >= request.num_prompt_tokens:
        return b""
    return b"\xfd" + prompt_embeds_digest(embeds, start, min(end, request.num_prompt_tokens))


def _pools_every_token(request: Request) -> bool:
    return request.pooling_params is not None and request.pooling_params.pools_every_token


def _needs_prompt_logprobs(request: Request) -> bool:
    return (request.sampling_params.prompt_logprobs is not None
            and request.num_prompt_logprobs_done < request.num_prompt_tokens - 1)
