"""The scheduler: continuous batching over a paged KV cache.

Each step, in this order (vLLM V0's policy, without chunked prefill or swapping):

1. Decode every running group, earliest arrival first, one token per running sequence.
   When the cache has no block for a group's next token, preempt the latest-arrived
   running group by recompute (free its blocks, put it back at the front of the waiting
   queue); a group that is itself the latest preempts itself.
2. Unless step 1 preempted something, admit waiting groups first-come-first-served while
   the token budget (prompt plus decode tokens of the step), max_num_seqs and the free
   blocks allow, stopping at the first that does not fit. A prompt that can never fit
   (longer than the context, or more blocks than the whole cache) is ignored.

The step goes to the workers as an `ExecuteModelRequest`; the engine appends the sampled
tokens, marks finished sequences, and calls `free_seq` / `free_finished_seq_groups`.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field

from raylm.engine.block_manager import AllocStatus, BlockSpaceManager
from raylm.engine.config import CacheConfig, SchedulerConfig
from raylm.engine.sequence import Sequence, SequenceGroup, SequenceStatus
from raylm.engine.step import ExecuteModelRequest, ScheduledSequence


@dataclass
class SchedulerOutputs:
    """What one schedule() decided, for the engine's bookkeeping and stats."""

    # Prefill groups first (num_prefill_groups of them), then decode groups.
    scheduled_seq_groups: list[SequenceGroup] = field(default_factory=list)
    num_prefill_groups: int = 0
    # Tokens whose KV the step computes: prompt (and recomputed) tokens plus one per decode.
    num_batched_tokens: int = 0
    num_decode_tokens: int = 0
    # Groups preempted (by recompute) during this step.
    preempted: int = 0
    # Groups that can never run; their sequences are FINISHED_IGNORED.
    ignored_seq_groups: list[SequenceGroup] = field(default_factory=list)
    blocks_to_copy: list[tuple[int, int]] = field(default_factory=list)

    def is_empty(self) -> bool:
        return not self.scheduled_seq_groups

    @property
    def prefill_seq_groups(self) -> list[SequenceGroup]:
        return self.scheduled_seq_groups[:self.num_prefill_groups]

    @property
    def decode_seq_groups(self) -> list[SequenceGroup]:
        return self.scheduled_seq_groups[self.num_prefill_groups:]


class Scheduler:
    def __init__(self, scheduler_config: SchedulerConfig, cache_config: CacheConfig) -> None:
        if cache_config.num_gpu_blocks is None or cache_config.num_gpu_blocks < 1:
            raise ValueError(f"cache_config.num_gpu_blocks must be set to at least 1 before building the "
                             f"scheduler, got {cache_config.num_gpu_blocks}.")
        self.scheduler_config = scheduler_config
        self.cache_config = cache_config
        self.block_manager = BlockSpaceManager(cache_config.block_size, cache_config.num_gpu_blocks)
        self.waiting: deque[SequenceGroup] = deque()
        self.running: deque[SequenceGroup] = deque()
        # Total groups preempted since the start.
        self.num_preemptions = 0
        # Sequences the workers hold state for (scheduled since their last (re)start).
        self._seqs_on_workers: set[int] = set()
        # Sequences freed since the last schedule(), in order (a dict as an ordered set).
        self._finished_seq_ids: dict[int, None] = {}

    # ------------------------------------------------------------ requests
    def add_seq_group(self, seq_group: SequenceGroup) -> None:
        self.waiting.append(seq_group)

    def has_request(self, request_id: str) -> bool:
        return any(group.request_id == request_id for group in (*self.waiting, *self.running))

    def abort_seq_group(self, request_id: str | Iterable[str]) -> list[SequenceGroup]:
        """Removes the requests from the queues, marks their unfinished sequences
        FINISHED_ABORTED and frees their blocks. Returns the aborted groups; unknown ids
        (already finished) are skipped."""
        ids = {request_id} if isinstance(request_id, str) else set(request_id)
        aborted = []
        for queue in (self.waiting, self.running):
            for group in [group for group in queue if group.request_id in ids]:
                queue.remove(group)
                for seq in group.seqs:
                    if not seq.is_finished():
                        seq.status = SequenceStatus.FINISHED_ABORTED
                    self.free_seq(seq)
                aborted.append(group)
        return aborted

    def fork_seq(self, parent_seq: Sequence, child_seq: Sequence) -> None:
        self.block_manager.fork(parent_seq, child_seq)

    def free_seq(self, seq: Sequence) -> None:
        """Returns a (finished) sequence's blocks; safe to call more than once."""
        self.block_manager.free(seq)
        if seq.seq_id in self._seqs_on_workers:
            self._seqs_on_workers.discard(seq.seq_id)
            self._finished_seq_ids[seq.seq_id] = None

    def free_finished_seq_groups(self) -> list[SequenceGroup]:
        """Drops finished groups from the running queue and returns them."""
        finished: list[SequenceGroup] = []
        still_running: deque[SequenceGroup] = deque()
        for group in self.running:
            (finished if group.is_finished() else still_running).append(group)
        if finished:
            for group in finished:
                for seq in group.seqs:
                    self.free_seq(seq)
            self.running = still_running
        return finished

    # ---------------------------------------------------------------- state
    def has_unfinished_seqs(self) -> bool:
        return bool(self.waiting or self.running)

    def get_num_unfinished_seq_groups(self) -> int:
        return len(self.waiting) + len(self.running)

    @property
    def num_running(self) -> int:
        """Running requests (groups)."""
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        """Waiting requests (groups), preempted ones included."""
        return len(self.waiting)

    @property
    def kv_cache_usage(self) -> float:
        """Fraction of KV-cache blocks in use, in [0, 1]."""
        total = self.block_manager.num_total_blocks
        return 1.0 - self.block_manager.get_num_free_blocks() / total

    # ------------------------------------------------------------- schedule
    def schedule(self) -> tuple[ExecuteModelRequest, SchedulerOutputs]:
        self.free_finished_seq_groups()
        out = SchedulerOutputs()
        decodes, unscheduled = self._schedule_running(out)
        prefills = self._schedule_waiting(out, decodes, unscheduled) if out.preempted == 0 else []
        self.running = deque(decodes + unscheduled + [group for group, _ in prefills])

        now = time.time()
        request = ExecuteModelRequest(seqs=[], blocks_to_copy=out.blocks_to_copy)
        for group, seqs in prefills:
            if group.metrics.first_scheduled_time is None:
                group.metrics.first_scheduled_time = now
            request.seqs.extend(self._prefill_seqs(group, seqs))
            for seq in seqs:
                seq.data.num_computed_tokens = seq.get_len()
                self._seqs_on_workers.add(seq.seq_id)
        for group in decodes:
            for seq in group.get_seqs(SequenceStatus.RUNNING):
                assert seq.data.num_computed_tokens == seq.get_len() - 1, (
                    f"sequence {seq.seq_id} has {seq.get_len()} tokens, {seq.data.num_computed_tokens} computed: "
                    f"the engine must append exactly one token per scheduled step")
                request.seqs.append(ScheduledSequence(
                    seq_id=seq.seq_id, token_ids=[seq.get_last_token_id()],
                    num_computed_tokens=seq.data.num_computed_tokens,
                    block_table=self.block_manager.get_block_table(seq), num_prompt_tokens=seq.get_prompt_len(),
                    sampling_params=group.sampling_params))
                seq.data.num_computed_tokens = seq.get_len()
                self._seqs_on_workers.add(seq.seq_id)
        out.scheduled_seq_groups = [group for group, _ in prefills] + decodes
        out.num_prefill_groups = len(prefills)
        request.finished_seq_ids = list(self._finished_seq_ids)
        if request.seqs:
            # An empty step may never reach the workers: its ids ride along with the next.
            self._finished_seq_ids.clear()
        return request, out

    def _schedule_running(self, out: SchedulerOutputs) -> tuple[list[SequenceGroup], list[SequenceGroup]]:
        """Step 1: decodes. Returns (scheduled groups, running groups left out by the budget)."""
        budget = self.scheduler_config.max_num_batched_tokens
        queue = deque(sorted(self.running, key=lambda group: group.arrival_time))
        decodes: list[SequenceGroup] = []
        while queue:
            group = queue.popleft()
            num_tokens = group.num_seqs(SequenceStatus.RUNNING)
            if out.num_batched_tokens + num_tokens > budget:
                # Only reachable when max_num_seqs exceeds the budget: the rest wait a step.
                queue.appendleft(group)
                break
            while not self.block_manager.can_append_slots(group):
                victim = queue.pop() if queue else group
                self._preempt(victim)
                out.preempted += 1
                if victim is group:
                    break
            else:
                for seq in group.get_seqs(SequenceStatus.RUNNING):
                    out.blocks_to_copy.extend(self.block_manager.append_slots(seq))
                decodes.append(group)
                out.num_batched_tokens += num_tokens
                out.num_decode_tokens += num_tokens
        return decodes, list(queue)

    def _schedule_waiting(self, out: SchedulerOutputs, decodes: list[SequenceGroup],
                          unscheduled: list[SequenceGroup]) -> list[tuple[SequenceGroup, list[Sequence]]]:
        """Step 2: FCFS admission. Returns (group, the sequences it prefills)."""
        prefills: list[tuple[SequenceGroup, list[Sequence]]] = []
        if not self.waiting:
            return prefills
        config = self.scheduler_config
        num_seqs = sum(group.num_seqs(SequenceStatus.RUNNING) for group in (*decodes, *unscheduled))
        while self.waiting:
            group = self.waiting[0]
            seqs = group.get_seqs(SequenceStatus.WAITING)
            fresh = all(seq.get_output_len() == 0 for seq in seqs)
            # A fresh group prefills its prompt once for all its samples.
            num_tokens = seqs[0].get_len() if fresh else sum(seq.get_len() for seq in seqs)
            too_long = fresh and num_tokens > config.max_model_len
            alloc = self.block_manager.can_allocate(group)
            if too_long or alloc == AllocStatus.NEVER:
                self.waiting.popleft()
                for seq in group.get_unfinished_seqs():
                    seq.status = SequenceStatus.FINISHED_IGNORED
                    self.free_seq(seq)
                out.ignored_seq_groups.append(group)
                continue
            if alloc == AllocStatus.LATER:
                break
            # A group over the limits on its own (a recomputed group with many long
            # samples) still runs when nothing else does, so that it cannot block the queue.
            step_is_empty = not (decodes or unscheduled or prefills)
            over_limits = (out.num_batched_tokens + num_tokens > config.max_num_batched_tokens
                           or num_seqs + len(seqs) > config.max_num_seqs)
            if over_limits and not step_is_empty:
                break
            self.waiting.popleft()
            self.block_manager.allocate(group)
            for seq in seqs:
                seq.status = SequenceStatus.RUNNING
            prefills.append((group, seqs))
            out.num_batched_tokens += num_tokens
            num_seqs += len(seqs)
        return prefills

    def _prefill_seqs(self, group: SequenceGroup, seqs: list[Sequence]) -> list[ScheduledSequence]:
        params = group.sampling_params
        if all(seq.get_output_len() == 0 for seq in seqs):
            # Shared prompt blocks: one prefill whose last logits feed every sample.
            first = seqs[0]
            return [ScheduledSequence(
                seq_id=first.seq_id, token_ids=first.get_token_ids(), num_computed_tokens=0,
                block_table=self.block_manager.get_block_table(first), num_prompt_tokens=first.get_prompt_len(),
                sampling_params=params, sample_seq_ids=[seq.seq_id for seq in seqs],
                compute_prompt_logprobs=params.prompt_logprobs is not None and group.prompt_logprobs is None)]
        # Recompute after preemption: each sample rebuilds its own prompt + outputs.
        return [ScheduledSequence(
            seq_id=seq.seq_id, token_ids=seq.get_token_ids(), num_computed_tokens=0,
            block_table=self.block_manager.get_block_table(seq), num_prompt_tokens=seq.get_prompt_len(),
            sampling_params=params) for seq in seqs]

    def _preempt(self, group: SequenceGroup) -> None:
        """Preemption by recompute: drop the group's KV; it prefills again when readmitted."""
        for seq in group.get_seqs(SequenceStatus.RUNNING):
            seq.status = SequenceStatus.WAITING
            self.block_manager.free(seq)
            seq.data.num_computed_tokens = 0
        # Victims are taken latest first, so the earliest preempted ends up in front.
        self.waiting.appendleft(group)
        self.num_preemptions += 1
