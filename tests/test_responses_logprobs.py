"""Logprobs on `POST /v1/responses`: `include: ["message.output_text.logprobs"]` with
`top_logprobs`, as OpenAI defines them and vLLM serves them. The reference is the
/v1/chat/completions route's logprobs for the same conversation on the same engine
(logprobs true, the same top_logprobs); the `openai` package's Response and stream event
types parse every body and event. The model is the tiny one whose weights write a known
chain (tests/responses_client.py), so that a reply's tokens and their text are known."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine_checks import assert_async_engine_idle
from responses_client import QUESTION, AsgiClient, build_pick_city_model

from raylm.deploy.api_server import build_app
from raylm.deploy.server_args import ServerArgs
from raylm.engine.arg_utils import EngineArgs
from raylm.engine.async_llm_engine import AsyncLLMEngine

INCLUDE = ["message.output_text.logprobs"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_pick_city_model(tmp_path_factory.mktemp("responses_logprobs"))


@pytest.fixture(scope="module")
def engine(model_dir: Path):
    engine = AsyncLLMEngine.from_engine_args(EngineArgs(model=str(model_dir), num_gpu_blocks_override=64,
                                                        disable_log_stats=True, dtype="float32"))
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def app(engine):
    return build_app(engine, ServerArgs())


# Every request of the module runs on this client's one event loop (see AsgiClient).
CLIENT = AsgiClient()
post, respond, stream = CLIENT.post, CLIENT.respond, CLIENT.stream


@pytest.fixture(scope="module", autouse=True)
def _close_client():
    yield
    CLIENT.close()


def chat_logprobs(app, top_logprobs: int, max_tokens: int) -> list[dict]:
    """The chat route's logprobs for the same conversation: the reference."""
    reply = post(app, "/v1/chat/completions", {
        "messages": [{"role": "user", "content": QUESTION}], "temperature": 0, "max_completion_tokens": max_tokens,
        "logprobs": True, "top_logprobs": top_logprobs})
    assert reply.status_code == 200, reply.text
    return reply.json()["choices"][0]["logprobs"]["content"]


def without_bytes(entries: list[dict]) -> list[dict]:
    """Chat's entries in the shape of a Responses text event's (which has no bytes)."""
    return [{"token": e["token"], "logprob": e["logprob"],
             "top_logprobs": [{"token": t["token"], "logprob": t["logprob"]} for t in e["top_logprobs"]]}
            for e in entries]


@pytest.mark.parametrize("top_logprobs", [0, 3])
def test_output_text_logprobs_equal_the_chat_routes(app, top_logprobs):
    expected = chat_logprobs(app, top_logprobs, max_tokens=6)
    assert len(expected) == 6 and all(len(e["top_logprobs"]) == top_logprobs for e in expected)
    response = respond(app, input=QUESTION, include=INCLUDE, top_logprobs=top_logprobs, max_output_tokens=6)
    (message,) = response.output
    (part,) = message.content
    assert [entry.model_dump() for entry in part.logprobs] == expected
    assert "".join(entry.token for entry in part.logprobs) == part.text
    assert response.top_logprobs == top_logprobs


def test_streamed_text_deltas_carry_their_own_tokens_logprobs(app):
    expected = chat_logprobs(app, 2, max_tokens=6)
    events = stream(app, input=QUESTION, include=INCLUDE, top_logprobs=2, max_output_tokens=6)
    deltas = [event for event in events if event.type == "response.output_text.delta"]
    assert len(deltas) > 1
    for delta in deltas:  # each delta's logprobs are those of the tokens that spell it
        assert "".join(entry.token for entry in delta.logprobs) == delta.delta
    assert [entry.model_dump() for delta in deltas for entry in delta.logprobs] == without_bytes(expected)
    (done,) = [event for event in events if event.type == "response.output_text.done"]
    assert [entry.model_dump() for entry in done.logprobs] == without_bytes(expected)
    (part_done,) = [event for event in events if event.type == "response.content_part.done"]
    final = events[-1].response
    assert [entry.model_dump() for entry in part_done.part.logprobs] == expected
    assert [entry.model_dump() for entry in final.output[0].content[0].logprobs] == expected


@pytest.mark.parametrize("streamed", [False, True])
def test_top_logprobs_without_include_adds_no_logprobs_as_in_vllm(app, streamed):
    body = {"input": QUESTION, "top_logprobs": 3, "max_output_tokens": 3}
    if streamed:
        events = stream(app, **body)
        assert all(not event.logprobs for event in events if event.type == "response.output_text.delta")
        response = events[-1].response
    else:
        response = respond(app, **body)
    assert response.output[0].content[0].logprobs == []
    assert response.top_logprobs == 3


@pytest.mark.parametrize("body, param", [
    ({"top_logprobs": 21, "include": INCLUDE}, "top_logprobs"),  # past --max-logprobs (20), as on chat
    ({"top_logprobs": 21}, "top_logprobs"),
    ({"top_logprobs": -1, "include": INCLUDE}, "top_logprobs"),
    ({"top_logprobs": 1.5, "include": INCLUDE}, "top_logprobs"),
    ({"include": ["message.output_text.logprobs", "bogus"]}, "include"),
])
def test_bad_logprobs_request_is_refused_naming_the_field(app, body, param):
    chat = post(app, "/v1/chat/completions", {"messages": [{"role": "user", "content": QUESTION}],
                                              "logprobs": True, "top_logprobs": 21})
    assert chat.status_code == 400 and chat.json()["error"]["param"] == "top_logprobs"  # the bound followed
    reply = post(app, "/v1/responses", {"input": QUESTION, **body})
    assert reply.status_code == 400, reply.text
    assert reply.json()["error"]["param"] == param, reply.text


def test_no_kv_blocks_are_left_after_the_requests(engine, app):
    stream(app, input=QUESTION, include=INCLUDE, top_logprobs=20, max_output_tokens=3)
    assert_async_engine_idle(engine)


@pytest.mark.parametrize("streamed", [False, True])
def test_message_logprobs_leave_the_reasoning_out(engine, model_dir, streamed):
    """Under --reasoning-parser the reasoning's tokens (its tags included) go to the
    reasoning item, which has no logprobs: the message's output_text logprobs are the chat
    reply's last entries, the tokens that spell its text (and the EOS that ends it)."""
    from transformers import AutoTokenizer

    reasoning_app = build_app(engine, ServerArgs(reasoning_parser="qwen3"))
    body = {"input": QUESTION, "include": INCLUDE, "top_logprobs": 1}
    final = stream(reasoning_app, **body)[-1].response if streamed else respond(reasoning_app, **body)
    assert [item.type for item in final.output] == ["reasoning", "message"]
    part = final.output[1].content[0]
    chat = post(reasoning_app, "/v1/chat/completions", {"messages": [{"role": "user", "content": QUESTION}],
                                                        "temperature": 0, "logprobs": True, "top_logprobs": 1})
    expected = chat.json()["choices"][0]["logprobs"]["content"]
    texts = [entry.token for entry in part.logprobs]
    eos = AutoTokenizer.from_pretrained(str(model_dir)).eos_token
    assert part.text and "".join(texts) == part.text + eos
    assert [entry.model_dump() for entry in part.logprobs] == expected[len(expected) - len(texts):]
