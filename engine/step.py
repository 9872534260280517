"""The plain, picklable description of one engine step and of what the workers return.

The scheduler builds an ``ExecuteModelRequest``; the executor sends the same object to
every worker; each worker builds its input tensors from it locally. It is kept small on
purpose: a decoding request carries its one new token and its block table, not its
history or its sampling parameters (workers keep what the sampler needs between steps,
keyed by ``req_id``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from raylm.engine.lora_request import LoRARequest
from raylm.engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from raylm.engine.multimodal.inputs import MultiModalFeature
    from raylm.executors.lora_adapter import AdapterDigest


# Stands in ScheduledRequest.token_ids for a token the previous step samples and the
# driver has not seen yet (async scheduling); the workers put in the token they sampled.
PLACEHOLDER_TOKEN_ID = -1


@dataclass
class ScheduledRequest:
    """One request's share of a step: a chunk of its prompt, or its last sampled token."""

    # The request's small integer name on the workers.
    req_id: int
    # Tokens whose KV is computed this step; token_ids[i] sits at position
    # num_computed_tokens + i. Only the last may be PLACEHOLDER_TOKEN_ID.
    token_ids: list[int]
    # Tokens of this request already in the KV cache (its own earlier steps, or a
    # prefix-cache hit).
    num_computed_tokens: int
    block_table: list[int]
    num_prompt_tokens: int
    # Sent in the request's first step since it was (re)admitted; later steps leave it
    # None and the workers use the copy they kept. Pickling 64 of them was 60% of a decode
    # step's message (16 KB against 6.7 KB without; 370 against 150 us to pickle and unpickle).
    sampling_params: SamplingParams | None
    # Whether the last position's logits are sampled: the chunk reaches the last known
    # token (a prefill chunk that does not is computed for its KV only).
    do_sample: bool = True
    # The first step since the request was admitted or readmitted after preemption: the
    # worker rebuilds its sampler state from `context_token_ids` (sent only when the
    # request's sampling reads its history) plus `token_ids`, and keeps its random stream.
    resumed: bool = False
    context_token_ids: list[int] | None = None
    # Which child of an n > 1 request this is: its seeded random stream depends on it.
    sample_index: int = 0
    # Prompt logprobs wanted from this chunk: the rows from `prompt_logprobs_start`
    # (a position) on, each scored against the next prompt token, in `prompt_logprobs_targets`.
    prompt_logprobs_start: int = 0
    prompt_logprobs_targets: list[int] | None = None
    # The LoRA adapter slot the request runs under this step (-1: the base model).
    lora_slot: int = -1
    # Speculative decoding: tokens proposed after token_ids (the request's last verified
    # token), at the positions that follow it, for the target to verify in this step.
    # PLACEHOLDER_TOKEN_ID entries are proposed by the workers' draft model. The sampled
    # output then holds 1 to len + 1 tokens for the request (see SamplerOutput).
    spec_token_ids: list[int] | None = None
    # Multi-modal: the request's images (their pixels and placeholder positions), sent in its
    # first step since it was (re)admitted, like sampling_params; the workers keep them and
    # compute each image's embeddings once, when a chunk first reaches its placeholders.
    mm_features: list[MultiModalFeature] | None = None
    # An embeddings prompt (enable_prompt_embeds): its embeddings, a CPU tensor [num_prompt_tokens,
    # hidden_size] of the model's dtype, sent in every first step since the request was
    # (re)admitted, like sampling_params; the workers feed its rows at the prompt positions in
    # place of token_ids' placeholders, and treat its prompt tokens as unknown to penalties.
    prompt_embeds: Any = None
    # A pooling request that pools every prompt token (token_classify): the workers return
    # the head's output at each row of every chunk, not one pooled vector at the prompt's end.
    pools_every_token: bool = False


@dataclass
class ExecuteModelRequest:
    requests: list[ScheduledRequest]
    # Requests that ended since the last step: workers drop their sampler state.
    finished_req_ids: list[int] = field(default_factory=list)
    # Requests preempted since the last step (vLLM's preempted_req_ids): workers give back
    # what a request holds only while it runs (a penalty state row); the rest stays for
    # its readmission, which rebuilds its state (ScheduledRequest.resumed).
    preempted_req_ids: list[int] = field(default_factory=list)
    # LoRA: the adapters that this step puts in slots (slot -> adapter and the digest of its
    # files, which a worker that must read them again checks), before it runs.
    lora_activations: dict[int, tuple[LoRARequest, AdapterDigest]] | None = None
    # Structured outputs: the next-token bitmask (int32 [k, ceil(V / 32)], bit j of a row
    # set where token j is allowed) of the k sampled requests in `structured_output_req_ids`,
    # row i for req_id structured_output_req_ids[i]; the sampler masks the others to -inf.
    grammar_bitmask: np.ndarray | None = None
    structured_output_req_ids: list[int] = field(default_factory=list)


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
class SampledToken:
    """The token one request drew this step."""

    req_id: int
    token_id: int
    # Raw log-softmax of the model's logits for the drawn token (vLLM's default,
    # before temperature, penalties or truncation); None when the request needs none
    # (SamplingParams.needs_sampled_logprob).
    logprob: float | None
    # Filled only when the request asked for logprobs.
    logprobs: TokenLogprobs | None = None
    # The model's logits for this row held NaN or +inf (weights or an adapter that overflow
    # in this dtype): token_id is a placeholder and the engine fails the request alone.
    logits_not_finite: bool = False


@dataclass
class SamplerOutput:
    # One token per sampled request, or, for a request that verified proposals
    # (ScheduledRequest.spec_token_ids), its accepted proposals then the token the target
    # drew after them, consecutive and in order.
    outputs: list[SampledToken] = field(default_factory=list)
    # req_id -> one entry per prompt row scored this step (see ScheduledRequest).
    prompt_logprobs: dict[int, list[TokenLogprobs]] = field(default_factory=dict)
    # LoRA: the adapters this step could not put in their slots (a worker had to read one
    # again and could not), as (lora_int_id, digest of the files read) -> (error class name,
    # message). Their slots ran empty, so their requests' tokens are not theirs: the engine
    # fails those requests (requests of the same id under another digest, which an adapter
    # removed and added again with other files has, hold another slot and go on).
    lora_failures: dict[tuple[int, Any], tuple[str, str]] = field(default_factory=dict)
    # req_id -> why the request failed in this step (a custom logits processor raised): its
    # token is a placeholder and the engine ends the request with this message.
    request_errors: dict[int, str] | None = None
    # Pooling runner: req_id -> the pooled final hidden state (float32, CPU) of each request
    # whose prompt ended in this step (see executors/pooling_model_runner.py).
    pooler_output: dict[int, Any] | None = None
