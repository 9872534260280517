"""The OpenAI-compatible FastAPI app over an `AsyncLLMEngine`.

`build_app(engine, args)` returns the app with every route; `raylm serve` runs it with
uvicorn and the Ray Serve deployment mounts the same app as its ingress.

Routes: POST /v1/completions, POST /v1/chat/completions, GET /v1/models, GET /health,
GET /version, POST /tokenize, POST /detokenize, GET /metrics (Prometheus).
"""

from __future__ import annotations

import argparse
import hmac
import logging
from dataclasses import dataclass, field
from http import HTTPStatus
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.types import ASGIApp, Receive, Scope, Send

from raylm.deploy.errors import OpenAIError, error_body, error_response, install_error_handlers
from raylm.deploy.limits import RequestLimits
from raylm.deploy.metrics import ServerMetrics
from raylm.deploy.protocol import (ChatCompletionRequest, CompletionRequest, DetokenizeRequest, DetokenizeResponse,
                                   ModelCard, ModelList, TokenizeRequest, TokenizeResponse)
from raylm.deploy.serving_chat import OpenAIServingChat, load_chat_template
from raylm.deploy.serving_completions import OpenAIServingCompletion
from raylm.engine.async_llm_engine import AsyncEngineDeadError, AsyncLLMEngine

logger = logging.getLogger(__name__)

VERSION = "0.1.0"


@dataclass
class ServerArgs:
    """The server's own settings (the engine's live in `EngineArgs`).

    served_model_name: names clients may put in `model`; the first is reported in
        responses. Default: the model path, as vLLM does.
    api_key: when set, /v1 routes need `Authorization: Bearer <api_key>`.
    chat_template: a Jinja template, or a file holding one, instead of the tokenizer's.
    """

    model: str = ""
    served_model_name: list[str] | None = None
    api_key: str | None = None
    chat_template: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_namespace(cls, args: Any) -> "ServerArgs":
        if isinstance(args, ServerArgs):
            return args
        values = vars(args) if isinstance(args, argparse.Namespace) else dict(args or {})
        names = values.get("served_model_name")
        if isinstance(names, str):
            names = [names]
        return cls(model=values.get("model") or "", served_model_name=names or None, api_key=values.get("api_key"),
                   chat_template=values.get("chat_template"))

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


class _ApiKeyMiddleware:
    """Rejects /v1 requests without the right bearer token (pure ASGI, so streaming and
    client disconnects pass through untouched)."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self._expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"].startswith("/v1") and scope["method"] != "OPTIONS":
            headers = dict(scope.get("headers") or [])
            if not hmac.compare_digest(headers.get(b"authorization", b""), self._expected):
                response = error_response("Unauthorized: a valid API key is required (Authorization: Bearer ...).",
                                          HTTPStatus.UNAUTHORIZED)
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


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
    chat = OpenAIServingChat(engine, model_names, tokenizer, chat_template=chat_template, limits=limits)
    metrics = ServerMetrics(engine, model_names[0])

    app = FastAPI(title="raylm OpenAI-compatible server", version=VERSION)
    app.state.engine = engine
    app.state.metrics = metrics
    install_error_handlers(app)

    @app.exception_handler(AsyncEngineDeadError)
    async def _engine_dead(_: Request, exc: AsyncEngineDeadError) -> JSONResponse:
        return error_response(str(exc), HTTPStatus.INTERNAL_SERVER_ERROR)

    if server_args.api_key:
        app.add_middleware(_ApiKeyMiddleware, api_key=server_args.api_key)

    @app.get("/health")
    async def health() -> Response:
        try:
            await engine.check_health()
        except Exception as exc:  # noqa: BLE001 - any failure means unhealthy
            return JSONResponse(error_body(f"The engine is unhealthy: {exc!r}",
                                           HTTPStatus.INTERNAL_SERVER_ERROR).model_dump(),
                                status_code=int(HTTPStatus.INTERNAL_SERVER_ERROR))
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
        if request.messages is not None:
            text = chat.render(request.messages, request.add_generation_prompt)
            add_special = False if request.add_special_tokens is None else request.add_special_tokens
        else:
            text = request.prompt
            add_special = True if request.add_special_tokens is None else request.add_special_tokens
        tokens = completions.tokenize(text, add_special)
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
        return JSONResponse(DetokenizeResponse(prompt=tokenizer.decode(request.tokens)).model_dump())

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
                        help="Require `Authorization: Bearer KEY` on /v1 routes (default: no key).")
    parser.add_argument("--served-model-name", nargs="+", default=None,
                        help="Model name(s) clients use; the first is reported. Default: the model path "
                             "('raylm-demo-code' for the demo model).")
    parser.add_argument("--chat-template", default=None,
                        help="Chat template (a Jinja file or the template itself) instead of the tokenizer's.")
    parser.add_argument("--uvicorn-log-level", default="warning",
                        help="uvicorn's log level (default: %(default)s).")
    RequestLimits.add_cli_args(parser)
    return parser


def resolve_model(args: argparse.Namespace) -> str:
    """The model folder `raylm serve` loads: no model or `raylm-demo-code` is the bundled demo."""
    from raylm.models.bundled import resolve_model_path

    return resolve_model_path(args.model)


def run_server(args: argparse.Namespace) -> None:
    """`raylm serve`: the engine and the app in this process, served by uvicorn."""
    import uvicorn

    from raylm.engine.arg_utils import EngineArgs

    args.model = resolve_model(args)
    engine_args = EngineArgs.from_cli_args(args)
    engine = AsyncLLMEngine.from_engine_args(engine_args)
    app = build_app(engine, args)
    logger.info("Serving %s as %s on http://%s:%d", args.model, ", ".join(ServerArgs.from_namespace(args)
                                                                           .model_names(engine)),
                args.host, args.port)
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.uvicorn_log_level,
                            timeout_keep_alive=5, access_log=False)
    try:
        uvicorn.Server(config).run()
    finally:
        engine.shutdown()
