"""The OpenAI-compatible FastAPI app over an `AsyncLLMEngine`.

`build_app(engine, server_args)` returns the app with every route (its settings:
`ServerArgs`, deploy/server_args.py); `raylm serve` runs it with uvicorn and the Ray Serve
deployment mounts the same app as its ingress.

Routes: POST /v1/completions, POST /v1/chat/completions, POST /v1/embeddings (runner "pooling"),
POST /classify, POST /score (/v1/score), POST /rerank (/v1/rerank, /v2/rerank), POST /pooling
(classifiers, cross-encoders and embedding models; /pooling's task token_classify is a
reward model's per-token rewards), GET /v1/models, GET /health,
GET /version, POST /tokenize, POST /detokenize, GET /metrics (Prometheus).
POST /v1/responses (OpenAI's Responses API) runs through the chat route (deploy/serving_responses.py).

What guards them, outermost first (pure ASGI middleware, so streams and client disconnects
pass through untouched): the API key, on every route but /health and /metrics; the bound on
requests in flight (429 past it; the routes that generate add a bound on the tokens their
responses in flight hold together, deploy/response_budget.py); the bounds on the body's size (413 past it, found while
the body is read) and on the time it takes to arrive (408 past it). `raylm serve` adds the
process's lifecycle: SIGTERM drains, and the process exits non-zero once the engine loop
has died. `shutdown_app` (the app's lifespan shutdown) ends the processes the app started.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import hmac
import logging
import signal
import socket
import time
from collections.abc import AsyncIterator
from http import HTTPStatus
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from raylm.deploy.dev_routes import install_sleep_mode_routes
from raylm.deploy.errors import OpenAIError, error_response, install_error_handlers
from raylm.deploy.metrics import ServerMetrics
from raylm.deploy.response_budget import RETRY_AFTER_S, ResponseBudget, default_response_tokens_in_flight
from raylm.deploy.protocol import (ChatCompletionRequest, CompletionRequest, DetokenizeRequest, DetokenizeResponse,
                                   EmbeddingRequest,
                                   TokenizeRequest, TokenizeResponse)
from raylm.deploy.protocol import ClassificationRequest, PoolingRequest, RerankRequest, ScoreRequest
from raylm.deploy.reasoning_parsers import get_reasoning_parser
from raylm.deploy.serving_chat import OpenAIServingChat, load_chat_template
from raylm.deploy.request_logger import RequestLogger
from raylm.deploy.server_args import ServerArgs
from raylm.deploy.serving_completions import OpenAIServingCompletion
from raylm.deploy.serving_classification import OpenAIServingClassification
from raylm.deploy.serving_pooling_route import OpenAIServingPooling
from raylm.deploy.serving_embedding import OpenAIServingEmbedding
from raylm.deploy.serving_score import OpenAIServingScores
from raylm.deploy.serving_engine import ClientDisconnected
from raylm.deploy.serving_models import OpenAIServingModels
from raylm.deploy.protocol_responses import ResponsesRequest
from raylm.deploy.serving_responses import OpenAIServingResponses
from raylm.deploy.tool_calls import ToolCallConfig
from raylm.engine.async_llm_engine import AsyncEngineDeadError, AsyncLLMEngine
from raylm.engine.usage_context import UsageContext

logger = logging.getLogger(__name__)

# How long the server waits for its grammar compile worker to start.
COMPILE_WORKER_START_S = 120.0

VERSION = "0.1.0"

# Routes a load balancer's health probe and a Prometheus scrape reach without the API key
# and past the bound on requests in flight: a probe must answer while the server is full,
# and the metrics hold only aggregate counters (no prompt, output or key), so a scraper
# needs no key that could also spend the engine's time (vLLM leaves /metrics open too).
OPEN_ROUTES = frozenset({"/health", "/metrics"})
# The status of a request whose client left before its answer (nginx's, which HTTP lacks).
CLIENT_CLOSED_REQUEST = 499
# How often `raylm serve` looks whether the engine loop has died.
ENGINE_WATCH_PERIOD_S = 0.5


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


class _RootPathMiddleware:
    """Sets the root path where the server in front has not (Ray Serve's proxy; uvicorn sets
    its --root-path itself), so that routing and the key check strip the same prefix."""

    def __init__(self, app: ASGIApp, root_path: str) -> None:
        self.app = app
        self.root_path = root_path

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] in ("http", "websocket") and not scope.get("root_path"):
            scope = dict(scope, root_path=self.root_path)
        await self.app(scope, receive, send)


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


class RequestsInFlight:
    """Requests received and not yet fully answered (OPEN_ROUTES not counted); one event
    loop updates it, so it needs no lock."""

    def __init__(self) -> None:
        self.count = 0


class _ConcurrencyLimitMiddleware:
    """Answers 429 at once to a request arriving while `max_requests` are in flight, so
    overload shows as fast refusals instead of ever longer queues. A request is in flight
    from its headers until its response (a whole stream) is sent or its client leaves."""

    def __init__(self, app: ASGIApp, max_requests: int, in_flight: "RequestsInFlight") -> None:
        self.app = app
        self.max_requests = max_requests
        self.in_flight = in_flight

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or _is_open(scope):
            await self.app(scope, receive, send)
            return
        in_flight = self.in_flight
        if in_flight.count >= self.max_requests:
            response = error_response(f"The server is busy: {self.max_requests} requests are in flight, its limit "
                                      f"(--max-concurrent-requests). Retry later.", HTTPStatus.TOO_MANY_REQUESTS,
                                      headers={"Retry-After": str(RETRY_AFTER_S)})
            await response(scope, receive, send)
            return
        in_flight.count += 1
        try:
            await self.app(scope, receive, send)
        finally:
            in_flight.count -= 1


class _BodyLimitMiddleware:
    """Answers 413 to a body over `max_bytes`: at once when its Content-Length says so,
    else as soon as the bytes read pass the limit (a chunked body), never buffering more;
    and 408 to a body not all read `timeout_s` after the request began, so that a client
    that sends part of one and waits does not hold a place among the requests in flight."""

    def __init__(self, app: ASGIApp, max_bytes: int, timeout_s: float) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.timeout_s = timeout_s

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
        body_read = False
        deadline = time.monotonic() + self.timeout_s

        async def receive_within_limits() -> Message:
            nonlocal received, body_read
            if body_read:  # later reads wait for the client to leave: no deadline
                return await receive()
            try:
                message = await asyncio.wait_for(receive(), max(0.0, deadline - time.monotonic()))
            except asyncio.TimeoutError:
                # FastAPI re-raises an HTTPException from reading the body; the error
                # handlers turn it into the OpenAI error body.
                raise StarletteHTTPException(int(HTTPStatus.REQUEST_TIMEOUT), (
                    f"The request body did not arrive within {self.timeout_s:g} s of the request "
                    f"(--request-body-timeout).")) from None
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    raise StarletteHTTPException(int(HTTPStatus.REQUEST_ENTITY_TOO_LARGE), self._too_large())
                body_read = not message.get("more_body", False)
            return message

        await self.app(scope, receive_within_limits, send)


def build_app(engine: AsyncLLMEngine, server_args: ServerArgs | None = None) -> FastAPI:
    """The FastAPI app serving `engine` with `server_args` (default: `ServerArgs()`)."""
    server_args = server_args or ServerArgs()
    model_names = server_args.model_names(engine.model_config.model)
    model_config = engine.model_config
    tokenizer = _frontend_tokenizer(engine)
    chat_template = load_chat_template(server_args.chat_template)
    limits = server_args.limits
    api_key = server_args.resolved_api_key()
    aliases = server_args.model_aliases(model_config.model)
    # The base model's names and the LoRA adapters (--lora-modules, loaded now).
    serving_models = OpenAIServingModels(engine, model_names, server_args.lora, aliases)
    serving_models.load_static_loras()
    # What the responses in flight may hold together, shared by the routes that generate.
    response_budget = ResponseBudget(server_args.max_response_tokens_in_flight
                                     or default_response_tokens_in_flight(limits.max_response_tokens))
    as_ids = server_args.return_tokens_as_token_ids
    request_logger = RequestLogger(server_args.max_log_len, server_args.enable_log_outputs) \
        if server_args.enable_log_requests else None
    if server_args.enable_log_outputs and not server_args.enable_log_requests:
        logger.warning("--enable-log-outputs logs nothing without --enable-log-requests (as in vLLM).")
    completions = OpenAIServingCompletion(engine, model_names, tokenizer, limits=limits, model_aliases=aliases,
                                          models=serving_models, response_budget=response_budget,
                                          return_tokens_as_token_ids=as_ids, request_logger=request_logger,
                                          enable_prompt_tokens_details=server_args.enable_prompt_tokens_details)
    embeddings = OpenAIServingEmbedding(engine, model_names, tokenizer, limits=limits, model_aliases=aliases,
                                        models=serving_models, response_budget=response_budget,
                                        request_logger=request_logger)
    classification = OpenAIServingClassification(engine, model_names, tokenizer, limits=limits, model_aliases=aliases,
                                                 models=serving_models, response_budget=response_budget,
                                                 request_logger=request_logger)
    pooling = OpenAIServingPooling(engine, model_names, tokenizer, limits=limits, model_aliases=aliases,
                                   models=serving_models, response_budget=response_budget, request_logger=request_logger)
    scores = OpenAIServingScores(engine, model_names, tokenizer, limits=limits, model_aliases=aliases,
                                 models=serving_models, response_budget=response_budget, request_logger=request_logger,
                                 score_template=chat_template)
    tool_config = ToolCallConfig(server_args.enable_auto_tool_choice, server_args.tool_call_parser)
    reasoning_parser = get_reasoning_parser(server_args.reasoning_parser, tokenizer) \
        if server_args.reasoning_parser is not None else None
    chat = OpenAIServingChat(engine, model_names, tokenizer, chat_template=chat_template, limits=limits,
                             model_aliases=aliases,
                             trust_request_chat_template=server_args.trust_request_chat_template,
                             max_queued_chat_template_renders=server_args.max_queued_chat_template_renders,
                             tool_config=tool_config, reasoning_parser=reasoning_parser, models=serving_models,
                             response_budget=response_budget, return_tokens_as_token_ids=as_ids,
                             request_logger=request_logger, response_role=server_args.response_role,
                             chat_template_content_format=server_args.chat_template_content_format,
                             enable_prompt_tokens_details=server_args.enable_prompt_tokens_details)
    metrics = ServerMetrics(engine, model_names[0])
    if engine.engine.structured_output_manager is not None:
        _start_compile_worker(engine.engine.structured_output_manager)

    app = FastAPI(title="raylm OpenAI-compatible server", version=VERSION, lifespan=_lifespan)
    app.state.engine = engine
    app.state.chat = chat
    app.state.metrics = metrics
    app.state.requests_in_flight = RequestsInFlight()
    app.state.response_budget = response_budget
    install_error_handlers(app)

    @app.exception_handler(AsyncEngineDeadError)
    async def _engine_dead(_: Request, exc: AsyncEngineDeadError) -> JSONResponse:
        return error_response(str(exc), HTTPStatus.INTERNAL_SERVER_ERROR)

    install_sleep_mode_routes(app, engine)  # the 503 while asleep; /sleep etc. in dev mode

    @app.exception_handler(ClientDisconnected)
    async def _client_disconnected(_: Request, __: ClientDisconnected) -> Response:
        # Nobody reads it; nginx's 499 tells the access log what happened. Raised unhandled,
        # as it was, each left request logged a traceback of some 50 lines.
        return Response(status_code=CLIENT_CLOSED_REQUEST)

    # The last added is the outermost.
    app.add_middleware(_BodyLimitMiddleware, max_bytes=server_args.max_request_body_bytes,
                       timeout_s=server_args.request_body_timeout)
    app.add_middleware(_ConcurrencyLimitMiddleware, max_requests=server_args.max_concurrent_requests,
                       in_flight=app.state.requests_in_flight)
    if api_key:
        app.add_middleware(_ApiKeyMiddleware, api_key=api_key)
    if server_args.root_path:
        app.add_middleware(_RootPathMiddleware, root_path=server_args.root_path)

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
        return JSONResponse(serving_models.model_list().model_dump())

    serving_models.add_routes(app)  # /v1/load_lora_adapter etc., with --allow-runtime-lora-updating

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        return Response(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.post("/v1/completions")
    async def create_completion(request: CompletionRequest, raw_request: Request) -> Response:
        return await completions.create_completion(request, raw_request)

    @app.post("/v1/embeddings")
    async def create_embedding(request: EmbeddingRequest, raw_request: Request) -> Response:
        return await embeddings.create_embedding(request, raw_request)

    @app.post("/classify")
    async def create_classify(request: ClassificationRequest, raw_request: Request) -> Response:
        return await classification.create_classify(request, raw_request)

    @app.post("/pooling")
    async def create_pooling(request: PoolingRequest, raw_request: Request) -> Response:
        return await pooling.create_pooling(request, raw_request)

    @app.post("/score")
    @app.post("/v1/score")
    async def create_score(request: ScoreRequest, raw_request: Request) -> Response:
        return await scores.create_score(request, raw_request)

    @app.post("/rerank")
    @app.post("/v1/rerank")
    @app.post("/v2/rerank")
    async def do_rerank(request: RerankRequest, raw_request: Request) -> Response:
        return await scores.create_rerank(request, raw_request)

    @app.post("/v1/chat/completions")
    async def create_chat_completion(request: ChatCompletionRequest, raw_request: Request) -> Response:
        return await chat.create_chat_completion(request, raw_request)

    responses = OpenAIServingResponses(chat)

    @app.post("/v1/responses")
    async def create_response(request: ResponsesRequest, raw_request: Request) -> Response:
        return await responses.create_response(request, raw_request)

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
        param = "prompt" if request.messages is None else "messages"
        tokens = await completions.off_loop(completions.tokenize, text, add_special, param)
        return JSONResponse(TokenizeResponse(count=len(tokens), max_model_len=model_config.max_model_len,
                                             tokens=tokens).model_dump())

    @app.post("/detokenize")
    async def detokenize(request: DetokenizeRequest) -> JSONResponse:
        completions.check_model(request.model)
        # vLLM's rule for token ids: no more than the context holds. Checked first: the
        # vocabulary scan below and the decode on the tokenizer thread (which every
        # request's tokenizing shares) grow with the count.
        if len(request.tokens) > model_config.max_model_len:
            raise OpenAIError(f"This model's maximum context length is {model_config.max_model_len} tokens. "
                              f"However, /detokenize was given {len(request.tokens)} tokens.", param="tokens")
        vocab_size = model_config.vocab_size
        bad = next((t for t in request.tokens if not 0 <= t < vocab_size), None)
        if bad is not None:
            raise OpenAIError(f"Token id {bad} is outside the vocabulary [0, {vocab_size}).", param="tokens")
        if tokenizer is None:
            raise OpenAIError("This server runs without a tokenizer.", param="tokens")
        text = await completions.off_loop(tokenizer.decode, request.tokens)
        return JSONResponse(DetokenizeResponse(prompt=text).model_dump())

    return app


def shutdown_app(app: FastAPI) -> None:
    """Stops what `build_app` started beside the engine: the processes that render request
    chat templates (--trust-request-chat-template). Idempotent; the engine is the caller's.
    uvicorn runs it at the app's lifespan shutdown, `raylm serve` once more after uvicorn
    (a forced exit skips the lifespan), the Serve replica when it goes away."""
    app.state.chat.close()


@contextlib.asynccontextmanager
async def _lifespan(app: FastAPI) -> AsyncIterator[None]:
    yield
    shutdown_app(app)


def _frontend_tokenizer(engine: AsyncLLMEngine) -> Any:
    """A tokenizer of the HTTP frontend's own, separate from the engine thread's."""
    model_config = engine.model_config
    if model_config.skip_tokenizer_init:
        return None
    from raylm.engine.tokenizer import get_tokenizer

    return get_tokenizer(model_config.tokenizer, model_config.trust_remote_code, model_config.revision,
                         model_config.tokenizer_mode)


def freeze_startup_heap() -> None:
    """Moves every object alive after startup (the model, torch, transformers: ~400k
    objects) out of the garbage collector's reach, as vLLM's server does: a full
    collection then scans only what requests allocate. Without it, the collection that an
    n=16384 request's fan-out triggers held the interpreter (and so the event loop) for
    0.5 s."""
    gc.collect()
    gc.freeze()


def check_port_free(host: str, port: int) -> None:
    """Raises a ValueError naming the address if nothing can listen there now (for a
    server that binds later, under Ray Serve)."""
    bind_socket(host, port).close()


def bind_socket(host: str, port: int) -> socket.socket:
    """A socket bound to (host, port), not yet listening: a busy port is found before the
    model loads, and connections are refused, not left waiting, until the server listens."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise ValueError(f"--host {host!r} is not an address this machine can listen on: {exc.strerror}.") from None
    family, kind, proto, _, address = infos[0]
    sock = socket.socket(family, kind, proto)
    try:
        # As uvicorn: a port left in TIME_WAIT by a previous server is reusable at once;
        # one that something listens on is not.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
    except OSError as exc:
        sock.close()
        raise ValueError(f"Cannot listen on {host}:{port}: {exc.strerror or exc} (is another server running "
                         f"there? --port picks another port).") from None
    return sock


def _start_compile_worker(manager: Any) -> None:
    """Starts the grammar compile worker (an engine built for the server started it while its
    model loaded) and waits until it is ready (xgrammar imported, the vocabulary indexed:
    1-3 s), so that no constrained request spends its compile deadline on it. One that does
    not start fails the constrained requests alone."""
    started = time.perf_counter()
    try:
        manager.start_warm_up().result(timeout=COMPILE_WORKER_START_S)
    except Exception as exc:  # noqa: BLE001 - the server serves unconstrained requests all the same
        logger.error("The grammar compile worker did not start (%s): constrained requests will fail.", exc)
        return
    logger.info("Grammar compile worker ready in %.1f s.", time.perf_counter() - started)


def resolve_model(args: argparse.Namespace) -> str:
    """The model folder `raylm serve` loads: no model or `raylm-demo-code` is the bundled demo."""
    from raylm.models.bundled import resolve_model_path

    return resolve_model_path(args.model)


def run_server(args: argparse.Namespace) -> int:
    """`raylm serve`: the engine and the app in this process, served by uvicorn. Returns
    the process's exit status.

    The port is bound before the model loads, so a busy one ends the command at once
    (exit 2); "Serving ..." is logged once the server listens. SIGTERM (or Ctrl-C) stops
    accepting connections, lets the requests in flight finish for up to --shutdown-timeout
    seconds, cancels the rest (which aborts them in the engine), shuts the engine down and
    returns 0; each stage is logged. If the engine loop dies (AsyncEngineDeadError: every
    request fails from then on) the server drains the same way and returns 1, so a
    supervisor restarts it. A dead tensor-parallel worker shows in /health at once and
    stops the loop at the next step.
    """
    from raylm.engine.arg_utils import EngineArgs

    server_args = ServerArgs.from_cli_args(args)
    server_args.resolved_api_key()  # a missing key file is found before the model loads
    args.model = resolve_model(args)
    sock = bind_socket(server_args.host, server_args.port)
    try:
        engine = AsyncLLMEngine.from_engine_args(EngineArgs.from_cli_args(args),
                                                 usage_context=UsageContext.OPENAI_API_SERVER)
        try:
            app = build_app(engine, server_args)
        except BaseException:
            engine.shutdown()
            raise
    except BaseException:
        sock.close()
        raise
    freeze_startup_heap()
    config = uvicorn.Config(app, log_level=server_args.uvicorn_log_level, timeout_keep_alive=5, access_log=False,
                            root_path=server_args.root_path, timeout_graceful_shutdown=server_args.shutdown_timeout)
    server = _Server(config, app.state.requests_in_flight, server_args.shutdown_timeout)
    # uvicorn re-raises the SIGTERM or SIGINT it drained on, to the handler that was there
    # before it: this one ignores it, so the process exits with the status below. (A Python
    # handler, unlike SIG_IGN, is not inherited by processes started from here.)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, _after_drain)
    announcement = (f"Serving {args.model} as {', '.join(server_args.model_names(args.model))} on "
                    f"http://{server_args.host}:{server_args.port}{server_args.root_path}")
    with asyncio.Runner(loop_factory=config.get_loop_factory()) as runner:
        engine_died = runner.run(_serve(server, app, engine, sock, announcement))
    return 1 if engine_died else 0


class _Server(uvicorn.Server):
    """uvicorn's server, logging what a shutdown does: that it started (and on which
    signal), what it waits for, and that it finished."""

    def __init__(self, config: uvicorn.Config, in_flight: RequestsInFlight, shutdown_timeout: float) -> None:
        super().__init__(config)
        self._in_flight = in_flight
        self._shutdown_timeout = shutdown_timeout
        self.shutdown_started: float | None = None

    def handle_exit(self, sig: int, frame: Any) -> None:
        name = signal.Signals(sig).name
        if not self.should_exit:
            logger.info("Shutting down on %s: no new connections; waiting up to %.0f s for %d request(s) in flight, "
                        "then aborting the rest.", name, self._shutdown_timeout, self._in_flight.count)
            self.shutdown_started = time.monotonic()
        elif not self.force_exit:
            logger.info("%s again: aborting the requests in flight now.", name)
        super().handle_exit(sig, frame)


def _after_drain(signum: int, _: Any) -> None:
    # uvicorn re-raises the signal it drained on once it has stopped: already handled.
    logger.debug("Signal %d after the drain: ignored.", signum)


async def _serve(server: Any, app: FastAPI, engine: AsyncLLMEngine, sock: socket.socket, announcement: str) -> bool:
    """Runs uvicorn on `sock` until a signal or the engine's death; True if the engine died."""
    async def watch_engine() -> None:
        while not engine.errored:
            await asyncio.sleep(ENGINE_WATCH_PERIOD_S)
        logger.error("The engine loop has died; shutting the server down (exit status 1).")
        server.should_exit = True

    async def announce() -> None:
        while not server.started:
            await asyncio.sleep(0.02)
        logger.info("%s", announcement)

    watcher = asyncio.create_task(watch_engine(), name="raylm-engine-watch")
    announcer = asyncio.create_task(announce(), name="raylm-announce")
    try:
        await server.serve(sockets=[sock])
    finally:
        watcher.cancel()
        announcer.cancel()
        sock.close()
        died = engine.errored
        started = server.shutdown_started
        logger.info("HTTP server stopped%s; shutting the engine down.",
                    f" {time.monotonic() - started:.1f} s after the signal" if started is not None else "")
        shutdown_app(app)
        engine.shutdown()
        logger.info("Shutdown complete.")
    return died
