"""BlockSpaceManager: block counts checked by arithmetic on block_size."""

import pytest

from raylm.engine.block_manager import AllocStatus, BlockAllocator, BlockSpaceManager
from raylm.engine.sampling_params import SamplingParams
from raylm.engine.sequence import Sequence, SequenceGroup, SequenceStatus

BLOCK_SIZE = 4


def make_group(request_id: str, prompt_len: int, n: int = 1, first_seq_id: int = 0) -> SequenceGroup:
    seqs = [Sequence(first_seq_id + i, None, list(range(prompt_len)), BLOCK_SIZE) for i in range(n)]
    params = SamplingParams(n=n, temperature=1.0)
    return SequenceGroup(request_id, seqs, params, arrival_time=0.0)


def start_running(group: SequenceGroup) -> None:
    """What the scheduler does after allocate: the prompt is computed, samples run."""
    for seq in group.get_seqs():
        seq.status = SequenceStatus.RUNNING
        seq.data.num_computed_tokens = seq.get_len()


def append_token(seq: Sequence, token_id: int = 7) -> None:
    """What the engine does after a step: one new, not yet computed token."""
    seq.append_token_id(token_id, -1.0)


def test_samples_of_one_request_share_their_prompt_blocks():
    manager = BlockSpaceManager(BLOCK_SIZE, num_blocks=10)
    group = make_group("r", prompt_len=10, n=4)  # ceil(10 / 4) = 3 blocks for all four
    manager.allocate(group)
    assert manager.get_num_free_blocks() == 10 - 3
    tables = [manager.get_block_table(seq) for seq in group.get_seqs()]
    assert all(table == tables[0] for table in tables)
    assert manager.get_ref_counts() == {block_id: 4 for block_id in tables[0]}
    manager.check_invariants()


def test_recomputed_samples_with_outputs_get_their_own_blocks():
    manager = BlockSpaceManager(BLOCK_SIZE, num_blocks=20)
    group = make_group("r", prompt_len=6, n=3)
    for i, seq in enumerate(group.get_seqs()):
        for _ in range(i + 1):
            append_token(seq)
    # lengths 7, 8, 9 -> 2 + 2 + 3 blocks
    assert manager.can_allocate(group) == AllocStatus.OK
    manager.allocate(group)
    assert manager.get_num_free_blocks() == 20 - 7
    assert set(manager.get_ref_counts().values()) == {1}
    manager.check_invariants()


def test_can_allocate_says_never_when_the_prompt_exceeds_the_whole_cache():
    manager = BlockSpaceManager(BLOCK_SIZE, num_blocks=3)
    assert manager.can_allocate(make_group("r", prompt_len=13)) == AllocStatus.NEVER
    assert manager.can_allocate(make_group("r", prompt_len=12)) == AllocStatus.OK


def test_can_allocate_says_later_when_free_blocks_are_short():
    manager = BlockSpaceManager(BLOCK_SIZE, num_blocks=4)
    manager.allocate(make_group("a", prompt_len=8, first_seq_id=0))
    assert manager.can_allocate(make_group("b", prompt_len=9, first_seq_id=1)) == AllocStatus.LATER


def test_copy_on_write_is_ordered_when_a_token_lands_in_a_shared_block():
    manager = BlockSpaceManager(BLOCK_SIZE, num_blocks=10)
    group = make_group("r", prompt_len=6, n=2)  # position 6 lands in the shared block 1
    manager.allocate(group)
    start_running(group)
    first, second = group.get_seqs()
    shared_last = manager.get_block_table(first)[-1]
    append_token(first)
    copies = manager.append_slots(first)
    assert len(copies) == 1 and copies[0][0] == shared_last
    assert manager.get_block_table(first)[-1] == copies[0][1]
    # The other sample is now the block's only holder and writes in place.
    append_token(second)
    assert manager.append_slots(second) == []
    assert manager.get_block_table(second)[-1] == shared_last
    assert manager.get_num_free_blocks() == 10 - 3
    manager.check_invariants()


def test_no_copy_when_the_new_token_starts_a_block():
    manager = BlockSpaceManager(BLOCK_SIZE, num_blocks=10)
    group = make_group("r", prompt_len=8, n=2)  # position 8 starts block 2
    manager.allocate(group)
    start_running(group)
    for seq in group.get_seqs():
        append_token(seq)
        assert manager.append_slots(seq) == []
        assert len(manager.get_block_table(seq)) == 3
    # 2 shared prompt blocks + one new block each.
    assert manager.get_num_free_blocks() == 10 - 4
    manager.check_invariants()


def test_append_within_an_owned_block_takes_no_block():
    manager = BlockSpaceManager(BLOCK_SIZE, num_blocks=10)
    group = make_group("r", prompt_len=5)
    manager.allocate(group)
    start_running(group)
    seq = group.get_seqs()[0]
    append_token(seq)
    assert manager.append_slots(seq) == []
    assert manager.get_num_free_blocks() == 10 - 2


def test_fork_shares_every_block_of_the_parent():
    manager = BlockSpaceManager(BLOCK_SIZE, num_blocks=10)
    group = make_group("r", prompt_len=9)
    manager.allocate(group)
    parent = group.get_seqs()[0]
    child = parent.fork(new_seq_id=99)
    manager.fork(parent, child)
    assert manager.get_block_table(child) == manager.get_block_table(parent)
    assert set(manager.get_ref_counts().values()) == {2}
    assert manager.get_num_free_blocks() == 10 - 3
    manager.check_invariants()


def test_free_returns_every_block_of_shared_and_owned_tables():
    manager = BlockSpaceManager(BLOCK_SIZE, num_blocks=10)
    group = make_group("r", prompt_len=6, n=3)
    manager.allocate(group)
    start_running(group)
    for seq in group.get_seqs():
        append_token(seq)
        manager.append_slots(seq)
    for seq in group.get_seqs():
        manager.free(seq)
        manager.check_invariants()
    assert manager.get_num_free_blocks() == 10
    assert manager.get_ref_counts() == {}


def test_freeing_a_sequence_twice_leaves_the_pool_unchanged():
    manager = BlockSpaceManager(BLOCK_SIZE, num_blocks=10)
    group = make_group("r", prompt_len=6)
    manager.allocate(group)
    seq = group.get_seqs()[0]
    manager.free(seq)
    manager.free(seq)
    assert manager.get_num_free_blocks() == 10
    manager.check_invariants()


def test_double_free_of_a_block_raises():
    allocator = BlockAllocator(num_blocks=2)
    block = allocator.allocate()
    allocator.free(block)
    with pytest.raises(RuntimeError, match="Double free"):
        allocator.free(block)


def test_check_invariants_catches_a_wrong_ref_count():
    manager = BlockSpaceManager(BLOCK_SIZE, num_blocks=4)
    group = make_group("r", prompt_len=4)
    manager.allocate(group)
    manager.block_tables[0][0].ref_count = 2
    with pytest.raises(AssertionError, match="ref_count"):
        manager.check_invariants()
