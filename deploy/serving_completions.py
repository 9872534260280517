"""`POST /v1/completions`: text or token-id prompts (one or many), or prompt embeddings under
--enable-prompt-embeds, streamed or not."""

from __future__ import annotations

import functools
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from raylm.deploy.errors import OpenAIError
from raylm.deploy.protocol import (CompletionLogProbs, CompletionRequest, CompletionResponse,
                                   CompletionResponseChoice, CompletionResponseStreamChoice, CompletionStreamResponse,
                                   PromptTokensDetails, UsageInfo, random_id)
from raylm.deploy.serving_engine import (SSE_DONE, OpenAIServing, SSEResponse, merge_async_iterators, sse,
                                         sse_error, token_id_placeholder)
from raylm.engine.beam_search import beams_to_keep
from raylm.engine.outputs import Logprob, RequestOutput
from raylm.engine.prompt_embeds import PLACEHOLDER_TOKEN_ID, PROMPT_EMBEDS_KEY, load_prompt_embeds
from raylm.engine.sampling_params import MAX_N_SEQUENCES


class OpenAIServingCompletion(OpenAIServing):
    async def create_completion(self, request: CompletionRequest, raw_request: Request) -> Response:
        model_name = self.check_model(request.model)
        self.check_priority(request)
        requested = request.prompts()
        payloads = request.prompt_embeds_payloads()
        self.check_limits(request, requested, len(payloads))
        structured_outputs = self.structured_outputs(request)
        # Embeddings prompts first, then the others, as vLLM orders the choices.
        embeds_list = await self.off_loop(self._load_prompt_embeds, payloads, request.truncate_prompt_tokens)
        token_ids_list = await self.off_loop(self._tokenize_all, requested, request.add_special_tokens)
        truncated = [request.truncated(token_ids, self.max_model_len) for token_ids in token_ids_list]
        # A truncated prompt's text is no longer its tokens': echo decodes the tokens kept.
        requested = [prompt if len(kept) == len(token_ids) else kept
                     for prompt, token_ids, kept in zip(requested, token_ids_list, truncated)]
        token_ids_list = truncated
        build = functools.partial(request.to_sampling_params, structured_outputs=structured_outputs)
        prompts, params = [], []
        for embeds in embeds_list:
            params.append(self.sampling_params(build, len(embeds), request.max_tokens))
            prompts.append(request.with_cache_salt({PROMPT_EMBEDS_KEY: embeds}))
        # The placeholder ids stand for each embeddings prompt's length (response-size checks).
        token_ids_list = [[PLACEHOLDER_TOKEN_ID] * len(embeds) for embeds in embeds_list] + token_ids_list
        for prompt, token_ids in zip(requested, token_ids_list[len(embeds_list):]):
            params.append(self.sampling_params(build, len(token_ids), request.max_tokens))
            prompts.append(request.with_cache_salt({"prompt": prompt, "prompt_token_ids": token_ids}
                                                   if isinstance(prompt, str) else {"prompt_token_ids": token_ids}))
        echo_logprobs = request.echo and request.logprobs is not None  # the prompt's logprobs, asked by logprobs
        held = self.limits.check_response_size(
            [(len(ids), p) for ids, p in zip(token_ids_list, params)],
            prompt_logprobs_param="logprobs" if echo_logprobs else "prompt_logprobs",
            returns_prompt_ids=bool(request.return_token_ids))
        request_id = random_id("cmpl")
        created = int(time.time())
        if request.use_beam_search and request.stream:
            raise OpenAIError("use_beam_search cannot be streamed: the best beams are known only at the end.",
                              param="stream")
        with self.response_budget.reserve(held) as reservation:
            # A beam search is a request like any other here (its stream yields the final
            # output), so a client that leaves stops it as it stops the others.
            streams = await self.add_requests(request_id, prompts, params, self.lora_request(model_name),
                                              request.priority)
            if request.stream:
                return SSEResponse(self._stream(request, request_id, created, model_name, streams),
                                   reservation.keep())
            finals: list[RequestOutput | None] = [None] * len(streams)
            async for index, output in merge_async_iterators(streams, raw_request.is_disconnected):
                finals[index] = output
            return JSONResponse(self._response(request, request_id, created, model_name, finals).model_dump())

    def check_limits(self, request: CompletionRequest, prompts: list[str | list[int]],
                     num_prompt_embeds: int = 0) -> None:
        """Every size the request asks for, before anything is tokenized, decoded or allocated."""
        if num_prompt_embeds:
            self.check_prompt_embeds_request(request)
        num_prompts = len(prompts) + num_prompt_embeds
        self.limits.check_num_prompts(num_prompts, "prompt" if prompts else PROMPT_EMBEDS_KEY)
        for prompt in prompts:
            if isinstance(prompt, str):
                self.limits.check_prompt_chars(len(prompt), self.max_model_len)
        self.limits.check_sampling(request)
        self.check_token_fields(request)
        self.check_logprobs(request)
        width = request.best_of if request.best_of is not None else request.n
        if num_prompts * width > MAX_N_SEQUENCES:
            param = "best_of" if request.best_of is not None else "n"
            raise OpenAIError(f"This request asks for {num_prompts} prompts x {param} {width} = {num_prompts * width} "
                              f"sequences; at most {MAX_N_SEQUENCES} are allowed in one request "
                              f"(RAYLM_MAX_N_SEQUENCES).", param=param)
        max_logprobs = self.engine.model_config.max_logprobs
        if request.use_beam_search and max_logprobs >= 0:
            # Each beam's step is a request for beams_to_keep logprobs (vLLM: 2 x beam_width).
            per_beam = beams_to_keep(1, len(self.engine.engine.eos_token_ids))
            if per_beam * width > max_logprobs:
                raise OpenAIError(f"best_of (the beam width) must be at most {max_logprobs // per_beam} with "
                                  f"use_beam_search: each step asks for {per_beam} x best_of logprobs and the "
                                  f"server's --max-logprobs is {max_logprobs}; got {width}.", param="best_of")

    def check_prompt_embeds_request(self, request: CompletionRequest) -> None:
        """vLLM's rules for prompt_embeds: only under --enable-prompt-embeds, and without what
        needs the prompt's tokens (echo, prompt_logprobs) or a beam search."""
        if not self.engine.model_config.enable_prompt_embeds:
            raise OpenAIError("prompt_embeds need the server to be started with --enable-prompt-embeds.",
                              param=PROMPT_EMBEDS_KEY)
        refused = [(request.echo, "echo", "echo is not supported with prompt_embeds: the prompt has no text."),
                   (request.prompt_logprobs is not None, "prompt_logprobs",
                    "prompt_logprobs is not supported with prompt_embeds: the prompt has no tokens to score."),
                   (request.use_beam_search, "use_beam_search",
                    "use_beam_search is not supported with prompt_embeds.")]
        for is_set, param, message in refused:
            if is_set:
                raise OpenAIError(message, param=param)

    def _load_prompt_embeds(self, payloads: list[str], truncate_prompt_tokens: int | None) -> list[Any]:
        """Each payload's tensor, loaded safely and checked (`load_prompt_embeds`), on the
        tokenizer thread; a bad one is a 400 naming prompt_embeds."""
        config = self.engine.model_config
        try:
            return [load_prompt_embeds(payload, config.hidden_size, config.max_model_len, config.dtype,
                                       truncate_prompt_tokens=truncate_prompt_tokens) for payload in payloads]
        except ValueError as exc:
            raise OpenAIError(str(exc), param=getattr(exc, "param", None) or PROMPT_EMBEDS_KEY) from None

    def _tokenize_all(self, prompts: list[str | list[int]], add_special_tokens: bool) -> list[list[int]]:
        """Each prompt's token ids (on the tokenizer thread)."""
        return [self.tokenize(prompt, add_special_tokens) if isinstance(prompt, str) else list(prompt)
                for prompt in prompts]

    # ------------------------------------------------------------ full response
    def _response(self, request: CompletionRequest, request_id: str, created: int, model_name: str,
                  finals: list[RequestOutput | None]) -> CompletionResponse:
        choices: list[CompletionResponseChoice] = []
        prompt_tokens = completion_tokens = 0
        as_ids = self.tokens_as_ids(request)
        for prompt_index, output in enumerate(finals):
            assert output is not None and output.finished
            prompt_tokens += len(output.prompt_token_ids)
            prompt_text = self._echo_text(request, output)
            for completion in output.outputs:
                completion_tokens += len(completion.token_ids)
                if self.logs_outputs:
                    self.log_output(f"{request_id}-{prompt_index}", completion)
                logprobs = None
                if request.logprobs is not None:
                    token_ids, entries = list(completion.token_ids), list(completion.logprobs or [])
                    if request.echo:
                        token_ids = output.prompt_token_ids + token_ids
                        entries = list(output.prompt_logprobs or [None] * len(output.prompt_token_ids)) + entries
                    logprobs = self.completion_logprobs(token_ids, entries, request.logprobs, 0, as_ids)
                choices.append(CompletionResponseChoice(
                    index=prompt_index * request.n + completion.index, text=prompt_text + completion.text,
                    logprobs=logprobs, finish_reason=completion.finish_reason, stop_reason=completion.stop_reason,
                    prompt_logprobs=_prompt_logprobs_body(output),
                    prompt_token_ids=output.prompt_token_ids if request.return_token_ids else None,
                    token_ids=list(completion.token_ids) if request.return_token_ids else None))
        usage = _usage(prompt_tokens, completion_tokens, self._cached_tokens(finals))
        return CompletionResponse(id=request_id, created=created, model=model_name, choices=choices, usage=usage)

    def _cached_tokens(self, outputs: list[RequestOutput | None]) -> int | None:
        """The prompts' prefix-cache hits together, under --enable-prompt-tokens-details."""
        if not self.enable_prompt_tokens_details:
            return None
        return sum(output.num_cached_tokens or 0 for output in outputs if output is not None)

    def _echo_text(self, request: CompletionRequest, output: RequestOutput) -> str:
        """The prompt's text that `echo` puts before a choice's text. With return_token_ids
        vLLM echoes the prompt as prompt_token_ids only (its text stays out, as do the
        decode's costs), and so does raylm; the echo's logprobs still cover the prompt."""
        if not request.echo or request.return_token_ids:
            return ""
        return output.prompt if output.prompt is not None else self.decode(output.prompt_token_ids)

    # --------------------------------------------------------------- streaming
    async def _stream(self, request: CompletionRequest, request_id: str, created: int, model_name: str,
                      streams: list[AsyncIterator[RequestOutput]]) -> AsyncIterator[str]:
        n = request.n
        text_lens = [0] * (len(streams) * n)  # characters sent per choice, for text_offset
        started = [False] * (len(streams) * n)  # the choice's first chunk (echo, prompt_token_ids) was sent
        choice_tokens = [0] * (len(streams) * n)
        as_ids = self.tokens_as_ids(request)
        completion_tokens = 0
        prompt_tokens = [0] * len(streams)
        last_outputs: list[RequestOutput | None] = [None] * len(streams)  # for the prompts' cache hits
        usage_per_chunk = request.stream_options is not None and request.stream_options.usage_per_chunk
        # --enable-log-outputs: each choice's text and ids so far, logged whole when it finishes.
        logged: list[tuple[list[str], list[int]]] | None = \
            [([], []) for _ in range(len(streams) * n)] if self.logs_outputs else None
        try:
            async for prompt_index, output in merge_async_iterators(streams):
                prompt_tokens[prompt_index] = len(output.prompt_token_ids)
                last_outputs[prompt_index] = output
                for completion in output.outputs:
                    choice_index = prompt_index * n + completion.index
                    text, token_ids = completion.text, list(completion.token_ids)
                    entries: list[Any] = list(completion.logprobs or [])
                    first = not started[choice_index]
                    started[choice_index] = True
                    if request.echo and first:
                        text = self._echo_text(request, output) + text
                        token_ids = output.prompt_token_ids + token_ids
                        entries = list(output.prompt_logprobs or [None] * len(output.prompt_token_ids)) + entries
                    logprobs = None
                    if request.logprobs is not None:
                        logprobs = self.completion_logprobs(token_ids, entries, request.logprobs,
                                                            text_lens[choice_index], as_ids)
                    text_lens[choice_index] += len(text)
                    completion_tokens += len(completion.token_ids)
                    if logged is not None:
                        self.log_streamed(logged[choice_index], f"{request_id}-{prompt_index}", completion)
                    choice_tokens[choice_index] += len(completion.token_ids)
                    ids = request.return_token_ids  # the prompt's in the choice's first chunk, as vLLM's
                    chunk = CompletionStreamResponse(
                        id=request_id, created=created, model=model_name,
                        choices=[CompletionResponseStreamChoice(
                            index=choice_index, text=text, logprobs=logprobs,
                            finish_reason=completion.finish_reason, stop_reason=completion.stop_reason,
                            prompt_token_ids=output.prompt_token_ids if ids and first else None,
                            token_ids=list(completion.token_ids) if ids else None)])
                    if usage_per_chunk:
                        chunk.usage = _usage(prompt_tokens[prompt_index], choice_tokens[choice_index])
                    yield sse(chunk)
            if request.stream_options is not None and request.stream_options.include_usage:
                yield sse(CompletionStreamResponse(id=request_id, created=created, model=model_name, choices=[],
                                                   usage=_usage(sum(prompt_tokens), completion_tokens,
                                                                self._cached_tokens(last_outputs))))
        except Exception as exc:  # noqa: BLE001 - reported in the stream, as vLLM does
            yield sse_error(exc)
        yield SSE_DONE

    # ---------------------------------------------------------------- logprobs
    def completion_logprobs(self, token_ids: list[int], entries: list[dict[int, Logprob] | None], num_logprobs: int,
                            initial_text_offset: int, as_ids: bool = False) -> CompletionLogProbs:
        """OpenAI's completions logprobs: per token its text (`token_id:{id}` with `as_ids`,
        the alternatives' too), logprob, offset in the choice's text, and the top
        `num_logprobs` alternatives (plus the chosen one). The offsets count the tokens'
        text even when they are named by id (vLLM's advance by the length of the
        `token_id:` name, which is no offset in the text)."""
        result = CompletionLogProbs()
        offset = initial_text_offset
        for position, token_id in enumerate(token_ids):
            entry = entries[position] if position < len(entries) else None
            chosen = entry.get(token_id) if entry is not None else None
            text = self.token_text(token_id, chosen)
            result.tokens.append(token_id_placeholder(token_id) if as_ids else text)
            if entry is None:
                result.token_logprobs.append(None)
                result.top_logprobs.append(None)
            else:
                result.token_logprobs.append(max(chosen.logprob, -9999.0) if chosen is not None else None)
                top: dict[str, float] = {}
                for alt_id, alt in entry.items():
                    if alt_id == token_id or (alt.rank is not None and alt.rank <= num_logprobs):
                        top.setdefault(self.token_name(alt_id, alt, as_ids), max(alt.logprob, -9999.0))
                result.top_logprobs.append(top)
            result.text_offset.append(offset)
            offset += len(text)
        return result


def _usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int | None = None) -> UsageInfo:
    return UsageInfo(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                     total_tokens=prompt_tokens + completion_tokens,
                     prompt_tokens_details=PromptTokensDetails(cached_tokens=cached_tokens)
                     if cached_tokens is not None else None)


def _prompt_logprobs_body(output: RequestOutput) -> list[dict[int, dict[str, Any]] | None] | None:
    """vLLM's `prompt_logprobs` of a choice: per prompt position (None for the first), token id
    -> {logprob, rank, decoded_token}."""
    if output.prompt_logprobs is None:
        return None
    return [None if entry is None else
            {token_id: {"logprob": lp.logprob, "rank": lp.rank, "decoded_token": lp.decoded_token}
             for token_id, lp in entry.items()}
            for entry in output.prompt_logprobs]
