"""What a request returns: `RequestOutput` holding one `CompletionOutput` per sample; a pooling
request's `PoolingRequestOutput` (`EmbeddingRequestOutput` from `LLM.embed`,
`ClassificationRequestOutput` from `LLM.classify`, `ScoringRequestOutput` from `LLM.score`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

# Position -> {token id -> Logprob}: the chosen token plus the top alternatives.
SampleLogprobs = list[dict[int, "Logprob"]]
PromptLogprobs = list[dict[int, "Logprob"] | None]


@dataclass
class Logprob:
    """The log-probability of a token, its rank in the distribution (1 = most likely)
    and its text."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass
class CompletionOutput:
    """One generated sequence of a request.

    finish_reason is "stop" (EOS, a stop token or a stop string), "length" (max_tokens or
    the context ran out), "abort", or None while generating. stop_reason is the stop
    string or stop token id that ended it (None for EOS or other reasons).
    cumulative_logprob is the sum of the generated tokens' raw logprobs; as in vLLM V1 it
    is None unless the request asked for logprobs (or ranks best_of > n samples by it).
    """

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: SampleLogprobs | None
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    """Times (time.time()) and token counts of one request, over all its samples."""

    arrival_time: float
    first_token_time: float | None = None
    finished_time: float | None = None
    num_generation_tokens: int = 0
    # Prompt tokens whose KV came from the prefix cache.
    num_cached_tokens: int = 0


@dataclass
class RequestOutput:
    """The state of one request: its prompt and its samples so far (or final)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    prompt_logprobs: PromptLogprobs | None
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics | None = field(default=None, repr=False)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_cached_tokens(self) -> int | None:
        """Prompt tokens whose KV came from the prefix cache (vLLM's field)."""
        return self.metrics.num_cached_tokens if self.metrics is not None else None


@dataclass
class PoolingOutput:
    """The pooled vector of one prompt (float32, on the CPU)."""

    data: "torch.Tensor"


@dataclass
class PoolingRequestOutput:
    """What a pooling request returns (vLLM's): its prompt's tokens, as pooled (after
    truncate_prompt_tokens), and its vector. Always finished: it is made in one go."""

    request_id: str
    outputs: PoolingOutput
    prompt_token_ids: list[int]
    finished: bool = True
    metrics: RequestMetrics | None = field(default=None, repr=False)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)


@dataclass
class EmbeddingOutput:
    """One embedding as a list of floats (vLLM's EmbeddingOutput)."""

    embedding: list[float]

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


@dataclass
class EmbeddingRequestOutput:
    """`LLM.embed`'s result for one prompt (vLLM's): `outputs.embedding`."""

    request_id: str
    outputs: EmbeddingOutput
    prompt_token_ids: list[int]
    finished: bool = True

    @classmethod
    def from_base(cls, output: PoolingRequestOutput) -> "EmbeddingRequestOutput":
        return cls(output.request_id, EmbeddingOutput(output.outputs.data.tolist()), output.prompt_token_ids,
                   output.finished)


@dataclass
class ClassificationOutput:
    """One prompt's class probabilities (vLLM's ClassificationOutput): the classifier's
    logits through its activation, or the logits themselves with use_activation=False."""

    probs: list[float]

    @property
    def num_classes(self) -> int:
        return len(self.probs)


@dataclass
class ClassificationRequestOutput:
    """`LLM.classify`'s result for one prompt (vLLM's): `outputs.probs`."""

    request_id: str
    outputs: ClassificationOutput
    prompt_token_ids: list[int]
    finished: bool = True

    @classmethod
    def from_base(cls, output: PoolingRequestOutput) -> "ClassificationRequestOutput":
        return cls(output.request_id, ClassificationOutput(output.outputs.data.tolist()), output.prompt_token_ids,
                   output.finished)


@dataclass
class ScoringOutput:
    """The score of one pair (vLLM's ScoringOutput): a cross-encoder's activated logit, or
    the cosine similarity of two embeddings."""

    score: float


@dataclass
class ScoringRequestOutput:
    """`LLM.score`'s result for one pair (vLLM's): `outputs.score`. prompt_token_ids are the
    pair's tokens as the cross-encoder read them; for two embeddings, the first text's, the
    pad token (where the tokenizer has one) and the second's, as vLLM reports them."""

    request_id: str
    outputs: ScoringOutput
    prompt_token_ids: list[int]
    finished: bool = True

    @classmethod
    def from_base(cls, output: PoolingRequestOutput) -> "ScoringRequestOutput":
        data = output.outputs.data
        if data.numel() != 1:
            raise ValueError(f"A score is one number; the pooled output holds {data.numel()}.")
        return cls(output.request_id, ScoringOutput(float(data.reshape(-1)[0])), output.prompt_token_ids,
                   output.finished)
