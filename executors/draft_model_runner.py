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
rejection sampler) and broadcasts them, so that every rank feeds the same tokens. The
proposals then fill the request's PLACEHOLDER_TOKEN_ID entries of `spec_token_ids`.

What the draft's KV holds is tracked per request: proposals e_1..e_j write the KV of
e_1..e_{j-1} while proposing; the next step's num_computed_tokens says how many were
accepted, so the draft knows which of those slots hold verified tokens, and feeds e_j again
when all were accepted (its KV was never written).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from raylm.engine.config import EngineConfig, kv_cache_block_bytes
from raylm.engine.step import ExecuteModelRequest, ScheduledRequest
from raylm.executors.sampler import inverse_cdf, process_logits, sampling_probs
from raylm.executors.sampling_metadata import SamplingMetadata
from raylm.kernels.backend import get_attention_backend
from raylm.models import get_model
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
        self.rank = rank
        self.device = device
        self.model = None
        self._states: dict[int, _DraftState] = {}

    def load_model(self) -> None:
        self.model = get_model(self.model_config, self.device)
        backend = get_attention_backend(self.model_config.attention_backend)
        for layer in self._attention_layers():
            layer.attn_backend = backend

    def _attention_layers(self) -> list[Attention]:
        return [m for m in self.model.modules() if isinstance(m, Attention)]

    def get_cache_block_size_bytes(self) -> int:
        return kv_cache_block_bytes(self.model_config, self.block_size, self.tensor_parallel_size)

    def initialize_cache(self, num_blocks: int, zeroed_cache: Callable[[tuple[int, ...]], torch.Tensor]) -> None:
        """The draft's own KV cache: num_blocks blocks (the target's block ids) of its shape,
        made by `zeroed_cache` as the target's are."""
        shape = (num_blocks, self.block_size, self.model_config.num_kv_heads_per_rank(self.tensor_parallel_size),
                 self.model_config.head_size)
        for layer in self._attention_layers():
            layer.kv_cache = (zeroed_cache(shape), zeroed_cache(shape))

    def release_memory(self) -> None:
        """Drops the draft's KV cache and model (`ModelRunner.release_memory`)."""
        if self.model is not None:
            for layer in self._attention_layers():
                layer.kv_cache = None
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
        base = runner._sampling_metadata(requests) if self.rank == 0 else None
        proposals: list[list[int]] = [[] for _ in requests]
        probs: list[list[torch.Tensor]] = [[] for _ in requests]
        active = list(range(len(requests)))
        while True:
            tokens = self._draw(logits, base, requests, active, proposals, probs)
            for j, token in zip(active, tokens):
                proposals[j].append(token)
            active = [j for j in active if len(proposals[j]) < len(requests[j].spec_token_ids)]
            if not active:
                break
            # The next proposal of each request still short of its count: feed the last one.
            step_inputs = [ScheduledRequest(req_id=requests[j].req_id, token_ids=[proposals[j][-1]],
                                            num_computed_tokens=self._states[requests[j].req_id].num_computed
                                            + len(proposals[j]) - 1,
                                            block_table=requests[j].block_table, num_prompt_tokens=0,
                                            sampling_params=None)
                           for j in active]
            logits = self._forward(step_inputs, list(range(len(step_inputs))), runner)
        for scheduled, tokens in zip(requests, proposals):
            scheduled.spec_token_ids = tokens
            state = self._states[scheduled.req_id]
            state.proposed = tokens
        if self.rank != 0:
            return None
        return {scheduled.req_id: torch.stack(rows) for scheduled, rows in zip(requests, probs) if rows}

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

    def _forward(self, inputs: list[ScheduledRequest], read: list[int], runner) -> torch.Tensor | None:
        """One draft forward; rank 0 returns fp32 logits of the last row of the inputs in `read`."""
        host = runner._host_inputs(inputs)
        rows = [host.last_rows[i] for i in read]
        # One-row queries (runner.MAX_QUERY_AS_DECODE_ROWS): every row goes through the last
        # layer, so that the CPU's fused decode layers take the whole forward, and the rows
        # read are picked after.
        output_rows = None if host.is_decode_only else step_output_rows(rows, len(host.input_ids))
        input_ids, positions, attn_metadata, rows_tensor, rows_metadata = runner._step_tensors(host, output_rows)
        with set_forward_context(attn_metadata, rows_tensor, output_rows, rows_metadata):
            hidden = self.model(input_ids, positions)
        if not rows:
            return None
        if output_rows is None and len(rows) != hidden.shape[0]:
            hidden = hidden[torch.tensor(rows, device=hidden.device)]
        logits = self.model.compute_logits(hidden)
        return None if logits is None else logits.float()

    def _draw(self, logits: torch.Tensor | None, base: SamplingMetadata | None, requests: list[ScheduledRequest],
              active: list[int], proposals: list[list[int]], probs: list[list[torch.Tensor]]) -> list[int]:
        """The next proposal of each active request, drawn on rank 0 and broadcast."""
        tokens = torch.zeros(len(active), dtype=torch.long, device=self.device)
        if self.rank == 0:
            metadata = _rows_after(base, active, proposals)
            processed = process_logits(logits, metadata)
            params = metadata.sampling_params
            greedy = [row for row, p in enumerate(params) if p.is_greedy]
            drawn = [row for row, p in enumerate(params) if not p.is_greedy]
            if greedy:
                index = torch.tensor(greedy, device=self.device)
                tokens[index] = processed[index].max(dim=-1).indices
            if drawn:
                index = torch.tensor(drawn, device=self.device)
                temperature = torch.tensor([params[row].temperature for row in drawn], dtype=processed.dtype,
                                           device=self.device)
                q = sampling_probs(processed[index], [params[row] for row in drawn], temperature)
                # One uniform a row, from the request's own generator when seeded.
                u = torch.empty(len(drawn), dtype=torch.float32, device=self.device)
                for i, row in enumerate(drawn):
                    u[i].uniform_(generator=metadata.generators[row])
                tokens[index] = inverse_cdf(q, u)
                for i, row in enumerate(drawn):
                    probs[active[row]].append(q[i])
        if self.tensor_parallel_size > 1:
            tokens = tensor_model_parallel_broadcast(tokens, src=0)
        return tokens.tolist()


def _rows_after(base: SamplingMetadata, active: list[int], proposals: list[list[int]]) -> SamplingMetadata:
    """One row per active request j: its parameters and generator, and (when it keeps one)
    its history followed by its proposals so far, staged in the history's buffer."""
    rows = base.subset(active)
    for row, j in enumerate(active):
        history = rows.histories[row]
        if history is not None and proposals[j]:
            history.stage(proposals[j])
            rows.history_lens[row] += len(proposals[j])
    return rows
