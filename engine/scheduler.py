"""The scheduler: continuous batching with chunked prefill over a prefix-cached KV pool.

Every step has one token budget (max_num_batched_tokens). In this order:

1. Running requests, earliest admitted first: each advances its `num_computed_tokens`
   toward its length, one token for a decode, as much of its prompt as the budget allows
   for a prefill. When the pool has no block for a request's tokens, the latest admitted
   running request is preempted by recompute (its blocks freed, back to the front of the
   waiting queue); a request that is itself the latest preempts itself.
2. Unless step 1 preempted something, waiting requests first-come-first-served while the
   budget, max_num_seqs and the pool allow, stopping at the first that does not fit. A
   request's cached prefix is skipped; the rest of its prompt is chunked to the budget
   (with chunked prefill off, a prompt that does not fit whole waits). With LoRA, a request
   whose adapter is still loading or finds no free adapter slot waits in its place while
   the requests behind it are considered (`engine/lora_slots.py`: a step never holds more
   distinct adapters than the workers' slots).

Under the "priority" scheduling policy (vLLM V1's), the waiting queue is kept ordered by
(priority, arrival_time), lowest first, ties in the order the requests were added, so step 2
takes them in that order (a preempted request goes back to its place, not to the front); and
in step 1 the running request preempted when blocks run out is the one with the worst
(priority, arrival_time), wherever it is in the running list: if this step had already
scheduled it, it is taken out of the step and its tokens given back to the budget. As in
vLLM, a waiting request never preempts a running one: priority orders the queue and picks
the victims.

A request always fits the pool alone (the engine checks that the pool holds max_model_len
tokens, or with a sliding window on every layer, the window and one step's tokens: see
`max_blocks_per_request`), so the earliest request always makes progress and no request can
stall the rest.

With async scheduling the next step is scheduled before the last one's tokens are known: a
request sampled by a step in flight counts that token as a placeholder
(`num_output_placeholders`), its next decode sends PLACEHOLDER_TOKEN_ID for the workers to
fill, and it is not scheduled at all once its tokens in flight reach max_tokens or
max_model_len.

Under pipeline parallelism the workers cannot fill placeholders (the first stage would wait
for the last), so a request with a token in flight is not scheduled until it is back, and
each step takes a micro-batch of the requests so that several steps are in flight at once
(`pipeline_schedule.py`).

Structured outputs: a waiting request whose grammar is still compiling
(WAITING_FOR_FSM) is passed over, without holding up the queue behind it. Each step
carries the next-token bitmask of every constrained request it samples, filled from the
request's matcher, which must have seen all its tokens: so with async scheduling a
constrained request is not scheduled while its last token is in flight (it decodes every
other step; unconstrained requests keep the overlap).

With speculative decoding (a `Drafter`), a decoding request also carries the tokens it
proposes (`spec_token_ids`), budgeted and given KV slots like any other token; the engine
core rolls back what the verification rejects. Under async scheduling a request that
proposes is not pipelined: how many tokens its verification accepts, so where its next
step starts, is known only once that step is collected (see `_schedule_running`). A
constrained request proposes nothing (`Drafter.num_drafts`): its one bitmask covers one
sampled token, so it decodes one token a step, and under async scheduling the two rules
never meet (it already waits for its token in flight before it is scheduled again).
Speculative decoding and pipeline parallelism are not combined (EngineArgs refuses it).
"""

from __future__ import annotations

import bisect
import itertools
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from raylm.engine.config import CacheConfig, SchedulerConfig
from raylm.engine.kv_cache_manager import KVCacheManager
from raylm.engine.lora_slots import LoRASlots
from raylm.engine.pipeline_schedule import micro_batch_size, steps_in_flight
from raylm.engine.request import Request, RequestStatus
from raylm.engine.spec_decode.config import SpeculativeConfig
from raylm.engine.spec_decode.drafter import Drafter
from raylm.engine.step import PLACEHOLDER_TOKEN_ID, ExecuteModelRequest, ScheduledRequest
from raylm.executors.sampling_metadata import needs_token_history

if TYPE_CHECKING:
    from raylm.engine.structured_output.manager import StructuredOutputManager


@dataclass
class SchedulerOutput:
    """What one schedule() decided: the workers' step and the engine's bookkeeping."""

    step: ExecuteModelRequest
    # The scheduled requests, in the order of step.requests.
    scheduled: list[Request] = field(default_factory=list)
    # Tokens whose KV the step computes: prompt chunks (and recomputed tokens) plus one per decode.
    num_batched_tokens: int = 0
    num_prefill_tokens: int = 0
    num_preempted: int = 0

    def is_empty(self) -> bool:
        """Nothing for the workers: no request, and no state of theirs to release now."""
        return not self.scheduled and not self.step.finished_req_ids


class Scheduler:
    def __init__(self, scheduler_config: SchedulerConfig, cache_config: CacheConfig,
                 speculative_config: SpeculativeConfig | None = None,
                 structured_output_manager: StructuredOutputManager | None = None,
                 lora_slots: LoRASlots | None = None, sends_all_context: bool = False) -> None:
        if cache_config.num_gpu_blocks is None or cache_config.num_gpu_blocks < 1:
            raise ValueError(f"cache_config.num_gpu_blocks must be set to at least 1 before building the "
                             f"scheduler, got {cache_config.num_gpu_blocks}.")
        self.scheduler_config = scheduler_config
        self.cache_config = cache_config
        # Every (re)admitted request's first step carries its tokens before the step (the
        # engine's custom logits processors read every request's tokens), not only those
        # of requests whose sampling reads their history.
        self.sends_all_context = sends_all_context
        self.block_size = cache_config.block_size
        self.kv_cache_manager = KVCacheManager(cache_config.num_gpu_blocks, cache_config.block_size,
                                               cache_config.enable_prefix_caching, cache_config.sliding_window)
        self.requests: dict[str, Request] = {}
        # "priority": waiting requests are kept in _priority_order, and the running request
        # of the worst order is preempted first; "fcfs": the waiting queue in arrival order.
        self.schedules_by_priority = scheduler_config.policy == "priority"
        self.waiting: deque[Request] = deque()
        # In admission order: under fcfs the last is the first to be preempted.
        self.running: list[Request] = []
        # Total requests preempted since the start.
        self.num_preemptions = 0
        self._worker_ids = itertools.count()
        # Worker ids of requests freed since the last step that workers hold state for.
        self._finished_worker_ids: list[int] = []
        # Worker ids of requests preempted since the last step that workers hold state for.
        self._preempted_worker_ids: list[int] = []
        self._on_workers: set[int] = set()
        # Worker state that must not wait for a next step that may never come goes out at
        # once, in a step of its own if nothing else is scheduled: the image of a request
        # that ended before its prefill passed it (EncoderCache), likewise the embeddings of an
        # embeddings prompt (PromptEmbedsCache), and the [V] device mask of
        # a request with allowed_token_ids (AllowedTokenMasks): an idle engine would
        # otherwise hold up to max_num_seqs of each.
        self._releases_now = False
        # Pipeline parallel (`pipeline_schedule.py`): requests wait for their tokens in
        # flight, and each step takes at most _step_request_limit requests.
        self.waits_for_tokens_in_flight = scheduler_config.pipeline_parallel_size > 1
        self.num_micro_batches = (steps_in_flight(scheduler_config, runs_steps_asynchronously=True)
                                  if self.waits_for_tokens_in_flight else 1)
        self._step_request_limit = scheduler_config.max_num_seqs
        # enable_lora: the adapter slots (a request of an adapter is admitted when its
        # adapter is loaded and has a slot; see engine/lora_slots.py).
        self.lora_slots = lora_slots
        self.structured_output_manager = structured_output_manager
        # Unfinished requests with a grammar: while there is none, a step skips the bitmask
        # (a pass over its requests) altogether.
        self._num_constrained = 0
        # Requests ended because their grammar did not compile, with the error, until the
        # engine core collects them.
        self.failed_requests: dict[str, BaseException] = {}
        # Speculative decoding: what each decoding request proposes (None: off).
        self.drafter = (Drafter(speculative_config, scheduler_config.max_model_len)
                        if speculative_config is not None else None)

    # ---------------------------------------------------------------- requests
    def add_request(self, request: Request) -> None:
        request.worker_id = next(self._worker_ids)
        self.requests[request.request_id] = request
        if request.structured_output_request is not None:
            self._num_constrained += 1
        if self.schedules_by_priority:
            self._enqueue_by_priority(request)
        else:
            self.waiting.append(request)

    def finish_requests(self, request_ids: str | Iterable[str], status: RequestStatus) -> list[Request]:
        """Ends the requests with `status` (an abort, or a stop the engine found in the
        text) and frees their blocks at once. Unknown or finished ids are skipped."""
        ids = {request_ids} if isinstance(request_ids, str) else set(request_ids)
        finished = [self.requests[i] for i in ids if i in self.requests]
        if not finished:
            return []
        gone = {id(request) for request in finished}
        self.running = [r for r in self.running if id(r) not in gone]
        if any(r.status != RequestStatus.RUNNING for r in finished):
            self.waiting = deque(r for r in self.waiting if id(r) not in gone)
        for request in finished:
            request.status = status
            self._free(request)
        return finished

    def _free(self, request: Request) -> None:
        self.kv_cache_manager.free(request)
        if self.lora_slots is not None:
            self.lora_slots.release(request)
        if request.structured_output_request is not None:
            request.structured_output_request.release()
            self._num_constrained -= 1
        if self.drafter is not None:
            self.drafter.free(request)
        del self.requests[request.request_id]
        if request.worker_id in self._on_workers:
            self._on_workers.discard(request.worker_id)
            self._finished_worker_ids.append(request.worker_id)
            if ((request.mm_features and request.num_computed_tokens < request.mm_features[-1].mm_position.end)
                    or (request.prompt_embeds is not None and request.num_computed_tokens < request.num_prompt_tokens)
                    or getattr(request.sampling_params, "allowed_token_ids", None) is not None):
                self._releases_now = True

    def free_finished(self, requests: list[Request], preempted: bool = False) -> None:
        """Drops requests the engine core just finished from the running list (and, if
        `preempted`, from the waiting queue: async scheduling can preempt a request whose
        last token was still in flight)."""
        if not requests:
            return
        gone = {id(request) for request in requests}
        self.running = [r for r in self.running if id(r) not in gone]
        if preempted:
            self.waiting = deque(r for r in self.waiting if id(r) not in gone)
        for request in requests:
            self._free(request)

    # ------------------------------------------------------------------- state
    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def has_worker_releases(self) -> bool:
        """Whether the next schedule() sends a step only to release workers' state (images
        of a request that ended before its prefill passed them, allowed_token_ids masks)."""
        return self._releases_now

    def get_num_unfinished_requests(self) -> int:
        return len(self.requests)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_constrained_requests(self) -> int:
        """Unfinished requests with structured outputs (a grammar)."""
        return self._num_constrained

    @property
    def num_waiting(self) -> int:
        """Waiting requests, preempted ones included."""
        return len(self.waiting)

    @property
    def kv_cache_usage(self) -> float:
        """Fraction of KV-cache blocks held by requests, in [0, 1]."""
        return self.kv_cache_manager.usage

    # ---------------------------------------------------------------- schedule
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput(ExecuteModelRequest(requests=[]))
        budget = self.scheduler_config.max_num_batched_tokens
        scheduled: list[tuple[Request, int]] = []
        self._step_request_limit = micro_batch_size(len(self.running) + len(self.waiting),
                                                    self.scheduler_config.max_num_seqs, self.num_micro_batches)
        budget = self._schedule_running(scheduled, budget, out)
        if out.num_preempted == 0:
            self._schedule_waiting(scheduled, budget)
        step_requests, scheduled_requests = out.step.requests, out.scheduled
        for request, num_new_tokens in scheduled:
            # A decode computes exactly the last sampled token (known, or a placeholder for
            # one in flight); anything else is prefill.
            if request.num_computed_tokens + 1 < len(request.all_token_ids) or not (
                    request.output_token_ids or request.num_output_placeholders):
                out.num_prefill_tokens += num_new_tokens
            out.num_batched_tokens += num_new_tokens + len(request.spec_token_ids)
            step_requests.append(self._scheduled_request(request, num_new_tokens))
            scheduled_requests.append(request)
        if scheduled or self._releases_now:
            # An empty step never reaches the workers: its ids ride along with the next one
            # (unless they hold images or masks, `_releases_now`).
            out.step.finished_req_ids, self._finished_worker_ids = self._finished_worker_ids, []
            out.step.preempted_req_ids, self._preempted_worker_ids = self._preempted_worker_ids, []
            self._releases_now = False
        if scheduled:
            if self.lora_slots is not None:
                out.step.lora_activations = self.lora_slots.take_activations()
            self._fill_grammar_bitmask(out)
        return out

    def _fill_grammar_bitmask(self, out: SchedulerOutput) -> None:
        if not self._num_constrained:
            return
        # A request still reasoning is sampled unmasked (its grammar starts after the reasoning).
        constrained = [request for request, scheduled in zip(out.scheduled, out.step.requests)
                       if scheduled.do_sample and request.structured_output_request is not None
                       and request.structured_output_request.reasoning_ended]
        if constrained:
            out.step.grammar_bitmask = self.structured_output_manager.grammar_bitmask(
                [request.structured_output_request for request in constrained])
            out.step.structured_output_req_ids = [request.worker_id for request in constrained]

    def _schedule_running(self, scheduled: list[tuple[Request, int]], budget: int, out: SchedulerOutput) -> int:
        kv = self.kv_cache_manager
        running, request_limit, waits_for_tokens_in_flight = \
            self.running, self._step_request_limit, self.waits_for_tokens_in_flight
        index = 0
        while index < len(running) and budget > 0 and len(scheduled) < request_limit:
            request = running[index]
            if waits_for_tokens_in_flight and request.num_output_placeholders:
                index += 1  # pipeline parallel: its token in flight must come back first
                continue
            if request.num_output_placeholders and (request.spec_token_ids
                                                    or request.structured_output_request is not None
                                                    or self._ends_with_tokens_in_flight(request)):
                # Nothing known to compute: its last token is being sampled, its
                # verification in flight decides where its next step starts, or its
                # grammar's bitmask needs the token being sampled.
                index += 1
                continue
            num_new_tokens = min(request.num_tokens + request.num_output_placeholders - request.num_computed_tokens,
                                 budget)
            assert num_new_tokens > 0, f"{request} is running with nothing to compute"
            num_new_tokens = self._keep_images_whole(request, request.num_computed_tokens, num_new_tokens)
            if num_new_tokens == 0:
                index += 1  # the rest of an image does not fit this step's budget
                continue
            drafts: list[int] = []
            if self.drafter is not None and num_new_tokens == 1 and (request.output_token_ids
                                                                      or request.num_output_placeholders):
                num_drafts = self.drafter.num_drafts(request, budget, len(self.running))
                if num_drafts and request.num_output_placeholders:
                    index += 1  # async scheduling: proposes once its step in flight is collected
                    continue
                if num_drafts:
                    drafts = self.drafter.propose(request, num_drafts)
            # Proposals never cost another request its place: without room for them the
            # request decodes one token.
            while kv.allocate_slots(request, num_new_tokens + len(drafts)) is None:
                if drafts:
                    drafts = []
                    continue
                if self.schedules_by_priority:
                    victim = max(self.running, key=_priority_order)
                    victim_index = self.running.index(victim)
                    del self.running[victim_index]
                    if victim_index < index:  # already passed in this step: taken back out
                        budget += self._unschedule(scheduled, victim)
                        index -= 1
                else:
                    victim = self.running.pop()
                self._preempt(victim)
                out.num_preempted += 1
                if victim is request:
                    return budget
            request.spec_token_ids = drafts
            scheduled.append((request, num_new_tokens))
            budget -= num_new_tokens + len(drafts)
            index += 1
        return budget

    @staticmethod
    def _unschedule(scheduled: list[tuple[Request, int]], victim: Request) -> int:
        """Takes a request out of this step if the step scheduled it (before any of it
        reached the step's description); returns the budget its tokens and proposals held
        (0 if it was passed over)."""
        position = next((i for i, (request, _) in enumerate(scheduled) if request is victim), None)
        if position is None:
            return 0
        _, num_new_tokens = scheduled.pop(position)
        num_tokens = num_new_tokens + len(victim.spec_token_ids)
        victim.spec_token_ids = []
        return num_tokens

    def _enqueue_by_priority(self, request: Request) -> None:
        """Puts a request in its place in the waiting queue under the "priority" policy."""
        bisect.insort_right(self.waiting, request, key=_priority_order)

    def _schedule_waiting(self, scheduled: list[tuple[Request, int]], budget: int) -> None:
        kv = self.kv_cache_manager
        config = self.scheduler_config
        lora_slots = self.lora_slots
        # Requests still compiling their grammar, or whose adapter is loading or has no slot:
        # they keep their places in the queue.
        skipped: list[Request] = []
        if lora_slots is not None:
            lora_slots.start_pass()
        while (self.waiting and budget > 0 and len(self.running) < config.max_num_seqs
               and len(scheduled) < self._step_request_limit):
            request = self.waiting[0]
            if self.waits_for_tokens_in_flight and request.num_output_placeholders:
                break  # preempted while its token was in flight: readmitted once it is back
            if request.status == RequestStatus.WAITING_FOR_FSM and not self._grammar_ready(request):
                self.waiting.popleft()
                if not request.is_finished:
                    skipped.append(request)
                continue
            if lora_slots is not None and not lora_slots.can_admit(request):
                skipped.append(self.waiting.popleft())
                continue
            computed_blocks, num_computed_tokens = kv.get_computed_blocks(request)
            num_new_tokens = request.num_tokens - num_computed_tokens
            if num_new_tokens > budget:
                if not config.enable_chunked_prefill:
                    break
                num_new_tokens = budget
            num_new_tokens = self._keep_images_whole(request, num_computed_tokens, num_new_tokens)
            if num_new_tokens == 0:
                break  # the rest of an image does not fit this step's budget
            if kv.allocate_slots(request, num_new_tokens, computed_blocks, num_computed_tokens) is None:
                break
            self.waiting.popleft()
            kv.record_admission(request, num_computed_tokens)
            request.num_computed_tokens = num_computed_tokens
            request.num_cached_tokens = num_computed_tokens
            request.status = RequestStatus.RUNNING
            request.resumed = True
            if lora_slots is not None:
                lora_slots.acquire(request)
            self.running.append(request)
            scheduled.append((request, num_new_tokens))
            budget -= num_new_tokens
        self.waiting.extendleft(reversed(skipped))

    def _keep_images_whole(self, request: Request, num_computed_tokens: int, num_new_tokens: int) -> int:
        """num_new_tokens, or fewer so that the chunk does not end inside an image under
        disable_chunked_mm_input: it stops before the image, or, begun inside the image (a
        prefix-cache hit), is 0 unless it takes the image's rest whole."""
        if not self.scheduler_config.disable_chunked_mm_input:
            return num_new_tokens
        end = num_computed_tokens + num_new_tokens
        for feature in request.mm_features:
            position = feature.mm_position
            if position.offset < end < position.end:
                return max(0, position.offset - num_computed_tokens)
        return num_new_tokens

    def _grammar_ready(self, request: Request) -> bool:
        """Whether a request waiting for its grammar may be scheduled now. One whose grammar
        failed to compile is ended here (FINISHED_ABORTED) and reported in failed_requests."""
        structured = request.structured_output_request
        if not structured.is_ready:
            return False
        error = structured.error
        if error is not None:
            request.status = RequestStatus.FINISHED_ABORTED
            self._free(request)
            self.failed_requests[request.request_id] = error
            return False
        request.status = RequestStatus.WAITING
        return True

    def _scheduled_request(self, request: Request, num_new_tokens: int) -> ScheduledRequest:
        """The workers' view of the request's share of this step; advances its
        num_computed_tokens past the scheduled tokens."""
        start = request.num_computed_tokens
        end = start + num_new_tokens
        params = request.sampling_params
        token_ids = request.all_token_ids[start:end]
        if len(token_ids) < num_new_tokens:
            # The token the step in flight samples (async scheduling): the workers know it.
            token_ids.append(PLACEHOLDER_TOKEN_ID)
        do_sample = end == request.num_tokens + request.num_output_placeholders
        scheduled = ScheduledRequest(
            req_id=request.worker_id, token_ids=token_ids, num_computed_tokens=start,
            block_table=self.kv_cache_manager.get_block_ids(request.request_id),
            num_prompt_tokens=request.num_prompt_tokens, sampling_params=params if request.resumed else None,
            do_sample=do_sample, resumed=request.resumed, sample_index=request.sample_index,
            lora_slot=self.lora_slots.slot_of(request) if self.lora_slots is not None else -1)
        if do_sample:
            request.num_output_placeholders += 1
        if request.resumed and request.mm_features:
            scheduled.mm_features = request.mm_features
        if request.resumed and request.prompt_embeds is not None:
            scheduled.prompt_embeds = request.prompt_embeds
        if request.pooling_params is not None and request.pooling_params.pools_every_token:
            scheduled.pools_every_token = True
        if request.resumed and start and (self.sends_all_context or needs_token_history(params)):
            scheduled.context_token_ids = request.all_token_ids[:start]
        if params.prompt_logprobs is not None:
            # Row p scores prompt token p + 1: rows up to the second-to-last prompt token.
            first = max(start, request.num_prompt_logprobs_done)
            last = min(end, request.num_prompt_tokens - 1)
            if first < last:
                scheduled.prompt_logprobs_start = first
                scheduled.prompt_logprobs_targets = request.prompt_token_ids[first + 1:last + 1]
                request.num_prompt_logprobs_done = last
        if request.spec_token_ids:
            # The proposals' KV is written too; the core takes back what is rejected.
            scheduled.spec_token_ids = list(request.spec_token_ids)
            end += len(request.spec_token_ids)
        request.num_computed_tokens = end
        request.resumed = False
        self._on_workers.add(request.worker_id)
        return scheduled

    def _ends_with_tokens_in_flight(self, request: Request) -> bool:
        """Whether the tokens already being sampled for the request take it to max_tokens or
        max_model_len, so that scheduling more would compute past its end."""
        placeholders = request.num_output_placeholders
        return (request.num_output_tokens + placeholders >= request.sampling_params.max_tokens
                or request.num_tokens + placeholders >= self.scheduler_config.max_model_len)

    def _preempt(self, request: Request) -> None:
        """Preemption by recompute: the request's blocks go back to the pool (cached ones
        stay cached until evicted) and it waits at the front of the queue."""
        self.kv_cache_manager.free(request)
        if self.lora_slots is not None:
            self.lora_slots.release(request)
        if request.worker_id in self._on_workers:
            self._preempted_worker_ids.append(request.worker_id)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.resumed = True
        if self.schedules_by_priority:
            self._enqueue_by_priority(request)
        else:
            # Victims are taken latest first, so the earliest preempted ends up in front.
            self.waiting.appendleft(request)
        self.num_preemptions += 1


def _priority_order(request: Request) -> tuple[int, float, int]:
    """The "priority" policy's order, lowest first: priority, then arrival time, then the
    order the scheduler was given the requests in (worker ids are handed out in that order)."""
    return request.priority, request.arrival_time, request.worker_id
