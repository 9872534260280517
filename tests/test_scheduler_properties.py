"""Random traffic through the real Scheduler and KVCacheManager with a small pool.

Requests share prefixes (so the prefix cache hits, on running and on freed blocks), the
pool is small (so requests are preempted and resumed from what is still cached), and
requests are aborted at random. The machine stands in for the workers: it writes each
scheduled token's KV into a simulated cache through the block table, and checks that every
scheduled request then reads back the KV of exactly its own tokens. Its "model" samples a
deterministic function of the prefix read from that cache, so each request's outputs must
equal `reference_outputs`: nothing lost, duplicated or read from another request's KV.

Half the runs pipeline the steps as async scheduling does: the next step is scheduled and
run by the workers before the driver collects the previous one, so decodes carry
placeholders that the stand-in workers fill with the tokens they sampled.

Some runs model a sliding window on every layer: the KV manager then frees the blocks a
request's window has passed, and the stand-in workers read each chunk's keys from its first
token's window only (what the kernels read), which must still be exactly its own.
"""

from __future__ import annotations

from collections import deque

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from raylm.engine.config import CacheConfig, SchedulerConfig
from raylm.engine.request import Request, RequestStatus
from raylm.engine.sampling_params import SamplingParams
from raylm.engine.scheduler import Scheduler, SchedulerOutput
from raylm.engine.step import PLACEHOLDER_TOKEN_ID

BLOCK_SIZE = 4
VOCAB = 5
# Distinct tokens (>= VOCAB) so prefixes only match on purpose; the second extends the first.
PREFIXES = ([], [10, 11, 12, 13, 14, 15, 16, 17], [10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22],
            [30, 31, 32, 33, 34, 35, 36, 37, 38, 39, 40, 41])


def model_token(prefix: tuple[int, ...]) -> int:
    """The stand-in model: the next token is a function of the whole prefix. A small vocab
    makes equal prompts produce equal outputs, so blocks of outputs are shared too."""
    return (sum(prefix) * 31 + len(prefix) * 7 + prefix[-1]) % VOCAB


def reference_outputs(prompt: list[int], num_outputs: int) -> list[int]:
    tokens = list(prompt)
    for _ in range(num_outputs):
        tokens.append(model_token(tuple(tokens)))
    return tokens[len(prompt):]


def expected_num_outputs(request: Request, max_model_len: int) -> int:
    # At least one token is sampled; then max_tokens or max_model_len ends the request.
    return max(1, min(request.sampling_params.max_tokens, max_model_len - request.num_prompt_tokens))


class SchedulerMachine(RuleBasedStateMachine):
    @initialize(num_blocks=st.integers(8, 40), budget=st.integers(8, 64), max_num_seqs=st.integers(1, 8),
                chunked=st.booleans(), caching=st.booleans(), pipelined=st.booleans(),
                sliding_window=st.sampled_from([None, None, 1, 3, 6, 9]), data=st.data())
    def configure(self, num_blocks: int, budget: int, max_num_seqs: int, chunked: bool, caching: bool,
                  pipelined: bool, sliding_window: int | None, data: st.DataObject) -> None:
        # The engine makes the pool hold max_model_len tokens; without chunking a whole
        # prompt must fit one step's budget.
        max_model_len = data.draw(st.integers(8, num_blocks * BLOCK_SIZE), label="max_model_len")
        if not chunked:
            max_model_len = min(max_model_len, budget)
        self.config = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget,
                                      max_model_len=max_model_len, enable_chunked_prefill=chunked)
        cache_config = CacheConfig(block_size=BLOCK_SIZE, enable_prefix_caching=caching, sliding_window=sliding_window)
        self.sliding_window = sliding_window
        cache_config.num_gpu_blocks = num_blocks
        self.scheduler = Scheduler(self.config, cache_config)
        self.num_blocks = num_blocks
        self.pipelined = pipelined
        # Steps the workers ran whose tokens the driver has not collected: (output, sampled).
        self.in_flight: deque[tuple[SchedulerOutput, dict[int, int]]] = deque()
        # What the workers know of each request's tokens: the driver's plus those in flight.
        self.worker_tokens: dict[int, list[int]] = {}
        self.all_requests: list[Request] = []
        # The simulated KV cache: (block id, offset) -> the token prefix whose last KV it holds.
        self.kv_slots: dict[tuple[int, int], tuple[int, ...]] = {}
        # Worker state: request worker id -> position its last step ended at.
        self.worker_positions: dict[int, int] = {}
        # Worker ids of requests that ended while the workers held state for them.
        self.unreported_finished: set[int] = set()
        self.reported_finished: set[int] = set()
        # Worker id -> prompt positions whose logprobs were asked for, in order.
        self.prompt_logprob_positions: dict[int, list[int]] = {}

    @property
    def kv(self):
        return self.scheduler.kv_cache_manager

    def live_requests(self) -> list[Request]:
        return list(self.scheduler.requests.values())

    # ------------------------------------------------------------------- rules
    @rule(prefix=st.sampled_from(PREFIXES), suffix=st.lists(st.integers(0, VOCAB - 1), max_size=24),
          max_tokens=st.integers(1, 24), prompt_logprobs=st.sampled_from([None, None, None, 1]),
          copies=st.integers(1, 3))
    def add(self, prefix: list[int], suffix: list[int], max_tokens: int, prompt_logprobs: int | None,
            copies: int) -> None:
        """Adds `copies` requests with one prompt (as the children of an n > 1 request)."""
        prompt = (prefix + suffix)[:self.config.max_model_len] or [0]
        for _ in range(copies):
            self._add(prompt, SamplingParams(max_tokens=max_tokens, prompt_logprobs=prompt_logprobs))

    def _add(self, prompt: list[int], params: SamplingParams) -> None:
        index = len(self.all_requests)
        request = Request(f"r{index}", list(prompt), params, arrival_time=float(index))
        self.all_requests.append(request)
        self.scheduler.add_request(request)

    @precondition(lambda self: self.all_requests)
    @rule(data=st.data(), suffix=st.lists(st.integers(0, VOCAB - 1), max_size=8), max_tokens=st.integers(1, 24))
    def add_follow_up(self, data: st.DataObject, suffix: list[int], max_tokens: int) -> None:
        """A next chat turn: an earlier request's tokens so far (running, finished or
        aborted), then more; its prompt extends one that is cached or being computed."""
        earlier = data.draw(st.sampled_from(self.all_requests))
        prompt = (earlier.all_token_ids + suffix)[:self.config.max_model_len]
        self._add(prompt, SamplingParams(max_tokens=max_tokens))

    @rule(num_steps=st.integers(1, 4))
    def step(self, num_steps: int) -> None:
        for _ in range(num_steps):
            self._step()

    @precondition(lambda self: self.scheduler.has_unfinished_requests())
    @rule(data=st.data())
    def abort(self, data: st.DataObject) -> None:
        request = data.draw(st.sampled_from(sorted(self.live_requests(), key=lambda r: r.worker_id)))
        self._abort(request)

    @precondition(lambda self: any(r.num_computed_tokens < r.num_prompt_tokens for r in self.scheduler.running))
    @rule(data=st.data())
    def abort_mid_prefill(self, data: st.DataObject) -> None:
        """Aborts a request whose prompt is partly computed: a block its tokens fill but
        whose KV no step has written yet must not stay behind in the prefix cache."""
        candidates = [r for r in self.scheduler.running if r.num_computed_tokens < r.num_prompt_tokens]
        self._abort(data.draw(st.sampled_from(candidates)))

    def _abort(self, request: Request) -> None:
        assert self.scheduler.finish_requests(request.request_id, RequestStatus.FINISHED_ABORTED) == [request]
        assert request.status == RequestStatus.FINISHED_ABORTED
        assert self.kv.get_block_ids(request.request_id) == []
        self._ended(request)

    # ----------------------------------------------------------- one engine step
    def _step(self) -> None:
        """One engine step: schedule and run a batch and collect one (pipelined: collect the
        previous batch after the next one started, as EngineCore with async scheduling)."""
        started = self._start_step()
        if not self.pipelined or len(self.in_flight) > 1 or not started:
            self._collect_step()

    def _start_step(self) -> bool:
        had_requests = self.scheduler.has_unfinished_requests()
        out = self.scheduler.schedule()
        if not self.in_flight:
            assert out.is_empty() != had_requests, "a step with live requests scheduled nothing"
        self._check_finished_ids(out.step.finished_req_ids, out.is_empty())
        assert out.num_batched_tokens == sum(len(s.token_ids) for s in out.step.requests)
        assert out.num_batched_tokens <= self.config.max_num_batched_tokens
        assert len(out.step.requests) <= self.config.max_num_seqs
        assert len({s.req_id for s in out.step.requests}) == len(out.step.requests)
        if out.is_empty():
            return False
        self._run_on_workers(out)
        return True

    def _run_on_workers(self, out: SchedulerOutput) -> None:
        """The stand-in workers: fill placeholders, write and read KV, sample."""
        for request, scheduled in zip(out.scheduled, out.step.requests, strict=True):
            if scheduled.resumed:
                self.worker_tokens[request.worker_id] = []
            # The request's tokens as the workers know them: the driver's, then those in flight.
            tokens = self.worker_tokens[request.worker_id]
            known = request.all_token_ids + tokens[request.num_tokens:]
            end = scheduled.num_computed_tokens + len(scheduled.token_ids)
            if scheduled.token_ids[-1] == PLACEHOLDER_TOKEN_ID:
                assert end == len(known) > request.num_tokens, "a placeholder for no token in flight"
                scheduled.token_ids[-1] = known[end - 1]
            self._check_chunk(request, scheduled, known)
            tokens[:] = known[:end]
        written: set[tuple[int, int]] = set()
        for request, scheduled in zip(out.scheduled, out.step.requests, strict=True):
            tokens = self.worker_tokens[request.worker_id]
            for offset, _ in enumerate(scheduled.token_ids):
                position = scheduled.num_computed_tokens + offset
                slot = (scheduled.block_table[position // BLOCK_SIZE], position % BLOCK_SIZE)
                assert slot not in written, f"two tokens of one step write KV slot {slot}"
                written.add(slot)
                self.kv_slots[slot] = tuple(tokens[:position + 1])
        # Every layer writes the step's KV before it attends: read after all the writes.
        sampled: dict[int, int] = {}
        for request, scheduled in zip(out.scheduled, out.step.requests, strict=True):
            tokens = self.worker_tokens[request.worker_id]
            end = scheduled.num_computed_tokens + len(scheduled.token_ids)
            # The kernels read from the window of the chunk's first token on.
            first_read = max(0, scheduled.num_computed_tokens - (self.sliding_window or end) + 1)
            for position in range(first_read, end):
                slot = (scheduled.block_table[position // BLOCK_SIZE], position % BLOCK_SIZE)
                assert self.kv_slots.get(slot) == tuple(tokens[:position + 1]), (
                    f"{request} reads position {position} from block {slot[0]}, which holds other KV")
            self.worker_positions[request.worker_id] = end
            if scheduled.do_sample:
                last_slot = (scheduled.block_table[(end - 1) // BLOCK_SIZE], (end - 1) % BLOCK_SIZE)
                sampled[request.worker_id] = model_token(self.kv_slots[last_slot])
                tokens.append(sampled[request.worker_id])
        self.in_flight.append((out, sampled))

    def _collect_step(self) -> None:
        """What EngineCore does with a batch's output: append tokens, stop, free."""
        if not self.in_flight:
            return
        out, sampled = self.in_flight.popleft()
        finished = []
        finished_while_preempted = False
        for request, scheduled in zip(out.scheduled, out.step.requests, strict=True):
            if not scheduled.do_sample:
                continue
            request.num_output_placeholders -= 1
            if request.is_finished:
                continue  # aborted while its batch ran
            request.append_output_token(sampled[request.worker_id])
            if (request.num_output_tokens >= request.sampling_params.max_tokens
                    or request.num_tokens >= self.config.max_model_len):
                finished_while_preempted |= request.status == RequestStatus.PREEMPTED
                request.status = RequestStatus.FINISHED_LENGTH_CAPPED
                finished.append(request)
        self.scheduler.free_finished(finished, preempted=finished_while_preempted)
        for request in finished:
            self._ended(request)

    def _check_chunk(self, request: Request, scheduled, worker_tokens: list[int]) -> None:
        start = scheduled.num_computed_tokens
        end = start + len(scheduled.token_ids)
        assert scheduled.req_id == request.worker_id
        assert scheduled.req_id not in self.reported_finished | self.unreported_finished
        assert len(scheduled.token_ids) > 0
        assert scheduled.token_ids == worker_tokens[start:end]
        assert request.num_computed_tokens == end
        # A chunk is sampled when it reaches the last token the workers know.
        assert scheduled.do_sample == (end == len(worker_tokens))
        assert not request.is_finished
        if request.num_output_placeholders > int(scheduled.do_sample):
            # Scheduled past a token in flight: never past max_tokens or max_model_len.
            assert request.num_output_tokens + request.num_output_placeholders <= request.sampling_params.max_tokens
            assert request.num_tokens + request.num_output_placeholders <= self.config.max_model_len
        assert len(scheduled.block_table) == -(-end // BLOCK_SIZE), "the block table does not cover the tokens"
        if scheduled.resumed:
            # (Re)admitted: it starts after its cached prefix, a whole number of blocks.
            assert start == request.num_cached_tokens and start % BLOCK_SIZE == 0
        else:
            assert start == self.worker_positions[request.worker_id], "a chunk skips or repeats tokens"
        if scheduled.prompt_logprobs_targets is not None:
            first = scheduled.prompt_logprobs_start
            targets = scheduled.prompt_logprobs_targets
            assert start <= first and first + len(targets) <= min(end, request.num_prompt_tokens - 1)
            assert targets == request.prompt_token_ids[first + 1:first + 1 + len(targets)]
            self.prompt_logprob_positions.setdefault(request.worker_id, []).extend(
                range(first + 1, first + 1 + len(targets)))

    def _check_finished_ids(self, finished_ids: list[int], empty_step: bool) -> None:
        if empty_step:
            assert finished_ids == []
            return
        assert len(finished_ids) == len(set(finished_ids))
        assert set(finished_ids) == self.unreported_finished, "finished ids not sent to workers exactly once"
        self.reported_finished |= self.unreported_finished
        self.unreported_finished = set()

    def _ended(self, request: Request) -> None:
        assert request.request_id not in self.scheduler.requests
        if request.worker_id in self.worker_positions:
            self.unreported_finished.add(request.worker_id)

    # -------------------------------------------------------------- invariants
    @invariant()
    def block_bookkeeping_is_exact(self) -> None:
        if not hasattr(self, "scheduler"):
            return
        live = self.live_requests()
        self.kv.check_invariants(live)
        assert sorted(r.worker_id for r in self.scheduler.running + list(self.scheduler.waiting)) == \
            sorted(r.worker_id for r in live)
        assert len(self.scheduler.running) <= self.config.max_num_seqs
        for request in self.scheduler.running:
            assert request.status == RequestStatus.RUNNING
            assert len(self.kv.get_block_ids(request.request_id)) == -(-request.num_computed_tokens // BLOCK_SIZE)
        # Preempted requests wait in front of new ones; new ones in arrival order.
        statuses = [r.status for r in self.scheduler.waiting]
        assert statuses == sorted(statuses, key=lambda s: s != RequestStatus.PREEMPTED)
        new = [r.worker_id for r in self.scheduler.waiting if r.status == RequestStatus.WAITING]
        assert new == sorted(new)
        for request in self.scheduler.waiting:
            assert request.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED)
            assert request.num_computed_tokens == 0 and self.kv.get_block_ids(request.request_id) == []
        if not live:
            assert self.kv.req_to_blocks == {}
            assert self.kv.get_num_free_blocks() == self.num_blocks

    @invariant()
    def outputs_follow_the_reference(self) -> None:
        for request in getattr(self, "all_requests", ()):
            assert request.output_token_ids == reference_outputs(request.prompt_token_ids, request.num_output_tokens)

    def teardown(self) -> None:
        """With nothing new arriving, every request finishes with all its tokens."""
        if not hasattr(self, "scheduler"):
            return
        for _ in range(10_000):
            if not (self.scheduler.has_unfinished_requests() or self.in_flight):
                break
            self._step()
        self.block_bookkeeping_is_exact()
        assert not self.scheduler.has_unfinished_requests()
        assert self.kv.get_num_free_blocks() == self.num_blocks
        for request in self.all_requests:
            if request.status == RequestStatus.FINISHED_ABORTED:
                continue
            assert request.status == RequestStatus.FINISHED_LENGTH_CAPPED
            assert request.output_token_ids == reference_outputs(
                request.prompt_token_ids, expected_num_outputs(request, self.config.max_model_len))
            if request.sampling_params.prompt_logprobs is not None:
                positions = self.prompt_logprob_positions.get(request.worker_id, [])
                assert positions == list(range(1, request.num_prompt_tokens))


SchedulerMachine.TestCase.settings = settings(max_examples=200, stateful_step_count=50, deadline=None)
test_scheduler_and_kv_cache_manager_under_random_traffic = SchedulerMachine.TestCase
