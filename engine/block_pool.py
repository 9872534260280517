"""The pool of KV-cache blocks: reference counts, the free queue and the prefix cache.

Every block is in exactly one of two states: held (ref_cnt > 0, by one or more requests'
block tables) or free (ref_cnt == 0, in the free queue). A free block may still be
*cached*: it carries the hash of the full block of tokens whose KV it holds, so a later
request with the same prefix can take it back instead of recomputing it. The free queue is
in LRU order; a cached block loses its contents only when it reaches the front and a fresh
block is needed (eviction).
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Iterable


class KVCacheBlock:
    """One block of `block_size` token slots in every layer's KV cache."""

    __slots__ = ("block_id", "ref_cnt", "block_hash")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        # Block tables holding this block; 0 while it sits in the free queue.
        self.ref_cnt = 0
        # Set once the block is full and its tokens are known; None otherwise.
        self.block_hash: bytes | None = None

    def __repr__(self) -> str:
        return f"KVCacheBlock({self.block_id}, ref_cnt={self.ref_cnt}, cached={self.block_hash is not None})"


def hash_block_tokens(parent_hash: bytes | None, token_ids: Iterable[int], extra_key: bytes = b"") -> bytes:
    """The identity of a full block: its tokens, everything before them (through the
    parent's hash) and anything else its KV depends on (`extra_key`).

    SHA-256 rather than Python's hash(): a tuple hash of ints is predictable, so a crafted
    prompt could collide with another user's prefix and read its cached KV.
    """
    digest = hashlib.sha256(parent_hash or b"")
    digest.update(array("q", token_ids).tobytes())
    digest.update(extra_key)
    return digest.digest()


def first_block_extra_key(cache_salt: str | None, adapter_key: bytes | None = None) -> bytes:
    """What, besides its tokens, the KV of a request's first block depends on (its
    `extra_key`): the request's cache_salt and its LoRA adapter. Empty for neither, the
    salt's UTF-8 for a salt alone; with an adapter, a 0xff byte (which starts no UTF-8
    text, so no salt can pose as an adapter), the salt length-prefixed, then the adapter's
    key. The KV-cache manager and the prefix router's keys both hash with it."""
    salt = b"" if cache_salt is None else cache_salt.encode()
    if adapter_key is None:
        return salt
    return b"\xff" + len(salt).to_bytes(8, "little") + salt + adapter_key


class BlockPool:
    """A fixed set of blocks, handed out from an LRU free queue, with a hash -> block map
    of the cached ones."""

    def __init__(self, num_blocks: int, enable_caching: bool) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be at least 1, got {num_blocks}.")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(block_id) for block_id in range(num_blocks)]
        # block_id -> block, least recently freed first. An OrderedDict gives O(1) removal
        # from the middle, which a cache hit on a free block needs.
        self.free_queue: OrderedDict[int, KVCacheBlock] = OrderedDict((b.block_id, b) for b in self.blocks)
        self.cached_blocks: dict[bytes, KVCacheBlock] = {}

    def get_num_free_blocks(self) -> int:
        """Blocks that can be handed out, cached ones included (they are evicted on demand)."""
        return len(self.free_queue)

    def get_cached_block(self, block_hash: bytes) -> KVCacheBlock | None:
        return self.cached_blocks.get(block_hash)

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """Takes blocks from the front of the free queue, evicting their cached contents."""
        if num_blocks > len(self.free_queue):
            raise RuntimeError(f"Out of KV-cache blocks: {num_blocks} asked, {len(self.free_queue)} free; "
                               f"the scheduler allocated without checking.")
        new_blocks = []
        for _ in range(num_blocks):
            _, block = self.free_queue.popitem(last=False)
            assert block.ref_cnt == 0, f"block {block.block_id} in the free queue has ref_cnt {block.ref_cnt}"
            if block.block_hash is not None:
                self._evict(block)
            block.ref_cnt = 1
            new_blocks.append(block)
        return new_blocks

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """One more holder for each block (a prefix-cache hit); free ones leave the queue."""
        for block in blocks:
            if block.ref_cnt == 0:
                del self.free_queue[block.block_id]
            block.ref_cnt += 1

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """Drops one holder of each block; blocks nobody holds join the free queue's tail in
        the given order (callers pass a request's blocks last first, so that its tail, the
        part least likely shared, is evicted before its prefix)."""
        for block in ordered_blocks:
            if block.ref_cnt <= 0:
                raise RuntimeError(f"Double free of KV-cache block {block.block_id}.")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.free_queue[block.block_id] = block

    def cache_full_block(self, block: KVCacheBlock, block_hash: bytes) -> None:
        """Records that `block` holds the full block named `block_hash`. When another block
        already holds it (two requests computed it in parallel), the first stays the
        cached one and this block stays private."""
        if not self.enable_caching or block.block_hash is not None:
            return
        if block_hash in self.cached_blocks:
            return
        block.block_hash = block_hash
        self.cached_blocks[block_hash] = block

    def recent_cached_hashes(self, limit: int) -> list[bytes]:
        """Up to `limit` hashes of cached blocks, most recently used first: the blocks
        requests hold, then the free ones from the most recently freed (the last to be
        evicted). What a replica tells a prefix-aware router it holds."""
        if limit <= 0:
            return []
        hashes = [block_hash for block_hash, block in self.cached_blocks.items() if block.ref_cnt > 0][:limit]
        for block in reversed(self.free_queue.values()):
            if len(hashes) >= limit:
                break
            if block.block_hash is not None:
                hashes.append(block.block_hash)
        return hashes

    def reset_prefix_cache(self) -> bool:
        """Forgets every cached block; only possible when no block is held."""
        if len(self.free_queue) != self.num_blocks:
            return False
        for block in self.blocks:
            block.block_hash = None
        self.cached_blocks.clear()
        return True

    def evict_cached_hashes(self, block_hashes: Iterable[bytes]) -> None:
        """Drops these hashes from the prefix cache, held blocks' too: their KV is not what the
        hash names (a step that computed it ran without its LoRA adapter). The blocks
        themselves stay where they are (held, or free without a hash)."""
        for block_hash in block_hashes:
            block = self.cached_blocks.get(block_hash)
            if block is not None:
                self._evict(block)

    def _evict(self, block: KVCacheBlock) -> None:
        if self.cached_blocks.get(block.block_hash) is block:
            del self.cached_blocks[block.block_hash]
        block.block_hash = None
