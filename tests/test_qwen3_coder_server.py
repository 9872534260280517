"""Qwen3.5's tool calls over HTTP (`--reasoning-parser qwen3 --tool-call-parser
qwen3_coder`), on a tiny model whose weights write a known reply: it thinks, then opens an
XML call without closing its thinking, as Qwen3.5 may. The reference is that chain, built
into the weights: the call's values typed by the request's tools; under a grammar (a named
tool_choice) the reasoning ends at the <tool_call> token, where the engine starts the
grammar; a named call cut while thinking gives empty arguments, streamed or not."""

from __future__ import annotations

import json

import httpx
import pytest

from chat_replies import message_parts, streamed_parts
from engine_checks import assert_async_engine_idle
from server_process import InProcessServer
from tiny_models import build_tiny_reasoning_model

REASONING = "Ray places"
# One added token each (every token of a chain must be a different one).
CALL = ["\n<function=pick_city>\n", "<parameter=city>\nParis\n</parameter>\n", "<parameter=days>\n3\n</parameter>\n",
        "</function>\n"]
CHAIN = ["\n", "<think>", "Ray", " places", "<tool_call>", *CALL, "</tool_call>"]


def city_tool(days_type: str | None = None) -> dict:
    """pick_city's definition; `days` of the given type (none: a grammar the greedy model
    finishes in a few tokens)."""
    properties = {"city": {"enum": ["Paris", "Rome"]}, **({"days": {"type": days_type}} if days_type else {})}
    return {"type": "function", "function": {"name": "pick_city", "parameters": {
        "type": "object", "properties": properties, "required": ["city"], "additionalProperties": False}}}


NAMED = {"type": "function", "function": {"name": "pick_city"}}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory):
    from raylm.deploy.server_args import ServerArgs
    from raylm.engine import AsyncLLMEngine, EngineArgs

    model_dir = build_tiny_reasoning_model(tmp_path_factory.mktemp("coder"), CHAIN,
                                           added_tokens=("<tool_call>", "</tool_call>", *CALL))
    engine = AsyncLLMEngine.from_engine_args(EngineArgs(model=str(model_dir), max_model_len=256,
                                                        disable_log_stats=True))
    try:
        with InProcessServer(engine, ServerArgs(reasoning_parser="qwen3", enable_auto_tool_choice=True,
                                                tool_call_parser="qwen3_coder")) as base_url:
            yield base_url, engine, model_dir
    finally:
        engine.shutdown()


def _chat(base_url: str, **fields) -> httpx.Response:
    body = {"messages": [{"role": "user", "content": "Where?"}], "temperature": 0, **fields}
    reply = httpx.post(f"{base_url}/v1/chat/completions", json=body, timeout=60)
    assert reply.status_code == 200, reply.text
    return reply


def _message(base_url: str, **fields) -> tuple:
    """(reasoning, content, [(name, arguments)], finish_reason) of the unstreamed reply."""
    return message_parts(_chat(base_url, **fields).json())


def _streamed(base_url: str, **fields) -> tuple[tuple, list[dict]]:
    """The same, from the stream's deltas, and the chunks' choices."""
    return streamed_parts(_chat(base_url, stream=True, **fields).text)


@pytest.mark.parametrize("days_type, days", [("integer", 3), ("string", "3")])
def test_auto_call_in_unclosed_thinking_is_parsed_with_the_tools_types(server, days_type, days):
    """The reasoning ends at <tool_call><function= (no </think>), the XML call is parsed with
    the request's schema (days an integer or a string by its type), no content, finish_reason
    tool_calls; the stream adds up to the same, arguments text and all."""
    base_url, engine, _ = server
    whole = _message(base_url, tools=[city_tool(days_type)])
    reasoning, content, ((name, arguments),), finish = whole
    assert (reasoning, content, name, finish) == (REASONING, None, "pick_city", "tool_calls")
    assert json.loads(arguments) == {"city": "Paris", "days": days}
    assert _streamed(base_url, tools=[city_tool(days_type)])[0] == whole
    assert_async_engine_idle(engine)


def test_named_tool_choice_grammar_starts_at_the_tool_call_token(server):
    """A named tool_choice under the reasoning parser: the engine starts the grammar after
    the <tool_call> token, as vLLM does, so the model writes the arguments' JSON there where
    its chain would write XML, and the split ends the reasoning at that token: the arguments
    are the grammar's JSON (before, the gate waited for a </think> that never came and the
    arguments were the XML call's text)."""
    base_url, engine, model_dir = server
    from transformers import AutoTokenizer

    whole = _message(base_url, tools=[city_tool()], tool_choice=NAMED)
    reasoning, content, ((name, arguments),), finish = whole
    assert (reasoning, content, name, finish) == (REASONING, None, "pick_city", "stop")
    assert json.loads(arguments)["city"] in ("Paris", "Rome")
    assert _streamed(base_url, tools=[city_tool()], tool_choice=NAMED)[0] == whole
    # Usage counts the thinking's tokens, the tags apart.
    usage = _chat(base_url, tools=[city_tool()], tool_choice=NAMED).json()["usage"]
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    assert usage["completion_tokens_details"]["reasoning_tokens"] == \
        len(tokenizer.encode(REASONING, add_special_tokens=False))
    assert_async_engine_idle(engine)


def test_named_call_cut_while_thinking_has_empty_arguments_streamed_or_not(server):
    """Cut by max_tokens inside the reasoning: the call with empty arguments, content null,
    finish_reason length (vLLM's unstreamed reply, #40148). Streamed, the call comes with the
    last chunk, not while the model thinks (vLLM names it with the first answer text)."""
    base_url, engine, _ = server
    fields = {"tools": [city_tool()], "tool_choice": NAMED, "max_tokens": 3}  # <think>, Ray, " places"
    whole = _message(base_url, **fields)
    assert whole == (REASONING, None, [("pick_city", "")], "length")
    streamed, choices = _streamed(base_url, **fields)
    assert streamed == whole
    assert all(not c["delta"].get("tool_calls") for c in choices if c["finish_reason"] is None)
    assert_async_engine_idle(engine)
