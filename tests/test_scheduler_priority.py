"""The Scheduler under vLLM's "priority" policy, driven step by step with the stand-in model
of test_scheduler.py: admission in (priority, arrival) order, the running request of the
worst (priority, arrival) preempted when blocks run out (taken back out of the step if the
step had scheduled it), preempted requests back in their place in the queue, every block
back in the pool at the end, and every request's tokens those of the stand-in reference."""

from __future__ import annotations

import random

import pytest

from raylm.engine.config import CacheConfig, SchedulerConfig
from raylm.engine.request import Request, RequestStatus
from raylm.engine.sampling_params import SamplingParams
from raylm.engine.scheduler import Scheduler
from test_scheduler import assert_all_blocks_free, reference_outputs, run_step, run_to_completion


def make_scheduler(num_blocks: int, block_size: int = 4, max_model_len: int | None = None, max_num_seqs: int = 256,
                   budget: int = 2048, policy: str = "priority", chunked: bool = True,
                   caching: bool = True) -> Scheduler:
    max_model_len = max_model_len or num_blocks * block_size
    cache_config = CacheConfig(block_size=block_size, enable_prefix_caching=caching)
    cache_config.num_gpu_blocks = num_blocks
    return Scheduler(SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget,
                                     max_model_len=max_model_len, enable_chunked_prefill=chunked, policy=policy),
                     cache_config)


def make_request(request_id: str, prompt: list[int], priority: int = 0, arrival_time: float = 0.0,
                 max_tokens: int = 16) -> Request:
    return Request(request_id, list(prompt), SamplingParams(max_tokens=max_tokens), arrival_time=arrival_time,
                   priority=priority)


def admission_order(scheduler: Scheduler, requests: list[Request]) -> list[str]:
    """The ids of the requests in the order the scheduler first gave them a step."""
    order: list[str] = []
    while scheduler.has_unfinished_requests():
        for request in run_step(scheduler).scheduled:
            if request.request_id not in order:
                order.append(request.request_id)
    for request in requests:
        assert request.output_token_ids == reference_outputs(request.prompt_token_ids,
                                                             request.sampling_params.max_tokens)
    assert_all_blocks_free(scheduler)
    return order


# ------------------------------------------------------------------ admission
def test_waiting_requests_are_admitted_lowest_priority_first_ties_by_arrival() -> None:
    # One request runs at a time: each is admitted when the one before finishes.
    scheduler = make_scheduler(num_blocks=16, max_num_seqs=1)
    specs = [("a", 3, 0.0), ("b", 1, 1.0), ("c", 2, 2.0), ("d", 1, 3.0), ("e", -5, 4.0)]
    requests = [make_request(name, [i + 1] * 5, priority, arrival, max_tokens=3)
                for i, (name, priority, arrival) in enumerate(specs)]
    for request in requests:
        scheduler.add_request(request)
    # Sorted by hand on (priority, arrival): e (-5), b (1, t=1), d (1, t=3), c (2), a (3).
    assert admission_order(scheduler, requests) == ["e", "b", "d", "c", "a"]


def test_equal_priority_and_arrival_keep_the_order_they_were_added_in() -> None:
    scheduler = make_scheduler(num_blocks=16, max_num_seqs=1)
    requests = [make_request(name, [7] * 4, priority=0, arrival_time=1.0, max_tokens=2) for name in "xyzw"]
    late_but_earlier = make_request("early", [8] * 4, priority=0, arrival_time=0.5, max_tokens=2)
    for request in requests + [late_but_earlier]:
        scheduler.add_request(request)
    # Arrival time first (the one added last arrived first), then the order of add_request.
    assert admission_order(scheduler, requests + [late_but_earlier]) == ["early", "x", "y", "z", "w"]


def test_a_better_priority_request_added_later_is_admitted_before_those_waiting() -> None:
    scheduler = make_scheduler(num_blocks=16, max_num_seqs=2)
    running = [make_request(f"run{i}", [i + 1] * 4, priority=0, arrival_time=i, max_tokens=4) for i in range(2)]
    waiting = [make_request(f"wait{i}", [i + 5] * 4, priority=0, arrival_time=2 + i, max_tokens=4) for i in range(3)]
    for request in running + waiting:
        scheduler.add_request(request)
    run_step(scheduler)  # run0 and run1 take the two seats
    urgent = make_request("urgent", [9] * 4, priority=-1, arrival_time=10.0, max_tokens=4)
    scheduler.add_request(urgent)
    assert [r.request_id for r in scheduler.waiting] == ["urgent", "wait0", "wait1", "wait2"]
    order = admission_order(scheduler, running + waiting + [urgent])
    assert order == ["run0", "run1", "urgent", "wait0", "wait1", "wait2"]


# ----------------------------------------------------------------- preemption
def running_a_b_c_then_d_waits(policy: str) -> tuple[Scheduler, dict[str, Request]]:
    """Blocks of 4 tokens, a pool of 7 blocks, at most 3 running. a (priority 2), b (0) and c
    (1) are added one step apart, so they run in the order a, b, c; d (priority 1) waits for
    a seat. Each prompt is 4 tokens (one block); a request needs a new block at positions
    4 and 8, so blocks held after each step (a, b, c): step 1 (1, 0, 0), step 2 (2, 1, 0),
    step 3 (2, 2, 1), step 4 (2, 2, 2), steps 5-6 (3, 2, 2): 7, the whole pool. In step 7
    b reaches position 8 and finds no block."""
    scheduler = make_scheduler(num_blocks=7, max_num_seqs=3, policy=policy)
    a, b, c, d = (make_request(name, [i + 1] * 4, priority=priority if policy == "priority" else 0,
                               arrival_time=i, max_tokens=12)
                  for i, (name, priority) in enumerate([("a", 2), ("b", 0), ("c", 1), ("d", 1)]))
    for request in (a, b, c, d):
        scheduler.add_request(request)
        assert run_step(scheduler).num_preempted == 0
    for _ in range(2):
        assert run_step(scheduler).num_preempted == 0
    kv = scheduler.kv_cache_manager
    assert [len(kv.get_block_ids(r.request_id)) for r in (a, b, c)] == [3, 2, 2]
    assert kv.get_num_free_blocks() == 0 and list(scheduler.waiting) == [d]
    return scheduler, {"a": a, "b": b, "c": c, "d": d}


def test_the_worst_priority_running_request_is_preempted_even_after_the_step_scheduled_it() -> None:
    scheduler, r = running_a_b_c_then_d_waits("priority")
    out = run_step(scheduler)
    # a (priority 2) goes, though it was admitted first and this step had scheduled its
    # decode already: that decode is taken back out of the step.
    assert out.num_preempted == 1 and r["a"].status == RequestStatus.PREEMPTED
    assert out.scheduled == [r["b"], r["c"]]
    assert [s.req_id for s in out.step.requests] == [r["b"].worker_id, r["c"].worker_id]
    assert out.num_batched_tokens == 2
    assert scheduler.running == [r["b"], r["c"]]
    # a goes back to its place in the queue, behind d (priority 1), not to the front.
    assert list(scheduler.waiting) == [r["d"], r["a"]]
    # The workers drop what they hold of a with this very step, which no longer computes it.
    assert out.step.preempted_req_ids == [r["a"].worker_id]
    run_to_completion(scheduler)
    for request in r.values():
        assert request.output_token_ids == reference_outputs(request.prompt_token_ids, 12)
    assert_all_blocks_free(scheduler)


def test_fcfs_preempts_the_latest_admitted_in_the_same_situation() -> None:
    scheduler, r = running_a_b_c_then_d_waits("fcfs")
    out = run_step(scheduler)
    assert out.num_preempted == 1 and r["c"].status == RequestStatus.PREEMPTED
    assert out.scheduled == [r["a"], r["b"]]
    assert list(scheduler.waiting) == [r["c"], r["d"]]
    run_to_completion(scheduler)
    assert_all_blocks_free(scheduler)


def test_a_running_request_of_the_worst_priority_preempts_itself() -> None:
    # As above, but b holds the worst priority: it gives its own blocks back.
    scheduler = make_scheduler(num_blocks=7, max_num_seqs=3)
    a, b, c = (make_request(name, [i + 1] * 4, priority, arrival_time=i, max_tokens=12)
               for i, (name, priority) in enumerate([("a", 0), ("b", 5), ("c", 1)]))
    for request in (a, b, c):
        scheduler.add_request(request)
        run_step(scheduler)
    for _ in range(3):
        run_step(scheduler)
    out = run_step(scheduler)
    assert out.num_preempted == 1 and b.status == RequestStatus.PREEMPTED
    # b was the one to schedule when the pool ran dry: the step holds a, and c is not reached.
    assert out.scheduled == [a]
    run_to_completion(scheduler)
    for request in (a, b, c):
        assert request.output_token_ids == reference_outputs(request.prompt_token_ids, 12)
    assert_all_blocks_free(scheduler)


def test_equal_priorities_preempt_the_latest_arrival_as_fcfs_does() -> None:
    outcomes = []
    for policy in ("fcfs", "priority"):
        scheduler = make_scheduler(num_blocks=6, max_num_seqs=8, policy=policy)
        requests = [make_request(f"r{i}", [i + 1] * 4, arrival_time=i, max_tokens=16) for i in range(4)]
        for request in requests:
            scheduler.add_request(request)
        steps = run_to_completion(scheduler)
        outcomes.append([[r.request_id for r in out.scheduled] for out in steps])
        assert_all_blocks_free(scheduler)
    assert outcomes[0] == outcomes[1]


# ---------------------------------------------------------------------- aborts
def test_aborts_keep_the_queue_ordered_and_leave_no_block_behind() -> None:
    scheduler, r = running_a_b_c_then_d_waits("priority")
    run_step(scheduler)  # a preempted: waiting d, a
    late = make_request("late", [9] * 4, priority=1, arrival_time=0.5)  # between a and d on arrival
    scheduler.add_request(late)
    assert [q.request_id for q in scheduler.waiting] == ["late", "d", "a"]
    scheduler.finish_requests(["d", "b"], RequestStatus.FINISHED_ABORTED)  # one waiting, one running
    assert [q.request_id for q in scheduler.waiting] == ["late", "a"]
    scheduler.finish_requests("a", RequestStatus.FINISHED_ABORTED)  # preempted
    run_to_completion(scheduler)
    assert r["c"].output_token_ids == reference_outputs(r["c"].prompt_token_ids, 12)
    assert_all_blocks_free(scheduler)


# ----------------------------------------------------------------- a workload
@pytest.mark.parametrize("chunked,caching", [(True, True), (False, True), (True, False)],
                         ids=["chunked-cached", "unchunked", "uncached"])
def test_random_priorities_under_pressure_give_reference_tokens_and_free_every_block(chunked: bool,
                                                                                     caching: bool) -> None:
    rng = random.Random(0)
    scheduler = make_scheduler(num_blocks=12, block_size=4, max_model_len=48, budget=48, chunked=chunked,
                               caching=caching)
    requests = []
    for i in range(24):
        prompt = [rng.randrange(1, 50) for _ in range(rng.randint(1, 20))]
        request = make_request(f"r{i}", prompt, priority=rng.randint(-2, 2), arrival_time=float(i),
                               max_tokens=rng.randint(1, 48 - len(prompt)))
        requests.append(request)
        scheduler.add_request(request)
        if i % 3 == 2:
            run_step(scheduler)
    steps = run_to_completion(scheduler)
    assert sum(out.num_preempted for out in steps) > 0, "the pool was meant to run out"
    for request in requests:
        assert request.output_token_ids == reference_outputs(request.prompt_token_ids,
                                                             request.sampling_params.max_tokens)
    assert_all_blocks_free(scheduler)


def test_an_unknown_policy_is_refused_naming_the_choices() -> None:
    with pytest.raises(ValueError, match="scheduling_policy must be one of fcfs, priority, got 'lifo'"):
        SchedulerConfig(policy="lifo")
