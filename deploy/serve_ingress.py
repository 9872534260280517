"""The Ray Serve app's HTTP ingress: reads each request, keys it for the router, and relays
it to an engine replica.

Serve's proxy hands an HTTP request to its deployment without the body (the replica pulls
it later), so a router in front of the engine replicas would see nothing to route on.
This small deployment sits between: it reads the body (refusing one over
--max-request-body-bytes with 413, and one not all arrived --request-body-timeout seconds
after the request with 408, as the server does: Serve's proxy bounds neither), computes its prefix key
(deploy/prefix_key.py) on a thread of its own, and calls the engine deployment's
`handle_http` through a handle whose router (deploy/prefix_router.py, or Serve's default)
picks the replica. The replica runs the request through the same FastAPI app `raylm serve`
runs (`run_forwarded`) and streams the ASGI messages back, which the ingress sends on as
they come. A client that leaves cancels the ingress's call, Serve cancels the replica's,
and the engine aborts the request.

`GET /metrics` answers an engine replica's metrics followed by the router's
(deploy/router_metrics.py): its decisions and each replica's reported prefix-cache
counters, labelled by replica. A request whose replica dies before answering is sent once
more (Serve has then taken the replica out); one that had started answering ends there.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import time
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any

from ray import serve

from raylm.deploy.prefix_key import (CHAT_ROUTE, COMPLETIONS_ROUTE, EMBEDDINGS_ROUTE, RESPONSES_ROUTE, PrefixKey,
                                    PrefixKeyer)
from raylm.deploy.server_args import DEFAULT_REQUEST_BODY_TIMEOUT_S

logger = logging.getLogger(__name__)

Message = dict[str, Any]

# The parts of an ASGI HTTP scope that travel to the replica (not the server's state).
_SCOPE_KEYS = ("type", "asgi", "http_version", "server", "client", "scheme", "method", "root_path", "path",
               "raw_path", "query_string", "headers")
_KEYED_ROUTES = frozenset({COMPLETIONS_ROUTE, CHAT_ROUTE, EMBEDDINGS_ROUTE, RESPONSES_ROUTE})
_METRICS_ROUTE = "/metrics"
# Attempts per request when the replica dies before it answers.
_MAX_ATTEMPTS = 2


@dataclass
class ForwardedRequest:
    """An HTTP request as the ingress hands it to an engine replica (what the router sees
    as the call's argument)."""

    scope: dict[str, Any]
    body: bytes
    prefix_key: PrefixKey | None = None


# ------------------------------------------------------------- replica side
async def run_forwarded(app: Any, request: ForwardedRequest) -> AsyncIterator[list[Message]]:
    """Runs `request` through the ASGI `app` and yields its response messages, those that
    are ready together. Closing the generator (the caller cancelled) disconnects the
    request's client and cancels the app's task."""
    queue: asyncio.Queue = asyncio.Queue()
    finished = object()
    disconnected = asyncio.Event()
    body_sent = False

    async def receive() -> Message:
        nonlocal body_sent
        if not body_sent:
            body_sent = True
            return {"type": "http.request", "body": request.body, "more_body": False}
        await disconnected.wait()
        return {"type": "http.disconnect"}

    async def send(message: Message) -> None:
        queue.put_nowait(message)

    task = asyncio.get_running_loop().create_task(app(dict(request.scope), receive, send))
    task.add_done_callback(lambda _: queue.put_nowait(finished))
    try:
        done = False
        while not done:
            batch = [await queue.get()]
            while not queue.empty():
                batch.append(queue.get_nowait())
            done = batch[-1] is finished
            messages = [m for m in batch if m is not finished]
            if messages:
                yield messages
        task.result()  # the app's own failure, if any
    finally:
        disconnected.set()
        if not task.done():
            task.cancel()


# ------------------------------------------------------------- ingress side
@serve.ingress()
class RaylmIngress:
    """The ingress deployment's class (see the module's docstring). `engine` is the handle to
    the engine deployment; `keyer` None routes without keys."""

    def __init__(self, engine: Any, keyer_args: dict[str, Any] | None, max_request_body_bytes: int,
                 root_path: str = "", api_key: str | None = None,
                 request_body_timeout: float = DEFAULT_REQUEST_BODY_TIMEOUT_S) -> None:
        self.engine = engine.options(stream=True)
        self.max_request_body_bytes = max_request_body_bytes
        self.request_body_timeout = request_body_timeout
        self.root_path = root_path
        self._authorization = f"Bearer {api_key}".encode() if api_key else None
        self.keyer = _build_keyer(**keyer_args) if keyer_args is not None else None
        # One thread: a fast tokenizer must not encode on two at once.
        self._key_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="raylm-prefix-key")

    def __serve_build_asgi_app__(self) -> Any:
        return _AsgiApp(self.asgi)

    async def asgi(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        """The ingress's ASGI app (Serve's ingress classes may not be callable themselves)."""
        if scope["type"] == "lifespan":
            await _lifespan(receive, send)
            return
        if scope["type"] != "http":
            return
        body = await self._read_body(scope, receive, send)
        if body is None:
            return
        route = self._route(scope)
        key = None
        if self.keyer is not None and scope["method"] == "POST" and route in _KEYED_ROUTES and self._authorized(scope):
            key = await asyncio.get_running_loop().run_in_executor(self._key_thread, self.keyer.key, route, body)
        request = ForwardedRequest({k: scope[k] for k in _SCOPE_KEYS if k in scope}, body, key)
        if route == _METRICS_ROUTE and scope["method"] == "GET":
            await self._metrics(request, send)
        else:
            await self._relay(request, send)

    def _route(self, scope: dict[str, Any]) -> str:
        """The path less the root path, as the replica's app routes it."""
        path, root_path = scope["path"], scope.get("root_path") or self.root_path
        if root_path and path.startswith(root_path) and path[len(root_path):len(root_path) + 1] in ("", "/"):
            return path[len(root_path):]
        return path

    def _authorized(self, scope: dict[str, Any]) -> bool:
        """Whether the request carries the API key (a request without it is not worth
        tokenizing: the replica answers it 401)."""
        if self._authorization is None:
            return True
        return hmac.compare_digest(dict(scope.get("headers") or []).get(b"authorization", b""), self._authorization)

    async def _read_body(self, scope: dict[str, Any], receive: Any, send: Any) -> bytes | None:
        """The whole body, or None after answering 413 to one over the limit or 408 to one
        that did not all arrive in time (it held one of the ingress's max_ongoing_requests
        for as long as its client liked: past them, every other request waited in Serve's
        queue)."""
        declared = dict(scope.get("headers") or []).get(b"content-length", b"")
        if declared.isdigit() and int(declared) > self.max_request_body_bytes:
            await self._too_large(send)
            return None
        chunks: list[bytes] = []
        size = 0
        deadline = time.monotonic() + self.request_body_timeout
        while True:
            try:
                message = await asyncio.wait_for(receive(), max(0.0, deadline - time.monotonic()))
            except asyncio.TimeoutError:
                await _send_error(send, f"The request body did not arrive within {self.request_body_timeout:g} s of "
                                        f"the request (--request-body-timeout).", HTTPStatus.REQUEST_TIMEOUT)
                return None
            if message["type"] == "http.disconnect":
                return None
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_request_body_bytes:
                await self._too_large(send)
                return None
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)

    async def _too_large(self, send: Any) -> None:
        await _send_error(send, f"The request body is larger than {self.max_request_body_bytes} bytes, the server's "
                                f"limit (--max-request-body-bytes).", HTTPStatus.REQUEST_ENTITY_TOO_LARGE)

    async def _relay(self, request: ForwardedRequest, send: Any) -> None:
        from ray.exceptions import ActorDiedError, ActorUnavailableError

        for attempt in range(1, _MAX_ATTEMPTS + 1):
            started = False
            stream = self.engine.handle_http.remote(request)
            try:
                async for messages in stream:
                    for message in messages:
                        started = True
                        await send(message)
                return
            except asyncio.CancelledError:
                stream.cancel()
                raise
            except (ActorDiedError, ActorUnavailableError) as exc:
                if started:
                    logger.error("The replica serving a %s request died while answering it: %r",
                                 request.scope.get("path"), exc)
                    await send({"type": "http.response.body", "body": b"", "more_body": False})
                    return
                if attempt == _MAX_ATTEMPTS:
                    await _send_error(send, f"No replica could answer the request: {exc!r}",
                                      HTTPStatus.SERVICE_UNAVAILABLE)
                    return
                logger.warning("The replica chosen for a %s request died before answering; sending it again.",
                               request.scope.get("path"))

    async def _metrics(self, request: ForwardedRequest, send: Any) -> None:
        """An engine replica's metrics, then the router's."""
        from prometheus_client import generate_latest

        from raylm.deploy import router_metrics

        status, headers, parts = 200, [(b"content-type", b"text/plain; version=0.0.4; charset=utf-8")], []
        async for messages in self.engine.handle_http.remote(request):
            for message in messages:
                if message["type"] == "http.response.start":
                    status, headers = message["status"], [h for h in message.get("headers", [])
                                                          if h[0].lower() != b"content-length"]
                elif message["type"] == "http.response.body":
                    parts.append(message.get("body", b""))
        if status == 200:
            parts.append(generate_latest(router_metrics.REGISTRY))
        body = b"".join(parts)
        await send({"type": "http.response.start", "status": status,
                    "headers": headers + [(b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body, "more_body": False})


class _AsgiApp:
    """An ASGI 3 callable over a coroutine method (uvicorn, which runs Serve's lifespan,
    tells ASGI 3 from 2 by an `async def __call__`)."""

    def __init__(self, handler: Any) -> None:
        self.handler = handler

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        await self.handler(scope, receive, send)


def _build_keyer(tokenizer: str | None, trust_remote_code: bool, revision: str | None, tokenizer_mode: str,
                 block_size: int, max_blocks: int, chat_template: str | None,
                 trust_request_chat_template: bool, base_model_names: list[str] | None = None,
                 chat_template_content_format: str = "auto") -> PrefixKeyer:
    """The keyer, with the replicas' tokenizer (None: token-id prompts only) and chat
    template (--chat-template read as the replicas read it: a file's contents, or the text)."""
    from raylm.deploy.serving_chat import load_chat_template

    loaded = None
    if tokenizer is not None:
        from raylm.engine.tokenizer import get_tokenizer

        loaded = get_tokenizer(tokenizer, trust_remote_code, revision, tokenizer_mode)
    return PrefixKeyer(loaded, block_size, max_blocks, load_chat_template(chat_template),
                       trust_request_chat_template, base_model_names, chat_template_content_format)


async def _lifespan(receive: Any, send: Any) -> None:
    while True:
        message = await receive()
        if message["type"] == "lifespan.startup":
            await send({"type": "lifespan.startup.complete"})
        elif message["type"] == "lifespan.shutdown":
            await send({"type": "lifespan.shutdown.complete"})
            return


async def _send_error(send: Any, message: str, status: HTTPStatus) -> None:
    from raylm.deploy.errors import error_body

    body = error_body(message, status).model_dump_json().encode()
    await send({"type": "http.response.start", "status": int(status),
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body, "more_body": False})
