"""Structured outputs and forced tool calls for gpt-oss (`--tool-call-parser openai`, which
turns on `--reasoning-parser openai_gptoss`), on a tiny model with a gpt-oss-shaped tokenizer
whose weights write an analysis message, then the final channel's header
`<|channel|>final<|message|>` spelled as the tokenizer spells it; past the chain the weights
are random, so the grammar alone decides the answer. References: the schema itself (the
content parses as JSON and validates with jsonschema), and the same request unconstrained
(the analysis' tokens and logprobs, which the grammar must leave alone)."""

from __future__ import annotations

import json

import httpx
import jsonschema
import pytest

from chat_replies import message_parts, streamed_parts
from engine_checks import assert_async_engine_idle
from server_process import InProcessServer
from tiny_models import build_tiny_harmony_model

ANALYSIS_HEADER = "<|channel|>analysis<|message|>"  # one added token: the chain writes <|channel|> once
ANALYSIS = ["Ray", " places"]
# A first-order chain writes each token once: the final header's own tokens come after it.
FINAL_HEADER = ["<|channel|>", "f", "in", "al", "<|message|>"]
# The second header's role is spelled "assist" "ant": "assistant" is the prompt's last token,
# the chain's first.
CHAIN = ["assistant", ANALYSIS_HEADER, *ANALYSIS, "<|end|>", "<|start|>", "assist", "ant", *FINAL_HEADER]
# Finite answers only (booleans, enums, no free strings): a random model cannot run past max_tokens.
SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}, "size": {"enum": [1, 2, 3]}},
          "required": ["ok", "size"], "additionalProperties": False}
UNIT = {"type": "object", "properties": {"unit": {"enum": ["c", "f"]}}, "required": ["unit"],
        "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "weather", "description": "The weather.", "parameters": UNIT}},
         {"type": "function", "function": {"name": "clock", "description": "The time.", "parameters": {
             "type": "object", "properties": {"utc": {"type": "boolean"}}, "required": ["utc"],
             "additionalProperties": False}}}]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory):
    from raylm.deploy.server_args import ServerArgs
    from raylm.engine import AsyncLLMEngine, EngineArgs

    model_dir = build_tiny_harmony_model(tmp_path_factory.mktemp("gpt_oss"), CHAIN,
                                         added_tokens=("assistant", ANALYSIS_HEADER, "assist", "ant"))
    engine = AsyncLLMEngine.from_engine_args(EngineArgs(model=str(model_dir), max_model_len=1024,
                                                        disable_log_stats=True))
    try:
        with InProcessServer(engine, ServerArgs(enable_auto_tool_choice=True, tool_call_parser="openai")) as base_url:
            yield base_url, engine
    finally:
        engine.shutdown()


def _chat(base_url: str, route: str = "chat/completions", **fields) -> httpx.Response:
    body = {"messages": [{"role": "user", "content": "Where?"}], "temperature": 0, "max_tokens": 120, **fields}
    reply = httpx.post(f"{base_url}/v1/{route}", json=body, timeout=60)
    assert reply.status_code == 200, reply.text
    return reply


@pytest.mark.parametrize("fields", [
    {"response_format": {"type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA}}},
    {"structured_outputs": {"json": SCHEMA}}])
def test_final_message_matches_the_schema_after_free_analysis(server, fields):
    """The analysis is the reasoning, as the chain wrote it; the final message's body, which
    the grammar decided, is JSON valid against the schema, streamed or not."""
    base_url, engine = server
    whole = message_parts(_chat(base_url, **fields).json())
    reasoning, content, calls, finish_reason = whole
    assert reasoning == "".join(ANALYSIS) and calls == [] and finish_reason == "stop"
    jsonschema.validate(json.loads(content), SCHEMA)
    assert streamed_parts(_chat(base_url, stream=True, **fields).text)[0] == whole
    assert_async_engine_idle(engine)


def test_grammar_leaves_the_analysis_alone(server):
    """Up to the final header the constrained request samples from the whole vocabulary: its
    tokens and their logprobs (with the top 5 alternatives) are the unconstrained request's;
    after the header they part (the grammar's mask)."""
    base_url, _ = server
    fields = dict(logprobs=True, top_logprobs=5, return_token_ids=True)
    constrained = _chat(base_url, response_format={"type": "json_object"}, **fields).json()["choices"][0]
    free = _chat(base_url, **fields).json()["choices"][0]
    header = len(CHAIN) - 1  # the reply's tokens up to the final header's end
    assert constrained["token_ids"][:header] == free["token_ids"][:header]
    assert constrained["logprobs"]["content"][:header] == free["logprobs"]["content"][:header]
    assert constrained["token_ids"][header:] != free["token_ids"][header:]


@pytest.mark.parametrize("streamed", [False, True])
@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "clock"}}])
def test_forced_tool_choice_makes_a_harmony_call_with_valid_arguments(server, tool_choice, streamed):
    """tool_choice "required" or a named function: after the analysis (the reasoning) the
    reply is a call to one of the tools (the named one), its arguments valid against its
    parameters; "required" finishes with tool_calls, a named function with stop (vLLM's)."""
    base_url, engine = server
    reply = _chat(base_url, tools=TOOLS, tool_choice=tool_choice, stream=streamed)
    reasoning, content, calls, finish_reason = streamed_parts(reply.text)[0] if streamed else message_parts(reply.json())
    assert reasoning.startswith("".join(ANALYSIS)) and not content
    ((name, arguments),) = calls
    schemas = {tool["function"]["name"]: tool["function"]["parameters"] for tool in TOOLS}
    assert name in (schemas if tool_choice == "required" else ["clock"])
    jsonschema.validate(json.loads(arguments), schemas[name])
    assert finish_reason == ("tool_calls" if tool_choice == "required" else "stop")
    assert_async_engine_idle(engine)


def test_responses_route_takes_a_schema_and_a_forced_call(server):
    """/v1/responses runs the same: text.format json_schema gives a message whose text
    validates; tool_choice naming a function gives its function_call item."""
    base_url, engine = server
    body = {"input": "Where?", "temperature": 0, "max_output_tokens": 120}
    reply = httpx.post(f"{base_url}/v1/responses", timeout=60, json={**body, "text": {"format": {
        "type": "json_schema", "name": "answer", "schema": SCHEMA}}})
    assert reply.status_code == 200, reply.text
    items = reply.json()["output"]
    assert [item["type"] for item in items] == ["reasoning", "message"]
    jsonschema.validate(json.loads(items[1]["content"][0]["text"]), SCHEMA)
    tools = [{"type": "function", **tool["function"]} for tool in TOOLS]
    reply = httpx.post(f"{base_url}/v1/responses", timeout=60, json={**body, "tools": tools, "tool_choice": {
        "type": "function", "name": "weather"}})
    assert reply.status_code == 200, reply.text
    (call,) = [item for item in reply.json()["output"] if item["type"] == "function_call"]
    assert call["name"] == "weather"
    jsonschema.validate(json.loads(call["arguments"]), UNIT)
    assert_async_engine_idle(engine)
