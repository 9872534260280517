"""`Request`: the driver-side state of one sequence being generated.

A request is one prompt and one stream of output tokens; the scheduler advances its
`num_computed_tokens` toward its length (a chunk of the prompt, or one token per decode
step) and the engine core appends the sampled tokens. `n > 1` and `best_of` are not a
request's business: the front end fans them out into child requests that share the prompt
through the prefix cache. Workers never see these objects, only `raylm.engine.step` types.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from raylm.engine.lora_request import LoRARequest
from raylm.engine.sampling_params import ParameterError, SamplingParams

if TYPE_CHECKING:
    from raylm.engine.multimodal.inputs import MultiModalFeature
    from raylm.engine.pooling_params import PoolingParams
    from raylm.engine.structured_output.request import StructuredOutputRequest
    from raylm.executors.lora_adapter import AdapterDigest


class RequestStatus(enum.IntEnum):
    # Ordered: every status after PREEMPTED is a finished one. An IntEnum compares in C,
    # and the core asks these questions for every request every step.
    WAITING = enum.auto()
    # Waiting for its grammar to compile (vLLM's name): the scheduler passes over it.
    WAITING_FOR_FSM = enum.auto()
    RUNNING = enum.auto()
    # Its blocks were taken back; it waits to be recomputed from what is still cached.
    PREEMPTED = enum.auto()
    # EOS, a stop token id or a stop string.
    FINISHED_STOPPED = enum.auto()
    # max_tokens or max_model_len reached.
    FINISHED_LENGTH_CAPPED = enum.auto()
    FINISHED_ABORTED = enum.auto()

    @staticmethod
    def is_finished(status: "RequestStatus") -> bool:
        return status > RequestStatus.PREEMPTED

    @staticmethod
    def get_finished_reason(status: "RequestStatus") -> str | None:
        """The OpenAI finish_reason: "stop", "length", "abort", or None while running."""
        return _FINISH_REASONS.get(status)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH_CAPPED: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
}


# Most characters of a request's cache_salt (vLLM sets no bound; a salt is an opaque tenant
# key, and 1024 characters hold any hash or id).
MAX_CACHE_SALT_CHARS = 1024

# The range of a request's priority: a 32-bit signed integer (vLLM sets no bound; this one
# holds any tiering scheme and keeps the value a plain machine integer).
MIN_PRIORITY = -(2**31)
MAX_PRIORITY = 2**31 - 1


def check_priority(priority: object, policy: str) -> int:
    """A request's priority as the engine takes it: an int (not a bool) in [MIN_PRIORITY,
    MAX_PRIORITY], and 0 (the default) unless the engine schedules by priority (vLLM refuses
    a priority under "fcfs" too). Raises ParameterError naming "priority"."""
    if isinstance(priority, bool) or not isinstance(priority, int):
        raise ParameterError(f"priority must be an integer, got {priority!r} ({type(priority).__name__}).",
                             "priority")
    if not MIN_PRIORITY <= priority <= MAX_PRIORITY:
        raise ParameterError(f"priority must be between {MIN_PRIORITY} and {MAX_PRIORITY}, got {priority}.",
                             "priority")
    if priority != 0 and policy != "priority":
        raise ParameterError(f"priority must be 0 under the {policy!r} scheduling policy, got {priority}: start "
                             f"the engine with scheduling_policy='priority' (--scheduling-policy priority) to "
                             f"order requests by priority.", "priority")
    return priority


@dataclass(eq=False)
class Request:
    """One prompt and its output tokens, as the scheduler and the KV-cache manager see it.

    `sampling_params` is the engine's private copy (its stop ids and max_tokens filled in);
    `sample_index` tells the children of an `n > 1` request apart (their seeded random
    streams differ by it).
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    arrival_time: float
    sample_index: int = 0
    # Under the "priority" scheduling policy, lower is served first (ties by arrival_time);
    # always 0 under "fcfs".
    priority: int = 0
    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    # Prompt then outputs, appended as tokens arrive (never rebuilt by concatenation).
    all_token_ids: list[int] = field(default_factory=list)
    # Tokens whose KV is in the cache or is written by the steps already scheduled; with
    # async scheduling this counts the placeholders too.
    num_computed_tokens: int = 0
    # Tokens sampled by steps scheduled but not yet collected (async scheduling): the next
    # step may compute them already, as placeholders the workers fill in.
    num_output_placeholders: int = 0
    # Prompt tokens found in the prefix cache when the request was last admitted.
    num_cached_tokens: int = 0
    # Prompt positions whose logprobs were already returned (they are never recomputed).
    num_prompt_logprobs_done: int = 0
    # The hash of each full block of all_token_ids, in order (filled by the KV-cache manager).
    block_hashes: list[bytes] = field(default_factory=list)
    stop_reason: int | str | None = None
    # Scheduled since it was last admitted: the first step after (re)admission tells the
    # workers to rebuild what they keep about it.
    resumed: bool = True
    # A small int that names the request on the workers (cheaper to send than the id).
    worker_id: int = -1
    # vLLM's per-tenant prefix-cache salt: part of the first block's hash, so requests share
    # cached KV only with requests of the same salt (or, unsalted, with unsalted ones).
    cache_salt: str | None = None
    # The LoRA adapter the request runs under (None: the base model); part of the first
    # block's hash too, so that only requests of the same adapter share cached KV.
    lora_request: LoRARequest | None = None
    # The digest of the adapter's files when the engine checked it: the workers serve the
    # request only from those bytes.
    lora_digest: AdapterDigest | None = None
    # The grammar and matcher of a request with structured outputs (None without).
    structured_output_request: StructuredOutputRequest | None = None
    # Speculative decoding: the proposals of this request's verification step in flight
    # (their KV slots are allocated and num_computed_tokens counts them until the step's
    # output says how many were accepted); empty otherwise.
    spec_token_ids: list[int] = field(default_factory=list)
    # A pooling request (runner="pooling"): its prompt is prefilled and pooled, nothing is
    # sampled. Its sampling_params are then the engine's one-step stand-in (max_tokens=1),
    # which ends its scheduling once its last chunk is in flight.
    pooling_params: PoolingParams | None = None
    # A pooling request that pools every token: the head's rows of its chunks so far, each
    # with the position it starts at (a chunk computed again after a preemption replaces them).
    pooled_token_rows: list[tuple[int, Any]] = field(default_factory=list)
    # The images of a multi-modal prompt, in the order of their placeholder tokens (their
    # content hashes go into the hashes of the blocks that hold those tokens).
    mm_features: list[MultiModalFeature] = field(default_factory=list)
    # An embeddings prompt (enable_prompt_embeds): the given embeddings, a CPU tensor
    # [num_prompt_tokens, hidden_size] of the model's dtype, kept until the request ends (a
    # preempted request sends them to the workers again); prompt_token_ids then holds
    # placeholders. Their content goes into the hashes of the blocks that hold them.
    prompt_embeds: Any = None

    def __post_init__(self) -> None:
        if not self.all_token_ids:
            self.all_token_ids = list(self.prompt_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status > RequestStatus.PREEMPTED

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)

    def __repr__(self) -> str:
        return (f"Request({self.request_id!r}, status={self.status.name}, tokens={self.num_tokens}, "
                f"computed={self.num_computed_tokens})")
