"""`PromptEmbedsCache`: a worker's embeddings of the running embeddings prompts
(enable_prompt_embeds; engine/prompt_embeds.py).

A request's embeddings arrive with its first step since (re)admission
(`ScheduledRequest.prompt_embeds`) and are kept until the chunk that takes their last rows (or
the request's end or preemption). Each step takes the rows its chunk covers, whatever its
start: a chunked prefill, or a prefix-cache hit that ends inside the prompt. Like
`EncoderCache`'s image embeddings, they then replace those rows of the embedding table's output
(`ModelRunner._run_model`). Which requests have an embeddings prompt is kept until they end:
their prompt tokens are unknown to penalties (`ModelRunner._update_states`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from raylm.engine.step import ScheduledRequest


@dataclass
class StepPromptEmbeds:
    """A step's given embeddings: the input rows they fill [rows], and their values [rows, hidden]."""

    rows: torch.Tensor
    embeddings: torch.Tensor


class PromptEmbedsCache:
    def __init__(self) -> None:
        # req_id -> the prompt's embeddings [num_prompt_tokens, hidden] on the device.
        self._embeds: dict[int, torch.Tensor] = {}
        # The running requests whose prompt is embeddings (kept past their prompt's rows).
        self.embeds_req_ids: set[int] = set()

    def __len__(self) -> int:
        return len(self._embeds)

    def release(self, req_ids: list[int]) -> None:
        """Forgets finished or preempted requests (a readmitted one sends its embeddings again)."""
        for req_id in req_ids:
            self._embeds.pop(req_id, None)
            self.embeds_req_ids.discard(req_id)

    def step_embeddings(self, requests: list[ScheduledRequest], device: torch.device) -> StepPromptEmbeds | None:
        """The step's input rows at embeddings-prompt positions and their embeddings, in the
        step's row order; None when no chunk of the step reaches such a position."""
        rows: list[int] = []
        pieces: list[torch.Tensor] = []
        row = 0
        for scheduled in requests:
            req_id = scheduled.req_id
            if scheduled.prompt_embeds is not None:
                self.embeds_req_ids.add(req_id)
                if scheduled.num_computed_tokens < scheduled.num_prompt_tokens:
                    self._embeds[req_id] = scheduled.prompt_embeds.to(device)
            embeds = self._embeds.get(req_id)
            if embeds is not None:
                start = scheduled.num_computed_tokens
                end = min(start + len(scheduled.token_ids), embeds.shape[0])
                if start < end:
                    pieces.append(embeds[start:end])
                    rows.extend(range(row, row + end - start))
                if end >= embeds.shape[0]:
                    del self._embeds[req_id]  # past its prompt: a recompute sends them again
            row += len(scheduled.token_ids) + len(scheduled.spec_token_ids or ())
        if not rows:
            return None
        return StepPromptEmbeds(torch.tensor(rows, dtype=torch.long, device=device), torch.cat(pieces))
