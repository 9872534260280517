"""`POST /v1/chat/completions`: messages rendered with the chat template, streamed or not."""

from __future__ import annotations

import dataclasses
import functools
import json
import time
from collections.abc import AsyncIterator
from http import HTTPStatus
from pathlib import Path
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from raylm.deploy.chat_template import (ChatTemplateBusyError, ChatTemplateError, ChatTemplateRenderer,
                                       ChatTemplateUnavailableError, detect_content_format)
from raylm.deploy.chat_template_sandbox import DEFAULT_MAX_QUEUED, ChatTemplateSandbox
from raylm.deploy.errors import OpenAIError
from raylm.deploy.protocol import (ChatCompletionLogProbs, ChatCompletionRequest, ChatCompletionResponse,
                                   ChatCompletionResponseChoice, ChatCompletionResponseStreamChoice,
                                   ChatCompletionStreamResponse, ChatLogProb, ChatLogProbsContent, ChatMessage,
                                   ChatResponseMessage, CompletionTokensDetails, DeltaMessage, PromptTokensDetails,
                                   UsageInfo, random_id)
from raylm.deploy.reasoning_parsers import ReasoningParser, ReasoningSplit
from raylm.deploy.response_budget import RETRY_AFTER_S
from raylm.deploy.serving_engine import (SSE_DONE, OpenAIServing, SSEResponse, merge_async_iterators, sse, sse_error,
                                         token_id_placeholder)
from raylm.deploy.tool_calls import ToolCallConfig, ToolCallStreamer, ToolMode, parse_reply, resolve_tool_mode, \
    tool_calls_of
from raylm.engine.multimodal.image import load_image_url
from raylm.engine.multimodal.inputs import MultiModalFeature
from raylm.engine.multimodal.processor import MultiModalProcessor
from raylm.engine.outputs import Logprob, RequestOutput
from raylm.engine.sampling_params import ParameterError
from raylm.engine.structured_output.params import StructuredOutputsParams


def load_chat_template(template: str | None) -> str | None:
    """`--chat-template`: a file holding a Jinja template, or the template itself."""
    if template is None:
        return None
    path = Path(template)
    try:
        if path.is_file():
            return path.read_text()
    except OSError:
        pass
    if "{" not in template:
        raise ValueError(f"--chat-template {template!r} is neither a file nor a Jinja template.")
    return template


class OpenAIServingChat(OpenAIServing):
    def __init__(self, *args: Any, chat_template: str | None = None, trust_request_chat_template: bool = False,
                 tool_config: ToolCallConfig | None = None, reasoning_parser: ReasoningParser | None = None,
                 max_queued_chat_template_renders: int = DEFAULT_MAX_QUEUED, response_role: str = "assistant",
                 chat_template_content_format: str = "auto", **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.chat_template = chat_template
        self.response_role = response_role
        # --chat-template-content-format: "string", "openai", or "auto" (decided per template).
        self.chat_template_content_format = chat_template_content_format
        self.trust_request_chat_template = trust_request_chat_template
        self.tool_config = tool_config or ToolCallConfig()
        self.reasoning_parser = reasoning_parser
        # Every template renders within the prompt's character limit, the step limit and the
        # time limit; a request's own template, in addition, in a process of its own
        # (deploy/chat_template_sandbox.py), killed past the time limit.
        max_chars = self.limits.prompt_chars(self.max_model_len)
        render_seconds = self.limits.max_chat_template_render_seconds
        self.renderer = ChatTemplateRenderer(max_chars, self.limits.max_chat_template_steps, render_seconds)
        self.sandbox = ChatTemplateSandbox(max_chars, self.limits.max_chat_template_steps, render_seconds,
                                           max_queued=max_queued_chat_template_renders) \
            if trust_request_chat_template else None

    def close(self) -> None:
        """Ends the sandbox's processes, if any (idempotent): the app's shutdown."""
        if self.sandbox is not None:
            self.sandbox.close()

    def render(self, messages: list[ChatMessage], add_generation_prompt: bool, continue_final_message: bool = False,
               template_kwargs: dict[str, Any] | None = None, tools: list[dict[str, Any]] | None = None) -> str:
        """The conversation as the prompt text the model was trained on, rendered with the
        server's template (--chat-template, else the tokenizer's)."""
        template, conversation, variables = self.template_inputs(messages, None, template_kwargs, tools)
        try:
            return self.renderer.render(template, conversation, add_generation_prompt, continue_final_message,
                                        variables)
        except ChatTemplateError as exc:
            raise OpenAIError(f"The chat template failed on these messages: {exc}", param="messages") from None

    async def render_request_template(self, messages: list[ChatMessage], chat_template: str,
                                      add_generation_prompt: bool, continue_final_message: bool = False,
                                      template_kwargs: dict[str, Any] | None = None,
                                      tools: list[dict[str, Any]] | None = None) -> str:
        """As `render`, with the request's own template, in the sandbox (a 400 naming
        chat_template when it fails or passes a bound)."""
        assert self.sandbox is not None
        template, conversation, variables = await self.off_loop(self.template_inputs, messages, chat_template,
                                                                template_kwargs, tools)
        try:
            return await self.sandbox.render(template, conversation, add_generation_prompt, continue_final_message,
                                             variables)
        except ChatTemplateUnavailableError as exc:
            raise OpenAIError(f"Request chat templates cannot be rendered now: {exc}",
                              HTTPStatus.SERVICE_UNAVAILABLE) from None
        except ChatTemplateBusyError as exc:
            # 429 with Retry-After, as the server's other overload bounds answer: OpenAI's
            # clients retry it after the time it names, and unlike a 5xx its body keeps the reason.
            raise OpenAIError(f"The server is busy: {exc}. Retry later.", HTTPStatus.TOO_MANY_REQUESTS,
                              param="chat_template", headers={"Retry-After": str(RETRY_AFTER_S)}) from None
        except ChatTemplateError as exc:
            raise OpenAIError(f"The request's chat_template failed on these messages: {exc}",
                              param="chat_template") from None

    def template_inputs(self, messages: list[ChatMessage], chat_template: str | None,
                        template_kwargs: dict[str, Any] | None, tools: list[dict[str, Any]] | None
                        ) -> tuple[str, list[dict[str, Any]], dict[str, Any]]:
        """The template (`chat_template`, else the server's), the messages as templates read
        them, and the template's other variables: the tokenizer's special tokens, then
        chat_template_kwargs, then the request's tools (what apply_chat_template passes)."""
        if self.tokenizer is None:
            raise OpenAIError("Chat needs a tokenizer; this server runs without one.", param="messages")
        self.limits.check_messages(messages, self.max_model_len)
        template = chat_template or self.chat_template
        if template is None and getattr(self.tokenizer, "chat_template", None) is None:
            raise OpenAIError("The model's tokenizer has no chat template: send chat_template, or start the server "
                              "with --chat-template.", param="chat_template")
        variables = {**self.tokenizer.special_tokens_map, **(template_kwargs or {})}
        if tools:
            variables["tools"] = tools
        try:
            template = self.tokenizer.get_chat_template(template, variables.get("tools"))
        except ValueError as exc:  # a template name the tokenizer does not have
            raise OpenAIError(str(exc), param="chat_template") from None
        content_format = resolve_content_format(self.chat_template_content_format, template)
        try:
            conversation = [template_message(m, content_format, self.image_placeholder) for m in messages]
        except ValueError as exc:
            raise OpenAIError(str(exc), param="messages") from None
        return template, conversation, variables

    async def create_chat_completion(self, request: ChatCompletionRequest, raw_request: Request) -> Response:
        model_name = self.check_model(request.model)
        self.check_priority(request)
        self.limits.check_messages(request.messages, self.max_model_len)
        self.limits.check_sampling(request)
        self.check_token_fields(request)
        self.check_logprobs(request)
        tool_mode = resolve_tool_mode(request, self.tool_config, self.limits)
        structured_outputs = self._constraint(request, tool_mode)
        if request.chat_template is not None and not self.trust_request_chat_template:
            raise OpenAIError("chat_template in a request is not accepted: this server was not started with "
                              "--trust-request-chat-template.", param="chat_template")
        self.limits.check_chat_template(request.chat_template, request.chat_template_kwargs)
        tools = tool_mode.tools if tool_mode is not None else None
        if request.chat_template is None:
            text, token_ids = await self.off_loop(self._render_and_tokenize, request, tools)
        else:
            text = await self.render_request_template(request.messages, request.chat_template,
                                                       request.add_generation_prompt, request.continue_final_message,
                                                       request.chat_template_kwargs, tools)
            token_ids = await self.off_loop(self.tokenize, text, request.add_special_tokens, "messages")
        images = await self.off_loop(self._images, request.messages)
        mm_features = None
        if images:
            # The model's processor runs here, once: the expanded ids are what the limits
            # count, and the engine takes them with the processed images (mm_features).
            token_ids, mm_features = await self.off_loop(self._multimodal_token_ids, request, token_ids, images)
        token_ids = request.truncated(token_ids, self.max_model_len)
        max_tokens = request.max_completion_tokens if request.max_completion_tokens is not None else request.max_tokens
        if len(token_ids) > self.max_model_len:
            self.check_context(len(token_ids), max_tokens, noun="messages")
        in_reasoning = self.reasoning_parser is not None and \
            self.reasoning_parser.starts_in_reasoning(text, request.chat_template_kwargs)
        reasoning_parser = self.reasoning_parser
        if in_reasoning and tool_mode is not None and tool_mode.constraint is not None:
            # A forced call in the format's own messages (gpt-oss's harmony call), whose
            # grammar covers the whole reply, the reasoning's free text included.
            tool_mode = reasoning_parser.forced_call_tool_mode(tool_mode)
            structured_outputs = tool_mode.constraint
        if reasoning_parser is not None and tool_mode is not None \
                and (tool_mode.choice == "auto" or tool_mode.constrains_whole_reply):
            reasoning_parser = reasoning_parser.for_tool_parser(tool_mode.parser)
        if in_reasoning and structured_outputs is not None \
                and not (tool_mode is not None and tool_mode.constrains_whole_reply):
            structured_outputs = self._after_reasoning(structured_outputs)
            # The reasoning ends where the grammar starts: the content is what it constrained.
            reasoning_parser = reasoning_parser.for_constrained_answer()
        params = self.sampling_params(functools.partial(request.to_sampling_params,
                                                        structured_outputs=structured_outputs),
                                      len(token_ids), max_tokens)
        held = self.limits.check_response_size([(len(token_ids), params)],
                                               returns_prompt_ids=bool(request.return_token_ids))
        if tool_mode is not None and tool_mode.choice == "auto":
            skip_special_tokens = tool_mode.parser.adjust_skip_special_tokens()
            if skip_special_tokens is not None:
                params.skip_special_tokens = skip_special_tokens
        if in_reasoning and self.reasoning_parser.adjust_skip_special_tokens() is not None:
            params.skip_special_tokens = self.reasoning_parser.adjust_skip_special_tokens()
        request_id = random_id("chatcmpl")
        created = int(time.time())
        with self.response_budget.reserve(held) as reservation:
            prompt = {"prompt": text, "prompt_token_ids": token_ids}
            if mm_features:
                prompt["mm_features"] = mm_features
            (stream,) = await self.add_requests(
                request_id, [request.with_cache_salt(prompt)], [params],
                self.lora_request(model_name), request.priority)
            echo = self._echo_text(request)
            if request.stream:
                return SSEResponse(self._stream(request, request_id, created, model_name, stream, token_ids, echo,
                                                tool_mode, in_reasoning, reasoning_parser), reservation.keep())
            final: RequestOutput | None = None
            async for _, output in merge_async_iterators([stream], raw_request.is_disconnected):
                final = output
            assert final is not None and final.finished
            return JSONResponse(self._response(request, request_id, created, model_name, final, echo,
                                               tool_mode, in_reasoning, reasoning_parser).model_dump())

    @functools.cached_property
    def mm_processor(self) -> MultiModalProcessor | None:
        """The server's own processor of image prompts (a vision-language model's; None for a
        text-only model): the engine's runs on the engine thread."""
        model_config = self.engine.model_config
        if not model_config.is_multimodal:
            return None
        return MultiModalProcessor(model_config.model, model_config.hf_config, model_config.limit_mm_per_prompt or {},
                                   model_config.trust_remote_code, model_config.revision)

    @functools.cached_property
    def image_placeholder(self) -> str | None:
        """The text of the model's image placeholder ("<image>" for LLaVA, "<start_of_image>" for
        Gemma 3), None for a text-only model."""
        if self.mm_processor is None:
            return None
        return self.tokenizer.convert_ids_to_tokens(self.mm_processor.placeholder_token_id)

    def _images(self, messages: list[ChatMessage]) -> list[Any]:
        """The images of the messages' image_url parts, in order, decoded from their data URLs
        (their count checked against limit_mm_per_prompt before any is decoded)."""
        urls = [(f"messages[{i}].content[{j}].image_url.url", part.get("image_url"))
                for i, message in enumerate(messages) if isinstance(message.content, list)
                for j, part in enumerate(message.content) if part.get("type") == "image_url"]
        if not urls:
            return []
        if self.mm_processor is None:
            raise OpenAIError(f"{urls[0][0]}: the model {self.model_name!r} takes text only; image_url content "
                              f"parts need a vision-language model.", param="messages")
        limit = self.mm_processor.limits.get("image", 0)
        if len(urls) > limit:
            raise OpenAIError(f"messages hold {len(urls)} images, more than limit_mm_per_prompt allows "
                              f"({{'image': {limit}}}).", param="messages")
        images = []
        for param, image_url in urls:
            if not isinstance(image_url, dict):
                raise OpenAIError(f"{param.removesuffix('.url')} must be an object with a url, got "
                                  f"{type(image_url).__name__}.", param=param.removesuffix(".url"))
            try:
                images.append(load_image_url(image_url.get("url"), param))
            except ParameterError as exc:
                raise OpenAIError(str(exc), param=exc.param) from None
        return images

    def _multimodal_token_ids(self, request: ChatCompletionRequest, token_ids: list[int], images: list[Any]
                              ) -> tuple[list[int], list[MultiModalFeature]]:
        """The prompt's token ids with its image placeholders expanded (what the engine will
        run), and the processed images."""
        if request.truncate_prompt_tokens is not None:
            raise OpenAIError("truncate_prompt_tokens is not supported with images (it could cut an image's "
                              "placeholder tokens).", param="truncate_prompt_tokens")
        try:
            return self.mm_processor.process_tokens(token_ids, {"image": images})
        except ParameterError as exc:
            raise OpenAIError(str(exc), param="messages") from None

    def _response(self, request: ChatCompletionRequest, request_id: str, created: int, model_name: str,
                  final: RequestOutput, echo: str, tool_mode: ToolMode | None,
                  in_reasoning: bool = False, reasoning_parser: ReasoningParser | None = None
                  ) -> ChatCompletionResponse:
        reasoning_parser = reasoning_parser or self.reasoning_parser
        choices = []
        as_ids = self.tokens_as_ids(request)
        for completion in final.outputs:
            if self.logs_outputs:
                self.log_output(f"{request_id}-0", completion)
            # Without the reasoning, its tokens' ids and logprobs go too (they spell it out).
            hidden = self._hidden_tokens(request, completion.token_ids, in_reasoning, reasoning_parser)
            token_ids = list(completion.token_ids)[hidden:]
            logprobs = None
            if request.logprobs:
                logprobs = self.chat_logprobs(token_ids, (completion.logprobs or [])[hidden:], request.top_logprobs,
                                              as_ids)
            split = self._split(completion.text, in_reasoning, completion.token_ids, reasoning_parser)
            message, finish_reason = self._message(split.content or "", completion.finish_reason, echo, tool_mode)
            message.role = self.reply_role(request)
            if split.reasoning is not None and request.include_reasoning:
                message.reasoning = split.reasoning
            if self.reasoning_parser is not None and not message.content and not echo:
                message.content = None  # vLLM's: no answer after the reasoning is a null content
            choices.append(ChatCompletionResponseChoice(
                index=completion.index, message=message,
                logprobs=logprobs, finish_reason=finish_reason, stop_reason=completion.stop_reason,
                token_ids=token_ids if request.return_token_ids else None))
        usage = _usage(len(final.prompt_token_ids), sum(len(c.token_ids) for c in final.outputs),
                       self._reasoning_tokens([c.token_ids for c in final.outputs], in_reasoning, reasoning_parser),
                       self._cached_tokens(request, final))
        return ChatCompletionResponse(id=request_id, created=created, model=model_name, choices=choices, usage=usage,
                                      prompt_token_ids=final.prompt_token_ids if request.return_token_ids else None)

    def _render_and_tokenize(self, request: ChatCompletionRequest, tools: list[dict[str, Any]] | None
                             ) -> tuple[str, list[int]]:
        """The prompt text and its token ids, with the server's template (on the tokenizer thread)."""
        text = self.render(request.messages, request.add_generation_prompt, request.continue_final_message,
                           request.chat_template_kwargs, tools)
        return text, self.tokenize(text, request.add_special_tokens, param="messages")

    def _split(self, text: str, in_reasoning: bool, token_ids: list[int], parser: ReasoningParser | None
               ) -> ReasoningSplit:
        """A reply's reasoning and content (all content without a reasoning parser)."""
        if parser is None:
            return ReasoningSplit(None, text)
        return parser.split(text, in_reasoning, token_ids)

    def _hidden_tokens(self, request: ChatCompletionRequest, token_ids: list[int], in_reasoning: bool,
                       parser: ReasoningParser | None) -> int:
        """How many of a reply's first tokens are left out of its logprobs and token_ids: its
        reasoning's (tags included) under `include_reasoning: false` (or for /v1/responses),
        else none."""
        if parser is None or (request.include_reasoning and not request._hides_reasoning_tokens):
            return 0
        return parser.reasoning_token_span(list(token_ids), in_reasoning)[0]

    def _reasoning_tokens(self, token_ids: list[list[int]], in_reasoning: bool, parser: ReasoningParser | None
                          ) -> int | None:
        """The choices' tokens spent reasoning, for usage (None without a reasoning parser)."""
        if parser is None:
            return None
        return sum(parser.count_reasoning_tokens(list(ids), in_reasoning) for ids in token_ids)

    def _after_reasoning(self, constraint: StructuredOutputsParams) -> StructuredOutputsParams:
        """The constraint applied from the token after the reasoning's end (vLLM's structured
        outputs under a reasoning parser): the thinking is free, the answer constrained."""
        end_token_ids = self.reasoning_parser.reasoning_end_token_ids()
        if end_token_ids is None:
            raise OpenAIError(f"{constraint.source} cannot be combined with --reasoning-parser "
                              f"{self.reasoning_parser.name} on this model: its tokenizer has no single token for "
                              f"{self.reasoning_parser.end_tag!r}, so the engine cannot tell where the reasoning "
                              f"ends and the constraint starts.", param=constraint.source)
        _, implicit_end_token_id = self.reasoning_parser.grammar_start_token_ids()
        # One token keeps the field (and the grammar cache's key) it always had.
        end = dict(reasoning_end_token_id=end_token_ids[0]) if len(end_token_ids) == 1 \
            else dict(reasoning_end_token_ids=end_token_ids)
        return dataclasses.replace(constraint, **end, reasoning_implicit_end_token_id=implicit_end_token_id)

    def _constraint(self, request: ChatCompletionRequest, tool_mode: ToolMode | None) -> StructuredOutputsParams | None:
        """The output's constraint: the request's own, or the one tool_choice sets."""
        requested = self.structured_outputs(request)
        if tool_mode is None or tool_mode.constraint is None:
            return requested
        if requested is not None:
            raise OpenAIError(f"tool_choice {tool_mode.choice!r} constrains the output itself: it cannot be combined "
                              f"with {requested.source}.", param="tool_choice")
        return tool_mode.constraint

    @staticmethod
    def _message(text: str, finish_reason: str | None, echo: str, tool_mode: ToolMode | None
                 ) -> tuple[ChatResponseMessage, str | None]:
        """A choice's message (its tool calls parsed out of the text) and finish_reason."""
        if tool_mode is None or tool_mode.parser is None:
            return ChatResponseMessage(content=echo + text), finish_reason
        parsed = parse_reply(tool_mode.parser, text, finish_reason)
        if not parsed.tools_called:
            return ChatResponseMessage(content=echo + parsed.content), finish_reason
        message = ChatResponseMessage(content=(echo + parsed.content) or None,
                                      tool_calls=tool_calls_of(parsed, tool_mode.parser))
        return message, tool_mode.finish_reason(True, finish_reason)

    def reply_role(self, request: ChatCompletionRequest) -> str:
        """The reply message's role (vLLM's): --response-role for a new turn
        (add_generation_prompt), else the role of the last message, which it continues."""
        return self.response_role if request.add_generation_prompt else request.messages[-1].role

    @staticmethod
    def _echo_text(request: ChatCompletionRequest) -> str:
        """vLLM's chat `echo`: the last message's content, when it is the assistant's."""
        last = request.messages[-1]
        return last.text() if request.echo and last.role == "assistant" else ""

    async def _stream(self, request: ChatCompletionRequest, request_id: str, created: int, model_name: str,
                      stream: AsyncIterator[RequestOutput], prompt_token_ids: list[int], echo: str,
                      tool_mode: ToolMode | None = None, in_reasoning: bool = False,
                      reasoning_parser: ReasoningParser | None = None) -> AsyncIterator[str]:
        reasoning_parser = reasoning_parser or self.reasoning_parser
        usage_per_chunk = request.stream_options is not None and request.stream_options.usage_per_chunk
        choice_tokens = [0] * request.n
        # Per choice, the split of its text into reasoning and content as it grows, and its
        # token ids (usage counts those spent reasoning).
        reasoning_streamers = {index: reasoning_parser.streamer(in_reasoning) for index in range(request.n)} \
            if reasoning_parser is not None else None
        choice_token_ids: list[list[int]] = [[] for _ in range(request.n)]
        # Under include_reasoning false, per choice what leaves the reasoning's token ids and
        # logprobs out of its chunks.
        token_filters = {index: reasoning_parser.token_filter() for index in range(request.n)} \
            if reasoning_parser is not None and in_reasoning and \
            (not request.include_reasoning or request._hides_reasoning_tokens) else None
        prompt_tokens = len(prompt_token_ids)
        as_ids = self.tokens_as_ids(request)
        # --enable-log-outputs: each choice's text and ids so far, logged whole when it finishes.
        logged: list[tuple[list[str], list[int]]] | None = \
            [([], []) for _ in range(request.n)] if self.logs_outputs else None

        def chunk(choice: ChatCompletionResponseStreamChoice, prompt_ids: list[int] | None = None) -> str:
            usage = _usage(prompt_tokens, choice_tokens[choice.index],
                           self._reasoning_tokens([choice_token_ids[choice.index]], in_reasoning, reasoning_parser)) \
                if usage_per_chunk else None
            return sse(ChatCompletionStreamResponse(id=request_id, created=created, model=model_name,
                                                    choices=[choice], usage=usage, prompt_token_ids=prompt_ids))

        # Per choice, what parses tool calls out of its text as it grows.
        streamers = {index: ToolCallStreamer(tool_mode.parser) for index in range(request.n)} \
            if tool_mode is not None and tool_mode.parser is not None else None
        completion_tokens = 0
        try:
            # vLLM opens every choice with the reply's role and empty content (or the echo).
            # With return_token_ids each of those chunks carries the prompt's ids, as vLLM's do.
            role = self.reply_role(request)
            for index in range(request.n):
                yield chunk(ChatCompletionResponseStreamChoice(
                    index=index, delta=DeltaMessage(role=role, content=echo)),
                    prompt_token_ids if request.return_token_ids else None)
            last_output = None
            async for _, output in merge_async_iterators([stream]):
                last_output = output
                for completion in output.outputs:
                    if logged is not None:
                        self.log_streamed(logged[completion.index], f"{request_id}-0", completion)
                    completion_tokens += len(completion.token_ids)
                    choice_tokens[completion.index] += len(completion.token_ids)
                    if reasoning_streamers is not None:
                        choice_token_ids[completion.index].extend(completion.token_ids)
                    finish_reason = completion.finish_reason
                    text, reasoning = completion.text, None
                    if reasoning_streamers is not None:
                        reasoning, text = reasoning_streamers[completion.index].feed(text, completion.finished(),
                                                                                     completion.token_ids)
                        reasoning = (reasoning or None) if request.include_reasoning else None
                    token_ids, entries = list(completion.token_ids), completion.logprobs or []
                    if token_filters is not None:
                        token_ids, entries = token_filters[completion.index].feed(
                            token_ids, entries, reasoning_streamers[completion.index].reasoning_ended,
                            completion.finished())
                    logprobs = None
                    if request.logprobs and (token_ids or token_filters is None):
                        logprobs = self.chat_logprobs(token_ids, entries, request.top_logprobs, as_ids)
                    # Whether the chunk carries token ids, which alone make it worth sending.
                    sends_ids = request.return_token_ids and (token_ids or token_filters is None)
                    if streamers is None:
                        if reasoning_streamers is not None and not text and not reasoning and \
                                not completion.finished() and not logprobs and not sends_ids:
                            continue  # held back: it may be the start of a reasoning tag
                        if reasoning_streamers is not None:
                            text = text or None  # a reasoning delta carries no empty content
                        delta = DeltaMessage(content=text, reasoning=reasoning) \
                            if text or reasoning or not completion.finished() else DeltaMessage()
                    else:
                        streamer = streamers[completion.index]
                        content, tool_calls = streamer.feed(text, final=completion.finished(),
                                                            cut=finish_reason == "length")
                        if (content is None and tool_calls is None and reasoning is None and not completion.finished()
                                and not logprobs and not sends_ids):
                            # Held back: it may be the start of a tool call. Its logprobs or
                            # token ids go out all the same, with an empty delta (as vLLM's).
                            continue
                        delta = DeltaMessage(content=content, reasoning=reasoning, tool_calls=tool_calls)
                        finish_reason = tool_mode.finish_reason(streamer.tools_called, finish_reason)
                    yield chunk(ChatCompletionResponseStreamChoice(
                        index=completion.index, delta=delta, logprobs=logprobs,
                        finish_reason=finish_reason, stop_reason=completion.stop_reason,
                        token_ids=token_ids if request.return_token_ids else None))
            if request.stream_options is not None and request.stream_options.include_usage:
                yield sse(ChatCompletionStreamResponse(
                    id=request_id, created=created, model=model_name, choices=[],
                    usage=_usage(prompt_tokens, completion_tokens,
                                 self._reasoning_tokens(choice_token_ids, in_reasoning, reasoning_parser),
                                 self._cached_tokens(request, last_output))))
        except Exception as exc:  # noqa: BLE001 - reported in the stream, as vLLM does
            yield sse_error(exc)
        yield SSE_DONE

    def _cached_tokens(self, request: ChatCompletionRequest, output: RequestOutput | None) -> int | None:
        """The prompt's prefix-cache hits for usage, when the server or the route asks for them."""
        if output is None or not (self.enable_prompt_tokens_details or request._with_prompt_tokens_details):
            return None
        return output.num_cached_tokens or 0

    def chat_logprobs(self, token_ids: list[int], entries: list[dict[int, Logprob]],
                      top_logprobs: int | None, as_ids: bool = False) -> ChatCompletionLogProbs:
        """OpenAI's chat logprobs: per token its text, logprob, UTF-8 bytes and the
        `top_logprobs` most likely alternatives, most likely first. With `as_ids` every
        token is named `token_id:{id}`; as in vLLM, the chosen token's bytes stay its text's
        while an alternative's are those of its `token_id:` name."""
        content = []
        for token_id, entry in zip(token_ids, entries):
            chosen = entry.get(token_id)
            text = self.token_text(token_id, chosen)
            ranked = sorted((alt for alt in entry.items() if alt[1].rank is not None), key=lambda alt: alt[1].rank)
            top = [ChatLogProb(token=(name := self.token_name(alt_id, alt, as_ids)), logprob=max(alt.logprob, -9999.0),
                               bytes=list(name.encode("utf-8", errors="replace")))
                   for alt_id, alt in ranked[:top_logprobs or 0]]
            content.append(ChatLogProbsContent(
                token=token_id_placeholder(token_id) if as_ids else text,
                logprob=max(chosen.logprob, -9999.0) if chosen is not None else -9999.0,
                bytes=list(text.encode("utf-8", errors="replace")), top_logprobs=top))
        return ChatCompletionLogProbs(content=content)


def _usage(prompt_tokens: int, completion_tokens: int, reasoning_tokens: int | None = None,
           cached_tokens: int | None = None) -> UsageInfo:
    details = CompletionTokensDetails(reasoning_tokens=reasoning_tokens) if reasoning_tokens is not None else None
    prompt_details = PromptTokensDetails(cached_tokens=cached_tokens) if cached_tokens is not None else None
    return UsageInfo(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                     total_tokens=prompt_tokens + completion_tokens, completion_tokens_details=details,
                     prompt_tokens_details=prompt_details)


@functools.lru_cache(maxsize=64)
def _detected_content_format(template: str) -> str:
    return detect_content_format(template)


def resolve_content_format(content_format: str, template: str) -> str:
    """--chat-template-content-format for `template`: "string" or "openai" as set, or the
    one "auto" detects in the template (how `template_message` hands it the content)."""
    return _detected_content_format(template) if content_format == "auto" else content_format


def template_message(message: ChatMessage, content_format: str = "string",
                     image_placeholder: str | None = None) -> dict[str, Any]:
    """A message as chat templates read it: role and content (content_format "string": its
    text, parts joined; "openai": OpenAI's list of parts, a string becoming one text part, as
    vLLM passes it), and an assistant's tool calls
    (their arguments as objects, as Hugging Face templates expect, where they parse) and
    reasoning, or a tool answer's tool_call_id. The reasoning goes under both of its names,
    as vLLM passes it: `reasoning`, and `reasoning_content`, which Qwen3's template reads; and
    as `thinking`, the field gpt-oss's template renders as an analysis message."""
    # Checks the parts either way: text parts only, or text and image_url parts for a
    # vision-language model (`image_placeholder`: its placeholder text).
    text = message.text(image_placeholder)
    entry: dict[str, Any] = {"role": message.role, "content": text if content_format == "string" else
                             _content_parts(message.content)}
    if message.tool_calls is not None:
        entry["tool_calls"] = [_template_tool_call(call) for call in message.tool_calls]
    reasoning = message.reasoning_text()
    if reasoning is not None and message.role == "assistant":
        entry["reasoning"] = entry["reasoning_content"] = entry["thinking"] = reasoning
    if message.tool_call_id is not None:
        entry["tool_call_id"] = message.tool_call_id
    return entry


def _content_parts(content: str | list[dict[str, Any]] | None) -> list[dict[str, Any]]:
    """The content as OpenAI's list of text parts (vLLM's "openai" format)."""
    if content is None:
        return []
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    # An image part goes in as {"type": "image"}, where Hugging Face templates put the
    # model's placeholder; its pixels go to the processor.
    return [{"type": "image"} if part.get("type") == "image_url" else {"type": "text", "text": part.get("text", "")}
            for part in content]


def _template_tool_call(call: dict[str, Any]) -> dict[str, Any]:
    function = call.get("function")
    if not isinstance(function, dict) or not isinstance(function.get("arguments"), str):
        return call
    try:
        arguments = json.loads(function["arguments"])
    except (ValueError, RecursionError):  # not JSON, or nested past what Python's parser reads
        return call
    return {**call, "function": {**function, "arguments": arguments}}
