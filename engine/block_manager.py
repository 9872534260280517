"""PagedAttention's block bookkeeping: which KV-cache blocks each sequence owns.

Each sequence has a block table: the token at position p lives in block
``block_table[p // block_size]`` at offset ``p % block_size``. Blocks are reference
counted so that the samples of one request share their prompt blocks; a shared block
that is about to receive a token is copied first (copy-on-write), and the copy order
goes to the workers with the step.
"""

from __future__ import annotations

import enum
from collections import Counter, deque
from dataclasses import dataclass

from raylm.engine.sequence import Sequence, SequenceGroup, SequenceStatus


class AllocStatus(enum.Enum):
    """Whether a waiting group's blocks can be allocated: now, after others free
    theirs, or never (it needs more blocks than the whole cache holds)."""

    OK = enum.auto()
    LATER = enum.auto()
    NEVER = enum.auto()


@dataclass
class Block:
    block_id: int
    # Number of block tables holding this block; 0 while it is in the free pool.
    ref_count: int = 0


class BlockAllocator:
    """A fixed pool of blocks with reference counts."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be at least 1, got {num_blocks}.")
        self.num_blocks = num_blocks
        self.blocks = [Block(block_id) for block_id in range(num_blocks)]
        self.free_block_ids: deque[int] = deque(range(num_blocks))

    def allocate(self) -> Block:
        if not self.free_block_ids:
            raise RuntimeError("Out of KV-cache blocks: the scheduler allocated without checking.")
        block = self.blocks[self.free_block_ids.popleft()]
        assert block.ref_count == 0, f"block {block.block_id} in the free pool has ref_count {block.ref_count}"
        block.ref_count = 1
        return block

    def incref(self, block: Block) -> None:
        if block.ref_count == 0:
            raise RuntimeError(f"Block {block.block_id} is free; it cannot gain a reference.")
        block.ref_count += 1

    def free(self, block: Block) -> None:
        """Drops one reference; the block returns to the pool when none is left."""
        if block.ref_count == 0:
            raise RuntimeError(f"Double free of KV-cache block {block.block_id}.")
        block.ref_count -= 1
        if block.ref_count == 0:
            self.free_block_ids.append(block.block_id)

    def get_num_free_blocks(self) -> int:
        return len(self.free_block_ids)


class BlockSpaceManager:
    """Maps sequences to KV-cache blocks; the scheduler's only view of cache memory."""

    def __init__(self, block_size: int, num_blocks: int) -> None:
        self.block_size = block_size
        self.num_total_blocks = num_blocks
        self.allocator = BlockAllocator(num_blocks)
        self.block_tables: dict[int, list[Block]] = {}

    def _num_blocks(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # ------------------------------------------------------------ prefill
    @staticmethod
    def _shares_prompt(seqs: list[Sequence]) -> bool:
        # Fresh samples hold the same tokens (the prompt) and can share its blocks; once
        # they have sampled, a recomputed group's samples differ and each needs its own.
        return all(seq.get_output_len() == 0 for seq in seqs)

    def _num_required_blocks(self, group: SequenceGroup) -> int:
        seqs = group.get_seqs(SequenceStatus.WAITING)
        if self._shares_prompt(seqs):
            return self._num_blocks(seqs[0].get_len())
        return sum(self._num_blocks(seq.get_len()) for seq in seqs)

    def can_allocate(self, group: SequenceGroup) -> AllocStatus:
        required = self._num_required_blocks(group)
        if required > self.num_total_blocks:
            return AllocStatus.NEVER
        if required > self.allocator.get_num_free_blocks():
            return AllocStatus.LATER
        return AllocStatus.OK

    def allocate(self, group: SequenceGroup) -> None:
        """Gives every waiting sequence of the group a block table covering all its tokens."""
        seqs = group.get_seqs(SequenceStatus.WAITING)
        for seq in seqs:
            assert seq.seq_id not in self.block_tables, f"sequence {seq.seq_id} already holds blocks"
        if self._shares_prompt(seqs):
            table = [self.allocator.allocate() for _ in range(self._num_blocks(seqs[0].get_len()))]
            for block in table:
                block.ref_count = len(seqs)
            for seq in seqs:
                self.block_tables[seq.seq_id] = list(table)
        else:
            for seq in seqs:
                self.block_tables[seq.seq_id] = [self.allocator.allocate()
                                                 for _ in range(self._num_blocks(seq.get_len()))]

    # ------------------------------------------------------------- decode
    def _num_new_blocks(self, seq: Sequence) -> int:
        """Blocks append_slots(seq) may take: a new one when the tokens to compute spill
        past the table, one per shared block those tokens land in (an upper bound: the
        last holder of a shared block writes in place)."""
        table = self.block_tables[seq.seq_id]
        first = seq.data.num_computed_tokens // self.block_size
        shared = sum(1 for block in table[first:] if block.ref_count > 1)
        return shared + max(0, self._num_blocks(seq.get_len()) - len(table))

    def can_append_slots(self, group: SequenceGroup) -> bool:
        needed = sum(self._num_new_blocks(seq) for seq in group.get_seqs(SequenceStatus.RUNNING))
        return needed <= self.allocator.get_num_free_blocks()

    def append_slots(self, seq: Sequence) -> list[tuple[int, int]]:
        """Makes the table cover the tokens from num_computed_tokens to the end, each in
        a block this sequence owns alone. Returns (src, dst) copy-on-write orders."""
        table = self.block_tables[seq.seq_id]
        copies = []
        for index in range(seq.data.num_computed_tokens // self.block_size, len(table)):
            block = table[index]
            if block.ref_count > 1:
                new_block = self.allocator.allocate()
                self.allocator.free(block)
                table[index] = new_block
                copies.append((block.block_id, new_block.block_id))
        while len(table) < self._num_blocks(seq.get_len()):
            table.append(self.allocator.allocate())
        return copies

    # ----------------------------------------------------------- lifetime
    def fork(self, parent: Sequence, child: Sequence) -> None:
        """The child shares every block of the parent."""
        assert child.seq_id not in self.block_tables, f"sequence {child.seq_id} already holds blocks"
        table = self.block_tables[parent.seq_id]
        for block in table:
            self.allocator.incref(block)
        self.block_tables[child.seq_id] = list(table)

    def free(self, seq: Sequence) -> None:
        """Returns the sequence's blocks; a sequence holding none (waiting, or already
        freed) is left alone, so freeing is safe after an abort."""
        table = self.block_tables.pop(seq.seq_id, None)
        if table is None:
            return
        for block in reversed(table):
            self.allocator.free(block)

    def has_block_table(self, seq: Sequence) -> bool:
        return seq.seq_id in self.block_tables

    def get_block_table(self, seq: Sequence) -> list[int]:
        return [block.block_id for block in self.block_tables[seq.seq_id]]

    def get_num_free_blocks(self) -> int:
        return self.allocator.get_num_free_blocks()

    def get_ref_counts(self) -> dict[int, int]:
        """block_id -> ref_count for every block in use."""
        return {block.block_id: block.ref_count for block in self.allocator.blocks if block.ref_count > 0}

    def check_invariants(self) -> None:
        """Raises AssertionError if the bookkeeping is inconsistent: each block's ref count
        equals the number of tables holding it, free and used blocks are disjoint and
        together the whole pool, and the free pool holds no block twice."""
        holders: Counter[int] = Counter()
        for seq_id, table in self.block_tables.items():
            ids = [block.block_id for block in table]
            assert len(ids) == len(set(ids)), f"sequence {seq_id} holds a block twice: {ids}"
            holders.update(ids)
        free = list(self.allocator.free_block_ids)
        assert len(free) == len(set(free)), f"the free pool holds a block twice: {sorted(free)}"
        assert not set(free) & set(holders), f"blocks both free and used: {sorted(set(free) & set(holders))}"
        assert len(free) + len(holders) == self.num_total_blocks, (
            f"leak: {len(free)} free + {len(holders)} used != {self.num_total_blocks} blocks")
        for block in self.allocator.blocks:
            assert block.ref_count == holders[block.block_id], (
                f"block {block.block_id} has ref_count {block.ref_count} but {holders[block.block_id]} holders")
