"""A request's token history as the sampler reads it on the host (penalties, min_tokens), kept by
the worker that samples; penalties kept on the device (executors/penalty_state.py) read none."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

# Tokens a new history has room for beyond those it starts with: a decode appends one a
# step, so the buffer first grows after this many.
_INITIAL_HEADROOM = 64


class TokenHistory:
    """A request's prompt then output token ids, in one int64 buffer that grows by doubling.

    A step appends its few new tokens (O(1) each); the sampler hands the buffer itself to
    the native penalty pass, which reads the first `num_tokens`. Converting every penalised
    row's history from Python lists each step instead cost ~3 ms a step at 64 rows of
    2k-token prompts, many times the penalty pass.

    Entries past `num_tokens` are not part of the history. `stage` writes proposals there
    (speculative decoding), so that the rows scoring the positions after them read the
    history followed by them without a copy; accepted ones join the history through
    `extend`, and the next append overwrites the rest.
    """

    __slots__ = ("_buffer", "token_ids", "num_tokens", "num_prompt_tokens")

    def __init__(self, token_ids: Sequence[int] = (), num_prompt_tokens: int | None = None) -> None:
        """`token_ids`: the history so far, of which the first `num_prompt_tokens` (all
        when None) are the prompt's (fewer are there while the prompt is prefilled in
        chunks: `extend` adds the rest)."""
        num_tokens = len(token_ids)
        self._buffer = np.empty(num_tokens + _INITIAL_HEADROOM, dtype=np.int64)
        self._buffer[:num_tokens] = token_ids
        # The buffer as a tensor (shared memory): what the sampler reads.
        self.token_ids = torch.from_numpy(self._buffer)
        self.num_tokens = num_tokens
        self.num_prompt_tokens = num_tokens if num_prompt_tokens is None else min(num_prompt_tokens, num_tokens)

    def extend(self, token_ids: Sequence[int], num_prompt_tokens: int = 0) -> None:
        """Appends a step's tokens, of which the first `num_prompt_tokens` are the prompt's
        (a prefill chunk; only while the history holds no output token)."""
        if num_prompt_tokens:
            assert self.num_prompt_tokens == self.num_tokens, "prompt tokens after output tokens"
            self.num_prompt_tokens += num_prompt_tokens
        self._write(token_ids)
        self.num_tokens += len(token_ids)

    def stage(self, token_ids: Sequence[int]) -> None:
        """Writes proposals right after the history, without making them part of it."""
        self._write(token_ids)

    @property
    def num_output_tokens(self) -> int:
        return self.num_tokens - self.num_prompt_tokens

    def prompt_token_ids(self) -> torch.Tensor:
        return self.token_ids[:self.num_prompt_tokens]

    def output_token_ids(self, num_tokens: int | None = None) -> torch.Tensor:
        """The output tokens among the first `num_tokens` (the history's when None; more
        reads staged proposals too)."""
        return self.token_ids[self.num_prompt_tokens:self.num_tokens if num_tokens is None else num_tokens]

    def output_tail(self, num_tokens: int, count: int) -> list[int]:
        """The last `count` (or fewer) output tokens among the first `num_tokens`, as a list
        (read from the host buffer: never a device's)."""
        start = max(self.num_prompt_tokens, num_tokens - count)
        return self._buffer[start:num_tokens].tolist()

    def _write(self, token_ids: Sequence[int]) -> None:
        start = self.num_tokens
        end = start + len(token_ids)
        if end > len(self._buffer):
            self._grow(end)
        if len(token_ids) == 1:
            self._buffer[start] = token_ids[0]  # a decode step: 4x cheaper than a slice
        else:
            self._buffer[start:end] = token_ids

    def _grow(self, capacity: int) -> None:
        """A buffer of at least twice the room, holding the history (a tensor handed out
        before keeps the old buffer alive and unchanged)."""
        buffer = np.empty(max(capacity, 2 * len(self._buffer)), dtype=np.int64)
        buffer[:self.num_tokens] = self._buffer[:self.num_tokens]
        self._buffer = buffer
        self.token_ids = torch.from_numpy(buffer)
