"""The request body of OpenAI's Responses API (`POST /v1/responses`), as vLLM serves it.

The request is checked here for its shape; deploy/serving_responses.py turns it into a chat
request and builds the response and its stream events (plain dicts in the shapes of the
`openai` package's `Response` types). Field names and defaults follow OpenAI's API
reference; unknown request fields are accepted and ignored, as on the other routes, and a
null stands for the field's default, as OpenAI's API takes it.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Union

from pydantic import Discriminator, Field, StrictBool, StrictInt, Tag, field_validator, model_validator

from raylm.deploy.protocol import OpenAIBaseModel, OpenAIRequest
from raylm.engine.request import MAX_CACHE_SALT_CHARS, MAX_PRIORITY, MIN_PRIORITY


# OpenAI's bounds on `metadata`.
MAX_METADATA_PAIRS = 16
MAX_METADATA_KEY_CHARS = 64
MAX_METADATA_VALUE_CHARS = 512


# OpenAI's `include` values (ResponseIncludable). raylm serves the output text's logprobs;
# the others name what it has no part of (stored items, built-in tools), and add nothing.
INCLUDABLE = Literal["file_search_call.results", "web_search_call.results", "web_search_call.action.sources",
                     "message.input_image.image_url", "computer_call_output.output.image_url",
                     "code_interpreter_call.outputs", "reasoning.encrypted_content", "message.output_text.logprobs"]
OUTPUT_TEXT_LOGPROBS = "message.output_text.logprobs"


# The fields whose default a null stands for (the others take null as their value).
_DEFAULTED_FIELDS = frozenset({"tools", "tool_choice", "parallel_tool_calls", "stream", "store", "background",
                               "truncation", "priority"})


# ------------------------------------------------------------------ input items
class InputTextPart(OpenAIBaseModel):
    """A text part of an input message: the user's `input_text`, or the `output_text` of an
    earlier reply sent back as an assistant message."""

    type: Literal["input_text", "output_text"]
    text: str


class InputImagePart(OpenAIBaseModel):
    """An image of an input message (OpenAI's `input_image`): `image_url` a base64 data URL,
    served as the chat route's image_url part (same bounds and errors; remote URLs are not
    fetched). `detail` is accepted and left to the model's processor, which decides the
    image's resolution, as vLLM does; `file_id` needs stored files, which this server has not."""

    type: Literal["input_image"]
    image_url: str | None = None
    file_id: str | None = None
    detail: Literal["low", "high", "auto"] = "auto"


MessagePart = Annotated[InputTextPart | InputImagePart, Field(discriminator="type")]


class InputMessageItem(OpenAIBaseModel):
    """A message of the conversation (`type` may be left out, as OpenAI's EasyInputMessage)."""

    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[MessagePart]


class FunctionCallItem(OpenAIBaseModel):
    """An earlier call the model made (the `function_call` output item sent back)."""

    type: Literal["function_call"]
    call_id: str = Field(min_length=1)
    name: str = Field(min_length=1)
    arguments: str


class FunctionCallOutputItem(OpenAIBaseModel):
    """What the caller's function returned for `call_id`: a tool message."""

    type: Literal["function_call_output"]
    call_id: str = Field(min_length=1)
    output: str | list[InputTextPart]


class ReasoningTextPart(OpenAIBaseModel):
    type: Literal["reasoning_text", "summary_text"]
    text: str


class ReasoningInputItem(OpenAIBaseModel):
    """An earlier turn's reasoning (the `reasoning` output item sent back): it reaches the
    chat template as the next assistant message's reasoning."""

    type: Literal["reasoning"]
    summary: list[ReasoningTextPart] = Field(default_factory=list)
    content: list[ReasoningTextPart] | None = None

    def text(self) -> str:
        return "".join(part.text for part in (self.content or self.summary))


def _item_type(item: Any) -> str | None:
    """An input item's type ("message" when left out); None for anything but a string."""
    kind = item.get("type", "message") if isinstance(item, dict) else getattr(item, "type", None)
    return kind if isinstance(kind, str) else None


# The input item types served, and the content part types each may hold.
_ITEM_PARTS = {"message": ("input_text", "output_text", "input_image"), "function_call": (),
               "function_call_output": ("input_text",), "reasoning": ()}

InputItem = Annotated[Union[
    Annotated[InputMessageItem, Tag("message")],
    Annotated[FunctionCallItem, Tag("function_call")],
    Annotated[FunctionCallOutputItem, Tag("function_call_output")],
    Annotated[ReasoningInputItem, Tag("reasoning")],
], Discriminator(_item_type)]


# ------------------------------------------------------------------ tools and formats
class FunctionToolParam(OpenAIBaseModel):
    """A function tool in the Responses API's flat shape (chat nests it under `function`)."""

    type: Literal["function"]
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class FunctionToolChoice(OpenAIBaseModel):
    type: Literal["function"]
    name: str


class TextFormat(OpenAIBaseModel):
    """`text.format`: "text" (no constraint), "json_object", or "json_schema" with its name,
    schema and strictness (the chat route's response_format, flattened)."""

    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class TextConfig(OpenAIBaseModel):
    format: TextFormat | None = None


class ReasoningConfig(OpenAIBaseModel):
    """`reasoning`: accepted (the effort reaches the chat template as `reasoning_effort`);
    the reasoning itself is the server's --reasoning-parser's split."""

    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"] | None = None
    summary: Literal["auto", "concise", "detailed"] | None = None
    generate_summary: Literal["auto", "concise", "detailed"] | None = None


# ------------------------------------------------------------------ the request
class ResponsesRequest(OpenAIRequest):
    """`POST /v1/responses`. Stateless, as vLLM by default: `store` is accepted and nothing
    is stored, so `previous_response_id` finds nothing and `background` (which needs a
    stored response) is refused."""

    model: str | None = None
    input: str | list[InputItem]
    instructions: str | None = None
    max_output_tokens: StrictInt | None = Field(default=None, ge=1)
    temperature: float | None = None
    top_p: float | None = None
    # Per output token, its logprob and those of the `top_logprobs` likeliest tokens, when
    # `include` names "message.output_text.logprobs" (as vLLM: top_logprobs alone adds nothing).
    top_logprobs: StrictInt | None = Field(default=None, ge=0)
    include: list[INCLUDABLE] | None = None
    tools: list[FunctionToolParam] = Field(default_factory=list)
    tool_choice: Literal["auto", "none", "required"] | FunctionToolChoice = "auto"
    parallel_tool_calls: StrictBool = True
    text: TextConfig | None = None
    reasoning: ReasoningConfig | None = None
    stream: StrictBool = False
    user: str | None = None
    metadata: dict[str, str] | None = None
    store: StrictBool = True
    background: StrictBool = False
    previous_response_id: str | None = None
    truncation: Literal["auto", "disabled"] = "disabled"
    # vLLM's extras, as on the chat route.
    priority: StrictInt = Field(default=0, ge=MIN_PRIORITY, le=MAX_PRIORITY)
    cache_salt: str | None = Field(default=None, min_length=1, max_length=MAX_CACHE_SALT_CHARS)

    @model_validator(mode="before")
    @classmethod
    def _nulls_are_defaults(cls, data: Any) -> Any:
        if isinstance(data, dict) and any(data.get(name, 0) is None for name in _DEFAULTED_FIELDS):
            return {name: value for name, value in data.items() if value is not None or name not in _DEFAULTED_FIELDS}
        return data

    @field_validator("input", mode="before")
    @classmethod
    def _check_input(cls, value: Any) -> Any:
        """The item and content part types raylm serves, each refused by its place in the
        list with a sentence (pydantic's own error for a union lists every member)."""
        if not isinstance(value, list):
            return value
        if not value:
            raise ValueError("input must hold at least one item.")
        for index, item in enumerate(value):
            kind = _item_type(item)
            if kind not in _ITEM_PARTS:
                stored = " (it refers to stored items, which this server does not keep)" \
                    if kind == "item_reference" else ""
                sent = item.get("type") if isinstance(item, dict) else item  # what was sent, not a string maybe
                raise ValueError(f"input[{index}] has type {sent!r}{stored}: the item types served are "
                                 f"{', '.join(map(repr, _ITEM_PARTS))}.")
            field = "content" if kind == "message" else "output"
            parts = item.get(field) if isinstance(item, dict) else None
            for part_index, part in enumerate(parts if isinstance(parts, list) else ()):
                part_kind = part.get("type") if isinstance(part, dict) else None
                if part_kind not in _ITEM_PARTS[kind]:
                    raise ValueError(f"input[{index}].{field}[{part_index}] has type {part_kind!r}: the part types "
                                     f"served here are {', '.join(map(repr, _ITEM_PARTS[kind]))}.")
                if part_kind == "input_image" and part.get("image_url") is None:
                    raise ValueError(f"input[{index}].{field}[{part_index}] needs an image_url (a base64 data URL): "
                                     f"file_id refers to stored files, which this server does not keep.")
        return value

    def includes_output_logprobs(self) -> bool:
        return OUTPUT_TEXT_LOGPROBS in (self.include or ())

    @field_validator("metadata")
    @classmethod
    def _check_metadata(cls, metadata: dict[str, str] | None) -> dict[str, str] | None:
        """OpenAI's bounds: at most 16 pairs, keys of at most 64 characters, values of 512."""
        if metadata is None:
            return None
        if len(metadata) > MAX_METADATA_PAIRS:
            raise ValueError(f"metadata may hold at most {MAX_METADATA_PAIRS} pairs, got {len(metadata)}.")
        for key, value in metadata.items():
            if len(key) > MAX_METADATA_KEY_CHARS or len(value) > MAX_METADATA_VALUE_CHARS:
                raise ValueError(f"metadata keys may have at most {MAX_METADATA_KEY_CHARS} characters and values "
                                 f"{MAX_METADATA_VALUE_CHARS}; the pair of key {key[:MAX_METADATA_KEY_CHARS]!r} has "
                                 f"{len(key)} and {len(value)}.")
        return metadata

    @field_validator("tools", mode="before")
    @classmethod
    def _check_tool_types(cls, tools: Any) -> Any:
        """raylm runs no built-in tools (web search, file search, code interpreter, MCP):
        a tool of any type but "function" is refused by name."""
        for index, tool in enumerate(tools if isinstance(tools, list) else ()):
            kind = tool.get("type") if isinstance(tool, dict) else None
            if kind != "function":
                raise ValueError(f"tools[{index}] has type {kind!r}: only function tools (type 'function') are "
                                 f"served; raylm runs no built-in tools.")
        return tools
