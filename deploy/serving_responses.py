"""`POST /v1/responses`: OpenAI's Responses API, served through the chat route.

A Responses request becomes one chat completion request (`chat_request_of`): `instructions`
a system message first, `input` its messages (a string is one user message; earlier
`function_call` items an assistant turn's tool calls, `function_call_output` items tool
messages, `reasoning` items that turn's reasoning), `max_output_tokens` its
max_completion_tokens, function tools and `tool_choice` in chat's nested shape, and
`text.format` its response_format. The chat route then renders the template, checks the
limits and runs the engine request as for any chat request; its answer comes back as
Responses output items: a `reasoning` item (under --reasoning-parser), a `message` item
with `output_text`, and a `function_call` item per tool call. A reply cut by
max_output_tokens is "incomplete". With `include: ["message.output_text.logprobs"]` the
message's output_text carries the logprobs of the reply's tokens but its reasoning's (the
chat route's, with `top_logprobs` alternatives each, bounded as chat's; vLLM's unstreamed
reply also lists the reasoning's), each text delta its own tokens' streamed. Streamed, the chat chunks become OpenAI's event sequence
(response.created ... response.completed), each event with its `type` and `sequence_number`.

Stateless, as vLLM by default (VLLM_ENABLE_RESPONSES_API_STORE unset): `store` is accepted
and nothing is stored, so a `previous_response_id` is not found (404) and `background`
mode, which needs a stored response, is a 400.
"""

from __future__ import annotations

import json
import re
import time
import uuid
from collections.abc import AsyncIterator, Callable
from http import HTTPStatus
from types import SimpleNamespace
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from pydantic import ValidationError

from raylm.deploy.errors import OpenAIError
from raylm.deploy.protocol import ChatCompletionRequest, ChatCompletionResponse, ChatResponseMessage, UsageInfo
from raylm.deploy.protocol_responses import (FunctionCallItem, FunctionCallOutputItem, InputImagePart,
                                             InputMessageItem, InputTextPart, ReasoningInputItem, ResponsesRequest)
from raylm.deploy.serving_chat import OpenAIServingChat
from raylm.deploy.serving_engine import SSE_DONE, SSEResponse, sse

# Chat request fields as the Responses API names them, for the errors the chat route raises.
_RESPONSES_PARAMS = {"messages": "input", "max_tokens": "max_output_tokens",
                     "max_completion_tokens": "max_output_tokens", "response_format": "text.format",
                     "chat_template_kwargs": "reasoning"}


def _renamed(error: OpenAIError, image_params: dict[str, str] | None = None) -> OpenAIError:
    """The chat route's error, naming the Responses field (in its message too: "messages"
    where the sentence names the prompt, "the messages" or "your messages", not where it
    counts chat messages); an image's, by `image_params` (`chat_messages`)."""
    if image_params and error.param in image_params:
        error.message = error.message.replace(error.param, image_params[error.param])
        error.param = image_params[error.param]
        return error
    name = _RESPONSES_PARAMS.get(error.param)
    if name is None:
        return error
    if error.param != "messages":
        error.message = error.message.replace(error.param, name)
    else:
        error.message = re.sub(r"\b(The|the|your) messages\b", rf"\1 {name}", error.message)
    error.param = name
    return error


def _item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


# ------------------------------------------------------------------ request
def chat_messages(request: ResponsesRequest, image_params: dict[str, str] | None = None) -> list[dict[str, Any]]:
    """The conversation as chat messages. Items an assistant turn produced (its reasoning,
    its message, its function calls) join one assistant message, in the order a reply
    holds them, so the template renders the turn as the model wrote it. `image_params`, if
    given, maps the chat route's name of each image's URL to its input field."""
    messages: list[dict[str, Any]] = []
    if request.instructions is not None:
        messages.append({"role": "system", "content": request.instructions})
    if isinstance(request.input, str):
        messages.append({"role": "user", "content": request.input})
        return messages

    def assistant_turn(joins: Callable[[dict[str, Any]], bool]) -> dict[str, Any]:
        """The last message if it is an assistant turn that `joins` accepts, else a new one."""
        if messages and messages[-1]["role"] == "assistant" and joins(messages[-1]):
            return messages[-1]
        messages.append({"role": "assistant", "content": None})
        return messages[-1]

    for index, item in enumerate(request.input):
        if isinstance(item, InputMessageItem) and item.role != "assistant":
            if image_params is not None and not isinstance(item.content, str):
                image_params.update({f"messages[{len(messages)}].content[{j}].image_url.url":
                                     f"input[{index}].content[{j}].image_url"
                                     for j, part in enumerate(item.content) if isinstance(part, InputImagePart)})
            messages.append({"role": item.role, "content": _chat_content(item.content)})
        elif isinstance(item, InputMessageItem):  # after its turn's reasoning, before its calls
            turn = assistant_turn(lambda last: last["content"] is None and "tool_calls" not in last)
            turn["content"] = _chat_content(item.content)
        elif isinstance(item, ReasoningInputItem):  # a turn's reasoning opens it
            assistant_turn(lambda last: False)["reasoning"] = item.text()
        elif isinstance(item, FunctionCallItem):
            turn = assistant_turn(lambda last: True)
            turn.setdefault("tool_calls", []).append(
                {"id": item.call_id, "type": "function", "function": {"name": item.name, "arguments": item.arguments}})
        elif isinstance(item, FunctionCallOutputItem):
            messages.append({"role": "tool", "tool_call_id": item.call_id, "content": _chat_content(item.output)})
    return messages


def _chat_content(content: str | list[InputTextPart | InputImagePart]) -> str | list[dict[str, Any]]:
    """A message's content as chat takes it: the string, or its parts as chat's text and
    image_url parts."""
    if isinstance(content, str):
        return content
    return [{"type": "image_url", "image_url": {"url": part.image_url}} if isinstance(part, InputImagePart)
            else {"type": "text", "text": part.text} for part in content]


def chat_request_of(request: ResponsesRequest, image_params: dict[str, str] | None = None) -> ChatCompletionRequest:
    """The chat completion request that serves `request` (a 400 naming the Responses field
    for what does not translate); `image_params` as `chat_messages` fills it."""
    fields: dict[str, Any] = {
        "model": request.model, "messages": chat_messages(request, image_params), "stream": request.stream,
        "temperature": request.temperature, "top_p": request.top_p,
        "max_completion_tokens": request.max_output_tokens, "user": request.user,
        "priority": request.priority, "cache_salt": request.cache_salt,
    }
    if request.includes_output_logprobs():
        fields.update(logprobs=True, top_logprobs=request.top_logprobs or 0)
    if request.stream:
        fields["stream_options"] = {"include_usage": True}  # the usage of response.completed
    if request.tools:
        fields["tools"] = [{"type": "function", "function": tool.model_dump(exclude={"type"}, exclude_none=True)}
                           for tool in request.tools]
        fields["parallel_tool_calls"] = request.parallel_tool_calls
    choice = request.tool_choice
    if not isinstance(choice, str):
        fields["tool_choice"] = {"type": "function", "function": {"name": choice.name}}
    elif request.tools or choice != "auto":
        fields["tool_choice"] = choice
    text_format = request.text.format if request.text is not None else None
    if text_format is not None and text_format.type == "json_schema":
        if text_format.schema_ is None:
            raise OpenAIError('text.format of type "json_schema" needs a schema.', param="text.format")
        fields["response_format"] = {"type": "json_schema", "json_schema": {
            "name": text_format.name, "description": text_format.description, "schema": text_format.schema_,
            "strict": text_format.strict}}
    elif text_format is not None and text_format.type == "json_object":
        fields["response_format"] = {"type": "json_object"}
    if request.reasoning is not None and request.reasoning.effort is not None:
        # As vLLM passes a chat request's reasoning_effort: templates that read it (gpt-oss's) use it.
        fields["chat_template_kwargs"] = {"reasoning_effort": request.reasoning.effort}
    try:
        chat_request = ChatCompletionRequest.model_validate(fields)
    except ValidationError as exc:
        error = exc.errors()[0]
        param = str(error["loc"][0]) if error.get("loc") else None
        raise OpenAIError(f"{error.get('msg')} (at {'.'.join(str(p) for p in error.get('loc', ()))})",
                          param=_RESPONSES_PARAMS.get(param, param)) from None
    chat_request._with_prompt_tokens_details = True  # OpenAI's usage always has cached_tokens
    chat_request._hides_reasoning_tokens = True  # output_text logprobs are the text's tokens
    return chat_request


def _check_stateless(request: ResponsesRequest) -> None:
    if request.previous_response_id is not None:
        # vLLM's answer when its store is off: the id is not found.
        raise OpenAIError(f"Response with id {request.previous_response_id!r} not found: this server stores no "
                          f"responses (as vLLM by default); send the earlier turns in input instead.",
                          HTTPStatus.NOT_FOUND, param="previous_response_id")
    if request.background:
        raise OpenAIError("background mode needs stored responses, which this server does not keep: send "
                          "background false (or leave it out).", param="background")
    if request.truncation != "disabled":
        raise OpenAIError(f"truncation {request.truncation!r} is not supported: only 'disabled' (an input over the "
                          f"context is a 400).", param="truncation")


# ------------------------------------------------------------------ response
def _message_item(text: str, status: str, item_id: str | None = None,
                  logprobs: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    return {"id": item_id or _item_id("msg"), "type": "message", "role": "assistant", "status": status,
            "content": [_output_text(text, logprobs)]}


def _output_text(text: str, logprobs: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs or []}


def _delta_logprobs(entries: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Chat's logprob entries in the shape of a text event's (OpenAI's has no bytes there)."""
    return [{"token": entry["token"], "logprob": entry["logprob"],
             "top_logprobs": [{"token": top["token"], "logprob": top["logprob"]} for top in entry["top_logprobs"]]}
            for entry in entries]


def _reasoning_item(text: str, status: str, item_id: str | None = None) -> dict[str, Any]:
    return {"id": item_id or _item_id("rs"), "type": "reasoning", "summary": [], "status": status,
            "content": [{"type": "reasoning_text", "text": text}]}


def _function_call_item(call_id: str, name: str, arguments: str, status: str,
                        item_id: str | None = None) -> dict[str, Any]:
    return {"id": item_id or _item_id("fc"), "type": "function_call", "call_id": call_id, "name": name,
            "arguments": arguments, "status": status}


def output_items(message: ChatResponseMessage, cut_by_max_tokens: bool,
                 logprobs: list[dict[str, Any]] | None = None) -> list[dict[str, Any]]:
    """A chat reply as output items, in the order the model wrote them: its reasoning, its
    text (also when the reply is empty, so that there is always an item; with the reply's
    `logprobs`, OpenAI's shape of chat's entries), its calls. The last is "incomplete" when
    max_output_tokens cut the reply."""
    items = []
    if message.reasoning:
        items.append(_reasoning_item(message.reasoning, "completed"))
    if message.content or not (items or message.tool_calls):
        items.append(_message_item(message.content or "", "completed", logprobs=logprobs))
    for call in message.tool_calls:
        function = call["function"]
        items.append(_function_call_item(call["id"], function["name"], function["arguments"], "completed"))
    if cut_by_max_tokens:
        items[-1]["status"] = "incomplete"
    return items


def _usage(usage: UsageInfo | dict[str, Any] | None) -> dict[str, Any] | None:
    if usage is None:
        return None
    usage = UsageInfo.model_validate(usage) if isinstance(usage, dict) else usage
    details = usage.completion_tokens_details
    output_tokens = usage.completion_tokens or 0
    cached = usage.prompt_tokens_details.cached_tokens if usage.prompt_tokens_details is not None else 0
    return {"input_tokens": usage.prompt_tokens,
            "input_tokens_details": {"cached_tokens": cached, "cache_write_tokens": 0},
            "output_tokens": output_tokens,
            "output_tokens_details": {"reasoning_tokens": details.reasoning_tokens if details is not None else 0},
            "total_tokens": usage.prompt_tokens + output_tokens}


def response_object(request: ResponsesRequest, response_id: str, created_at: int, model: str,
                    output: list[dict[str, Any]], status: str, usage: dict[str, Any] | None) -> dict[str, Any]:
    """OpenAI's `Response`, with the request's settings echoed as OpenAI's server does."""
    choice = request.tool_choice
    return {
        "id": response_id, "object": "response", "created_at": created_at, "status": status, "error": None,
        "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
        "instructions": request.instructions, "max_output_tokens": request.max_output_tokens, "model": model,
        "output": output, "parallel_tool_calls": request.parallel_tool_calls, "previous_response_id": None,
        "reasoning": request.reasoning.model_dump() if request.reasoning is not None else None,
        "store": False, "background": False, "temperature": request.temperature, "top_p": request.top_p,
        "top_logprobs": request.top_logprobs,
        "text": {"format": request.text.format.model_dump(by_alias=True, exclude_none=True)}
        if request.text is not None and request.text.format is not None else {"format": {"type": "text"}},
        "tool_choice": choice if isinstance(choice, str) else choice.model_dump(),
        "tools": [tool.model_dump() for tool in request.tools], "truncation": request.truncation,
        "usage": usage, "user": request.user, "metadata": request.metadata or {},
    }


class OpenAIServingResponses:
    """`/v1/responses` over the server's chat route (its template, parsers and limits)."""

    def __init__(self, chat: OpenAIServingChat) -> None:
        self.chat = chat

    async def create_response(self, request: ResponsesRequest, raw_request: Request) -> Response:
        model_name = self.chat.check_model(request.model)
        # Bounded as chat's top_logprobs (the server's --max-logprobs), also when not used.
        self.chat.check_logprobs(SimpleNamespace(top_logprobs=request.top_logprobs))
        _check_stateless(request)
        image_params: dict[str, str] = {}
        chat_request = chat_request_of(request, image_params)
        response_id, created_at = _item_id("resp"), int(time.time())
        try:
            answer = await self.chat.create_chat_completion(chat_request, raw_request)
        except OpenAIError as exc:
            raise _renamed(exc, image_params) from None
        except ValueError as exc:
            raise _renamed(OpenAIError(str(exc), param=getattr(exc, "param", None)), image_params) from None
        if isinstance(answer, SSEResponse):
            events = ResponseEventStream(request, response_id, created_at, model_name)
            return SSEResponse(events.translate(answer.body_iterator), answer.reservation)
        chat = ChatCompletionResponse.model_validate_json(answer.body)
        (choice,) = chat.choices
        cut_by_max_tokens = choice.finish_reason == "length"
        logprobs = [entry.model_dump() for entry in choice.logprobs.content or ()] \
            if choice.logprobs is not None else None
        output = output_items(choice.message, cut_by_max_tokens, logprobs)
        body = response_object(request, response_id, created_at, chat.model, output,
                               "incomplete" if cut_by_max_tokens else "completed", _usage(chat.usage))
        return JSONResponse(body)


class ResponseEventStream:
    """Turns a streamed chat reply (its SSE chunks) into the Responses API's events: each
    output item opens (output_item.added, content_part.added), grows by deltas and closes
    (.done events) as the next one opens or the reply ends; then response.completed (or
    response.incomplete) carries the whole response, as the unstreamed route returns it.
    Logprobs (the chat route leaves the reasoning's tokens out of them): a chunk's entries
    wait for the next text delta (a chunk held back by the tool call parser has logprobs and
    no text yet); those of tool call deltas are dropped, and those left when the message
    closes (a last token with no text, such as EOS) join its output_text only."""

    def __init__(self, request: ResponsesRequest, response_id: str, created_at: int, model: str) -> None:
        self.request = request
        self.response_id = response_id
        self.created_at = created_at
        self.model = model
        self.sequence_number = 0
        self.closed_items: list[dict[str, Any]] = []
        self.item: dict[str, Any] | None = None  # the open output item, and its text so far
        self.item_text = ""
        self.item_logprobs: list[dict[str, Any]] = []  # the open message's, and those awaiting text
        self.pending_logprobs: list[dict[str, Any]] = []

    def event(self, kind: str, **fields: Any) -> str:
        body = {"type": kind, "sequence_number": self.sequence_number, **fields}
        self.sequence_number += 1
        return f"event: {kind}\n" + sse(body)

    def response(self, status: str, usage: dict[str, Any] | None = None) -> dict[str, Any]:
        return response_object(self.request, self.response_id, self.created_at, self.model, list(self.closed_items),
                               status, usage)

    async def translate(self, chunks: AsyncIterator[str]) -> AsyncIterator[str]:
        finish_reason, usage = None, None
        try:
            yield self.event("response.created", response=self.response("in_progress"))
            yield self.event("response.in_progress", response=self.response("in_progress"))
            async for chunk in chunks:
                if chunk == SSE_DONE:
                    break
                body = json.loads(chunk.removeprefix("data: "))
                if "error" in body:
                    error = body["error"]
                    yield self.event("error", code=error.get("type"), message=error.get("message", ""),
                                     param=_RESPONSES_PARAMS.get(error.get("param"), error.get("param")))
                    return
                usage = body.get("usage") or usage
                for choice in body.get("choices") or ():
                    delta = choice.get("delta") or {}
                    self.pending_logprobs += (choice.get("logprobs") or {}).get("content") or []
                    for event in self._delta(delta):
                        yield event
                    finish_reason = choice.get("finish_reason") or finish_reason
            cut_by_max_tokens = finish_reason == "length"
            if self.item is None and not self.closed_items:  # an empty reply is an empty message, as unstreamed
                for event in self._open("message"):
                    yield event
            for event in self._close("incomplete" if cut_by_max_tokens else "completed"):
                yield event
            status = "incomplete" if cut_by_max_tokens else "completed"
            yield self.event(f"response.{status}", response=self.response(status, _usage(usage)))
        finally:
            aclose = getattr(chunks, "aclose", None)
            if aclose is not None:
                await aclose()

    def _delta(self, delta: dict[str, Any]) -> list[str]:
        events = []
        if delta.get("reasoning"):
            if self.item is None or self.item["type"] != "reasoning":
                events += self._close("completed") + self._open("reasoning")
            events += self._text_delta("response.reasoning_text.delta", delta["reasoning"])
            if not delta.get("content"):
                self.pending_logprobs = []
        if delta.get("content"):
            if self.item is None or self.item["type"] != "message":
                events += self._close("completed") + self._open("message")
            logprobs, self.pending_logprobs = self.pending_logprobs, []
            self.item_logprobs += logprobs
            events += self._text_delta("response.output_text.delta", delta["content"],
                                       logprobs=_delta_logprobs(logprobs))
        if delta.get("tool_calls"):
            self.pending_logprobs = []
        for call in delta.get("tool_calls") or ():
            function = call.get("function") or {}
            if "id" in call:  # a new call: its id and name come first
                events += self._close("completed") + self._open("function_call", call["id"], function.get("name", ""))
            if function.get("arguments"):
                events += self._text_delta("response.function_call_arguments.delta", function["arguments"])
        return events

    def _text_delta(self, kind: str, text: str, **fields: Any) -> list[str]:
        assert self.item is not None
        self.item_text += text
        content = {} if kind == "response.function_call_arguments.delta" else {"content_index": 0}
        return [self.event(kind, item_id=self.item["id"], output_index=len(self.closed_items), **content, delta=text,
                           **fields)]

    def _open(self, kind: str, call_id: str = "", name: str = "") -> list[str]:
        if kind == "function_call":
            self.item = _function_call_item(call_id, name, "", "in_progress")
        else:
            item = _reasoning_item if kind == "reasoning" else _message_item
            self.item = {**item("", "in_progress"), "content": []}
        self.item_text = ""
        index = len(self.closed_items)
        events = [self.event("response.output_item.added", output_index=index, item=self.item)]
        if kind != "function_call":
            part = {"type": "reasoning_text", "text": ""} if kind == "reasoning" else _output_text("")
            events.append(self.event("response.content_part.added", item_id=self.item["id"], output_index=index,
                                     content_index=0, part=part))
        return events

    def _close(self, status: str) -> list[str]:
        """The .done events of the open item, if any, which joins the closed ones."""
        item = self.item
        if item is None:
            return []
        index, text, item_id = len(self.closed_items), self.item_text, item["id"]
        if item["type"] == "function_call":
            closed = _function_call_item(item["call_id"], item["name"], text, status, item_id)
            events = [self.event("response.function_call_arguments.done", item_id=item_id, output_index=index,
                                 name=item["name"], arguments=text)]
        elif item["type"] == "reasoning":
            closed = _reasoning_item(text, status, item_id)
            events = [self.event("response.reasoning_text.done", item_id=item_id, output_index=index,
                                 content_index=0, text=text),
                      self.event("response.content_part.done", item_id=item_id, output_index=index, content_index=0,
                                 part=closed["content"][0])]
        else:
            logprobs, self.pending_logprobs = self.item_logprobs + self.pending_logprobs, []
            closed = _message_item(text, status, item_id, logprobs)
            events = [self.event("response.output_text.done", item_id=item_id, output_index=index, content_index=0,
                                 text=text, logprobs=_delta_logprobs(logprobs)),
                      self.event("response.content_part.done", item_id=item_id, output_index=index, content_index=0,
                                 part=closed["content"][0])]
        events.append(self.event("response.output_item.done", output_index=index, item=closed))
        self.closed_items.append(closed)
        self.item, self.item_text = None, ""
        self.item_logprobs = []
        return events
