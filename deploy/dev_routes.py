"""The server's sleep-mode answers and its development routes (vLLM's, behind
VLLM_SERVER_DEV_MODE; here RAYLM_SERVER_DEV_MODE=1):

- `POST /sleep?level=1|2`: `LLM.sleep` (needs --enable-sleep-mode); requests in flight are
  aborted (vLLM's mode "abort").
- `POST /wake_up[?tags=weights&tags=kv_cache]`: `LLM.wake_up`.
- `GET /is_sleeping`: `{"is_sleeping": bool}`.
- `POST /reset_prefix_cache`: `LLM.reset_prefix_cache` (409 while requests hold blocks).
- `POST /collective_rpc` with `{"method", "args", "kwargs", "timeout"}`: a Worker method
  (or one of --worker-extension-cls) on every worker; `{"results": [...]}` in rank order.

They sit behind the API key like every route. A request that reaches a sleeping engine is
a 503 saying to wake it up (as vLLM's proposal for its sleeping server); the server serves
again once it is awake.
"""

from __future__ import annotations

from http import HTTPStatus
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, Field

from raylm.deploy.errors import OpenAIError
from raylm.deploy.protocol import ErrorInfo, ErrorResponse
from raylm.engine import envs
from raylm.engine.engine_core import EngineSleepingError

if TYPE_CHECKING:
    from fastapi import FastAPI

    from raylm.engine.async_llm_engine import AsyncLLMEngine


class CollectiveRpcRequest(BaseModel):
    method: str = Field(min_length=1, max_length=200)
    args: list[Any] = Field(default_factory=list)
    kwargs: dict[str, Any] = Field(default_factory=dict)
    timeout: float | None = Field(default=None, gt=0)


def engine_sleeping_body(exc: EngineSleepingError) -> ErrorResponse:
    """The 503's body. Its message is our own sentence (no path or traceback in it), so it
    is shown, unlike other 5xx messages (deploy/errors.py)."""
    return ErrorResponse(error=ErrorInfo(message=str(exc), type="ServiceUnavailableError", param=None,
                                         code=int(HTTPStatus.SERVICE_UNAVAILABLE)))


def install_sleep_mode_routes(app: FastAPI, engine: AsyncLLMEngine) -> None:
    """The 503 for requests to a sleeping engine; with RAYLM_SERVER_DEV_MODE=1 the routes."""
    from fastapi import Query, Request
    from fastapi.responses import JSONResponse, Response

    @app.exception_handler(EngineSleepingError)
    async def _engine_sleeping(_: Request, exc: EngineSleepingError) -> JSONResponse:
        return JSONResponse(engine_sleeping_body(exc).model_dump(), status_code=int(HTTPStatus.SERVICE_UNAVAILABLE))

    if not envs.RAYLM_SERVER_DEV_MODE:
        return

    # A bad level or tag is a ParameterError naming it, sleep mode off a ValueError naming
    # the flag: both 400s (deploy/errors.py).
    @app.post("/sleep")
    async def sleep(level: int = 1) -> Response:
        await engine.sleep(level)
        return Response(status_code=200)

    @app.post("/wake_up")
    async def wake_up(tags: list[str] | None = Query(default=None)) -> Response:
        await engine.wake_up(tags)
        return Response(status_code=200)

    @app.get("/is_sleeping")
    async def is_sleeping() -> JSONResponse:
        return JSONResponse({"is_sleeping": await engine.is_sleeping()})

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache() -> Response:
        if not await engine.reset_prefix_cache():
            raise OpenAIError("The prefix cache was not reset: running requests hold blocks; retry when they are "
                              "done.", HTTPStatus.CONFLICT)
        return Response(status_code=200)

    @app.post("/collective_rpc")
    async def collective_rpc(request: CollectiveRpcRequest) -> JSONResponse:
        from fastapi.encoders import jsonable_encoder

        # The engine checks the method and its arguments before any worker runs (a
        # ParameterError naming method or args: a 400).
        results = await engine.collective_rpc(request.method, request.timeout, tuple(request.args),
                                              request.kwargs)
        return JSONResponse({"results": jsonable_encoder(results)})
