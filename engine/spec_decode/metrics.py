"""Speculative-decoding counters (vLLM's SpecDecodingStats): drafts, proposed tokens,
accepted tokens, and acceptance per draft position."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SpecDecodingStats:
    # Verification steps that carried at least one proposed token, one per request.
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    # [i]: proposals at position i (0-based) accepted.
    num_accepted_tokens_per_pos: list[int] = field(default_factory=list)

    def observe(self, num_draft_tokens: int, num_accepted_tokens: int) -> None:
        if num_draft_tokens <= 0:
            return
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted_tokens
        per_pos = self.num_accepted_tokens_per_pos
        if len(per_pos) < num_accepted_tokens:
            per_pos.extend([0] * (num_accepted_tokens - len(per_pos)))
        for i in range(num_accepted_tokens):
            per_pos[i] += 1

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens a verification step yields on average: the accepted ones plus the one the
        target samples itself (vLLM's definition); 0 before any draft."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    def take(self) -> "SpecDecodingStats":
        """These counts, and resets them (the periodic log line's interval)."""
        taken = SpecDecodingStats(self.num_drafts, self.num_draft_tokens, self.num_accepted_tokens,
                                  self.num_accepted_tokens_per_pos)
        self.num_drafts = self.num_draft_tokens = self.num_accepted_tokens = 0
        self.num_accepted_tokens_per_pos = []
        return taken
