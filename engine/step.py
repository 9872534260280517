"""The plain, picklable description of one engine step and of what the workers return.

The scheduler builds an ``ExecuteModelRequest``; the executor sends the same object to
every worker; each worker builds its input tensors from it locally. It is kept small on
purpose: a decoding sequence carries its one new token and its block table, not its
history (workers keep what the sampler needs between steps, keyed by ``seq_id``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from raylm.engine.sampling_params import SamplingParams


@dataclass
class ScheduledSequence:
    """One sequence's share of a step."""

    seq_id: int
    # Tokens whose KV is computed this step: the whole prompt (plus any earlier outputs
    # when recomputing after preemption) for a prefill, the last sampled token for a decode.
    token_ids: list[int]
    # Tokens of this sequence already in the KV cache; token_ids[i] sits at position
    # num_computed_tokens + i. 0 means the worker must forget any state it held for seq_id.
    num_computed_tokens: int
    block_table: list[int]
    num_prompt_tokens: int
    sampling_params: SamplingParams
    # Whether the last position's logits are sampled this step.
    do_sample: bool = True
    # The sequences that each draw one token from this step's last logits: [seq_id] as a
    # rule; every sibling of an n > 1 request at the end of its shared prompt prefill.
    sample_seq_ids: list[int] = field(default_factory=list)
    # Return logprobs of the prompt tokens of this chunk (first prefill only).
    compute_prompt_logprobs: bool = False

    def __post_init__(self) -> None:
        if not self.sample_seq_ids:
            self.sample_seq_ids = [self.seq_id]

    @property
    def is_prefill(self) -> bool:
        return len(self.token_ids) > 1 or self.num_computed_tokens == 0


@dataclass
class ExecuteModelRequest:
    seqs: list[ScheduledSequence]
    # (source block, destination block) copies to do before the forward: copy-on-write.
    blocks_to_copy: list[tuple[int, int]] = field(default_factory=list)
    # Sequences that ended since the last step: workers drop their sampler state.
    finished_seq_ids: list[int] = field(default_factory=list)


@dataclass
class TokenLogprobs:
    """Logprob of one chosen (sampled or prompt) token, and the top alternatives."""

    token_id: int
    logprob: float
    # 1 for the most likely token of the distribution.
    rank: int
    # The top-k (token_id, logprob) of the distribution, most likely first; k is the
    # request's logprobs / prompt_logprobs.
    top: list[tuple[int, float]] = field(default_factory=list)


@dataclass
class SequenceOutput:
    """The token one sequence drew this step."""

    seq_id: int
    token_id: int
    # Raw log-softmax of the model's logits for the drawn token (vLLM's default,
    # before temperature, penalties or truncation).
    logprob: float
    # Filled only when the request asked for logprobs.
    logprobs: TokenLogprobs | None = None


@dataclass
class SamplerOutput:
    outputs: list[SequenceOutput] = field(default_factory=list)
    # seq_id -> one entry per prompt token from the second on (the first has no context).
    prompt_logprobs: dict[int, list[TokenLogprobs]] = field(default_factory=dict)
