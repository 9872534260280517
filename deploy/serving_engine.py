"""What the completions and chat routes share: model-name checks, tokenization, the
context-length rule, turning engine outputs into logprob entries, and streaming helpers."""

from __future__ import annotations

import asyncio
import functools
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from http import HTTPStatus
from typing import Any

from pydantic import BaseModel
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from raylm.deploy.errors import OpenAIError, error_body
from raylm.deploy.limits import RequestLimits
from raylm.deploy.request_logger import RequestLogger
from raylm.deploy.response_budget import Reservation, ResponseBudget, default_response_tokens_in_flight
from raylm.deploy.serving_models import adapter_unavailable
from raylm.deploy.structured_outputs import structured_outputs_params
from raylm.engine.async_llm_engine import AsyncEngineDeadError, AsyncLLMEngine
from raylm.engine.engine_core import EngineSleepingError
from raylm.engine.outputs import Logprob, RequestOutput
from raylm.engine.pooling_params import PoolingParams
from raylm.engine.request import check_priority
from raylm.engine.sampling_params import SamplingParams
from raylm.engine.structured_output.params import GrammarCompilerUnavailableError, StructuredOutputsParams
from raylm.executors.lora_adapter import LoRAAdapterError

logger = logging.getLogger(__name__)

# How often a non-streaming request checks whether its client is still there.
DISCONNECT_POLL_S = 1.0


class OpenAIServing:
    """Holds the engine, the request limits and the frontend's own tokenizer (the
    engine's belongs to the engine thread). Tokenizing and chat templating run on a
    thread of their own, as in vLLM, so a long prompt never stalls the event loop."""

    def __init__(self, engine: AsyncLLMEngine, served_model_names: list[str], tokenizer: Any,
                 limits: RequestLimits | None = None, model_aliases: Iterable[str] = (),
                 models: Any = None, response_budget: ResponseBudget | None = None,
                 return_tokens_as_token_ids: bool = False, request_logger: RequestLogger | None = None,
                 enable_prompt_tokens_details: bool = False) -> None:
        self.engine = engine
        # --enable-prompt-tokens-details: usage carries the prompt's prefix-cache hits.
        self.enable_prompt_tokens_details = enable_prompt_tokens_details
        # --enable-log-requests: logs each engine request as it is added (None: off).
        self.request_logger = request_logger
        # --return-tokens-as-token-ids: logprobs name tokens `token_id:{id}` unless a request says.
        self.return_tokens_as_token_ids = return_tokens_as_token_ids
        self.served_model_names = served_model_names
        # Names a request may use that are not advertised (ServerArgs.model_aliases).
        self.accepted_model_names = frozenset([*served_model_names, *model_aliases])
        self.model_name = served_model_names[0]
        # The served names with the LoRA adapters (deploy/serving_models.py), when given.
        self.models = models
        self.tokenizer = tokenizer
        self.limits = limits or RequestLimits()
        # What the responses in flight hold together (shared by the routes that generate).
        self.response_budget = response_budget or ResponseBudget(
            default_response_tokens_in_flight(self.limits.max_response_tokens))
        self.max_model_len: int = engine.model_config.max_model_len
        # The sampling defaults of the model's generation_config.json, for fields a request leaves unset.
        self.model_defaults: dict[str, Any] = dict(engine.engine.generation_defaults.sampling)
        # One thread per tokenizer, shared by every route that uses it: a fast tokenizer
        # must not encode on two threads at once.
        self._tokenizer_thread = _tokenizer_thread(tokenizer)

    async def off_loop(self, function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """`function(*args, **kwargs)` on the tokenizer thread (tokenizing, chat templates)."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._tokenizer_thread, functools.partial(function, *args, **kwargs))

    # ------------------------------------------------------------ validation
    def check_model(self, model: str | None) -> str:
        if model and model not in self.accepted_model_names:
            if self.models is not None:  # a LoRA adapter's name, or 404
                return self.models.check_model(model)
            raise OpenAIError(f"The model `{model}` does not exist.", HTTPStatus.NOT_FOUND, "model")
        return self.model_name

    def lora_request(self, model_name: str) -> Any:
        """The LoRA adapter a request for `model_name` (check_model's answer) runs under."""
        return None if self.models is None else self.models.lora_request(model_name)

    def tokenize(self, text: str, add_special_tokens: bool, param: str = "prompt") -> list[int]:
        """The text's token ids; text too long for any context is refused before tokenizing."""
        if self.tokenizer is None:
            raise OpenAIError("This server runs without a tokenizer: send prompts as token ids.", param=param)
        self.limits.check_prompt_chars(len(text), self.max_model_len, param)
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)

    def check_token_fields(self, request: Any) -> None:
        """allowed_token_ids (within the vocabulary), bad_words (their count and length),
        truncate_prompt_tokens (within the context) and detokenize, before tokenizing."""
        try:
            request.check_token_fields(self.engine.model_config.vocab_size, self.max_model_len)
        except ValueError as exc:
            raise OpenAIError(str(exc), param=getattr(exc, "param", None)) from None

    def check_logprobs(self, request: Any) -> None:
        """vLLM's max_logprobs (an engine argument) for logprobs, chat's top_logprobs and
        prompt_logprobs; checked here too so the error names the request's field."""
        vocab_size = self.engine.model_config.vocab_size
        max_logprobs = self.engine.model_config.max_logprobs
        for name in ("logprobs", "top_logprobs", "prompt_logprobs"):
            value = getattr(request, name, None)
            if value is None or isinstance(value, bool):  # chat's logprobs is a switch
                continue
            if 0 <= max_logprobs < value:
                raise OpenAIError(f"{name} must be at most {max_logprobs} (the server's --max-logprobs), "
                                  f"got {value}.", param=name)
            if value > vocab_size:
                raise OpenAIError(f"{name} must be at most the vocabulary size {vocab_size}, got {value}.",
                                  param=name)

    def check_priority(self, request: Any) -> None:
        """vLLM's rule for the request's `priority`: any value but 0 needs the server started
        with --scheduling-policy priority (a 400 naming the field otherwise)."""
        try:
            check_priority(request.priority, self.engine.engine.engine_config.scheduler_config.policy)
        except ValueError as exc:
            raise OpenAIError(str(exc), param="priority") from None

    def decode(self, token_ids: list[int]) -> str:
        return "" if self.tokenizer is None else self.tokenizer.decode(token_ids)

    def check_context(self, prompt_len: int, max_tokens: int | None, noun: str = "prompt") -> int:
        """vLLM's rule: the prompt and max_tokens must fit in the context. Returns the
        max_tokens to use (the rest of the context when the request gave none)."""
        if prompt_len > self.max_model_len:
            raise OpenAIError(f"This model's maximum context length is {self.max_model_len} tokens. However, "
                              f"your {noun} has {prompt_len} tokens. Please reduce the length of the {noun}.",
                              param="prompt" if noun == "prompt" else "messages")
        if max_tokens is None:
            return max(1, self.max_model_len - prompt_len)
        if prompt_len + max_tokens > self.max_model_len:
            raise OpenAIError(f"This model's maximum context length is {self.max_model_len} tokens. However, you "
                              f"requested {prompt_len + max_tokens} tokens ({prompt_len} in the {noun}, "
                              f"{max_tokens} in the completion). Please reduce the length of the {noun} or "
                              f"completion.", param="max_tokens")
        return max_tokens

    def sampling_params(self, build: Callable[[int, dict[str, Any]], SamplingParams], prompt_len: int,
                        max_tokens: int | None) -> SamplingParams:
        """The request's SamplingParams; a value out of range is a 400 naming its field."""
        default_max_tokens = self.check_context(prompt_len, max_tokens)
        try:
            return build(default_max_tokens, self.model_defaults)
        except ValueError as exc:
            raise OpenAIError(str(exc), param=getattr(exc, "param", None)) from None

    def structured_outputs(self, request: Any) -> StructuredOutputsParams | None:
        """The request's output constraint (response_format, structured_outputs, guided_*),
        checked against the limits; a 400 names the field."""
        return structured_outputs_params(request, self.limits)

    async def compile_structured_outputs(self, params: list[SamplingParams]) -> None:
        """Waits until the requests' grammars are compiled (off the event loop and the engine
        step), so that they start at once; one that does not compile, or not within
        --max-grammar-compile-seconds, is a 400 naming its field. The grammar compile worker
        down (it died, or cannot start) is a 503, as when no replica can answer: the request
        may succeed once it is back."""
        constraints = {p.structured_outputs.cache_key(): p.structured_outputs
                       for p in params if getattr(p, "structured_outputs", None) is not None}
        for constraint in constraints.values():
            try:
                await self.engine.compile_structured_outputs(constraint, self.limits.max_grammar_compile_seconds)
            except ValueError as exc:
                raise OpenAIError(str(exc), param=getattr(exc, "param", None)) from None
            except GrammarCompilerUnavailableError as exc:
                raise OpenAIError(str(exc), HTTPStatus.SERVICE_UNAVAILABLE) from None

    @property
    def logs_outputs(self) -> bool:
        """--enable-log-outputs with --enable-log-requests: finished choices are logged."""
        return self.request_logger is not None and self.request_logger.log_outputs

    def log_output(self, engine_request_id: str, completion: Any, streamed: bool = False,
                   text: str | None = None, token_ids: list[int] | None = None) -> None:
        """Logs one finished choice (a CompletionOutput; a streamed one's text and ids whole)."""
        assert self.request_logger is not None
        self.request_logger.log_output(engine_request_id, completion.index,
                                       completion.text if text is None else text,
                                       list(completion.token_ids) if token_ids is None else token_ids,
                                       completion.finish_reason, streamed)

    def log_streamed(self, so_far: tuple[list[str], list[int]], engine_request_id: str, completion: Any) -> None:
        """Adds a streamed choice's delta to what it wrote so far; logs it all once it finishes."""
        texts, token_ids = so_far
        texts.append(completion.text)
        token_ids.extend(completion.token_ids)
        if completion.finished():
            self.log_output(engine_request_id, completion, streamed=True, text="".join(texts), token_ids=token_ids)

    async def add_requests(self, request_id: str, prompts: list[dict],
                           params: list[SamplingParams] | list[PoolingParams], lora_request: Any = None,
                           priority: int = 0) -> list[AsyncIterator[RequestOutput]]:
        """Adds one engine request per prompt (all of `priority`; PoolingParams: one
        embedding each); a rejected prompt aborts the others."""
        await self.compile_structured_outputs(params)
        streams: list[AsyncIterator[RequestOutput]] = []
        try:
            for index, (prompt, sampling_params) in enumerate(zip(prompts, params)):
                if self.request_logger is not None:
                    self.request_logger.log_inputs(f"{request_id}-{index}", prompt.get("prompt"),
                                                   prompt.get("prompt_token_ids"), sampling_params, lora_request)
                streams.append(await self.engine.add_request(f"{request_id}-{index}", prompt, sampling_params,
                                                             lora_request=lora_request, priority=priority))
        except BaseException as exc:
            for stream in streams:
                await stream.aclose()
            if isinstance(exc, LoRAAdapterError):  # the adapter's files went bad since it was loaded
                raise adapter_unavailable(exc, lora_request.lora_name) from None
            if isinstance(exc, ValueError):
                # The sampling fields were checked when the params were built; what the
                # engine still rejects without naming a field is the prompt (its token ids).
                raise OpenAIError(str(exc), param=getattr(exc, "param", None) or "prompt") from None
            if isinstance(exc, AsyncEngineDeadError):
                raise OpenAIError(str(exc), HTTPStatus.INTERNAL_SERVER_ERROR) from None
            raise
        if lora_request is not None:
            streams = [_adapter_errors_as_openai(stream, lora_request.lora_name) for stream in streams]
        return streams

    # -------------------------------------------------------------- logprobs
    def tokens_as_ids(self, request: Any) -> bool:
        """Whether the request's logprobs name tokens `token_id:{id}`: its own
        return_tokens_as_token_ids, else the server's --return-tokens-as-token-ids."""
        if request.return_tokens_as_token_ids is not None:
            return request.return_tokens_as_token_ids
        return self.return_tokens_as_token_ids

    def token_text(self, token_id: int, logprob: Logprob | None = None) -> str:
        if logprob is not None and logprob.decoded_token is not None:
            return logprob.decoded_token
        return self.decode([token_id])

    def token_name(self, token_id: int, logprob: Logprob | None, as_id: bool) -> str:
        """How a logprobs entry names a token: `token_id:{id}` with as_id (vLLM's form, which
        tells apart tokens whose text is not valid UTF-8 alone), else its text."""
        return token_id_placeholder(token_id) if as_id else self.token_text(token_id, logprob)


def token_id_placeholder(token_id: int) -> str:
    """vLLM's name of a token in logprobs under return_tokens_as_token_ids."""
    return f"token_id:{token_id}"


async def _adapter_errors_as_openai(stream: AsyncIterator[RequestOutput], lora_name: str
                                    ) -> AsyncIterator[RequestOutput]:
    """The stream of a request under a LoRA adapter; the engine fails such a request alone
    when the adapter's files went bad after it was loaded, which is a 404 or 400 naming the
    adapter (vLLM's statuses for an adapter it cannot load), not a 500."""
    try:
        async for output in stream:
            yield output
    except LoRAAdapterError as exc:
        raise adapter_unavailable(exc, lora_name) from None
    finally:
        await stream.aclose()


class ClientDisconnected(Exception):
    """The client of a non-streamed request left before its answer: its engine requests are
    aborted, and the app answers quietly (api_server's handler), with nothing to log."""


_TOKENIZER_THREADS: dict[int, ThreadPoolExecutor] = {}


def _tokenizer_thread(tokenizer: Any) -> ThreadPoolExecutor:
    key = id(tokenizer)
    if key not in _TOKENIZER_THREADS:
        _TOKENIZER_THREADS[key] = ThreadPoolExecutor(max_workers=1, thread_name_prefix="raylm-tokenizer")
    return _TOKENIZER_THREADS[key]


async def merge_async_iterators(iterators: list[AsyncIterator[Any]],
                                is_cancelled: Callable[[], Awaitable[bool]] | None = None
                                ) -> AsyncIterator[tuple[int, Any]]:
    """Yields (index, item) from several iterators as items arrive. With `is_cancelled`
    (the client's disconnect check), stops and closes them all once it says True."""
    if len(iterators) == 1 and is_cancelled is None:
        try:
            async for item in iterators[0]:
                yield 0, item
        finally:
            await iterators[0].aclose()
        return
    queue: asyncio.Queue = asyncio.Queue()
    finished = object()

    async def drain(index: int, iterator: AsyncIterator[Any]) -> None:
        try:
            async for item in iterator:
                queue.put_nowait((index, item))
            queue.put_nowait((index, finished))
        except Exception as exc:  # noqa: BLE001 - handed to the consumer
            queue.put_nowait((index, exc))

    async def watch() -> None:
        while True:
            await asyncio.sleep(DISCONNECT_POLL_S)
            if await is_cancelled():
                queue.put_nowait((-1, ClientDisconnected()))
                return

    tasks = [asyncio.create_task(drain(i, it)) for i, it in enumerate(iterators)]
    watcher = asyncio.create_task(watch()) if is_cancelled is not None else None
    try:
        remaining = len(tasks)
        while remaining:
            index, item = await queue.get()
            if item is finished:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield index, item
    finally:
        for task in tasks:
            task.cancel()
        if watcher is not None:
            watcher.cancel()
        # Cancelling a drain task closes its iterator (the request is aborted) once the
        # task runs; wait for that, then close any iterator that never started.
        await asyncio.gather(*tasks, return_exceptions=True)
        for iterator in iterators:
            await iterator.aclose()


_UNICODE_LINE_BREAKS = (("\u0085", "\\u0085"), ("\u2028", "\\u2028"), ("\u2029", "\\u2029"))


def sse(payload: BaseModel | dict) -> str:
    """One server-sent event. Chat deltas leave out their empty fields, as OpenAI's do."""
    body = payload.model_dump(mode="json") if isinstance(payload, BaseModel) else payload
    for choice in body.get("choices") or ():
        delta = choice.get("delta")
        if isinstance(delta, dict):
            choice["delta"] = {k: v for k, v in delta.items() if v is not None}
    # Line separators other than CR/LF (U+0085, U+2028, U+2029) stay escaped: clients that
    # split the stream with str.splitlines() would otherwise cut a token's JSON in two.
    text = json.dumps(body, ensure_ascii=False)
    for separator, escaped in _UNICODE_LINE_BREAKS:
        text = text.replace(separator, escaped)
    return f"data: {text}\n\n"


def sse_error(exc: BaseException) -> str:
    if isinstance(exc, OpenAIError):
        body = error_body(exc.message, exc.status, exc.param)
    elif isinstance(exc, EngineSleepingError):  # aborted by /sleep (deploy/dev_routes.py)
        from raylm.deploy.dev_routes import engine_sleeping_body

        body = engine_sleeping_body(exc)
    elif isinstance(exc, ValueError):
        body = error_body(str(exc), HTTPStatus.BAD_REQUEST, getattr(exc, "param", None))
    else:
        logger.error("A streamed request failed: %r", exc)
        body = error_body("The request failed inside the server.", HTTPStatus.INTERNAL_SERVER_ERROR)
    return sse(body)


SSE_DONE = "data: [DONE]\n\n"


class SSEResponse(StreamingResponse):
    """Server-sent events whose body generator is always closed, whatever ended the
    response (a client disconnect included), so the request behind it is aborted; then
    the request's `reservation` of the response budget is given back."""

    media_type = "text/event-stream"

    def __init__(self, content: AsyncIterator[str], reservation: Reservation | None = None) -> None:
        super().__init__(content)
        self.reservation = reservation

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            try:
                aclose = getattr(self.body_iterator, "aclose", None)
                if aclose is not None:
                    await aclose()
            finally:
                if self.reservation is not None:
                    self.reservation.release()
