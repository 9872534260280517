"""`KVCacheManager`: which blocks each request holds, and which of its prefix is cached.

The scheduler's only view of KV-cache memory. A request's block table covers its computed
tokens plus the ones scheduled this step: token p lives in block ``blocks[p // block_size]``
at offset ``p % block_size``. With prefix caching on, every block that fills with known
tokens is registered in the pool under the hash of its tokens and everything before them,
and stays cached after its request ends, until the pool evicts it for a fresh block.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable

from raylm.engine.block_pool import BlockPool, KVCacheBlock, hash_block_tokens
from raylm.engine.request import Request


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True) -> None:
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.block_pool = BlockPool(num_blocks, enable_caching)
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
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
        since cached tokens produce no logits.
        """
        if not self.enable_caching or _needs_prompt_logprobs(request):
            return [], 0
        self._update_block_hashes(request)
        max_hit_blocks = (request.num_tokens - 1) // self.block_size
        computed: list[KVCacheBlock] = []
        for block_hash in request.block_hashes[:max_hit_blocks]:
            block = self.block_pool.get_cached_block(block_hash)
            if block is None:
                break
            computed.append(block)
        return computed, len(computed) * self.block_size

    def record_admission(self, request: Request, num_computed_tokens: int) -> None:
        """Counts a lookup that led to admission (a request that waits and looks again
        next step is counted once, when it gets in)."""
        if self.enable_caching and not _needs_prompt_logprobs(request):
            self.prefix_cache_queries += request.num_tokens
            self.prefix_cache_hits += num_computed_tokens

    def get_block_ids(self, request_id: str) -> list[int]:
        return [block.block_id for block in self.req_to_blocks.get(request_id, ())]

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
        more. Returns the fresh blocks, or None (nothing changed) when the pool is short."""
        total_tokens = request.num_computed_tokens + num_new_computed_tokens + num_new_tokens
        if not new_computed_blocks and self._covers(request, total_tokens):
            return []  # a decode step inside its last block: most calls, on the driver's critical path
        new_computed_blocks = new_computed_blocks or []
        held = self.req_to_blocks.get(request.request_id, [])
        num_new_blocks = -(-total_tokens // self.block_size) - len(held) - len(new_computed_blocks)
        # A hit on a free block takes it out of the free queue: it cannot also be handed out.
        num_hits_on_free = sum(1 for block in new_computed_blocks if block.ref_cnt == 0)
        if num_new_blocks > self.block_pool.get_num_free_blocks() - num_hits_on_free:
            return None
        self.block_pool.touch(new_computed_blocks)
        new_blocks = self.block_pool.get_new_blocks(max(0, num_new_blocks))
        held = self.req_to_blocks.setdefault(request.request_id, held)
        held.extend(new_computed_blocks)
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

    def free(self, request: Request) -> None:
        """Returns the request's blocks, last first (see `BlockPool.free_blocks`); a request
        holding none is left alone, so freeing twice is harmless."""
        blocks = self.req_to_blocks.pop(request.request_id, None)
        self._num_cached_blocks.pop(request.request_id, None)
        if blocks is not None:
            self.block_pool.free_blocks(reversed(blocks))

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
        extra = blocks[keep:]
        del blocks[keep:]
        self.block_pool.free_blocks(reversed(extra))

    def reset_prefix_cache(self) -> bool:
        return self.block_pool.reset_prefix_cache()

    # ----------------------------------------------------------------- caching
    def _update_block_hashes(self, request: Request) -> None:
        """Hashes the request's full blocks not hashed yet (each block once, ever)."""
        hashes = request.block_hashes
        tokens = request.all_token_ids
        size = self.block_size
        for index in range(len(hashes), len(tokens) // size):
            if index:
                hashes.append(hash_block_tokens(hashes[index - 1], tokens[index * size:(index + 1) * size]))
            else:
                # The salt goes into the first block; every later hash chains on it.
                salt = request.cache_salt.encode() if request.cache_salt is not None else b""
                hashes.append(hash_block_tokens(None, tokens[:size], salt))

    def _cache_full_blocks(self, request: Request, blocks: list[KVCacheBlock], num_full_blocks: int) -> None:
        already = self._num_cached_blocks.get(request.request_id, 0)
        if num_full_blocks <= already:
            return
        self._update_block_hashes(request)
        for index in range(already, num_full_blocks):
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
            ids = [block.block_id for block in blocks]
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
                if block.block_hash is not None:
                    assert block.block_hash == request.block_hashes[index], (
                        f"block {block.block_id} of request {request.request_id} is cached under a hash "
                        f"that is not its tokens'")


def _needs_prompt_logprobs(request: Request) -> bool:
    return (request.sampling_params.prompt_logprobs is not None
            and request.num_prompt_logprobs_done < request.num_prompt_tokens - 1)
