"""Sequences and sequence groups: the driver-side state of a request.

A request is one `SequenceGroup`; it holds one `Sequence` per sample (`best_of` of them,
created up front by the engine, all WAITING, all with the same prompt). The scheduler
moves sequences between statuses; the engine appends sampled tokens and decides when a
sequence finishes. Workers never see these objects, only `raylm.engine.step` types.
"""

from __future__ import annotations

import copy
import enum
from typing import Any

from raylm.engine.outputs import RequestMetrics
from raylm.engine.sampling_params import SamplingParams


class SequenceStatus(enum.IntEnum):
    # Ordered: every status after RUNNING is a finished one. An IntEnum hashes and compares
    # in C, and the engine asks these questions for every sequence every step.
    WAITING = enum.auto()
    RUNNING = enum.auto()
    # EOS, a stop token id or a stop string.
    FINISHED_STOPPED = enum.auto()
    # max_tokens or max_model_len reached.
    FINISHED_LENGTH_CAPPED = enum.auto()
    FINISHED_ABORTED = enum.auto()
    # The prompt can never be scheduled (longer than the context or the whole KV cache).
    FINISHED_IGNORED = enum.auto()

    @staticmethod
    def is_finished(status: "SequenceStatus") -> bool:
        return status > SequenceStatus.RUNNING

    @staticmethod
    def get_finished_reason(status: "SequenceStatus") -> str | None:
        """The OpenAI finish_reason: "stop", "length", "abort", or None while running.
        An ignored prompt reports "length", as in vLLM: it is too long to run."""
        return _FINISH_REASONS.get(status)


_FINISH_REASONS = {
    SequenceStatus.FINISHED_STOPPED: "stop",
    SequenceStatus.FINISHED_LENGTH_CAPPED: "length",
    SequenceStatus.FINISHED_ABORTED: "abort",
    SequenceStatus.FINISHED_IGNORED: "length",
}


class SequenceData:
    """The token ids of one sequence and how many of them sit in the KV cache."""

    def __init__(self, prompt_token_ids: list[int], output_token_ids: list[int] | None = None) -> None:
        self.prompt_token_ids = list(prompt_token_ids)
        self.output_token_ids = list(output_token_ids or [])
        self.cumulative_logprob = 0.0
        # Tokens whose KV is in the cache (or is being written by the step just scheduled).
        # Reset to 0 when the sequence is preempted and its blocks freed.
        self.num_computed_tokens = 0

    def append_token_id(self, token_id: int, logprob: float) -> None:
        self.output_token_ids.append(token_id)
        self.cumulative_logprob += logprob

    def get_len(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    def get_prompt_len(self) -> int:
        return len(self.prompt_token_ids)

    def get_output_len(self) -> int:
        return len(self.output_token_ids)

    def get_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def get_last_token_id(self) -> int:
        return self.output_token_ids[-1] if self.output_token_ids else self.prompt_token_ids[-1]

    def get_num_uncomputed_tokens(self) -> int:
        return self.get_len() - self.num_computed_tokens

    def __repr__(self) -> str:
        return (f"SequenceData(prompt_len={len(self.prompt_token_ids)}, output_token_ids={self.output_token_ids}, "
                f"num_computed_tokens={self.num_computed_tokens})")


class Sequence:
    """One sample of a request: its tokens, status and text (the engine holds its incremental detokenizer)."""

    def __init__(self, seq_id: int, prompt: str | None, prompt_token_ids: list[int], block_size: int) -> None:
        self.seq_id = seq_id
        self.prompt = prompt
        self.block_size = block_size
        self.data = SequenceData(prompt_token_ids)
        self.status = SequenceStatus.WAITING
        self.output_text = ""
        # One {token_id: Logprob} per output token, appended by the engine when the
        # request asked for logprobs.
        self.output_logprobs: list[Any] = []
        # The stop string or stop token id that ended the sequence; None for EOS/length.
        self.stop_reason: int | str | None = None
        # (tokens, characters) already streamed in DELTA mode.
        self.delta_offsets: tuple[int, int] = (0, 0)

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.data.prompt_token_ids

    @property
    def output_token_ids(self) -> list[int]:
        return self.data.output_token_ids

    def append_token_id(self, token_id: int, logprob: float, logprobs: Any = None) -> None:
        """Appends a sampled token; `logprobs` (the {token_id: Logprob} of this position),
        when given, goes to output_logprobs."""
        self.data.append_token_id(token_id, logprob)
        if logprobs is not None:
            self.output_logprobs.append(logprobs)

    def get_len(self) -> int:
        return self.data.get_len()

    def get_prompt_len(self) -> int:
        return self.data.get_prompt_len()

    def get_output_len(self) -> int:
        return self.data.get_output_len()

    def get_token_ids(self) -> list[int]:
        return self.data.get_token_ids()

    def get_last_token_id(self) -> int:
        return self.data.get_last_token_id()

    def get_cumulative_logprob(self) -> float:
        return self.data.cumulative_logprob

    def is_finished(self) -> bool:
        return self.status > SequenceStatus.RUNNING

    def fork(self, new_seq_id: int) -> "Sequence":
        """A copy with its own id and its own (deep-copied) token lists."""
        child = copy.deepcopy(self)
        child.seq_id = new_seq_id
        return child

    def __repr__(self) -> str:
        return f"Sequence(seq_id={self.seq_id}, status={self.status.name}, len={self.get_len()})"


class SequenceGroup:
    """The sequences of one request, sharing a prompt and sampling parameters."""

    def __init__(self, request_id: str, seqs: list[Sequence], sampling_params: SamplingParams,
                 arrival_time: float, prompt: str | None = None,
                 prompt_token_ids: list[int] | None = None) -> None:
        if not seqs:
            raise ValueError(f"SequenceGroup {request_id!r} needs at least one sequence.")
        self.request_id = request_id
        self.seqs = list(seqs)
        self.sampling_params = sampling_params
        self.arrival_time = arrival_time
        self.prompt = prompt if prompt is not None else seqs[0].prompt
        self.prompt_token_ids = list(prompt_token_ids if prompt_token_ids is not None else seqs[0].prompt_token_ids)
        # Position -> {token_id: Logprob}, first entry None; set by the engine.
        self.prompt_logprobs: list[Any] | None = None
        self.metrics = RequestMetrics(arrival_time=arrival_time)

    def get_seqs(self, status: SequenceStatus | None = None) -> list[Sequence]:
        if status is None:
            return list(self.seqs)
        return [seq for seq in self.seqs if seq.status == status]

    def get_unfinished_seqs(self) -> list[Sequence]:
        return [seq for seq in self.seqs if not seq.is_finished()]

    def get_finished_seqs(self) -> list[Sequence]:
        return [seq for seq in self.seqs if seq.is_finished()]

    def num_seqs(self, status: SequenceStatus | None = None) -> int:
        return len(self.get_seqs(status))

    def num_unfinished_seqs(self) -> int:
        return len(self.get_unfinished_seqs())

    def num_output_tokens(self) -> int:
        return sum(seq.get_output_len() for seq in self.seqs)

    def find(self, seq_id: int) -> Sequence:
        for seq in self.seqs:
            if seq.seq_id == seq_id:
                return seq
        raise ValueError(f"Sequence {seq_id} is not in request {self.request_id!r}.")

    def add(self, seq: Sequence) -> None:
        self.seqs.append(seq)

    def is_finished(self) -> bool:
        for seq in self.seqs:
            if seq.status <= SequenceStatus.RUNNING:
                return False
        return True

    def __repr__(self) -> str:
        return f"SequenceGroup(request_id={self.request_id!r}, seqs={self.seqs})"
