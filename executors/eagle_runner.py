"""The EAGLE head of speculative decoding (`method: "eagle"`), run on the worker beside the
target (`models/llama_eagle.py` says what the head computes).

The head at position i reads the target's final hidden state h_i and the token at i + 1.
Both are known only once the target has run position i and the token after it was
verified, so the head runs one step behind the target, at the start of each step, before
the target's forward (as the draft model does, `DraftModelRunner`):

1. Catch-up: one head forward over every request's positions that the target verified
   since the head last ran (the last step's prompt chunk, or its last token plus the
   accepted proposals), from the hidden states the target returned then and the verified
   tokens after them (this step's first token included). It writes the head's KV there.
   The last row of a request that proposes gives its first proposal.
2. j - 1 more one-row forwards, each feeding the last proposal and the head's own hidden
   state, give the rest; they write head KV at positions the next catch-up overwrites
   with the target's verified hidden states.
3. After the target's forward, `record` keeps each request's new rows' hidden states
   (the target returns every row when EAGLE is on) for the next catch-up.

KV: the head has its own cache blocks under the target's block ids (one layer's worth per
head layer, sized with the target's), rather than a recompute window: a catch-up is then
only the positions verified since the last step, and attention over the whole context
costs one layer's decode. Prefix caching: a request that hits cached blocks reads the
head's KV those blocks hold (written when they were computed, by whichever request did);
the positions the head had not caught up when that request stopped hold stale KV, which
lowers the acceptance rate, never the output (the target verifies every proposal).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from raylm.engine.step import ExecuteModelRequest, ScheduledRequest
from raylm.executors.draft_model_runner import DraftModelRunner
from raylm.executors.input_staging import to_device
from raylm.kernels.backend import get_attention_backend
from raylm.models.forward_context import set_forward_context
from raylm.models.llama_eagle import EagleLlamaForCausalLM
from raylm.models.loader import _default_dtype
from raylm.models.rotary_embedding import max_model_len_context
from raylm.models.weight_utils import safetensors_weights_iterator


@dataclass
class _HeadState:
    # The target's last forward of the request: its first position, the tokens it ran
    # (proposals included) and its final hidden states, one row per token.
    start: int = 0
    tokens: list[int] = field(default_factory=list)
    hidden: torch.Tensor | None = None


class EagleRunner(DraftModelRunner):
    """`DraftModelRunner`'s interface (cache, sleep, finish, propose) over an EAGLE head."""

    # Most rows of one catch-up forward; None: max_num_batched_tokens. (Tests lower it to
    # split catch-ups that would not need it.)
    catch_up_rows: int | None = None

    def load_model(self, target: nn.Module) -> None:
        config = self.model_config
        with _default_dtype(config.dtype), torch.device(self.device), max_model_len_context(config.max_model_len):
            head = EagleLlamaForCausalLM(config.hf_config, target)
        loaded = head.load_weights(safetensors_weights_iterator(config.model))
        missing = sorted({name for name, _ in head.named_parameters()} - loaded)
        if missing:
            raise ValueError(f"EAGLE head checkpoint in {config.model!r} lacks parameters {missing}.")
        for module in head.modules():
            hook = getattr(module, "process_weights_after_loading", None)
            if hook is not None:
                hook()
        self.model = head.eval()
        backend = get_attention_backend(config.attention_backend)
        for layer in self._attention_layers():
            layer.attn_backend = backend

    def profile_held_state(self, num_tokens: int) -> torch.Tensor:
        # `record` keeps the target's final hidden state of every row of a step until the
        # head's catch-up in the next step, whose forward is the target's peak.
        config = self.model_config
        return torch.empty(num_tokens, config.hf_config.hidden_size, dtype=config.dtype, device=self.device)

    # ---- one step -------------------------------------------------------------------------

    def propose(self, req: ExecuteModelRequest, runner) -> dict[int, torch.Tensor] | None:
        """Catches the head up over every request's verified positions and fills the
        placeholder proposals. Returns, on rank 0, req_id -> [j, V] distributions of the
        proposals drawn at random (greedy requests' are one-hot and absent)."""
        inputs: list[ScheduledRequest] = []
        hiddens: list[torch.Tensor] = []
        index_of: dict[int, int] = {}
        for scheduled in req.requests:
            caught_up = self._catch_up_input(scheduled)
            if caught_up is not None:
                index_of[scheduled.req_id] = len(inputs)
                inputs.append(caught_up[0])
                hiddens.append(caught_up[1])
        requests = [s for s in req.requests if s.spec_token_ids]
        # A request that proposes without a verified hidden state to start from (none
        # recorded since it was admitted) proposes its last token again: a deterministic
        # proposal, verified exactly like an n-gram one.
        for scheduled in requests:
            if scheduled.req_id not in index_of:
                scheduled.spec_token_ids = [scheduled.token_ids[-1]] * len(scheduled.spec_token_ids)
        requests = [s for s in requests if s.req_id in index_of]
        if not inputs:
            return None
        logits, hidden = self._catch_up(inputs, hiddens, [index_of[s.req_id] for s in requests], runner)
        if not requests:
            return None

        return self._draw_proposals(requests, logits, runner, carry=hidden)

    def _proposal_position(self, scheduled: ScheduledRequest, step: int) -> int:
        # Proposal step + 2 sits at position c + step + 1: the head reads the last proposal
        # at position c + step with its own hidden state from that row.
        return scheduled.num_computed_tokens + step

    def _proposal_forward(self, step_inputs: list[ScheduledRequest], runner, tokens: torch.Tensor,
                          carry: torch.Tensor | None) -> tuple[torch.Tensor | None, torch.Tensor]:
        """The head's next logits and hidden states from the last proposals and its own hidden states."""
        return self._forward(step_inputs, list(range(len(step_inputs))), runner, tokens, carry)

    def _catch_up(self, inputs: list[ScheduledRequest], hiddens: list[torch.Tensor], read: list[int], runner
                  ) -> tuple[torch.Tensor | None, torch.Tensor]:
        """The catch-up forwards: the logits and head hidden states of the last row of each
        input in `read`, in that order. Each forward takes at most max_num_batched_tokens
        rows (what the CUDA path's staging buffer holds): a request's rows are those of
        one earlier step, but requests skipped by the last step bring older steps' rows."""
        limit = self.catch_up_rows or runner.scheduler_config.max_num_batched_tokens
        groups: list[list[int]] = [[]]
        rows = 0
        for index, scheduled in enumerate(inputs):
            if groups[-1] and rows + len(scheduled.token_ids) > limit:
                groups.append([])
                rows = 0
            groups[-1].append(index)
            rows += len(scheduled.token_ids)
        if len(groups) == 1:
            return self._forward(inputs, read, runner, None, torch.cat(hiddens))
        group_of = {index: (g, group.index(index)) for g, group in enumerate(groups) for index in group}
        logits_parts: list[torch.Tensor] = []
        hidden_parts: list[torch.Tensor] = []
        order: list[int] = []
        for g, group in enumerate(groups):
            group_read = [index for index in read if group_of[index][0] == g]
            logits, hidden = self._forward([inputs[i] for i in group], [group_of[i][1] for i in group_read], runner,
                                           None, torch.cat([hiddens[i] for i in group]))
            order.extend(group_read)
            hidden_parts.append(hidden)
            if logits is not None:
                logits_parts.append(logits)
        if not read:
            return None, hiddens[0][:0]
        # The groups' rows back in the order of `read`.
        position = {index: n for n, index in enumerate(order)}
        back = to_device([position[index] for index in read], hiddens[0].device)
        hidden = torch.cat(hidden_parts).index_select(0, back)
        logits = torch.cat(logits_parts).index_select(0, back) if logits_parts else None
        return logits, hidden

    def _catch_up_input(self, scheduled: ScheduledRequest) -> tuple[ScheduledRequest, torch.Tensor] | None:
        """The head's input over the request's positions verified since its last catch-up
        (each with the target's hidden state and the token after it), or None when there
        are none; the request's recorded state is used up."""
        start = scheduled.num_computed_tokens
        state = self._states.pop(scheduled.req_id, None)
        if scheduled.resumed or state is None or state.hidden is None:
            return None
        verified = start - state.start
        assert 0 <= verified <= len(state.tokens), (
            f"request {scheduled.req_id}: {verified} of the {len(state.tokens)} tokens recorded are verified")
        if verified == 0:
            return None
        tokens = state.tokens[1:verified] + scheduled.token_ids[:1]
        return (ScheduledRequest(req_id=scheduled.req_id, token_ids=tokens, num_computed_tokens=state.start,
                                 block_table=scheduled.block_table, num_prompt_tokens=0, sampling_params=None),
                state.hidden[:verified])

    def _forward(self, inputs: list[ScheduledRequest], read: list[int], runner, input_ids: torch.Tensor | None,
                 hidden_states: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor]:
        """One head forward over every row (the head's layers are few: no output rows);
        returns rank 0's fp32 logits (None elsewhere) and the head's hidden states of the
        last row of each input in `read`."""
        host = runner._host_inputs(inputs)
        staged_ids, positions, attn_metadata, _, _ = runner._step_tensors(host, None)
        with set_forward_context(attn_metadata):
            hidden = self.model(staged_ids if input_ids is None else input_ids, positions, hidden_states)
        rows = [host.last_rows[i] for i in read]
        if not rows:
            return None, hidden[:0]
        if len(rows) != hidden.shape[0]:
            hidden = hidden.index_select(0, to_device(rows, hidden.device))
        logits = self.model.compute_logits(hidden)
        return (None if logits is None else logits.float()), hidden

    def record(self, requests: list[ScheduledRequest], last_rows: list[int], hidden_states: torch.Tensor) -> None:
        """Keeps the target's final hidden states of each request's rows of this step (all
        rows of the forward, `hidden_states`) for the next step's catch-up."""
        for scheduled, last in zip(requests, last_rows):
            tokens = scheduled.token_ids + (scheduled.spec_token_ids or [])
            first = last + 1 - len(tokens)
            # A copy: on a GPU the rows may be a CUDA graph's output buffer.
            self._states[scheduled.req_id] = _HeadState(scheduled.num_computed_tokens, tokens,
                                                        hidden_states[first:last + 1].clone())
