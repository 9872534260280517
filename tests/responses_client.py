"""What the Responses API tests (test_responses_api.py, test_responses_logprobs.py) share: the
tiny model whose weights write a known chain (`<think>Ray places</think>` then a Hermes tool
call to pick_city), and an in-process app (raylm.deploy.api_server.build_app) driven over
ASGI by httpx, bodies and stream events parsed with the `openai` package's types (a
test-only dependency)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Coroutine
from typing import Any

from pathlib import Path

import httpx
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter

from tiny_models import build_tiny_reasoning_model

EVENTS = TypeAdapter(ResponseStreamEvent)
# The tool call the model writes, in the two pieces its added tokens hold, and the whole chain.
CALL = ('{"name": "pick_city", ', '"arguments": {"city": "Paris"}}')
CHAIN = ["\n", "<think>", "Ray", " places", "</think>", "<tool_call>", *CALL, "</tool_call>"]
QUESTION = "Where do workers go?"


def build_pick_city_model(path: Path) -> Path:
    """The tiny reasoning model that answers any prompt with CHAIN."""
    return build_tiny_reasoning_model(path, CHAIN, added_tokens=("<tool_call>", "</tool_call>", *CALL))


class AsgiClient:
    """Requests to in-process apps, every one on this client's one event loop: the engine's
    output loop belongs to the event loop it first ran on, as a server's requests all run on
    uvicorn's. A test module holds one and closes it when its tests are done."""

    def __init__(self) -> None:
        self._runner = asyncio.Runner()

    def close(self) -> None:
        self._runner.close()

    def run(self, coroutine: Coroutine[Any, Any, Any]) -> Any:
        """Runs `coroutine` (a test's own requests) on the client's event loop."""
        return self._runner.run(coroutine)

    def post(self, app, path: str, body: dict) -> httpx.Response:
        async def send() -> httpx.Response:
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://test", timeout=60) as client:
                return await client.post(path, json=body)

        return self.run(send())

    def respond(self, app, **body) -> Response:
        """POST /v1/responses (temperature 0 unless the body says), its 200 reply parsed."""
        reply = self.post(app, "/v1/responses", {"temperature": 0, **body})
        assert reply.status_code == 200, reply.text
        return Response.model_validate(reply.json())

    def stream(self, app, **body) -> list:
        """The stream's events, each parsed with the openai package's event types (and its
        `event:` line checked against the event's type)."""
        reply = self.post(app, "/v1/responses", {"temperature": 0, "stream": True, **body})
        assert reply.status_code == 200, reply.text
        events = []
        for block in filter(None, reply.text.split("\n\n")):
            kind, data = block.split("\n")
            event = EVENTS.validate_python(json.loads(data.removeprefix("data: ")))
            assert kind == f"event: {event.type}"
            events.append(event)
        return events
