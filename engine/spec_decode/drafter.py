"""`Drafter`: the driver's side of speculative decoding, asked by the scheduler for each
decoding request's proposals and told by the engine core what was accepted.

With the n-gram method it returns the proposed tokens themselves. With a draft model the
workers propose; it returns as many PLACEHOLDER_TOKEN_ID as the workers are to propose, so
that the scheduler budgets and allocates KV slots for them all the same.
"""

from __future__ import annotations

from raylm.engine.request import Request
from raylm.engine.spec_decode.config import SpeculativeConfig
from raylm.engine.spec_decode.draft_length import AdaptiveDraftLength
from raylm.engine.spec_decode.metrics import SpecDecodingStats
from raylm.engine.spec_decode.ngram_proposer import NgramProposer
from raylm.engine.step import PLACEHOLDER_TOKEN_ID


class Drafter:
    def __init__(self, config: SpeculativeConfig, max_model_len: int) -> None:
        self.config = config
        self.max_model_len = max_model_len
        self.ngram = (NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)
                      if config.method == "ngram" else None)
        self.draft_lengths = AdaptiveDraftLength(config.num_speculative_tokens, config.draft_token_cost,
                                                 config.adaptive)
        # Since the engine started (the /metrics counters; the log line takes differences).
        self.stats = SpecDecodingStats()
        # Under async scheduling a request waits for its step in flight before it looks
        # for proposals (Scheduler._schedule_running), so a lookup that finds nothing has
        # cost it its place in the pipeline: it then counts as a rejected proposal.
        self.misses_count_as_rejections = False

    def num_drafts(self, request: Request, budget: int, num_running: int) -> int:
        """How many tokens the decoding request should propose this step: its adaptive draft
        length, bounded by the step's remaining token budget (its own token included), its
        max_tokens and max_model_len; 0 while more than disable_by_batch_size requests run,
        and always 0 for a request with structured outputs: its grammar's bitmask covers the
        one token after its last, and a proposal verified without the bitmask at its position
        could be accepted though the grammar forbids it."""
        if request.structured_output_request is not None:
            return 0
        limit = self.config.disable_by_batch_size
        if limit is not None and num_running > limit:
            return 0
        params = request.sampling_params
        room = min(self.config.num_speculative_tokens, budget - 1,
                   params.max_tokens - request.num_output_tokens - 1,
                   self.max_model_len - request.num_tokens - 1)
        if room <= 0:
            return 0
        return min(room, self.draft_lengths.num_drafts(request.request_id))

    def propose(self, request: Request, num_drafts: int) -> list[int]:
        """Up to num_drafts tokens to follow the request's last one (placeholders for the
        draft model to fill); [] when the n-gram lookup finds nothing."""
        if self.ngram is None:
            return [PLACEHOLDER_TOKEN_ID] * num_drafts
        drafts = self.ngram.propose(request.request_id, request.all_token_ids, num_drafts)
        if not drafts and self.misses_count_as_rejections:
            self.draft_lengths.record(request.request_id, 1, 0)
        return drafts

    def record(self, request: Request, num_drafts: int, num_accepted: int) -> None:
        """A verification's outcome: the first num_accepted of num_drafts were accepted."""
        self.stats.observe(num_drafts, num_accepted)
        self.draft_lengths.record(request.request_id, num_drafts, num_accepted)

    def free(self, request: Request) -> None:
        if self.ngram is not None:
            self.ngram.free(request.request_id)
        self.draft_lengths.free(request.request_id)

