"""The OpenAI-compatible FastAPI app over an `AsyncLLMEngine`.

`build_app(engine, args)` returns the app with every route; `raylm serve` runs it with
uvicorn and the Ray Serve deployment mounts the same app as its ingress.

Routes: POST /v1/completions, POST /v1/chat/completions, GET /v1/models, GET /health,
GET /version, POST /tokenize, POST /detokenize, GET /metrics (Prometheus).

What guards them, outermost first (pure ASGI middleware, so streams and client disconnects
pass through untouched): the API key, on every route but /health and /metrics; the bound on
requests in flight (429 past it); the bound on the body's size (413 past it, found while
the body is read). `raylm serve` adds the process's lifecycle: SIGTERM drains, and the
process exits non-zero once the engine loop has died.
"""

from __future__ import annotations

import argparse
import asyncio
import hmac
import logging
import signal
from dataclasses import dataclass, field
from http import HTTPStatus
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from raylm.deploy.errors import OpenAIError, error_response, install_error_handlers
from raylm.deploy.limits import RequestLimits
from raylm.deploy.metrics import ServerMetrics
from raylm.deploy.protocol import (ChatCompletionRequest, CompletionRequest, DetokenizeRequest, DetokenizeResponse,
                                   ModelCard, ModelList, TokenizeRequest, TokenizeResponse)
from raylm.deploy.serving_chat import OpenAIServingChat, load_chat_template
from raylm.deploy.serving_completions import OpenAIServingCompletion
from raylm.deploy.tool_calls import ToolCallConfig
from raylm.deploy.tool_parsers import TOOL_PARSERS
from raylm.engine.async_llm_engine import AsyncEngineDeadError, AsyncLLMEngine

logger = logging.getLogger(__name__)

VERSION = "0.1.0"

# Routes a load balancer's health probe and a Prometheus scrape reach without the API key
# and past the bound on requests in flight: a probe must answer while the server is full,
# and the metrics hold only aggregate counters (no prompt, output or key), so a scraper
# needs no key that could also spend the engine's time (vLLM leaves /metrics open too).
OPEN_ROUTES = frozenset({"/health", "/metrics"})
# 4x the engine's default max_num_seqs (256): enough waiting requests to keep the batch
# full, a bounded queue behind it (TGI's --max-concurrent-requests defaults to 128).
DEFAULT_MAX_CONCURRENT_REQUESTS = 1024
# A prompt of 128k tokens as text or as token ids, or --max-prompts-per-request prompts
# of a few thousand token ids, fit several times over.
DEFAULT_MAX_REQUEST_BODY_BYTES = 16 * 1024 * 1024
# Below Kubernetes' default grace period (30 s, then SIGKILL), so the engine and its
# workers are shut down before the kill.
DEFAULT_SHUTDOWN_TIMEOUT_S = 25.0
# How often `raylm serve` looks whether the engine loop has died.
ENGINE_WATCH_PERIOD_S = 0.5


@dataclass
class ServerArgs:
    """The server's own settings (the engine's live in `EngineArgs`).

    served_model_name: names clients may put in `model`; the first is reported in
        responses. Default: the model path, as vLLM does.
    api_key: when set, every route but OPEN_ROUTES needs `Authorization: Bearer <api_key>`.
    chat_template: a Jinja template, or a file holding one, instead of the tokenizer's.
    trust_request_chat_template: accept a `chat_template` sent with a chat request (off, as
        in vLLM: a template is code that runs on the server's tokenizer thread).
    max_concurrent_requests: requests in flight (received, not yet fully answered) past
        which a new one gets 429 at once; OPEN_ROUTES do not count.
    max_request_body_bytes: the largest request body; a larger one gets 413, before it
        is buffered.
    enable_auto_tool_choice: serve tool_choice "auto" (the default with tools), parsing the
        calls out of the model's text with `tool_call_parser` (vLLM's flags).
    tool_call_parser: the model family's tool-call format: hermes, llama3_json or mistral.
    """

    model: str = ""
    served_model_name: list[str] | None = None
    api_key: str | None = None
    chat_template: str | None = None
    trust_request_chat_template: bool = False
    max_concurrent_requests: int = DEFAULT_MAX_CONCURRENT_REQUESTS
    max_request_body_bytes: int = DEFAULT_MAX_REQUEST_BODY_BYTES
    enable_auto_tool_choice: bool = False
    tool_call_parser: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for name in ("max_concurrent_requests", "max_request_body_bytes"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}.")

    @classmethod
    def from_namespace(cls, args: Any) -> "ServerArgs":
        if isinstance(args, ServerArgs):
            return args
        values = vars(args) if isinstance(args, argparse.Namespace) else dict(args or {})
        names = values.get("served_model_name")
        if isinstance(names, str):
            names = [names]
        limits = {name: int(values[name]) for name in ("max_concurrent_requests", "max_request_body_bytes")
                  if values.get(name) is not None}
        return cls(model=values.get("model") or "", served_model_name=names or None, api_key=values.get("api_key"),
                   chat_template=values.get("chat_template"),
                   trust_request_chat_template=bool(values.get("trust_request_chat_template")),
                   enable_auto_tool_choice=str(values.get("enable_auto_tool_choice")).lower() in ("true", "1", "yes"),
                   tool_call_parser=values.get("tool_call_parser"), **limits)

    def model_names(self, engine: AsyncLLMEngine) -> list[str]:
        if self.served_model_name:
            return list(self.served_model_name)
        return [_default_model_name(self.model or engine.model_config.model)]


def _default_model_name(model: str) -> str:
    """vLLM names a served model by its path; the bundled demo model gets its short name
    so that requests (and the README's curl) need not spell a path inside the package."""
    from pathlib import Path

    from raylm.models.bundled import DEMO_MODEL_NAME, default_model_path

    try:
        if Path(model).resolve() == Path(default_model_path()).resolve():
            return DEMO_MODEL_NAME
    except FileNotFoundError:
        pass
    return model


def _route_path(scope: Scope) -> str:
    """The path the router matches: `scope["path"]` less the root path (uvicorn's
    --root-path, Ray Serve's route_prefix), which the path still holds. The same rule as
    Starlette's routing, so what is checked is what is served."""
    path, root_path = scope["path"], scope.get("root_path") or ""
    if root_path and path.startswith(root_path) and path[len(root_path):len(root_path) + 1] in ("", "/"):
        return path[len(root_path):]
    return path


def _is_open(scope: Scope) -> bool:
    return _route_path(scope) in OPEN_ROUTES


class _ApiKeyMiddleware:
    """Rejects requests without the right bearer token on every route but OPEN_ROUTES
    (and CORS preflights, which carry no credentials)."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self._expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] != "OPTIONS" and not _is_open(scope):
            headers = dict(scope.get("headers") or [])
            # Constant time: how much of a guess matched must not show in the timing.
            if not hmac.compare_digest(headers.get(b"authorization", b""), self._expected):
                response = error_response("Unauthorized: a valid API key is required (Authorization: Bearer ...).",
                                          HTTPStatus.UNAUTHORIZED)
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


class _ConcurrencyLimitMiddleware:
    """Answers 429 at once to a request arriving while `max_requests` are in flight, so
    overload shows as fast refusals instead of ever longer queues. A request is in flight
    from its headers until its response (a whole stream) is sent or its client leaves."""

    def __init__(self, app: ASGIApp, max_requests: int) -> None:
        self.app = app
        self.max_requests = max_requests
        self.in_flight = 0  # one event loop: no lock needed

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or _is_open(scope):
            await self.app(scope, receive, send)
            return
        if self.in_flight >= self.max_requests:
            response = error_response(f"The server is busy: {self.max_requests} requests are in flight, its limit "
                                      f"(--max-concurrent-requests). Retry later.", HTTPStatus.TOO_MANY_REQUESTS)
            await response(scope, receive, send)
            return
        self.in_flight += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.in_flight -= 1


class _BodySizeLimitMiddleware:
    """Answers 413 to a body over `max_bytes`: at once when its Content-Length says so,
    else as soon as the bytes read pass the limit (a chunked body), never buffering more."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    def _too_large(self) -> str:
        return (f"The request body is larger than {self.max_bytes} bytes, the server's limit "
                f"(--max-request-body-bytes).")

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope.get("headers") or []).get(b"content-length", b"")
        if declared.isdigit() and int(declared) > self.max_bytes:
            await error_response(self._too_large(), HTTPStatus.REQUEST_ENTITY_TOO_LARGE)(scope, receive, send)
            return
        received = 0

        async def receive_within_limit() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    # FastAPI re-raises an HTTPException from reading the body; the error
                    # handlers turn it into the OpenAI error body.
                    raise StarletteHTTPException(int(HTTPStatus.REQUEST_ENTITY_TOO_LARGE), self._too_large())
            return message

        await self.app(scope, receive_within_limit, send)


def build_app(engine: AsyncLLMEngine, args: Any = None) -> FastAPI:
    """The FastAPI app serving `engine`; `args` is a `ServerArgs`, an argparse namespace
    or a dict with its fields."""
    server_args = ServerArgs.from_namespace(args)
    model_names = server_args.model_names(engine)
    model_config = engine.model_config
    tokenizer = _frontend_tokenizer(engine)
    chat_template = load_chat_template(server_args.chat_template)
    limits = RequestLimits.from_args(args)
    completions = OpenAIServingCompletion(engine, model_names, tokenizer, limits=limits)
    tool_config = ToolCallConfig(server_args.enable_auto_tool_choice, server_args.tool_call_parser)
    chat = OpenAIServingChat(engine, model_names, tokenizer, chat_template=chat_template, limits=limits,
                             trust_request_chat_template=server_args.trust_request_chat_template,
                             tool_config=tool_config)
    metrics = ServerMetrics(engine, model_names[0])
    if engine.engine.structured_output_manager is not None:
        # Ready before the first constrained request, whose compile deadline it would spend.
        engine.engine.structured_output_manager.start_warm_up()

    app = FastAPI(title="raylm OpenAI-compatible server", version=VERSION)
    app.state.engine = engine
    app.state.metrics = metrics
    install_error_handlers(app)

    @app.exception_handler(AsyncEngineDeadError)
    async def _engine_dead(_: Request, exc: AsyncEngineDeadError) -> JSONResponse:
        return error_response(str(exc), HTTPStatus.INTERNAL_SERVER_ERROR)

    # The last added is the outermost.
    app.add_middleware(_BodySizeLimitMiddleware, max_bytes=server_args.max_request_body_bytes)
    app.add_middleware(_ConcurrencyLimitMiddleware, max_requests=server_args.max_concurrent_requests)
    if server_args.api_key:
        app.add_middleware(_ApiKeyMiddleware, api_key=server_args.api_key)

    @app.get("/health")
    async def health() -> Response:
        try:
            await engine.check_health()
        except Exception as exc:  # noqa: BLE001 - any failure means unhealthy
            return error_response(f"/health: the engine is unhealthy: {exc}", HTTPStatus.INTERNAL_SERVER_ERROR)
        return Response(status_code=200)

    @app.get("/version")
    async def version() -> JSONResponse:
        return JSONResponse({"version": VERSION})

    @app.get("/v1/models")
    async def models() -> JSONResponse:
        cards = [ModelCard(id=name, root=model_config.model, max_model_len=model_config.max_model_len)
                 for name in model_names]
        return JSONResponse(ModelList(data=cards).model_dump())

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        return Response(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.post("/v1/completions")
    async def create_completion(request: CompletionRequest, raw_request: Request) -> Response:
        return await completions.create_completion(request, raw_request)

    @app.post("/v1/chat/completions")
    async def create_chat_completion(request: ChatCompletionRequest, raw_request: Request) -> Response:
        return await chat.create_chat_completion(request, raw_request)

    @app.post("/tokenize")
    async def tokenize(request: TokenizeRequest) -> JSONResponse:
        completions.check_model(request.model)
        # Templating and tokenizing run on the tokenizer's thread, off the event loop.
        if request.messages is not None:
            text = await chat.off_loop(chat.render, request.messages, request.add_generation_prompt)
            add_special = False if request.add_special_tokens is None else request.add_special_tokens
        else:
            text = request.prompt
            add_special = True if request.add_special_tokens is None else request.add_special_tokens
        tokens = await completions.off_loop(completions.tokenize, text, add_special)
        return JSONResponse(TokenizeResponse(count=len(tokens), max_model_len=model_config.max_model_len,
                                             tokens=tokens).model_dump())

    @app.post("/detokenize")
    async def detokenize(request: DetokenizeRequest) -> JSONResponse:
        completions.check_model(request.model)
        vocab_size = model_config.vocab_size
        bad = next((t for t in request.tokens if not 0 <= t < vocab_size), None)
        if bad is not None:
            raise OpenAIError(f"Token id {bad} is outside the vocabulary [0, {vocab_size}).", param="tokens")
        if tokenizer is None:
            raise OpenAIError("This server runs without a tokenizer.", param="tokens")
        text = await completions.off_loop(tokenizer.decode, request.tokens)
        return JSONResponse(DetokenizeResponse(prompt=text).model_dump())

    return app


def _frontend_tokenizer(engine: AsyncLLMEngine) -> Any:
    """A tokenizer of the HTTP frontend's own, separate from the engine thread's."""
    model_config = engine.model_config
    if model_config.skip_tokenizer_init:
        return None
    from raylm.engine.tokenizer import get_tokenizer

    return get_tokenizer(model_config.tokenizer, model_config.trust_remote_code, model_config.revision,
                         model_config.tokenizer_mode)


def add_server_cli_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """`raylm serve`'s own flags; the engine's come from `EngineArgs.add_cli_args`."""
    parser.add_argument("model", nargs="?", default=None,
                        help="Hugging Face model folder, or 'raylm-demo-code'; default: raylm's bundled demo "
                             "model, 'raylm-demo-code'.")
    parser.add_argument("--host", default="127.0.0.1",
                        help="Address to listen on (default: %(default)s, loopback only).")
    parser.add_argument("--port", type=int, default=8000, help="Port to listen on (default: %(default)s).")
    parser.add_argument("--api-key", default=None,
                        help="Require `Authorization: Bearer KEY` on every route but /health and /metrics "
                             "(default: no key).")
    parser.add_argument("--root-path", default="",
                        help="The path prefix a proxy serves this server under (uvicorn's root_path), as in "
                             "vLLM (default: none).")
    parser.add_argument("--served-model-name", nargs="+", default=None,
                        help="Model name(s) clients use; the first is reported. Default: the model path "
                             "('raylm-demo-code' for the demo model).")
    parser.add_argument("--chat-template", default=None,
                        help="Chat template (a Jinja file or the template itself) instead of the tokenizer's.")
    parser.add_argument("--trust-request-chat-template", action="store_true",
                        help="Accept a chat_template sent with a chat request (default: off, as in vLLM; a "
                             "template is code the server runs).")
    parser.add_argument("--enable-auto-tool-choice", action="store_true",
                        help="Serve tool_choice 'auto' (the default when a chat request gives tools): the model "
                             "decides whether to call tools, and --tool-call-parser finds the calls in its text "
                             "(default: off, as in vLLM; such requests get 400).")
    parser.add_argument("--tool-call-parser", default=None, choices=sorted(TOOL_PARSERS),
                        help="The model family's tool-call format, for --enable-auto-tool-choice: hermes (Hermes, "
                             "Qwen 2.5 / 3), llama3_json (Llama 3.1 / 3.2 JSON), mistral (default: none).")
    parser.add_argument("--uvicorn-log-level", default="warning",
                        help="uvicorn's log level (default: %(default)s).")
    parser.add_argument("--max-concurrent-requests", type=int, default=DEFAULT_MAX_CONCURRENT_REQUESTS,
                        help="Requests in flight past which a new one is answered 429 at once (/health and "
                             "/metrics do not count) (default: %(default)s).")
    parser.add_argument("--max-request-body-bytes", type=int, default=DEFAULT_MAX_REQUEST_BODY_BYTES,
                        help="Largest request body; a larger one is answered 413 before it is read "
                             "(default: %(default)s, 16 MiB).")
    parser.add_argument("--shutdown-timeout", type=float, default=DEFAULT_SHUTDOWN_TIMEOUT_S,
                        help="Seconds SIGTERM lets the requests in flight finish before it aborts them "
                             "(default: %(default)s).")
    RequestLimits.add_cli_args(parser)
    return parser


def resolve_model(args: argparse.Namespace) -> str:
    """The model folder `raylm serve` loads: no model or `raylm-demo-code` is the bundled demo."""
    from raylm.models.bundled import resolve_model_path

    return resolve_model_path(args.model)


def run_server(args: argparse.Namespace) -> int:
    """`raylm serve`: the engine and the app in this process, served by uvicorn. Returns
    the process's exit status.

    SIGTERM (or Ctrl-C) stops accepting connections, lets the requests in flight finish for
    up to --shutdown-timeout seconds, cancels the rest (which aborts them in the engine),
    shuts the engine down and returns 0. If the engine loop dies (AsyncEngineDeadError:
    every request fails from then on) the server drains the same way and returns 1, so a
    supervisor restarts it. A dead tensor-parallel worker shows in /health at once and
    stops the loop at the next step.
    """
    import uvicorn

    from raylm.engine.arg_utils import EngineArgs

    if args.shutdown_timeout < 0:
        raise ValueError(f"--shutdown-timeout must be >= 0 seconds, got {args.shutdown_timeout}.")
    args.model = resolve_model(args)
    engine_args = EngineArgs.from_cli_args(args)
    engine = AsyncLLMEngine.from_engine_args(engine_args)
    try:
        app = build_app(engine, args)
    except BaseException:
        engine.shutdown()
        raise
    logger.info("Serving %s as %s on http://%s:%d%s", args.model, ", ".join(ServerArgs.from_namespace(args)
                                                                             .model_names(engine)),
                args.host, args.port, args.root_path)
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.uvicorn_log_level,
                            timeout_keep_alive=5, access_log=False, root_path=args.root_path,
                            timeout_graceful_shutdown=args.shutdown_timeout)
    server = uvicorn.Server(config)
    # uvicorn re-raises the SIGTERM or SIGINT it drained on, to the handler that was there
    # before it: this one ignores it, so the process exits with the status below. (A Python
    # handler, unlike SIG_IGN, is not inherited by processes started from here.)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, _after_drain)
    with asyncio.Runner(loop_factory=config.get_loop_factory()) as runner:
        engine_died = runner.run(_serve(server, engine))
    return 1 if engine_died else 0


def _after_drain(signum: int, _: Any) -> None:
    logger.info("Signal %d: already shutting down.", signum)


async def _serve(server: Any, engine: AsyncLLMEngine) -> bool:
    """Runs uvicorn until a signal or the engine's death; True if the engine died."""
    async def watch_engine() -> None:
        while not engine.errored:
            await asyncio.sleep(ENGINE_WATCH_PERIOD_S)
        logger.error("The engine loop has died; shutting the server down (exit status 1).")
        server.should_exit = True

    watcher = asyncio.create_task(watch_engine(), name="raylm-engine-watch")
    try:
        await server.serve()
    finally:
        watcher.cancel()
        died = engine.errored
        engine.shutdown()
    return died
