"""The chat-template time and queue bounds on a real server (the app over a real engine on a
real port): a burst of slow request templates gets immediate 429s past
--max-queued-chat-template-renders while the admitted ones end by their deadline, and a
server template that request content makes slow ends at --max-chat-template-render-seconds;
afterwards the server answers normally, with no render process or KV block left over."""

from __future__ import annotations

import asyncio
import os
import time

import httpx
import pytest
from engine_checks import assert_async_engine_idle
from server_process import InProcessServer

RENDER_SECONDS = 1.5
MAX_QUEUED = 2  # behind the sandbox's 2 processes
# A request template within every bound but minutes of work: each iteration sorts 100,000 characters.
SLOW_REQUEST_TEMPLATE = ("{% set big = 'ab' * 50000 %}{% for i in range(30000) %}{% set x = big|list|sort|join %}"
                         "{% endfor %}")
# The server's template: the tiny model's, plus work that grows with a message's length (80
# sorts of a 100,000-character message take 2-5 s on a loaded 2-core machine).
SERVER_TEMPLATE = (
    "{% if messages[0].content|length > 10000 %}{% for i in range(80) %}"
    "{% set x = messages[0].content|list|sort|join %}{% endfor %}{% endif %}"
    "{% for message in messages %}<|{{ message['role'] }}|>\n{{ message['content'] }}<|end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")
HELLO = [{"role": "user", "content": "Hello"}]


@pytest.fixture(scope="module")
def server(llama_dir):
    """(engine, the app's chat route with its sandbox, base URL)."""
    from raylm.deploy.limits import RequestLimits
    from raylm.deploy.server_args import ServerArgs
    from raylm.engine import AsyncLLMEngine, EngineArgs

    engine = AsyncLLMEngine.from_engine_args(EngineArgs(model=str(llama_dir), max_model_len=128,
                                                        num_gpu_blocks_override=64, disable_log_stats=True))
    args = ServerArgs(trust_request_chat_template=True, max_queued_chat_template_renders=MAX_QUEUED,
                      chat_template=SERVER_TEMPLATE,
                      limits=RequestLimits(max_prompt_chars=200_000, max_chat_template_render_seconds=RENDER_SECONDS))
    try:
        in_process = InProcessServer(engine, args)
        with in_process as base_url:
            yield engine, in_process.app.state.chat, base_url
    finally:
        engine.shutdown()


def test_a_burst_of_slow_request_templates_is_refused_past_the_queue_and_the_rest_ends_by_the_deadline(server):
    engine, chat, base_url = server
    assert post_chat(base_url, messages=HELLO, chat_template="{{ 'warm' }}").status_code == 200
    burst = 2 + MAX_QUEUED + 4  # 2 render, MAX_QUEUED wait, 4 are refused

    answers = asyncio.run(_burst(base_url, burst))
    refused = [(reply, took) for reply, took in answers if "--max-queued-chat-template-renders" in reply.text]
    assert len(refused) == 4
    for reply, took in refused:
        error = reply.json()["error"]
        assert reply.status_code == 429 and reply.headers["Retry-After"] == "1"
        assert error["type"] == "RateLimitError" and error["param"] == "chat_template" and error["code"] == 429
        # At once, not after the renders before it (each takes RENDER_SECONDS to be cut off;
        # a refusal took 1.008 s on CI's loaded 2 cores).
        assert took < RENDER_SECONDS
    admitted = [(reply, took) for reply, took in answers if (reply, took) not in refused]
    for reply, took in admitted:
        # Out of time rendering (400, the template's doing), or, having waited, before a
        # process came free (429): either way within the deadline, the wait counted in it.
        assert reply.status_code in (400, 429), reply.text
        assert "did not render within 1.5 s" in reply.text or "waited" in reply.text
        assert took < RENDER_SECONDS + 1.0
    # (A render that started a process counts that time as waiting too.)
    assert sum("waited" in reply.text for reply, _ in admitted) >= MAX_QUEUED

    _assert_serves_normally_and_nothing_is_left(engine, chat, base_url)


def test_a_server_template_made_slow_by_request_content_ends_at_the_deadline(server):
    engine, chat, base_url = server
    started = time.monotonic()
    reply = post_chat(base_url, messages=[{"role": "user", "content": "ab" * 50_000}])
    took = time.monotonic() - started
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert "did not render within 1.5 s (--max-chat-template-render-seconds)" in error["message"]
    assert error["param"] == "messages"
    assert took < RENDER_SECONDS + 1.0

    _assert_serves_normally_and_nothing_is_left(engine, chat, base_url)


def post_chat(base_url: str, **body) -> httpx.Response:
    return httpx.post(f"{base_url}/v1/chat/completions", timeout=60, json={"max_tokens": 3, **body})


async def _burst(base_url: str, count: int) -> list[tuple[httpx.Response, float]]:
    """`count` chat requests with the slow template at once: each reply and its seconds."""
    async with httpx.AsyncClient(timeout=60, limits=httpx.Limits(max_connections=count)) as client:
        async def one() -> tuple[httpx.Response, float]:
            started = time.monotonic()
            reply = await client.post(f"{base_url}/v1/chat/completions", json={
                "messages": HELLO, "max_tokens": 3, "chat_template": SLOW_REQUEST_TEMPLATE})
            return reply, time.monotonic() - started

        return await asyncio.gather(*(one() for _ in range(count)))


def _assert_serves_normally_and_nothing_is_left(engine, chat, base_url: str) -> None:
    """Both templates render again and generate what was asked; no render is in flight,
    the render processes left are the sandbox's idle ones, alive, and every KV block is
    back in the pool."""
    for template in (None, "{% for m in messages %}{{ m.content }}{% endfor %}"):
        reply = post_chat(base_url, messages=HELLO, chat_template=template, ignore_eos=True)
        assert reply.status_code == 200, reply.text
        assert reply.json()["usage"]["completion_tokens"] == 3
    sandbox = chat.sandbox
    assert sandbox.renders_admitted == 0
    pids = sandbox.worker_pids
    assert 1 <= len(pids) <= sandbox.max_processes
    assert all(os.waitpid(pid, os.WNOHANG) == (0, 0) for pid in pids)  # alive, not zombies
    assert_async_engine_idle(engine, timeout_s=5)
