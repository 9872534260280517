"""Random traffic through the real Scheduler and BlockSpaceManager with a small cache:
the block bookkeeping stays exact and every step's request is one a worker can run."""

import random
from collections import Counter

from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from raylm.engine.config import CacheConfig, SchedulerConfig
from raylm.engine.sampling_params import SamplingParams
from raylm.engine.scheduler import Scheduler
from raylm.engine.sequence import Sequence, SequenceGroup, SequenceStatus

BLOCK_SIZE = 4
NUM_BLOCKS = 12
MAX_MODEL_LEN = 40
MAX_NUM_BATCHED_TOKENS = 48
MAX_NUM_SEQS = 6


class SchedulerMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        cache_config = CacheConfig(block_size=BLOCK_SIZE)
        cache_config.num_gpu_blocks = NUM_BLOCKS
        self.scheduler = Scheduler(SchedulerConfig(MAX_NUM_SEQS, MAX_NUM_BATCHED_TOKENS, MAX_MODEL_LEN),
                                   cache_config)
        self.groups: dict[str, SequenceGroup] = {}
        self.next_seq_id = 0
        self.time = 0.0

    @property
    def manager(self):
        return self.scheduler.block_manager

    @rule(prompt_len=st.integers(1, 60), n=st.integers(1, 3), max_tokens=st.integers(1, 20))
    def add(self, prompt_len: int, n: int, max_tokens: int) -> None:
        seqs = [Sequence(self.next_seq_id + i, None, [3] * prompt_len, BLOCK_SIZE) for i in range(n)]
        self.next_seq_id += n
        self.time += 1.0
        request_id = f"r{len(self.groups)}"
        group = SequenceGroup(request_id, seqs, SamplingParams(n=n, temperature=1.0, max_tokens=max_tokens),
                              self.time)
        self.groups[request_id] = group
        self.scheduler.add_seq_group(group)

    @rule(rnd=st.randoms(use_true_random=False), finish_chance=st.sampled_from([0.0, 0.1, 0.5]))
    def step(self, rnd, finish_chance: float) -> None:
        request, out = self.scheduler.schedule()
        self._check_request(request, out)
        seqs = {seq.seq_id: seq for group in out.scheduled_seq_groups for seq in group.get_seqs()}
        for scheduled in request.seqs:
            for seq_id in scheduled.sample_seq_ids:
                seq = seqs[seq_id]
                seq.append_token_id(rnd.randrange(100), -1.0)
                max_tokens = scheduled.sampling_params.max_tokens
                if seq.get_output_len() >= max_tokens or seq.get_len() >= MAX_MODEL_LEN:
                    seq.status = SequenceStatus.FINISHED_LENGTH_CAPPED
                elif rnd.random() < finish_chance:
                    seq.status = SequenceStatus.FINISHED_STOPPED
                if seq.is_finished():
                    self.scheduler.free_seq(seq)
        for group in self.scheduler.free_finished_seq_groups():
            assert group.is_finished()

    @rule(data=st.data())
    def abort(self, data) -> None:
        unfinished = sorted(rid for rid, group in self.groups.items() if not group.is_finished())
        if not unfinished:
            return
        request_id = data.draw(st.sampled_from(unfinished))
        self.scheduler.abort_seq_group(request_id)
        assert all(seq.is_finished() for seq in self.groups[request_id].get_seqs())

    def _check_request(self, request, out) -> None:
        decode_tokens = sum(len(s.token_ids) for s in request.seqs if s.num_computed_tokens > 0)
        tokens = sum(len(s.token_ids) for s in request.seqs)
        assert tokens == out.num_batched_tokens and decode_tokens == out.num_decode_tokens
        if len(out.scheduled_seq_groups) > 1:
            # Only a lone group may exceed the limits (so that it can never block the queue).
            assert tokens <= MAX_NUM_BATCHED_TOKENS
        if out.preempted:
            assert out.num_prefill_groups == 0
        ref_counts = self.manager.get_ref_counts()
        written = Counter()
        for s in request.seqs:
            assert len(s.block_table) * BLOCK_SIZE >= s.num_computed_tokens + len(s.token_ids)
            for pos in range(s.num_computed_tokens, s.num_computed_tokens + len(s.token_ids)):
                block_id = s.block_table[pos // BLOCK_SIZE]
                written[block_id * BLOCK_SIZE + pos % BLOCK_SIZE] += 1
                if s.num_computed_tokens > 0:
                    assert ref_counts[block_id] == 1, "a decode writes into a block another sequence reads"
        assert all(count == 1 for count in written.values()), "two sequences write the same slot"
        running_seqs = sum(g.num_seqs(SequenceStatus.RUNNING) for g in self.scheduler.running)
        if len(self.scheduler.running) > 1:
            assert running_seqs <= MAX_NUM_SEQS

    @invariant()
    def bookkeeping_is_exact(self) -> None:
        self.manager.check_invariants()
        free = set(self.manager.allocator.free_block_ids)
        for group in self.scheduler.waiting:
            for seq in group.get_seqs():
                assert not self.manager.has_block_table(seq), "a waiting sequence holds blocks"
        for group in self.scheduler.running:
            for seq in group.get_seqs(SequenceStatus.RUNNING):
                table = self.manager.get_block_table(seq)
                assert not free & set(table)
                assert len(table) == -(-seq.data.num_computed_tokens // BLOCK_SIZE)
        for group in self.groups.values():
            for seq in group.get_finished_seqs():
                assert not self.manager.has_block_table(seq), "a finished sequence holds blocks"

    def teardown(self) -> None:
        self.scheduler.abort_seq_group(list(self.groups))
        self.manager.check_invariants()
        assert self.manager.get_num_free_blocks() == NUM_BLOCKS
        assert not self.scheduler.has_unfinished_seqs()


SchedulerMachine.TestCase.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)
test_scheduler_keeps_block_bookkeeping_exact = SchedulerMachine.TestCase


def test_random_traffic_always_drains():
    """No deadlock: with nothing new arriving, every request ends (finished or ignored)."""
    @settings(max_examples=30, deadline=None)
    @given(requests=st.lists(st.tuples(st.integers(1, 60), st.integers(1, 3), st.integers(1, 20)),
                             min_size=1, max_size=8))
    def run(requests):
        machine = SchedulerMachine()
        for prompt_len, n, max_tokens in requests:
            machine.add(prompt_len, n, max_tokens)
        rnd = random.Random(0)
        for _ in range(1000):
            if not machine.scheduler.has_unfinished_seqs():
                break
            machine.step(rnd, 0.0)
            machine.bookkeeping_is_exact()
        assert not machine.scheduler.has_unfinished_seqs()
        assert all(group.is_finished() for group in machine.groups.values())
        assert machine.manager.get_num_free_blocks() == NUM_BLOCKS

    run()
