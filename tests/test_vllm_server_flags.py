"""vLLM's server flags on a real in-process server (the engine and the FastAPI app in this
process, driven over ASGI by httpx): --enable-log-requests / --max-log-len log each
request's id, prompt and parameters, and never the API key; --response-role names the
reply's role, streamed or not, unless the request continues its last message."""

from __future__ import annotations

import asyncio
import json
import logging
from pathlib import Path

import httpx
import pytest

from raylm.deploy.api_server import build_app
from raylm.deploy.server_args import ServerArgs
from raylm.engine.arg_utils import EngineArgs
from raylm.engine.async_llm_engine import AsyncLLMEngine

API_KEY = "sk-request-log-secret"
ENGINE_KWARGS = dict(num_gpu_blocks_override=128, disable_log_stats=True, dtype="float32")
LOGGER = "raylm.deploy.request_logger"


@pytest.fixture(scope="module")
def engine(llama_dir: Path):
    engine = AsyncLLMEngine.from_engine_args(EngineArgs(model=str(llama_dir), **ENGINE_KWARGS))
    yield engine
    engine.shutdown()


# The engine's output loop belongs to the event loop it first ran on: every request of the
# module runs on this one, as a server's requests all run on uvicorn's.
_RUNNER = asyncio.Runner()


@pytest.fixture(scope="module", autouse=True)
def _close_runner():
    yield
    _RUNNER.close()


def post(app, path: str, body: dict, api_key: str | None = None) -> httpx.Response:
    """One request to the app over ASGI, on the module's event loop."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}

    async def send() -> httpx.Response:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test", timeout=60) as client:
            return await client.post(path, json=body, headers=headers)

    return _RUNNER.run(send())


def stream_events(response: httpx.Response) -> list[dict]:
    return [json.loads(line[len("data: "):]) for line in response.text.splitlines()
            if line.startswith("data: ") and line != "data: [DONE]"]


# ------------------------------------------------------------ request logs
def test_enable_log_requests_logs_id_cut_prompt_and_params_never_the_key(engine, caplog):
    app = build_app(engine, ServerArgs(enable_log_requests=True, max_log_len=3, api_key=API_KEY))
    prompt = "The quick brown fox jumps"
    token_ids = engine.engine.tokenizer.encode(prompt)
    with caplog.at_level(logging.INFO, logger=LOGGER):
        response = post(app, "/v1/completions", {"prompt": prompt, "max_tokens": 2, "temperature": 0,
                                                        "seed": 1234}, API_KEY)
    assert response.status_code == 200, response.text
    lines = [r.getMessage() for r in caplog.records if r.name == LOGGER]
    assert len(lines) == 1
    line = lines[0]
    assert line.startswith(f"Received request {response.json()['id']}-0: ")
    assert len(token_ids) > 3
    assert line.split(", params: ")[0].endswith(f"prompt: {prompt[:3]!r}")
    assert line.split("prompt_token_ids: ")[1].split(", lora_request")[0] == str(token_ids[:3])
    assert "seed=1234" in line and "max_tokens=2" in line
    assert API_KEY not in caplog.text


def test_requests_are_not_logged_by_default(engine, caplog):
    app = build_app(engine, ServerArgs())
    with caplog.at_level(logging.INFO, logger=LOGGER):
        response = post(app, "/v1/completions", {"prompt": "Hello", "max_tokens": 1})
    assert response.status_code == 200, response.text
    assert not [r for r in caplog.records if r.name == LOGGER]
    assert app.state.chat.request_logger is None  # the hot path pays one `is None` test


def test_chat_requests_log_the_rendered_prompt_whole_without_max_log_len(engine, caplog):
    app = build_app(engine, ServerArgs(enable_log_requests=True))
    messages = [{"role": "user", "content": "Tell me about paged attention, at length."}]
    rendered = engine.engine.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    with caplog.at_level(logging.INFO, logger=LOGGER):
        response = post(app, "/v1/chat/completions", {"messages": messages, "max_tokens": 1})
    assert response.status_code == 200, response.text
    (line,) = [r.getMessage() for r in caplog.records if r.name == LOGGER]
    assert f"prompt: {rendered!r}," in line


def test_max_log_len_must_be_a_non_negative_integer():
    with pytest.raises(ValueError, match="max_log_len"):
        ServerArgs(max_log_len=-1)
    assert ServerArgs.from_values({"enable_log_requests": "true", "max_log_len": "12"}).max_log_len == 12


# ------------------------------------------------------------ response role
CHAT = [{"role": "user", "content": "Hello there"}]


@pytest.mark.parametrize("stream", [False, True])
def test_response_role_names_the_reply_of_a_new_turn(engine, stream):
    app = build_app(engine, ServerArgs(response_role="bot"))
    response = post(app, "/v1/chat/completions", {"messages": CHAT, "max_tokens": 2, "stream": stream})
    assert response.status_code == 200, response.text
    if stream:
        roles = [c["choices"][0]["delta"].get("role") for c in stream_events(response) if c["choices"]]
        assert roles[0] == "bot" and not any(roles[1:])
    else:
        assert response.json()["choices"][0]["message"]["role"] == "bot"


@pytest.mark.parametrize("stream", [False, True])
def test_a_continued_message_keeps_its_own_role(engine, stream):
    """vLLM: without add_generation_prompt the reply continues the last message, in its role."""
    app = build_app(engine, ServerArgs(response_role="bot"))
    messages = CHAT + [{"role": "assistant", "content": "Hi, I am"}]
    response = post(app, "/v1/chat/completions", {"messages": messages, "max_tokens": 2, "stream": stream,
                                                        "add_generation_prompt": False,
                                                        "continue_final_message": True})
    assert response.status_code == 200, response.text
    if stream:
        assert stream_events(response)[0]["choices"][0]["delta"]["role"] == "assistant"
    else:
        assert response.json()["choices"][0]["message"]["role"] == "assistant"


def test_response_role_defaults_to_assistant(engine):
    response = post(build_app(engine, ServerArgs()), "/v1/chat/completions", {"messages": CHAT,
                                                                                    "max_tokens": 1})
    assert response.json()["choices"][0]["message"]["role"] == "assistant"
