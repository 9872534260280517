"""How many tokens each request proposes this step: adaptive, from its own acceptance.

A proposed token pays off only when every token before it is accepted too. With a
per-token acceptance rate a, the j-th proposal is accepted with chance a^j and costs
`draft_token_cost` of a decode step (one more row in the verification forward), so a
request proposes the largest j <= num_speculative_tokens with a^j >= draft_token_cost.
The rate is estimated per request from its recent verifications (accepted tokens over
accepted tokens plus rejections, geometrically discounted so that a request whose text
changes character adapts within a few steps). A request whose rate falls below the cost
proposes nothing, except one token every PROBE_INTERVAL steps, so that it notices when
proposals become good again.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

# Weight of the past in the acceptance estimate, per verification step.
DECAY = 0.8
# The prior: as if 2 of 3 proposals had been accepted, so that a new request tries a few.
PRIOR_ACCEPTED = 2.0
PRIOR_TRIALS = 3.0
# A request proposing nothing still proposes one token this often (in steps).
PROBE_INTERVAL = 16


@dataclass
class _Acceptance:
    # Discounted counts of accepted proposals and of trials (accepted ones plus
    # rejections), starting from the prior, which fades like any other observation.
    accepted: float = PRIOR_ACCEPTED
    trials: float = PRIOR_TRIALS
    steps_without_drafts: int = 0

    @property
    def rate(self) -> float:
        return self.accepted / self.trials


class AdaptiveDraftLength:
    def __init__(self, num_speculative_tokens: int, draft_token_cost: float, adaptive: bool = True) -> None:
        self.num_speculative_tokens = num_speculative_tokens
        self.draft_token_cost = draft_token_cost
        self.adaptive = adaptive
        self._requests: dict[str, _Acceptance] = {}

    def num_drafts(self, request_id: str) -> int:
        """The draft length for the request's next step, before the step's own limits
        (budget, max_tokens, max_model_len)."""
        k = self.num_speculative_tokens
        if not self.adaptive:
            return k
        state = self._requests.get(request_id)
        if state is None:
            state = self._requests[request_id] = _Acceptance()
        rate = state.rate
        if rate >= 1.0 or self.draft_token_cost <= 0.0:
            return k
        # Largest j with rate^j >= cost.
        j = 0 if rate <= 0.0 else min(k, int(math.log(self.draft_token_cost) / math.log(rate) + 1e-9))
        if j == 0:
            state.steps_without_drafts += 1
            if state.steps_without_drafts >= PROBE_INTERVAL:
                state.steps_without_drafts = 0
                return 1
        return j

    def record(self, request_id: str, num_drafts: int, num_accepted: int) -> None:
        """A verification of num_drafts proposals, of which the first num_accepted were accepted."""
        state = self._requests.get(request_id)
        if state is None or num_drafts <= 0:
            return
        rejected = 1 if num_accepted < num_drafts else 0
        state.accepted = DECAY * state.accepted + num_accepted
        state.trials = DECAY * state.trials + num_accepted + rejected
        state.steps_without_drafts = 0

    def free(self, request_id: str) -> None:
        self._requests.pop(request_id, None)
