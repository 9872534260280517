"""The Scheduler, driven step by step with a stand-in for the engine core.

`run_step` does what `EngineCore.step` does with the scheduler's output: every scheduled
request whose chunk reaches its last known token (`do_sample`) gets one token from a
stand-in model, and requests that reach max_tokens or max_model_len are finished and
freed. The stand-in model's token depends only on what the workers are sent (the last
token of the chunk and its position), so `reference_outputs` is an independent reference:
a token lost, duplicated or computed at the wrong position changes every later one.
"""

from __future__ import annotations

import pytest

from raylm.engine.config import CacheConfig, SchedulerConfig
from raylm.engine.request import Request, RequestStatus
from raylm.engine.sampling_params import SamplingParams
from raylm.engine.scheduler import Scheduler, SchedulerOutput
from raylm.engine.step import ScheduledRequest

VOCAB = 1000


def make_scheduler(num_blocks: int, block_size: int = 16, budget: int = 2048, max_num_seqs: int = 256,
                   max_model_len: int | None = None, chunked: bool = True, caching: bool = True) -> Scheduler:
    if max_model_len is None:
        max_model_len = min(2048, num_blocks * block_size)
    assert num_blocks * block_size >= max_model_len, "the engine only builds pools that fit one longest request"
    cache_config = CacheConfig(block_size=block_size, enable_prefix_caching=caching)
    cache_config.num_gpu_blocks = num_blocks
    return Scheduler(SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget,
                                     max_model_len=max_model_len, enable_chunked_prefill=chunked), cache_config)


def make_request(request_id: str, prompt: list[int], max_tokens: int = 16,
                 prompt_logprobs: int | None = None) -> Request:
    params = SamplingParams(max_tokens=max_tokens, prompt_logprobs=prompt_logprobs)
    return Request(request_id, list(prompt), params, arrival_time=0.0)


def model_token(scheduled: ScheduledRequest) -> int:
    """The stand-in model: the token after position p is a function of the token at p and p."""
    position = scheduled.num_computed_tokens + len(scheduled.token_ids)
    return (scheduled.token_ids[-1] * 7 + position) % VOCAB


def reference_outputs(prompt: list[int], num_outputs: int) -> list[int]:
    tokens = list(prompt)
    for _ in range(num_outputs):
        tokens.append((tokens[-1] * 7 + len(tokens)) % VOCAB)
    return tokens[len(prompt):]


def run_step(scheduler: Scheduler) -> SchedulerOutput:
    out = scheduler.schedule()
    max_model_len = scheduler.scheduler_config.max_model_len
    finished = []
    for request, scheduled in zip(out.scheduled, out.step.requests, strict=True):
        assert scheduled.req_id == request.worker_id
        if not scheduled.do_sample:
            continue
        request.num_output_placeholders -= 1  # collected, as EngineCore does
        request.append_output_token(model_token(scheduled))
        if request.num_output_tokens >= request.sampling_params.max_tokens or request.num_tokens >= max_model_len:
            request.status = RequestStatus.FINISHED_LENGTH_CAPPED
            finished.append(request)
    scheduler.free_finished(finished)
    return out


def run_to_completion(scheduler: Scheduler, max_steps: int = 100_000) -> list[SchedulerOutput]:
    outputs = []
    while scheduler.has_unfinished_requests():
        assert len(outputs) < max_steps, "the scheduler did not finish its requests"
        outputs.append(run_step(scheduler))
    return outputs


def chunk_of(out: SchedulerOutput, request: Request) -> ScheduledRequest | None:
    return next((s for s in out.step.requests if s.req_id == request.worker_id), None)


def assert_all_blocks_free(scheduler: Scheduler) -> None:
    kv = scheduler.kv_cache_manager
    assert kv.req_to_blocks == {}
    assert kv.get_num_free_blocks() == kv.num_blocks
    kv.check_invariants()


# ----------------------------------------------------------------- the budget
@pytest.mark.parametrize("chunked", [True, False], ids=["chunked", "unchunked"])
def test_every_step_stays_within_the_token_budget(chunked: bool) -> None:
    scheduler = make_scheduler(num_blocks=64, budget=64, max_model_len=64, chunked=chunked)
    requests = [make_request(f"r{i}", [i + 1] * ((i * 37) % 59 + 1), max_tokens=5) for i in range(20)]
    for request in requests:
        scheduler.add_request(request)
    for out in run_to_completion(scheduler):
        assert out.num_batched_tokens == sum(len(s.token_ids) for s in out.step.requests)
        assert 0 < out.num_batched_tokens <= 64
    for request in requests:
        assert request.output_token_ids == reference_outputs(request.prompt_token_ids, 5)
    assert_all_blocks_free(scheduler)


def decoders_then_long_prompt() -> tuple[Scheduler, list[Request], Request]:
    """16 requests decoding (admitted in one step, 8 prompt tokens each), then a
    2000-token prompt arrives; budget 256 tokens per step."""
    scheduler = make_scheduler(num_blocks=300, budget=256)
    decoders = [make_request(f"d{i}", [i + 1] * 8, max_tokens=100) for i in range(16)]
    for request in decoders:
        scheduler.add_request(request)
    run_step(scheduler)
    assert all(request.num_output_tokens == 1 for request in decoders)
    long_prompt = make_request("long", [7] * 2000, max_tokens=1)
    scheduler.add_request(long_prompt)
    return scheduler, decoders, long_prompt


def test_long_prompt_is_chunked_to_the_budget_the_decodes_leave() -> None:
    scheduler, _, long_prompt = decoders_then_long_prompt()
    chunks = []
    while long_prompt.num_output_tokens == 0:
        scheduled = chunk_of(run_step(scheduler), long_prompt)
        chunks.append((scheduled.num_computed_tokens, len(scheduled.token_ids)))
    # 256 - 16 decodes = 240 per step: 8 chunks of 240 = 1920, then the last 80.
    assert chunks == [(240 * i, 240) for i in range(8)] + [(1920, 80)]


def test_every_running_request_gains_a_token_every_step_while_a_long_prompt_is_chunked() -> None:
    scheduler, decoders, long_prompt = decoders_then_long_prompt()
    for step in range(2, 11):  # the 9 steps of the long prompt's prefill
        out = run_step(scheduler)
        # Running requests first, in admission order; the prompt chunk last.
        assert [s.req_id for s in out.step.requests] == [r.worker_id for r in decoders + [long_prompt]]
        assert all(len(s.token_ids) == 1 and s.do_sample for s in out.step.requests[:16])
        assert [request.num_output_tokens for request in decoders] == [step] * 16
    assert long_prompt.num_output_tokens == 1


def test_prompt_larger_than_the_remaining_budget_waits_with_chunked_prefill_off() -> None:
    scheduler = make_scheduler(num_blocks=16, budget=64, max_model_len=64, chunked=False)
    decoder = make_request("decoder", [1] * 10, max_tokens=5)
    scheduler.add_request(decoder)
    run_step(scheduler)
    whole = make_request("whole", [2] * 64, max_tokens=1)
    scheduler.add_request(whole)
    # 63 tokens are left after the decode: the 64-token prompt waits as long as decoder runs.
    for _ in range(4):
        out = run_step(scheduler)
        assert out.scheduled == [decoder]
    assert decoder.is_finished
    out = run_step(scheduler)
    assert out.scheduled == [whole]
    assert chunk_of(out, whole).token_ids == whole.prompt_token_ids


def test_prompt_larger_than_the_remaining_budget_is_chunked_with_chunked_prefill_on() -> None:
    scheduler = make_scheduler(num_blocks=16, budget=64, max_model_len=64, chunked=True)
    decoder = make_request("decoder", [1] * 10, max_tokens=5)
    scheduler.add_request(decoder)
    run_step(scheduler)
    whole = make_request("whole", [2] * 64, max_tokens=1)
    scheduler.add_request(whole)
    out = run_step(scheduler)
    assert out.scheduled == [decoder, whole]
    assert len(chunk_of(out, whole).token_ids) == 63 and not chunk_of(out, whole).do_sample


def test_running_requests_never_exceed_max_num_seqs() -> None:
    scheduler = make_scheduler(num_blocks=64, max_num_seqs=3)
    requests = [make_request(f"r{i}", [i + 1] * 5, max_tokens=2 + i) for i in range(5)]
    for request in requests:
        scheduler.add_request(request)
    first_steps = {}
    for index, out in enumerate(run_to_completion(scheduler)):
        assert len(out.scheduled) <= 3 and scheduler.num_running <= 3
        for request in out.scheduled:
            first_steps.setdefault(request.request_id, index)
    # r0 finishes at step 1 (2 tokens), r1 at step 2: r3 and r4 start in the steps after.
    assert first_steps == {"r0": 0, "r1": 0, "r2": 0, "r3": 2, "r4": 3}


def test_waiting_request_skips_its_cached_prefix() -> None:
    scheduler = make_scheduler(num_blocks=16)
    first = make_request("first", list(range(40)), max_tokens=1)
    scheduler.add_request(first)
    run_to_completion(scheduler)
    second = make_request("second", list(range(32)) + [90, 91, 92, 93, 94])
    scheduler.add_request(second)
    scheduled = chunk_of(run_step(scheduler), second)
    # Two full 16-token blocks of the 40-token prompt are cached.
    assert second.num_cached_tokens == 32
    assert (scheduled.num_computed_tokens, scheduled.token_ids) == (32, [90, 91, 92, 93, 94])
    assert scheduler.kv_cache_manager.get_block_ids("second")[:2] == [0, 1]


# ---------------------------------------------------------------- preemption
def two_requests_filling_the_pool(caching: bool = True, max_num_seqs: int = 2, c_arrives_first: bool = True):
    """Blocks of 4 tokens, 6 blocks. a and b (8-token prompts) each need a fourth block at
    their 13th token, in step 6: the pool has 6 blocks, so b (the latest) is preempted.
    c (4 tokens) arrives first but waits (max_num_seqs is 2), or arrives after step 5."""
    scheduler = make_scheduler(num_blocks=6, block_size=4, budget=64, max_num_seqs=max_num_seqs,
                               max_model_len=24, caching=caching)
    a = make_request("a", list(range(1, 9)), max_tokens=6)
    b = make_request("b", list(range(11, 19)), max_tokens=10)
    c = make_request("c", [21, 22, 23, 24], max_tokens=2)
    for request in (a, b, c) if c_arrives_first else (a, b):
        scheduler.add_request(request)
    for _ in range(5):
        out = run_step(scheduler)
        assert out.scheduled == [a, b] and out.num_preempted == 0
    assert scheduler.kv_cache_manager.get_num_free_blocks() == 0
    if not c_arrives_first:
        scheduler.add_request(c)
    return scheduler, a, b, c


def test_sampling_params_travel_only_in_the_first_step_after_each_admission() -> None:
    # Workers keep them (step.py); a preempted request is readmitted with them again.
    scheduler, a, b, c = two_requests_filling_the_pool()
    sent: dict[str, int] = {}
    for out in run_to_completion(scheduler):
        for request, scheduled in zip(out.scheduled, out.step.requests, strict=True):
            if scheduled.sampling_params is not None:
                assert scheduled.sampling_params is request.sampling_params and scheduled.resumed
                sent[request.request_id] = sent.get(request.request_id, 0) + 1
            else:
                assert not scheduled.resumed
    # Steps 1-5 (in two_requests_filling_the_pool) sent a's and b's; since then b, the
    # only one preempted, was readmitted once per preemption and c admitted once.
    assert scheduler.num_preemptions >= 1
    assert sent == {"b": scheduler.num_preemptions, "c": 1}


def test_latest_admitted_request_is_preempted_when_blocks_run_out() -> None:
    scheduler, a, b, c = two_requests_filling_the_pool()
    out = run_step(scheduler)
    assert out.scheduled == [a] and out.num_preempted == 1
    assert b.status == RequestStatus.PREEMPTED and b.num_computed_tokens == 0
    assert scheduler.kv_cache_manager.get_block_ids("b") == []
    assert scheduler.num_preemptions == 1


def test_the_step_after_a_preemption_names_the_preempted_request_to_the_workers_once() -> None:
    # Workers give back what a request holds only while it runs (a penalty state row).
    scheduler, a, b, c = two_requests_filling_the_pool()
    out = run_step(scheduler)
    assert out.num_preempted == 1 and out.step.preempted_req_ids == [b.worker_id]
    reported = [out.step.preempted_req_ids for out in run_to_completion(scheduler)]
    assert sum(reported, []).count(b.worker_id) == scheduler.num_preemptions - 1
    assert set(sum(reported, [])) <= {b.worker_id}


def test_preempted_request_is_readmitted_ahead_of_earlier_waiting_requests() -> None:
    scheduler, a, b, c = two_requests_filling_the_pool()
    run_step(scheduler)
    assert list(scheduler.waiting) == [b, c]
    out = run_step(scheduler)  # a finished at step 6
    assert out.scheduled == [b, c]


def test_preempted_request_resumes_from_its_still_cached_blocks() -> None:
    scheduler, a, b, c = two_requests_filling_the_pool()
    run_step(scheduler)
    # b's 12 computed tokens were 3 full cached blocks; a's fresh block evicted b's last
    # (its tail goes first): blocks 0 and 1 of b, 8 tokens, are still cached.
    scheduled = chunk_of(run_step(scheduler), b)
    assert b.num_cached_tokens == 8
    assert scheduled.resumed and scheduled.num_computed_tokens == 8
    assert scheduled.token_ids == b.all_token_ids[8:13]
    run_to_completion(scheduler)
    assert b.output_token_ids == reference_outputs(b.prompt_token_ids, 10)
    assert_all_blocks_free(scheduler)


def test_preempted_request_recomputes_everything_with_caching_off() -> None:
    scheduler, a, b, c = two_requests_filling_the_pool(caching=False)
    run_step(scheduler)
    scheduled = chunk_of(run_step(scheduler), b)
    assert b.num_cached_tokens == 0
    assert scheduled.resumed and scheduled.num_computed_tokens == 0
    assert scheduled.token_ids == b.all_token_ids[:13] and len(b.all_token_ids) == 14
    run_to_completion(scheduler)
    assert b.output_token_ids == reference_outputs(b.prompt_token_ids, 10)


def test_no_waiting_request_is_admitted_in_a_step_that_preempted() -> None:
    scheduler, a, b, c = two_requests_filling_the_pool(max_num_seqs=3, c_arrives_first=False)
    # In step 6 b's preemption frees 3 blocks and a takes 1; c (1 block) still waits.
    out = run_step(scheduler)
    assert out.scheduled == [a] and out.num_preempted == 1
    assert c.status == RequestStatus.WAITING


@pytest.mark.parametrize("num_blocks, block_size", [(300, 16), (16, 2)], ids=["ample-pool", "scarce-pool"])
def test_many_one_token_requests_never_stall(num_blocks: int, block_size: int) -> None:
    # n > 1 fans out into child requests before the scheduler, so a large fan-out reaches
    # it as many small requests: each step must schedule some until all are done.
    scheduler = make_scheduler(num_blocks=num_blocks, block_size=block_size, budget=2048, max_num_seqs=256,
                               max_model_len=min(2048, num_blocks * block_size))
    requests = [make_request(f"r{i}", [i % VOCAB], max_tokens=4) for i in range(3000)]
    for request in requests:
        scheduler.add_request(request)
    outputs = run_to_completion(scheduler)
    assert all(not out.is_empty() for out in outputs)
    assert all(r.output_token_ids == reference_outputs(r.prompt_token_ids, 4) for r in requests)
    if num_blocks == 300:
        # 256 at a time, 4 steps each (prompt + 3 decodes) for 12 batches (11 full, 1 of 184).
        assert len(outputs) == 12 * 4 and scheduler.num_preemptions == 0
    else:
        assert scheduler.num_preemptions > 0
    assert_all_blocks_free(scheduler)


# --------------------------------------------------------------------- aborts
def test_abort_of_a_running_request_frees_its_blocks_at_once() -> None:
    scheduler = make_scheduler(num_blocks=8, block_size=4, max_model_len=32)
    a = make_request("a", list(range(10)))
    scheduler.add_request(a)
    run_step(scheduler)
    assert scheduler.kv_cache_manager.get_num_free_blocks() == 5
    assert scheduler.finish_requests("a", RequestStatus.FINISHED_ABORTED) == [a]
    assert a.status == RequestStatus.FINISHED_ABORTED
    assert scheduler.running == [] and not scheduler.has_unfinished_requests()
    assert_all_blocks_free(scheduler)


def test_abort_of_a_waiting_request_removes_it_before_it_is_scheduled() -> None:
    scheduler = make_scheduler(num_blocks=8, block_size=4, max_model_len=32, max_num_seqs=1)
    a, b = make_request("a", [1] * 5, max_tokens=2), make_request("b", [2] * 5)
    scheduler.add_request(a)
    scheduler.add_request(b)
    run_step(scheduler)
    assert list(scheduler.waiting) == [b]
    assert scheduler.finish_requests(["b"], RequestStatus.FINISHED_ABORTED) == [b]
    assert b.status == RequestStatus.FINISHED_ABORTED and list(scheduler.waiting) == []
    outputs = run_to_completion(scheduler)
    assert all(out.scheduled == [a] for out in outputs)
    assert_all_blocks_free(scheduler)


def test_abort_of_a_preempted_request_leaves_no_blocks_behind() -> None:
    scheduler, a, b, c = two_requests_filling_the_pool()
    run_step(scheduler)
    scheduler.finish_requests(["b", "c"], RequestStatus.FINISHED_ABORTED)
    assert list(scheduler.waiting) == []
    run_to_completion(scheduler)
    assert_all_blocks_free(scheduler)


def test_abort_of_unknown_or_finished_requests_does_nothing() -> None:
    scheduler = make_scheduler(num_blocks=8, block_size=4, max_model_len=32)
    a = make_request("a", [1] * 5, max_tokens=1)
    scheduler.add_request(a)
    run_step(scheduler)
    assert a.status == RequestStatus.FINISHED_LENGTH_CAPPED
    assert scheduler.finish_requests(["a", "nope"], RequestStatus.FINISHED_ABORTED) == []
    assert a.status == RequestStatus.FINISHED_LENGTH_CAPPED


# ------------------------------------------------------ finished ids to workers
def test_finished_worker_ids_reach_the_next_step_exactly_once() -> None:
    scheduler = make_scheduler(num_blocks=16, block_size=4, max_model_len=64)
    a, b, c = (make_request(n, [i] * 5, max_tokens=t) for i, (n, t) in enumerate([("a", 1), ("b", 4), ("c", 4)]))
    for request in (a, b, c):
        scheduler.add_request(request)
    assert run_step(scheduler).step.finished_req_ids == []  # a finishes here
    scheduler.finish_requests("c", RequestStatus.FINISHED_ABORTED)
    assert sorted(run_step(scheduler).step.finished_req_ids) == sorted([a.worker_id, c.worker_id])
    assert run_step(scheduler).step.finished_req_ids == []


def test_finished_worker_ids_wait_through_empty_steps() -> None:
    scheduler = make_scheduler(num_blocks=16, block_size=4, max_model_len=64)
    a = make_request("a", [1] * 5, max_tokens=1)
    scheduler.add_request(a)
    run_step(scheduler)
    empty = scheduler.schedule()
    assert empty.is_empty() and empty.step.finished_req_ids == []
    scheduler.add_request(make_request("b", [2] * 5))
    assert run_step(scheduler).step.finished_req_ids == [a.worker_id]


def test_request_never_scheduled_is_not_reported_finished_to_workers() -> None:
    scheduler = make_scheduler(num_blocks=16, block_size=4, max_model_len=64, max_num_seqs=1)
    a, b = make_request("a", [1] * 5), make_request("b", [2] * 5)
    scheduler.add_request(a)
    scheduler.add_request(b)
    run_step(scheduler)
    scheduler.finish_requests("b", RequestStatus.FINISHED_ABORTED)
    assert run_step(scheduler).step.finished_req_ids == []


# ------------------------------------------------------------ prompt logprobs
def prompt_logprob_positions(outputs: list[SchedulerOutput], request: Request) -> list[int]:
    """Prompt positions whose logprobs were asked for, in order, checked against their tokens."""
    positions = []
    for out in outputs:
        scheduled = chunk_of(out, request)
        if scheduled is None or scheduled.prompt_logprobs_targets is None:
            continue
        start = scheduled.prompt_logprobs_start
        # Row p scores token p + 1, and the rows lie inside this chunk.
        assert scheduled.num_computed_tokens <= start
        assert start + len(scheduled.prompt_logprobs_targets) <= scheduled.num_computed_tokens + len(scheduled.token_ids)
        for offset, target in enumerate(scheduled.prompt_logprobs_targets):
            assert target == request.prompt_token_ids[start + offset + 1]
            positions.append(start + offset + 1)
    return positions


def test_prompt_logprob_targets_cover_every_prompt_position_once_across_chunks() -> None:
    scheduler = make_scheduler(num_blocks=16, block_size=4, budget=16, max_model_len=64)
    request = make_request("p", list(range(100, 150)), max_tokens=2, prompt_logprobs=1)
    scheduler.add_request(request)
    outputs = run_to_completion(scheduler)
    assert sum(chunk_of(out, request) is not None and not chunk_of(out, request).do_sample for out in outputs) == 3
    assert prompt_logprob_positions(outputs, request) == list(range(1, 50))


def test_prompt_logprob_targets_cover_every_prompt_position_once_across_a_preemption() -> None:
    # Blocks of 4, 6 blocks, budget 8: the decoder (admitted first) grows into the blocks of
    # the 20-token prompt while it is being prefilled, and preempts it, more than once.
    scheduler = make_scheduler(num_blocks=6, block_size=4, budget=8, max_model_len=24)
    decoder = make_request("decoder", [1, 2, 3, 4], max_tokens=16)
    prompt = make_request("p", list(range(100, 120)), max_tokens=2, prompt_logprobs=1)
    scheduler.add_request(decoder)
    scheduler.add_request(prompt)
    outputs = []
    preempted_mid_prefill = 0
    while scheduler.has_unfinished_requests():
        outputs.append(run_step(scheduler))
        if prompt.status == RequestStatus.PREEMPTED and 0 < prompt.num_prompt_logprobs_done < 19:
            preempted_mid_prefill += outputs[-1].num_preempted
    assert preempted_mid_prefill >= 1
    assert prompt_logprob_positions(outputs, prompt) == list(range(1, 20))
    assert prompt.output_token_ids == reference_outputs(prompt.prompt_token_ids, 2)
    assert decoder.output_token_ids == reference_outputs(decoder.prompt_token_ids, 16)


def test_prefix_cache_stats_count_each_admission_once_however_long_it_waited() -> None:
    # Two 40-token prompts with the same first 16 tokens, in a pool of 4 blocks of 16: the
    # first takes 3 blocks, so the second (one block found in the cache, two new) waits
    # until the first is done, looking up its prefix at every step; only its admission
    # counts.
    scheduler = make_scheduler(num_blocks=4, max_model_len=64)
    first = make_request("first", list(range(40)), max_tokens=8)
    second = make_request("second", list(range(16)) + list(range(100, 124)), max_tokens=2)
    scheduler.add_request(first)
    scheduler.add_request(second)
    outputs = run_to_completion(scheduler)
    admitted_at = next(i for i, out in enumerate(outputs) if second in out.scheduled)
    assert admitted_at >= 8  # it waited while the first decoded
    kv = scheduler.kv_cache_manager
    assert (kv.prefix_cache_queries, kv.prefix_cache_hits) == (40 + 40, 16)
