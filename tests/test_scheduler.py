"""Scheduler policy: token budget, FCFS admission, continuous batching, preemption by
recompute and ignored prompts. Expected numbers come from arithmetic on block_size."""

from raylm.engine.config import CacheConfig, SchedulerConfig
from raylm.engine.sampling_params import SamplingParams
from raylm.engine.scheduler import Scheduler, SchedulerOutputs
from raylm.engine.sequence import Sequence, SequenceGroup, SequenceStatus
from raylm.engine.step import ExecuteModelRequest

BLOCK_SIZE = 4


def make_scheduler(num_blocks: int = 64, max_num_batched_tokens: int = 64, max_num_seqs: int = 16,
                   max_model_len: int = 64) -> Scheduler:
    cache_config = CacheConfig(block_size=BLOCK_SIZE)
    cache_config.num_gpu_blocks = num_blocks
    return Scheduler(SchedulerConfig(max_num_seqs, max_num_batched_tokens, max_model_len), cache_config)


_next_seq_id = iter(range(10**9))


def add_group(scheduler: Scheduler, request_id: str, prompt_len: int, n: int = 1, arrival_time: float = 0.0,
              **params) -> SequenceGroup:
    seqs = [Sequence(next(_next_seq_id), None, [5] * prompt_len, BLOCK_SIZE) for _ in range(n)]
    group = SequenceGroup(request_id, seqs, SamplingParams(n=n, temperature=1.0, **params), arrival_time)
    scheduler.add_seq_group(group)
    return group


def engine_step(scheduler: Scheduler, max_output_len: int = 100) -> tuple[ExecuteModelRequest, SchedulerOutputs]:
    """schedule(), then what the engine does with the sampled tokens: one token for every
    sampled sequence, finish it at max_output_len, free what finished."""
    request, out = scheduler.schedule()
    seqs = {seq.seq_id: seq for group in out.scheduled_seq_groups for seq in group.get_seqs()}
    for scheduled in request.seqs:
        for seq_id in scheduled.sample_seq_ids:
            seq = seqs[seq_id]
            seq.append_token_id(9, -0.5)
            if seq.get_output_len() >= max_output_len:
                seq.status = SequenceStatus.FINISHED_LENGTH_CAPPED
                scheduler.free_seq(seq)
    scheduler.free_finished_seq_groups()
    scheduler.block_manager.check_invariants()
    return request, out


def test_prefills_are_admitted_while_the_token_budget_allows():
    scheduler = make_scheduler(max_num_batched_tokens=16, max_model_len=16)
    a, b, c = (add_group(scheduler, name, prompt_len=6) for name in "abc")
    _, out = engine_step(scheduler)
    assert out.scheduled_seq_groups == [a, b]
    assert out.num_batched_tokens == 12
    assert list(scheduler.waiting) == [c]


def test_decode_tokens_count_against_the_budget():
    scheduler = make_scheduler(max_num_batched_tokens=16, max_model_len=16)
    add_group(scheduler, "a", prompt_len=6)
    add_group(scheduler, "b", prompt_len=6)
    engine_step(scheduler)
    add_group(scheduler, "c", prompt_len=14)  # 2 decode tokens + 14 = 16: fits exactly
    d = add_group(scheduler, "d", prompt_len=1)
    _, out = engine_step(scheduler)
    assert out.num_batched_tokens == 16 and out.num_decode_tokens == 2
    assert [g.request_id for g in out.scheduled_seq_groups] == ["c", "a", "b"]
    assert list(scheduler.waiting) == [d]


def test_admission_is_first_come_first_served():
    # "big" must wait for blocks; "small" behind it would fit but may not overtake it.
    scheduler = make_scheduler(num_blocks=4)
    add_group(scheduler, "first", prompt_len=8)
    engine_step(scheduler)
    big = add_group(scheduler, "big", prompt_len=12)
    small = add_group(scheduler, "small", prompt_len=2)
    _, out = engine_step(scheduler)
    assert [g.request_id for g in out.scheduled_seq_groups] == ["first"]
    assert list(scheduler.waiting) == [big, small]


def test_max_num_seqs_counts_every_sample_of_a_group():
    scheduler = make_scheduler(max_num_seqs=4)
    a = add_group(scheduler, "a", prompt_len=3, n=3)
    b = add_group(scheduler, "b", prompt_len=3, n=2)
    _, out = engine_step(scheduler)
    assert out.scheduled_seq_groups == [a]
    assert list(scheduler.waiting) == [b]


def test_a_new_request_joins_the_running_batch():
    scheduler = make_scheduler()
    a = add_group(scheduler, "a", prompt_len=5)
    engine_step(scheduler)
    b = add_group(scheduler, "b", prompt_len=3)
    request, out = engine_step(scheduler)
    assert out.scheduled_seq_groups == [b, a] and out.num_prefill_groups == 1
    prefill, decode = request.seqs
    assert prefill.token_ids == [5, 5, 5] and prefill.num_computed_tokens == 0
    assert decode.token_ids == [9] and decode.num_computed_tokens == 5
    assert out.num_batched_tokens == 3 + 1


def test_decode_sends_only_the_last_token_and_advances_num_computed_tokens():
    scheduler = make_scheduler()
    a = add_group(scheduler, "a", prompt_len=5)
    engine_step(scheduler)
    engine_step(scheduler)
    request, _ = engine_step(scheduler)
    (decode,) = request.seqs
    seq = a.get_seqs()[0]
    assert decode.token_ids == [9] and decode.num_computed_tokens == 6
    assert seq.data.num_computed_tokens == 7 and seq.get_len() == 8
    assert decode.block_table == scheduler.block_manager.get_block_table(seq)


def test_samples_share_one_prefill_and_copy_the_shared_block_on_their_first_decode():
    scheduler = make_scheduler(num_blocks=10)
    group = add_group(scheduler, "r", prompt_len=6, n=3, prompt_logprobs=2)
    request, _ = engine_step(scheduler)
    (prefill,) = request.seqs
    ids = [seq.seq_id for seq in group.get_seqs()]
    assert prefill.seq_id == ids[0] and prefill.sample_seq_ids == ids
    assert prefill.compute_prompt_logprobs
    assert scheduler.block_manager.get_num_free_blocks() == 10 - 2
    request, _ = engine_step(scheduler)
    # Position 6 is in the shared second block: two copies, the last holder writes in place.
    assert len(request.blocks_to_copy) == 2
    assert scheduler.block_manager.get_num_free_blocks() == 10 - 4
    assert [s.sample_seq_ids for s in request.seqs] == [[i] for i in ids]


def test_the_latest_running_request_is_preempted_and_later_recomputed():
    # 6 blocks of 4 slots; a, b, c take 2 each; their 9th token needs a 7th block.
    scheduler = make_scheduler(num_blocks=6)
    a = add_group(scheduler, "a", prompt_len=7, arrival_time=0.0)
    b = add_group(scheduler, "b", prompt_len=7, arrival_time=1.0)
    c = add_group(scheduler, "c", prompt_len=7, arrival_time=2.0)
    engine_step(scheduler, max_output_len=4)
    engine_step(scheduler, max_output_len=4)
    d = add_group(scheduler, "d", prompt_len=1, arrival_time=3.0)
    request, out = engine_step(scheduler, max_output_len=4)
    # c's two blocks serve a's and b's new tokens.
    assert out.preempted == 1 and scheduler.num_preemptions == 1
    assert out.scheduled_seq_groups == [a, b]  # and no prefill in a step that preempted
    assert list(scheduler.waiting) == [c, d]
    c_seq = c.get_seqs()[0]
    assert c_seq.status == SequenceStatus.WAITING and c_seq.data.num_computed_tokens == 0
    assert not scheduler.block_manager.has_block_table(c_seq)

    outputs_before = list(c_seq.output_token_ids)
    for _ in range(10):
        request, out = engine_step(scheduler, max_output_len=4)
        if c in out.scheduled_seq_groups:
            break
    assert a.is_finished() and b.is_finished()
    (recompute, *_) = request.seqs
    assert recompute.seq_id == c_seq.seq_id and recompute.num_computed_tokens == 0
    assert recompute.token_ids == [5] * 7 + outputs_before
    assert recompute.num_prompt_tokens == 7 and not recompute.compute_prompt_logprobs


def test_a_request_that_is_itself_the_latest_preempts_itself():
    scheduler = make_scheduler(num_blocks=4)
    a = add_group(scheduler, "a", prompt_len=6, arrival_time=0.0)  # position 6: own block
    b = add_group(scheduler, "b", prompt_len=8, arrival_time=1.0)  # position 8: needs a block
    engine_step(scheduler)
    _, out = engine_step(scheduler)
    assert out.scheduled_seq_groups == [a] and out.preempted == 1
    assert list(scheduler.waiting) == [b]


def test_a_prompt_larger_than_the_whole_cache_is_ignored():
    scheduler = make_scheduler(num_blocks=4)
    too_big = add_group(scheduler, "big", prompt_len=17)
    ok = add_group(scheduler, "ok", prompt_len=16)
    _, out = engine_step(scheduler)
    assert out.ignored_seq_groups == [too_big] and out.scheduled_seq_groups == [ok]
    seq = too_big.get_seqs()[0]
    assert seq.status == SequenceStatus.FINISHED_IGNORED
    assert SequenceStatus.get_finished_reason(seq.status) == "length"
    assert not scheduler.has_request("big")


def test_a_prompt_longer_than_max_model_len_is_ignored():
    scheduler = make_scheduler(max_model_len=16, max_num_batched_tokens=16)
    group = add_group(scheduler, "long", prompt_len=17)
    _, out = engine_step(scheduler)
    assert out.ignored_seq_groups == [group] and out.is_empty()


def test_abort_frees_blocks_and_tells_the_workers_next_step():
    scheduler = make_scheduler(num_blocks=10)
    running = add_group(scheduler, "run", prompt_len=6, n=2)
    engine_step(scheduler)
    waiting = add_group(scheduler, "wait", prompt_len=100)
    aborted = scheduler.abort_seq_group(["run", "wait"])
    assert set(map(id, aborted)) == {id(running), id(waiting)}
    assert all(seq.status == SequenceStatus.FINISHED_ABORTED for seq in running.get_seqs() + waiting.get_seqs())
    assert scheduler.block_manager.get_num_free_blocks() == 10
    assert not scheduler.has_unfinished_seqs()
    freed = sorted(seq.seq_id for seq in running.get_seqs())
    request, out = scheduler.schedule()
    assert out.is_empty() and sorted(request.finished_seq_ids) == freed
    # An empty step may not reach the workers, so the next one repeats the ids.
    add_group(scheduler, "next", prompt_len=2)
    request, _ = engine_step(scheduler)
    assert sorted(request.finished_seq_ids) == freed
    assert engine_step(scheduler)[0].finished_seq_ids == []


def test_finished_requests_leave_and_return_their_blocks():
    scheduler = make_scheduler(num_blocks=10)
    group = add_group(scheduler, "r", prompt_len=6, n=2)
    for _ in range(3):
        engine_step(scheduler, max_output_len=3)
    assert group.is_finished()
    assert scheduler.get_num_unfinished_seq_groups() == 0
    assert scheduler.kv_cache_usage == 0.0


def test_counters_report_queues_and_cache_usage():
    scheduler = make_scheduler(num_blocks=8, max_num_seqs=1)
    add_group(scheduler, "a", prompt_len=8)
    add_group(scheduler, "b", prompt_len=8)
    engine_step(scheduler)
    assert (scheduler.num_running, scheduler.num_waiting) == (1, 1)
    assert scheduler.kv_cache_usage == 2 / 8
