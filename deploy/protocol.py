"""Request and response bodies of the OpenAI-compatible API, with vLLM's extra fields.

Field names, defaults and response shapes follow OpenAI's API as vLLM's server implements
it, so the `openai` client and tools written for vLLM work unchanged. Unknown request
fields are accepted and ignored, as vLLM does.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any, Literal

from pydantic import (AliasChoices, BaseModel, ConfigDict, Field, PrivateAttr, StrictBool, StrictFloat, StrictInt,
                      StrictStr, field_validator, model_validator)

from raylm.engine.request import MAX_CACHE_SALT_CHARS, MAX_PRIORITY, MIN_PRIORITY
from raylm.engine.sampling_params import ParameterError, RequestOutputKind, SamplingParams, truncated_prompt
from raylm.engine.structured_output.params import StructuredOutputsParams

# Logprobs: OpenAI allows at most 20 alternatives per position in chat and 5 in completions;
# vLLM bounds both by its max_logprobs engine argument (default 20), and so does raylm's
# server (OpenAIServing.check_logprobs), with the other request limits (deploy/limits.py).


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


class OpenAIBaseModel(BaseModel):
    model_config = ConfigDict(extra="allow")


class OpenAIRequest(OpenAIBaseModel):
    """A request body, whose text must be Unicode. JSON's \\ud800-\\udfff escapes can spell a
    lone surrogate, which Python keeps in a str but nothing downstream can encode: the
    tokenizer raises on it, and a constraint holding one would make the grammar compile
    worker look dead (every constrained request a 503 for a while). Refused here, once, with
    a 400 naming the field."""

    @model_validator(mode="before")
    @classmethod
    def _check_unicode(cls, data: Any) -> Any:
        if isinstance(data, dict):
            for name, value in data.items():
                if name in cls.model_fields and not _is_unicode(value):
                    raise ParameterError(f"{name} holds a lone UTF-16 surrogate (a \\ud800-\\udfff escape without "
                                         f"its pair), which is not Unicode text.", name)
        return data


def _is_unicode(value: Any) -> bool:
    """Whether every string in a JSON value (keys included) encodes as UTF-8."""
    try:
        json.dumps(value, ensure_ascii=False).encode()
    except UnicodeEncodeError:
        return False
    except (ValueError, TypeError, RecursionError):
        return True  # not the JSON its field takes: the field's own validation says so
    return True


# ------------------------------------------------------------------ errors
class ErrorInfo(OpenAIBaseModel):
    message: str
    type: str
    param: str | None = None
    code: int


class ErrorResponse(OpenAIBaseModel):
    error: ErrorInfo


# ------------------------------------------------------------------ shared
class StreamOptions(OpenAIBaseModel):
    include_usage: bool | None = True
    continuous_usage_stats: bool | None = False

    @property
    def usage_per_chunk(self) -> bool:
        """vLLM's continuous usage: every chunk carries its choice's usage so far (with
        include_usage only)."""
        return bool(self.include_usage and self.continuous_usage_stats)


class CompletionTokensDetails(OpenAIBaseModel):
    reasoning_tokens: int = 0


class PromptTokensDetails(OpenAIBaseModel):
    cached_tokens: int = 0


class UsageInfo(OpenAIBaseModel):
    prompt_tokens: int = 0
    total_tokens: int = 0
    completion_tokens: int | None = 0
    # Chat under --reasoning-parser: the completion's tokens spent reasoning (OpenAI's field).
    completion_tokens_details: CompletionTokensDetails | None = None
    # --enable-prompt-tokens-details: the prompt's tokens served from the prefix cache.
    prompt_tokens_details: PromptTokensDetails | None = None


class ModelPermission(OpenAIBaseModel):
    id: str = Field(default_factory=lambda: random_id("modelperm"))
    object: str = "model_permission"
    created: int = Field(default_factory=lambda: int(time.time()))
    allow_create_engine: bool = False
    allow_sampling: bool = True
    allow_logprobs: bool = True
    allow_search_indices: bool = False
    allow_view: bool = True
    allow_fine_tuning: bool = False
    organization: str = "*"
    group: str | None = None
    is_blocking: bool = False


class ModelCard(OpenAIBaseModel):
    id: str
    object: str = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "raylm"
    root: str | None = None
    parent: str | None = None
    max_model_len: int | None = None
    permission: list[ModelPermission] = Field(default_factory=lambda: [ModelPermission()])


class ModelList(OpenAIBaseModel):
    object: str = "list"
    data: list[ModelCard] = Field(default_factory=list)


# ------------------------------------------- structured outputs and tools
class JsonSchemaResponseFormat(OpenAIBaseModel):
    model_config = ConfigDict(extra="allow", populate_by_name=True)
    name: str | None = None
    description: str | None = None
    # `schema` in the body (the name shadows a pydantic attribute).
    json_schema: dict[str, Any] | bool | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(OpenAIBaseModel):
    type: Literal["text", "json_object", "json_schema", "structural_tag"]
    json_schema: JsonSchemaResponseFormat | None = None
    # type "structural_tag" (vLLM's): xgrammar's `format`, or the legacy `structures` and
    # `triggers` (checked where the constraint is built, deploy/structured_outputs.py).
    format: Any = None
    structures: Any = None
    triggers: Any = None


class StructuredOutputFields(OpenAIRequest):
    """The request fields that may ask for an output constraint, in completions and chat
    (read by deploy/structured_outputs.py)."""

    response_format: ResponseFormat | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    # Accepted for vLLM clients that send them; raylm has one backend, xgrammar.
    guided_decoding_backend: str | None = None
    guided_whitespace_pattern: str | None = None


class FunctionDefinition(OpenAIBaseModel):
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ChatCompletionToolsParam(OpenAIBaseModel):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class ChatCompletionNamedFunction(OpenAIBaseModel):
    name: str


class ChatCompletionNamedToolChoiceParam(OpenAIBaseModel):
    type: Literal["function"] = "function"
    function: ChatCompletionNamedFunction


ToolChoice = Literal["none", "auto", "required"] | ChatCompletionNamedToolChoiceParam


class FunctionCall(OpenAIBaseModel):
    name: str
    arguments: str


class ToolCall(OpenAIBaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


# One value of vllm_xargs (JSON true/false is not one: lax parsing would read it as 1 / 0).
_XArg = StrictStr | StrictInt | StrictFloat


class _SamplingFields(StructuredOutputFields):
    """Sampling fields shared by completions and chat (OpenAI's and vLLM's extras), and the
    output-constraint fields (deploy/structured_outputs.py)."""

    model: str | None = None
    frequency_penalty: float | None = 0.0
    logit_bias: dict[str, float] | None = None
    n: int = 1
    presence_penalty: float | None = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: float | None = None
    top_p: float | None = None
    user: str | None = None
    # vLLM's extra sampling fields.
    best_of: int | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: list[StrictInt] | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    prompt_logprobs: int | None = None
    # vLLM's token masks and prompt truncation (SamplingParams documents them); sizes are
    # checked before the prompt is tokenized (`check_token_fields`).
    allowed_token_ids: list[StrictInt] | None = None
    bad_words: list[str] | None = None
    truncate_prompt_tokens: StrictInt | None = None
    # SamplingParams.detokenize: false returns token ids only (ask for them with
    # return_token_ids); the text is "".
    detokenize: StrictBool = True  # JSON true/false only: lax parsing reads "no" as false
    # vLLM's per-tenant prefix-cache salt: requests share cached KV only with requests of the
    # same salt (checked here, before tokenizing, as the engine checks LLM prompts).
    cache_salt: str | None = Field(default=None, min_length=1, max_length=MAX_CACHE_SALT_CHARS)
    # vLLM's token ids in the response. return_tokens_as_token_ids: logprobs name each token
    # (and each alternative) `token_id:{id}` instead of its text; unset, the server's
    # --return-tokens-as-token-ids decides. return_token_ids: the prompt's and each choice's
    # token ids beside the text (token_ids per chunk when streamed, the prompt's in the first).
    return_tokens_as_token_ids: bool | None = None
    return_token_ids: bool | None = None
    # vLLM's request priority: lower is served first under --scheduling-policy priority; any
    # value but 0 is a 400 under fcfs (OpenAIServing.check_priority). A JSON integer only
    # (not true, 1.0 or "1"), within a 32-bit signed range.
    priority: StrictInt = Field(default=0, ge=MIN_PRIORITY, le=MAX_PRIORITY)
    # vLLM's custom arguments: strings, numbers or lists of them, handed to the engine's
    # custom logits processors as SamplingParams.extra_args (docs/logits_processors.md).
    vllm_xargs: dict[str, _XArg | list[_XArg]] | None = None

    def with_cache_salt(self, prompt: dict[str, Any]) -> dict[str, Any]:
        """The engine's prompt dict, with this request's cache_salt when it has one."""
        return prompt if self.cache_salt is None else {**prompt, "cache_salt": self.cache_salt}

    @model_validator(mode="after")
    def _check_stream_options(self) -> "_SamplingFields":
        if self.stream_options is not None and not self.stream:
            raise ParameterError("stream_options may only be set when stream is true.", "stream_options")
        if self.stream and self.best_of is not None and self.best_of > self.n:
            raise ParameterError("best_of must equal n when streaming: the best samples are known only at the end.",
                                 "best_of")
        return self

    def check_token_fields(self, vocab_size: int, max_model_len: int) -> None:
        """allowed_token_ids, bad_words, truncate_prompt_tokens and detokenize (with stop)
        by SamplingParams' own rules, before anything is tokenized: ParameterError naming
        the field."""
        if (self.allowed_token_ids is None and self.bad_words is None and self.truncate_prompt_tokens is None
                and self.detokenize):
            return
        params = SamplingParams(allowed_token_ids=self.allowed_token_ids, bad_words=self.bad_words,
                                truncate_prompt_tokens=self.truncate_prompt_tokens, detokenize=self.detokenize,
                                stop=self.stop)
        params.verify_vocab(vocab_size)
        params.truncated_prompt([], max_model_len)

    def truncated(self, token_ids: list[int], max_model_len: int) -> list[int]:
        """The prompt's token ids as the request runs them (truncate_prompt_tokens)."""
        return truncated_prompt(token_ids, self.truncate_prompt_tokens, max_model_len)

    def _sampling_params(self, max_tokens: int | None, logprobs: int | None, default_max_tokens: int,
                         prompt_logprobs: int | None, model_defaults: dict[str, Any] | None = None,
                         structured_outputs: StructuredOutputsParams | None = None,
                         **beam_search: Any) -> SamplingParams:
        """Builds the engine's SamplingParams; raises ParameterError naming a bad field.
        Sampling fields the request leaves unset take `model_defaults` (the model's
        generation_config.json, as vLLM's --generation-config auto), else vLLM's defaults."""
        defaults = {**_VLLM_SAMPLING_DEFAULTS, **(model_defaults or {})}

        def pick(name: str) -> Any:
            value = getattr(self, name)
            return defaults[name] if value is None else value

        if max_tokens is None:
            # The rest of the context, or less where the model's generation_config.json
            # sets max_new_tokens (as LLM's default SamplingParams have it).
            max_tokens = min(default_max_tokens, defaults.get("max_tokens") or default_max_tokens)
        logit_bias = None
        if self.logit_bias:
            try:
                logit_bias = {int(token): float(bias) for token, bias in self.logit_bias.items()}
            except ValueError:
                raise ParameterError(f"logit_bias keys must be token ids (integers as strings), got "
                                     f"{list(self.logit_bias)!r}.", "logit_bias") from None
        return SamplingParams(
            n=self.n,
            best_of=self.best_of,
            presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            repetition_penalty=pick("repetition_penalty"),
            temperature=pick("temperature"),
            top_p=pick("top_p"),
            top_k=pick("top_k"),
            min_p=pick("min_p"),
            seed=self.seed,
            stop=self.stop,
            stop_token_ids=self.stop_token_ids,
            include_stop_str_in_output=self.include_stop_str_in_output,
            ignore_eos=self.ignore_eos,
            max_tokens=max_tokens,
            min_tokens=self.min_tokens,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            skip_special_tokens=self.skip_special_tokens,
            spaces_between_special_tokens=self.spaces_between_special_tokens,
            logit_bias=logit_bias,
            output_kind=RequestOutputKind.DELTA if self.stream else RequestOutputKind.FINAL_ONLY,
            structured_outputs=structured_outputs,
            allowed_token_ids=self.allowed_token_ids,
            bad_words=self.bad_words,
            truncate_prompt_tokens=self.truncate_prompt_tokens,
            detokenize=self.detokenize,
            extra_args=self.vllm_xargs,
            **beam_search,
        )


# The sampling fields a request may leave unset, and vLLM's values for them.
_VLLM_SAMPLING_DEFAULTS = {"repetition_penalty": 1.0, "temperature": 1.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0}


# ------------------------------------------------------------- completions
class CompletionRequest(_SamplingFields):
    # JSON integers only: lax parsing reads `true` as token id 1 and "5" as 5.
    # At least one of prompt and prompt_embeds (vLLM's: base64 of torch.save(tensor [num_tokens,
    # hidden_size]), one string or a list; the server's --enable-prompt-embeds). Embeddings
    # prompts come first in the choices, then the text or token-id ones, as in vLLM.
    prompt: str | list[str] | list[StrictInt] | list[list[StrictInt]] | None = None
    prompt_embeds: str | list[str] | None = None
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    add_special_tokens: bool = True
    # vLLM 0.4's beam search fields: best_of beams, the n best returned (not streamed).
    use_beam_search: bool = False
    length_penalty: float = 1.0
    early_stopping: bool | Literal["never"] = False

    @model_validator(mode="after")
    def _check_completion(self) -> "CompletionRequest":
        if self.suffix is not None:
            raise ParameterError("suffix is not supported.", "suffix")
        if self.prompt is None and self.prompt_embeds is None:
            raise ParameterError("Give prompt or prompt_embeds (or both).", "prompt")
        if isinstance(self.prompt, list) and not self.prompt:
            raise ParameterError("prompt must not be an empty list.", "prompt")
        if isinstance(self.prompt_embeds, list) and not self.prompt_embeds:
            raise ParameterError("prompt_embeds must not be an empty list.", "prompt_embeds")
        if self.logprobs is not None and self.logprobs < 0:
            raise ParameterError(f"logprobs must be non-negative, got {self.logprobs}.", "logprobs")
        return self

    def prompts(self) -> list[str | list[int]]:
        """The prompt field as a list of prompts (text or token ids)."""
        prompt = self.prompt
        if prompt is None or (prompt == "" and self.prompt_embeds is not None):
            return []  # vLLM's clients send prompt="" beside prompt_embeds (OpenAI's SDK requires a prompt)
        if isinstance(prompt, str):
            return [prompt]
        if all(isinstance(p, int) for p in prompt):
            return [list(prompt)]
        return list(prompt)

    def prompt_embeds_payloads(self) -> list[str]:
        """The prompt_embeds field as a list of base64 payloads."""
        embeds = self.prompt_embeds
        return [] if embeds is None else [embeds] if isinstance(embeds, str) else list(embeds)

    def to_sampling_params(self, default_max_tokens: int, model_defaults: dict[str, Any] | None = None,
                           structured_outputs: StructuredOutputsParams | None = None) -> SamplingParams:
        prompt_logprobs = self.prompt_logprobs
        if self.echo and self.logprobs is not None:
            prompt_logprobs = self.logprobs
        return self._sampling_params(self.max_tokens, self.logprobs, default_max_tokens, prompt_logprobs,
                                     model_defaults, structured_outputs, use_beam_search=self.use_beam_search,
                                     length_penalty=self.length_penalty, early_stopping=self.early_stopping)


class CompletionLogProbs(OpenAIBaseModel):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class CompletionResponseChoice(OpenAIBaseModel):
    index: int
    text: str
    logprobs: CompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    prompt_logprobs: list[dict[int, Any] | None] | None = None
    # With return_token_ids (vLLM's placement: on each choice in completions).
    prompt_token_ids: list[int] | None = None
    token_ids: list[int] | None = None


class CompletionResponse(OpenAIBaseModel):
    id: str = Field(default_factory=lambda: random_id("cmpl"))
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionResponseChoice]
    usage: UsageInfo


class CompletionResponseStreamChoice(OpenAIBaseModel):
    index: int
    text: str
    logprobs: CompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    # With return_token_ids: the prompt's ids in the choice's first chunk, each chunk's new ids.
    prompt_token_ids: list[int] | None = None
    token_ids: list[int] | None = None


class CompletionStreamResponse(OpenAIBaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionResponseStreamChoice]
    usage: UsageInfo | None = None


# -------------------------------------------------------------------- chat
class ChatMessage(OpenAIBaseModel):
    role: str
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    # An assistant message's calls and a tool message's answer (deploy/tool_calls.py).
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None
    # An earlier assistant turn's thinking, for templates that show it (Qwen3's reads
    # `reasoning_content` of the turns since the last user message): vLLM's `reasoning`, or
    # the name vLLM replied with before, which clients still send back.
    reasoning: str | None = None
    reasoning_content: str | None = None

    @model_validator(mode="after")
    def _check_reasoning(self) -> "ChatMessage":
        if self.reasoning is not None and self.reasoning_content is not None and \
                self.reasoning != self.reasoning_content:
            raise ValueError("reasoning and reasoning_content are two names of one field (the turn's thinking); "
                             "send one, or both equal.")
        return self

    def reasoning_text(self) -> str | None:
        """The turn's thinking, under either name."""
        return self.reasoning if self.reasoning is not None else self.reasoning_content

    @field_validator("content")
    @classmethod
    def _check_text_parts(cls, content: Any) -> Any:
        """A text part's text is a string (OpenAI's and vLLM's rule): anything else failed
        when the parts were joined, a 500, and escaped the character limit."""
        for index, part in enumerate(content if isinstance(content, list) else ()):
            if part.get("type") == "text" and not isinstance(part.get("text"), str):
                raise ValueError(f"content[{index}] is a text part whose text must be a string, got "
                                 f"{type(part.get('text')).__name__}.")
        return content

    def text(self, image_placeholder: str | None = None) -> str:
        """The message's text; a list of content parts is joined (text parts only). With an
        `image_placeholder` (a vision-language model's), image_url parts are taken too, each
        as the placeholder, placed before the text as vLLM places them."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        texts, placeholders = [], []
        for part in self.content:
            if part.get("type") == "image_url" and image_placeholder is not None:
                placeholders.append(image_placeholder)
                continue
            if part.get("type") != "text":
                supported = "text and image_url" if image_placeholder is not None else "text"
                raise ParameterError(f"Only {supported} content parts are supported by this model, got type "
                                     f"{part.get('type')!r}.", "messages")
            texts.append(part.get("text", ""))
        return "\n".join(placeholders + (["\n".join(texts)] if texts or not placeholders else []))


class ChatCompletionRequest(_SamplingFields):
    # Set by /v1/responses, whose usage always reports cached tokens (OpenAI's does).
    _with_prompt_tokens_details: bool = PrivateAttr(default=False)
    # Set by /v1/responses, whose output_text logprobs are the text's: the reasoning's tokens
    # are left out of logprobs and token ids as under include_reasoning false, its text kept.
    _hides_reasoning_tokens: bool = PrivateAttr(default=False)
    messages: list[ChatMessage]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    echo: bool = False
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    # Tools (deploy/tool_calls.py): tool_choice defaults to "auto" when tools are given.
    tools: list[ChatCompletionToolsParam] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = None
    # vLLM's: under --reasoning-parser, whether the reply's reasoning is returned.
    include_reasoning: StrictBool = True
    # OpenAI's and vLLM's: how hard a reasoning model thinks. As vLLM does, it reaches the
    # chat template as `reasoning_effort` (gpt-oss's writes it into its system message),
    # over chat_template_kwargs' own.
    reasoning_effort: Literal["low", "medium", "high"] | None = None

    @model_validator(mode="after")
    def _check_chat(self) -> "ChatCompletionRequest":
        if not self.messages:
            raise ParameterError("messages must hold at least one message.", "messages")
        if self.reasoning_effort is not None:
            self.chat_template_kwargs = {**(self.chat_template_kwargs or {}), "reasoning_effort": self.reasoning_effort}
        if self.top_logprobs is not None:
            if not self.logprobs:
                raise ParameterError("top_logprobs needs logprobs set to true.", "top_logprobs")
            if self.top_logprobs < 0:
                raise ParameterError(f"top_logprobs must be non-negative, got {self.top_logprobs}.", "top_logprobs")
        if self.continue_final_message and self.add_generation_prompt:
            # vLLM's rule: continuing the last message and opening a new one contradict.
            raise ParameterError("continue_final_message and add_generation_prompt cannot both be true.",
                                 "continue_final_message")
        return self

    def to_sampling_params(self, default_max_tokens: int, model_defaults: dict[str, Any] | None = None,
                           structured_outputs: StructuredOutputsParams | None = None) -> SamplingParams:
        max_tokens = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        return self._sampling_params(max_tokens, logprobs, default_max_tokens, self.prompt_logprobs, model_defaults,
                                     structured_outputs)


class ChatLogProb(OpenAIBaseModel):
    token: str
    logprob: float = -9999.0
    bytes: list[int] | None = None


class ChatLogProbsContent(ChatLogProb):
    top_logprobs: list[ChatLogProb] = Field(default_factory=list)


class ChatCompletionLogProbs(OpenAIBaseModel):
    content: list[ChatLogProbsContent] | None = None


class ChatResponseMessage(OpenAIBaseModel):
    role: str = "assistant"
    content: str | None = None
    # Under --reasoning-parser: the reply's thinking, apart from its content (vLLM's field,
    # which older vLLM called reasoning_content).
    reasoning: str | None = None
    tool_calls: list[Any] = Field(default_factory=list)


class ChatCompletionResponseChoice(OpenAIBaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatCompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None  # with return_token_ids


class ChatCompletionResponse(OpenAIBaseModel):
    id: str = Field(default_factory=lambda: random_id("chatcmpl"))
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatCompletionResponseChoice]
    usage: UsageInfo
    prompt_logprobs: list[dict[int, Any] | None] | None = None
    # With return_token_ids (vLLM's placement: once, on the response, in chat).
    prompt_token_ids: list[int] | None = None


class DeltaMessage(OpenAIBaseModel):
    role: str | None = None
    content: str | None = None
    reasoning: str | None = None
    # OpenAI's tool-call deltas, JSON-ready (deploy/tool_calls.py's ToolCallStreamer).
    tool_calls: list[dict[str, Any]] | None = None


class ChatCompletionResponseStreamChoice(OpenAIBaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatCompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None  # with return_token_ids: the chunk's new token ids


class ChatCompletionStreamResponse(OpenAIBaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatCompletionResponseStreamChoice]
    usage: UsageInfo | None = None
    # With return_token_ids: in each choice's first chunk (the one opening it with the role).
    prompt_token_ids: list[int] | None = None


# ------------------------------------------------------- tokenize endpoints
class TokenizeRequest(OpenAIRequest):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = True

    @model_validator(mode="after")
    def _one_input(self) -> "TokenizeRequest":
        if (self.prompt is None) == (self.messages is None):
            raise ParameterError("Give exactly one of prompt and messages.", "prompt")
        return self


class TokenizeResponse(OpenAIBaseModel):
    count: int
    max_model_len: int
    tokens: list[int]


class DetokenizeRequest(OpenAIRequest):
    model: str | None = None
    tokens: list[StrictInt]


class DetokenizeResponse(OpenAIBaseModel):
    prompt: str


# -------------------------------------------------------------- embeddings
class _PoolingInputs(OpenAIRequest):
    """The `input` of /v1/embeddings and /classify: a text, a list of texts, token ids, or a
    list of token-id lists; none of them empty."""

    # JSON integers and booleans only where they are meant: lax parsing would read `true` as
    # token id 1 or truncate_prompt_tokens 1 (PoolingParams refuses a bool, but never saw
    # one), "5" as 5, and "yes" as normalize true.
    input: str | list[str] | list[StrictInt] | list[list[StrictInt]]

    @model_validator(mode="after")
    def _check_inputs(self) -> "_PoolingInputs":
        inputs = self.inputs()
        if not inputs:
            raise ParameterError("input must not be an empty list.", "input")
        if any(len(item) == 0 for item in inputs):
            raise ParameterError("input must not hold an empty string or an empty list of token ids.", "input")
        return self

    def inputs(self) -> list[str | list[int]]:
        """The input field as a list of inputs (text or token ids)."""
        value = self.input
        if isinstance(value, str):
            return [value]
        if value and all(isinstance(item, int) for item in value):
            return [list(value)]
        return list(value)


class EmbeddingRequest(_PoolingInputs):
    """`POST /v1/embeddings` (OpenAI's fields and vLLM's extras: truncate_prompt_tokens,
    add_special_tokens, normalize, priority)."""

    model: str | None = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: StrictInt | None = None
    user: str | None = None
    truncate_prompt_tokens: StrictInt | None = None
    add_special_tokens: StrictBool = True
    normalize: StrictBool | None = None
    # vLLM's request priority, as on completions (_SamplingFields.priority).
    priority: StrictInt = Field(default=0, ge=MIN_PRIORITY, le=MAX_PRIORITY)


class EmbeddingResponseData(OpenAIBaseModel):
    index: int
    object: str = "embedding"
    # A list of floats, or with encoding_format "base64" the little-endian float32 bytes in base64.
    embedding: list[float] | str


class EmbeddingResponse(OpenAIBaseModel):
    id: str
    object: str = "list"
    created: int
    model: str
    data: list[EmbeddingResponseData]
    usage: UsageInfo


# ------------------------------------------------ classification, scores, rerank
class _PoolingFields(OpenAIRequest):
    """vLLM's extras shared by /classify, /score and /rerank: truncate_prompt_tokens,
    use_activation (the classifier's activation; default on) and priority."""

    model: str | None = None
    user: str | None = None
    truncate_prompt_tokens: StrictInt | None = None
    use_activation: StrictBool | None = None
    priority: StrictInt = Field(default=0, ge=MIN_PRIORITY, le=MAX_PRIORITY)


class ClassificationRequest(_PoolingFields, _PoolingInputs):
    """`POST /classify` (vLLM's): one classification per input (a text or token ids)."""

    add_special_tokens: StrictBool = True


class ClassificationData(OpenAIBaseModel):
    index: int
    # id2label of the most probable class (None where config.json names no labels).
    label: str | None
    probs: list[float]
    num_classes: int


class ClassificationResponse(OpenAIBaseModel):
    id: str
    object: str = "list"
    created: int
    model: str
    data: list[ClassificationData]
    usage: UsageInfo


class PoolingRequest(_PoolingFields, _PoolingInputs):
    """`POST /pooling` (vLLM's): each input's pooling output for `task` (None: the model's
    own): "embed", "classify", or "token_classify" (every token's, what LLM.reward returns)."""

    task: Literal["embed", "classify", "token_classify"] | None = None
    add_special_tokens: StrictBool = True
    encoding_format: Literal["float"] = "float"
    dimensions: StrictInt | None = None
    normalize: StrictBool | None = None


class PoolingResponseData(OpenAIBaseModel):
    index: int
    object: str = "pooling"
    # A vector (embed, classify), or a list of them, one per prompt token (token_classify).
    data: list[list[float]] | list[float]


class PoolingResponse(OpenAIBaseModel):
    id: str
    object: str = "list"
    created: int
    model: str
    data: list[PoolingResponseData]
    usage: UsageInfo


def _texts(value: str | list[str], name: str) -> list[str]:
    texts = [value] if isinstance(value, str) else list(value)
    if not texts:
        raise ParameterError(f"{name} must not be an empty list.", name)
    if any(not text for text in texts):
        raise ParameterError(f"{name} must not hold an empty string.", name)
    if not _is_unicode(texts):  # data_1 / data_2, spelled so, pass OpenAIRequest's check by
        raise ParameterError(f"{name} holds a lone UTF-16 surrogate (a \\ud800-\\udfff escape without its pair), "
                             f"which is not Unicode text.", name)
    return texts


class ScoreRequest(_PoolingFields):
    """`POST /score` and `/v1/score` (vLLM's): text_1 and text_2 are a text or a list of
    texts, paired 1-to-1, 1-to-N or N-to-N (newer vLLM spells them data_1 and data_2)."""

    text_1: str | list[str] = Field(validation_alias=AliasChoices("text_1", "data_1"))
    text_2: str | list[str] = Field(validation_alias=AliasChoices("text_2", "data_2"))

    @model_validator(mode="before")
    @classmethod
    def _one_spelling_each(cls, data: Any) -> Any:
        # Both spellings of a side would leave one of them silently unscored.
        if isinstance(data, dict):
            for old, new in (("text_1", "data_1"), ("text_2", "data_2")):
                if old in data and new in data:
                    raise ParameterError(f"Give {old} or {new}, not both: they are two names of one field.", new)
        return data

    @model_validator(mode="after")
    def _check_pairs(self) -> "ScoreRequest":
        texts_1, texts_2 = _texts(self.text_1, "text_1"), _texts(self.text_2, "text_2")
        if len(texts_1) > 1 and len(texts_1) != len(texts_2):
            raise ParameterError(f"Input lengths must be either 1:1, 1:N or N:N; got {len(texts_1)} text_1 and "
                                 f"{len(texts_2)} text_2.", "text_2")
        return self

    def texts(self) -> tuple[list[str], list[str]]:
        return _texts(self.text_1, "text_1"), _texts(self.text_2, "text_2")


class ScoreResponseData(OpenAIBaseModel):
    index: int
    object: str = "score"
    score: float


class ScoreResponse(OpenAIBaseModel):
    id: str
    object: str = "list"
    created: int
    model: str
    data: list[ScoreResponseData]
    usage: UsageInfo


class RerankRequest(_PoolingFields):
    """`POST /rerank`, `/v1/rerank` and `/v2/rerank` (vLLM's, Jina's and Cohere's shape): the
    documents ranked by their score against the query, the top_n best (0: all), with their
    text unless return_documents is false."""

    query: str
    documents: list[str]
    top_n: StrictInt = Field(default=0, ge=0)
    return_documents: StrictBool = True

    @model_validator(mode="after")
    def _check_texts(self) -> "RerankRequest":
        _texts(self.query, "query")
        _texts(self.documents, "documents")
        return self


class RerankDocument(OpenAIBaseModel):
    text: str


class RerankResult(OpenAIBaseModel):
    index: int
    document: RerankDocument | None = None
    relevance_score: float


class RerankUsage(OpenAIBaseModel):
    prompt_tokens: int
    total_tokens: int


class RerankResponse(OpenAIBaseModel):
    id: str
    model: str
    usage: RerankUsage
    results: list[RerankResult]
