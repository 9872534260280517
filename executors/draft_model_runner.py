"""The draft model of speculative decoding, run on every worker beside the target.

It is sharded like the target (same tensor-parallel group) and keeps its own KV cache with
the same block ids, so the scheduler's block tables serve both. Each step, before the
target's forward:

1. One draft forward over every request's new tokens (prompt chunks, decodes), plus the
   accepted proposals its KV does not hold yet: the draft's KV follows the target's. Its
   last row gives each proposing request's first proposal.
2. j - 1 more one-token forwards, each feeding the last proposal, give the rest.

Rank 0 draws the proposals with the request's own sampling parameters and history (greedy
requests take the argmax; others draw from the processed distribution q, kept for the
rejection sampler) and broadcasts them, so that every rank feeds the same tokens. They
stay on the device from one forward to the next (each feeds the last proposals as its
input ids; penalties read the proposals so far as `SamplingMetadata.output_suffix`), and
come back to the host in one read after the last: on a GPU the host waits for the draft
once a step, not once a proposal. They then fill the request's PLACEHOLDER_TOKEN_ID
entries of `spec_token_ids`.

What the draft's KV holds is tracked per request: proposals e_1..e_j write the KV of
e_1..e_{j-1} while proposing; the next step's num_computed_tokens says how many were
accepted, so the draft knows which of those slots hold verified tokens, and feeds e_j again
when all were accepted (its KV was never written).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from raylm.engine.config import EngineConfig, kv_cache_block_bytes
from raylm.engine.step import ExecuteModelRequest, ScheduledRequest
from raylm.executors.input_staging import to_device
from raylm.executors.sampler import greedy_tokens, inverse_cdf, process_logits_, sampling_probs
from raylm.executors.sampling_metadata import SamplingMetadata, needs_token_history
from raylm.kernels.backend import get_attention_backend
from raylm.models import get_model, release_model
from raylm.models.attention import Attention
from raylm.models.forward_context import set_forward_context, step_output_rows
from raylm.parallel.communication import tensor_model_parallel_broadcast


@dataclass
class _DraftState:
    # Leading positions whose draft KV holds the request's verified tokens.
    num_computed: int
    # The last proposals, e_1 at position `proposed_at`; their outcome is learnt next step.
    proposed: list[int] = field(default_factory=list)
    proposed_at: int = 0


class DraftModelRunner:
    def __init__(self, engine_config: EngineConfig, rank: int, device: torch.device) -> None:
        self.model_config = engine_config.speculative_config.draft_model_config
        self.block_size = engine_config.cache_config.block_size
        self.tensor_parallel_size = engine_config.parallel_config.tensor_parallel_size
        self.cache_dtype = engine_config.cache_config.cache_dtype
        self.rank = rank
        self.device = device
        self.model = None
        self._states: dict[int, _DraftState] = {}

    def load_model(self, target: torch.nn.Module) -> None:
        """Loads the draft from its own checkpoint (`target`: unused here, `EagleRunner`
        shares its modules)."""
        self.model = get_model(self.model_config, self.device)
        backend = get_attention_backend(self.model_config.attention_backend)
        for layer in self._attention_layers():
            layer.attn_backend = backend

    def _attention_layers(self) -> list[Attention]:
        return [m for m in self.model.modules() if isinstance(m, Attention)]

    def get_cache_block_size_bytes(self) -> int:
        # Made by the target's zeroed_cache: in the target's cache dtype.
        return kv_cache_block_bytes(self.model_config, self.block_size, self.tensor_parallel_size,
                                    cache_dtype=self.cache_dtype)

    def initialize_cache(self, num_blocks: int, zeroed_cache: Callable[[tuple[int, ...]], torch.Tensor]) -> None:
        """The draft's own KV cache: num_blocks blocks (the target's block ids) of its shape,
        made by `zeroed_cache` as the target's are."""
        shape = (num_blocks, self.block_size, self.model_config.num_kv_heads_per_rank(self.tensor_parallel_size),
                 self.model_config.head_size)
        for layer in self._attention_layers():
            layer.kv_cache = (zeroed_cache(shape), zeroed_cache(shape))

    def profile_held_state(self, num_tokens: int) -> torch.Tensor | None:
        """What this runner holds from one step to the next for a step of num_tokens rows,
        allocated so that the target's profile run counts it; a draft model keeps nothing
        outside its KV cache (sized with the target's blocks)."""
        return None

    def release_memory(self) -> None:
        """Drops the draft's KV cache and model (`ModelRunner.release_memory`)."""
        if self.model is not None:
            release_model(self.model)
        self.model = None
        self._states.clear()

    # ---- one step -------------------------------------------------------------------------

    def finish(self, req_ids: list[int]) -> None:
        """Forgets finished requests (also those a step without requests reports)."""
        for req_id in req_ids:
            self._states.pop(req_id, None)

    def propose(self, req: ExecuteModelRequest, runner) -> dict[int, torch.Tensor] | None:
        """Runs the draft over the step's tokens and fills every placeholder proposal of the
        step's requests. Returns, on rank 0, req_id -> [j, V] distributions of the proposals
        drawn at random (greedy requests' are one-hot and absent); None elsewhere."""
        inputs = [self._catch_up(scheduled) for scheduled in req.requests]
        proposing = [i for i, scheduled in enumerate(req.requests) if scheduled.spec_token_ids]
        logits = self._forward(inputs, proposing, runner)
        for scheduled, draft_input in zip(req.requests, inputs):
            state = self._states[scheduled.req_id]
            state.num_computed = draft_input.num_computed_tokens + len(draft_input.token_ids)
            state.proposed, state.proposed_at = [], state.num_computed
        if not proposing:
            return None

        requests = [req.requests[i] for i in proposing]
        distributions = self._draw_proposals(requests, logits, runner)
        for scheduled in requests:
            self._states[scheduled.req_id].proposed = scheduled.spec_token_ids
        return distributions

    def _draw_proposals(self, requests: list[ScheduledRequest], logits: torch.Tensor | None, runner,
                        carry: torch.Tensor | None = None) -> dict[int, torch.Tensor] | None:
        """Draws each request's proposals one step at a time, the first from `logits`, each
        next from `_proposal_forward` over the last drawn (with `carry`, one row per request
        still proposing, which the EAGLE head feeds back as its hidden states), and fills their
        `spec_token_ids`. Returns, on rank 0, req_id -> [j, V] distributions of the proposals
        drawn at random (greedy requests' are one-hot and absent); None elsewhere."""
        counts = [len(scheduled.spec_token_ids) for scheduled in requests]
        base = runner._sampling_metadata(requests) if self.rank == 0 else None
        # The proposals stay on the device until the last is drawn: step i's tokens, of the
        # requests then still proposing (active), feed step i + 1 as its input ids.
        drawn: list[torch.Tensor] = []
        probs: list[list[torch.Tensor]] = [[] for _ in requests]
        active = list(range(len(requests)))
        # Rank 0, when a request's sampling reads its history (penalties, min_tokens): the
        # active requests' proposals so far, [len(active), step], on the device.
        history = (torch.zeros(len(requests), 0, dtype=torch.long, device=self.device)
                   if base is not None and any(map(needs_token_history, base.sampling_params)) else None)
        for step in itertools.count():
            tokens = self._draw(logits, None if base is None else _rows_after(base, active, history), active, probs)
            drawn.append(tokens)
            still = [index for index, j in enumerate(active) if counts[j] > step + 1]
            if not still:
                break
            keep = None if len(still) == len(active) else to_device(still, self.device)
            if history is not None:
                history = torch.cat([history, tokens.unsqueeze(1)], dim=1)
                history = history if keep is None else history.index_select(0, keep)
            if keep is not None:
                tokens = tokens.index_select(0, keep)
                carry = None if carry is None else carry.index_select(0, keep)
            active = [active[index] for index in still]
            # The next proposal of each request still short of its count: feed the last one.
            step_inputs = [ScheduledRequest(req_id=requests[j].req_id, token_ids=[0],
                                            num_computed_tokens=self._proposal_position(requests[j], step),
                                            block_table=requests[j].block_table, num_prompt_tokens=0,
                                            sampling_params=None)
                           for j in active]
            logits, carry = self._proposal_forward(step_inputs, runner, tokens, carry)
        for scheduled, proposed in zip(requests, _read_proposals(drawn, counts)):
            scheduled.spec_token_ids = proposed
        if self.rank != 0:
            return None
        return {scheduled.req_id: torch.stack(rows) for scheduled, rows in zip(requests, probs) if rows}

    def _proposal_position(self, scheduled: ScheduledRequest, step: int) -> int:
        """The position of the proposal drawn at `step`: after what the draft has computed."""
        return self._states[scheduled.req_id].num_computed + step

    def _proposal_forward(self, step_inputs: list[ScheduledRequest], runner, tokens: torch.Tensor,
                          carry: torch.Tensor | None) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """The next proposals' logits, the last drawn `tokens` as input (the draft carries nothing)."""
        return self._forward(step_inputs, list(range(len(step_inputs))), runner, input_ids=tokens), None

    def _catch_up(self, scheduled: ScheduledRequest) -> ScheduledRequest:
        """The request's draft input this step: the accepted proposals the draft's KV lacks,
        then the step's tokens, from the draft's first position not computed."""
        start = scheduled.num_computed_tokens
        state = self._states.get(scheduled.req_id)
        pending: list[int] = []
        if scheduled.resumed or state is None:
            # (Re)admitted: the target's cached prefix was computed by the draft too.
            state = self._states[scheduled.req_id] = _DraftState(start)
        elif state.proposed:
            accepted = start - state.proposed_at
            assert 0 <= accepted <= len(state.proposed), (
                f"request {scheduled.req_id}: {accepted} of {len(state.proposed)} proposals accepted")
            written = min(accepted, len(state.proposed) - 1)
            pending = state.proposed[written:accepted]
            state.num_computed = state.proposed_at + written
            state.proposed = []
        assert state.num_computed + len(pending) == start, (
            f"request {scheduled.req_id}: the draft's KV reaches {state.num_computed} + {len(pending)}, "
            f"the target's {start}")
        return ScheduledRequest(req_id=scheduled.req_id, token_ids=pending + scheduled.token_ids,
                                num_computed_tokens=state.num_computed, block_table=scheduled.block_table,
                                num_prompt_tokens=scheduled.num_prompt_tokens, sampling_params=None)

    def _forward(self, inputs: list[ScheduledRequest], read: list[int], runner,
                 input_ids: torch.Tensor | None = None) -> torch.Tensor | None:
        """One draft forward; rank 0 returns fp32 logits of the last row of the inputs in
        `read`. input_ids: the step's tokens on the device, in place of the inputs' own
        (the last proposals, which the host has not read)."""
        host = runner._host_inputs(inputs)
        rows = [host.last_rows[i] for i in read]
        # One-row queries (runner.MAX_QUERY_AS_DECODE_ROWS): every row goes through the last
        # layer, so that the CPU's fused decode layers take the whole forward, and the rows
        # read are picked after.
        output_rows = None if host.is_decode_only else step_output_rows(rows, len(host.input_ids))
        staged_ids, positions, attn_metadata, rows_tensor, rows_metadata = runner._step_tensors(host, output_rows)
        with set_forward_context(attn_metadata, rows_tensor, output_rows, rows_metadata):
            hidden = self.model(staged_ids if input_ids is None else input_ids, positions)
        if not rows:
            return None
        if output_rows is None and len(rows) != hidden.shape[0]:
            hidden = hidden.index_select(0, to_device(rows, hidden.device))
        logits = self.model.compute_logits(hidden)
        return None if logits is None else logits.float()

    def _draw(self, logits: torch.Tensor | None, metadata: SamplingMetadata | None, active: list[int],
              probs: list[list[torch.Tensor]]) -> torch.Tensor:
        """The next proposal of each active request, drawn on rank 0 (metadata: one row per
        active request) and broadcast; [len(active)] on the device, unread."""
        if self.rank != 0:
            tokens = torch.zeros(len(active), dtype=torch.long, device=self.device)
        else:
            processed = process_logits_(logits, metadata)
            params = metadata.sampling_params
            greedy = [row for row, p in enumerate(params) if p.is_greedy]
            drawn = [row for row, p in enumerate(params) if not p.is_greedy]
            if not drawn:
                tokens = greedy_tokens(processed)
            else:
                tokens = torch.empty(len(active), dtype=torch.long, device=self.device)
                if greedy:
                    index = to_device(greedy, self.device)
                    tokens[index] = greedy_tokens(processed, index)
                index = to_device(drawn, self.device)
                temperature = to_device([params[row].temperature for row in drawn], self.device, processed.dtype)
                drawn_logits = processed if len(drawn) == len(active) else processed[index]
                q = sampling_probs(drawn_logits, [params[row] for row in drawn], temperature)
                # One uniform a row, from the request's own generator when seeded.
                u = torch.empty(len(drawn), dtype=torch.float32, device=self.device)
                for i, row in enumerate(drawn):
                    u[i].uniform_(generator=metadata.generators[row])
                tokens[index] = inverse_cdf(q, u)
                for i, row in enumerate(drawn):
                    probs[active[row]].append(q[i])
        if self.tensor_parallel_size > 1:
            tokens = tensor_model_parallel_broadcast(tokens, src=0)
        return tokens


def _read_proposals(drawn: list[torch.Tensor], counts: list[int]) -> list[list[int]]:
    """Each request's proposals, from the tokens of every draft step (step i's: one per
    request with more than i proposals, in request order), in one read of the device."""
    values = torch.cat(drawn).tolist()
    proposals: list[list[int]] = [[] for _ in counts]
    tokens = iter(values)
    for step in range(len(drawn)):
        for j, count in enumerate(counts):
            if count > step:
                proposals[j].append(next(tokens))
    return proposals


def _rows_after(base: SamplingMetadata, active: list[int], history: torch.Tensor | None) -> SamplingMetadata:
    """One row per active request j: its parameters, generator and history; `history`
    (the active requests' proposals so far, on the device) follows the tokens of the rows
    whose parameters read them."""
    metadata = base.subset(active)
    if history is not None and history.shape[1]:
        metadata.output_suffix = history
    return metadata
