"""Penalised requests' penalty state kept on the device, in rows allocated once per engine.

vLLM's repetition penalty reads which tokens a request's prompt and output hold, its
frequency and presence penalties how often each token occurs in the output. On the CPU the
native penalty pass reads the host's token histories (executors/token_history.py). On a GPU
that meant padding every penalised row's prompt and output on the host and copying them over
each step (~1 MB a step at 64 rows of 2k-token prompts), and waiting for a deferred step's
tokens to reach the host before the next step could be launched. Here each penalised request
holds a row of two [max_num_seqs, V] tensors: a bool mask of its prompt's tokens and an int32
count of each output token. A row takes a request's tokens as the host history does, when
they come in as a step's input: prompt tokens once, chunk by chunk as the prompt is
prefilled; a drawn token in the next step, which feeds it to the model (from the previous
step's token tensor on the device when the host has not read it yet: deferred reads, so no
step waits for the host to count it); a verification's accepted proposals once verified
(they are never a step's input again). A (re)admitted request's row is rebuilt from its
tokens. The sampler then penalises from the rows, with nothing sent per step but the rows'
indices (and a verification's proposals, which each of its rows reads after the row).

Memory: max_num_seqs x V x 5 bytes (164 MiB for 256 rows of Llama 3's 128k vocabulary),
allocated before the KV cache is sized, so the cache is sized around it. The prompt mask
stays one byte a token rather than one bit: the penalty reads it as it is, where a packed
mask would need an unpacking pass over [rows, V] each step to save a fifth of the memory.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch

from raylm.engine.step import ScheduledRequest
from raylm.executors.input_staging import to_device


@dataclass
class _Row:
    index: int
    # The request's tokens (prompt, then output) the row holds: those at positions below.
    num_tokens: int = 0


def penalty_state_bytes(max_num_rows: int, vocab_size: int) -> int:
    """Bytes of the state: an int32 count and a bool mask per row and vocabulary entry."""
    return max_num_rows * vocab_size * (4 + 1)


class PenaltyState:
    """Rows of per-request penalty state on one device, keyed by req_id."""

    def __init__(self, max_num_rows: int, vocab_size: int, device: torch.device) -> None:
        self.vocab_size = vocab_size
        self.device = torch.device(device)
        # [rows, V]: how often each token occurs in the request's output.
        self.output_counts = torch.zeros(max_num_rows, vocab_size, dtype=torch.int32, device=device)
        # [rows, V]: whether the token occurs in the request's prompt.
        self.prompt_mask = torch.zeros(max_num_rows, vocab_size, dtype=torch.bool, device=device)
        self._free_rows = list(range(max_num_rows - 1, -1, -1))  # popped from the end: row 0 first
        self._rows: dict[int, _Row] = {}

    @property
    def nbytes(self) -> int:
        return penalty_state_bytes(self.output_counts.shape[0], self.vocab_size)

    @property
    def num_free_rows(self) -> int:
        return len(self._free_rows)

    def row_of(self, req_id: int) -> int:
        return self._rows[req_id].index

    def has_row(self, req_id: int) -> bool:
        return req_id in self._rows

    def release(self, req_ids: Iterable[int]) -> None:
        """Gives back the rows of requests that finished, were aborted or were preempted (a
        preempted one is given a fresh row when readmitted). A row is zeroed when it is
        next assigned, behind whatever work on it is queued on the device."""
        for req_id in req_ids:
            row = self._rows.pop(req_id, None)
            if row is not None:
                self._free_rows.append(row.index)

    def update(self, requests: list[ScheduledRequest],
               holes: dict[int, tuple[torch.Tensor, int]] | None = None,
               unknown_prompt_req_ids: set[int] | frozenset[int] = frozenset()) -> None:
        """Brings the rows of the step's penalised `requests` up to the step's tokens, before
        the step samples: a (re)admitted request's row is rebuilt from `context_token_ids`
        and `token_ids`; otherwise the step's tokens are added (a prompt chunk, the token the
        last step drew, the tokens a recomputed request replays), which start where the row's
        end. `holes`: req_id -> (token tensor on the device, row in it) for a last token the
        host has not read yet: it is counted from there. `unknown_prompt_req_ids`: requests
        whose prompt tokens are unknown (embeddings prompts): their prompt masks stay empty."""
        holes = holes or {}
        vocab = self.vocab_size
        reset: list[int] = []
        prompt_entries: list[int] = []  # row * V + token, into the flat views
        output_entries: list[int] = []
        # id(token tensor) -> (the tensor, the rows' bases, the positions of their tokens in it)
        hole_entries: dict[int, tuple[torch.Tensor, list[int], list[int]]] = {}
        for scheduled in requests:
            req_id = scheduled.req_id
            row = self._rows.get(req_id)
            if scheduled.resumed or row is None:
                row = self._assign(req_id, row)
                reset.append(row.index)
                context = scheduled.context_token_ids or []
                assert len(context) == scheduled.num_computed_tokens, (
                    f"request {req_id}: its row needs the {scheduled.num_computed_tokens} tokens before the step")
                tokens, start = context + scheduled.token_ids, 0
            else:
                tokens, start = scheduled.token_ids, scheduled.num_computed_tokens
            assert row.num_tokens == start, (
                f"request {req_id}: its penalty row holds {row.num_tokens} tokens, the step starts at {start}")
            row.num_tokens = start + len(tokens)
            base = row.index * vocab
            hole = holes.get(req_id)
            if hole is not None:  # always the last token, and an output token
                entry = hole_entries.setdefault(id(hole[0]), (hole[0], [], []))
                entry[1].append(base)
                entry[2].append(hole[1])
                tokens = tokens[:-1]
            num_prompt = max(0, scheduled.num_prompt_tokens - start)  # tokens[:num_prompt] are the prompt's
            if req_id not in unknown_prompt_req_ids:
                prompt_entries.extend(base + token for token in tokens[:num_prompt])
            output_entries.extend(base + token for token in tokens[num_prompt:])
        device = self.device
        if reset:
            index = to_device(reset, device)
            self.output_counts.index_fill_(0, index, 0)
            self.prompt_mask.index_fill_(0, index, False)
        if prompt_entries:
            self.prompt_mask.view(-1).index_fill_(0, to_device(prompt_entries, device), True)
        if output_entries:
            self._count(to_device(output_entries, device))
        for token_ids, bases, positions in hole_entries.values():
            self._count(token_ids.index_select(0, to_device(positions, device)) + to_device(bases, device))

    def add_output_tokens(self, tokens: dict[int, list[int]]) -> None:
        """Counts output tokens that never come in as a step's input: req_id -> a
        verification's accepted proposals."""
        entries: list[int] = []
        for req_id, token_ids in tokens.items():
            base = self._advance(req_id, len(token_ids)) * self.vocab_size
            entries.extend(base + token for token in token_ids)
        if entries:
            self._count(to_device(entries, self.device))

    def _advance(self, req_id: int, num_tokens: int) -> int:
        row = self._rows[req_id]
        row.num_tokens += num_tokens
        return row.index

    def _count(self, flat_index: torch.Tensor) -> None:
        ones = torch.ones(flat_index.shape[0], dtype=torch.int32, device=self.device)
        self.output_counts.view(-1).index_add_(0, flat_index, ones)

    def _assign(self, req_id: int, row: _Row | None) -> _Row:
        """The request's row, emptied: its own if it holds one, else a free one."""
        if row is None:
            if not self._free_rows:
                raise RuntimeError(f"No penalty row is free for request {req_id}: all {self.output_counts.shape[0]} "
                                   f"are held (more penalised requests at once than max_num_seqs)")
            row = self._rows[req_id] = _Row(self._free_rows.pop())
        row.num_tokens = 0
        return row
