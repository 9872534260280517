"""gpt-oss's harmony replies over HTTP (`--enable-auto-tool-choice --tool-call-parser openai`,
which turns on `--reasoning-parser openai_gptoss`), on a tiny model with a gpt-oss-shaped
tokenizer (the harmony markers special tokens, gpt-oss's chat template) whose weights write
a known reply: it reasons in the analysis channel, writes a preamble, then calls a function.
The reference is that reply, built into the weights (and run through transformers' greedy
decoding in the unit tests' model check); the prompt's reference is transformers'
apply_chat_template with the messages in the form gpt-oss's template reads."""

from __future__ import annotations

import json

import httpx
import pytest

from chat_replies import message_parts, streamed_parts
from engine_checks import assert_async_engine_idle
from server_process import InProcessServer
from tiny_models import build_tiny_harmony_model

ANALYSIS = ["Ray", " places"]
PREAMBLE = "Checking."
# The later headers are one token each of the test's vocabulary (a first-order chain never
# writes a token twice); the first is written in gpt-oss's special tokens.
PREAMBLE_HEADER = "assistant<|channel|>commentary<|message|>"
CALL_HEADER = "<|end|><|start|>assistant to=functions.pick_city<|channel|>commentary <|constrain|>json<|message|>"
ARGUMENTS = '{"city": "Paris"}'
CHAIN = ["assistant", "<|channel|>", "analysis", "<|message|>", *ANALYSIS, "<|end|>", "<|start|>", PREAMBLE_HEADER,
         PREAMBLE, CALL_HEADER, ARGUMENTS, "<|call|>"]
TOOLS = [{"type": "function", "function": {
    "name": "pick_city", "description": "Picks the city to visit.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "description": "Its name."}},
                   "required": ["city"]}}}]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory):
    from raylm.deploy.server_args import ServerArgs
    from raylm.engine import AsyncLLMEngine, EngineArgs

    model_dir = build_tiny_harmony_model(tmp_path_factory.mktemp("gpt_oss"), CHAIN, added_tokens=(
        "assistant", "analysis", PREAMBLE_HEADER, PREAMBLE, CALL_HEADER, ARGUMENTS))
    engine = AsyncLLMEngine.from_engine_args(EngineArgs(model=str(model_dir), max_model_len=1024,
                                                        disable_log_stats=True))
    try:
        server_args = ServerArgs(enable_auto_tool_choice=True, tool_call_parser="openai")
        assert server_args.reasoning_parser == "openai_gptoss"
        with InProcessServer(engine, server_args) as base_url:
            yield base_url, engine, model_dir
    finally:
        engine.shutdown()


def _post(base_url: str, route: str = "chat/completions", **fields) -> httpx.Response:
    body = {"messages": [{"role": "user", "content": "Where?"}], "temperature": 0, **fields}
    return httpx.post(f"{base_url}/v1/{route}", json=body, timeout=60)


def _chat(base_url: str, **fields) -> httpx.Response:
    reply = _post(base_url, **fields)
    assert reply.status_code == 200, reply.text
    return reply


def _message(base_url: str, **fields) -> tuple:
    """(reasoning, content, [(name, arguments)], finish_reason) of the unstreamed reply."""
    return message_parts(_chat(base_url, **fields).json())


def _streamed(base_url: str, **fields) -> tuple:
    """The same, from the stream's deltas."""
    return streamed_parts(_chat(base_url, stream=True, **fields).text)[0]


def test_analysis_is_reasoning_preamble_content_and_the_call_a_tool_call(server):
    """vLLM's split of a harmony reply: the analysis channel is `reasoning`, the preamble
    (commentary without a recipient) `content`, the message to functions.pick_city a tool
    call with the body as its arguments, finish_reason tool_calls; the stream adds up to the
    same; usage counts the analysis body's tokens as reasoning."""
    base_url, engine, _ = server
    whole = _message(base_url, tools=TOOLS)
    assert whole == ("".join(ANALYSIS), PREAMBLE, [("pick_city", ARGUMENTS)], "tool_calls")
    assert _streamed(base_url, tools=TOOLS) == whole
    usage = _chat(base_url, tools=TOOLS).json()["usage"]
    assert usage["completion_tokens"] == len(CHAIN) - 1
    assert usage["completion_tokens_details"]["reasoning_tokens"] == len(ANALYSIS)
    assert_async_engine_idle(engine)


def test_without_tools_the_call_is_neither_content_nor_a_tool_call(server):
    """A request without tools has no tool parser: as vLLM's parse_chat_output, the message to
    a function is left out of the content, which is the preamble alone."""
    base_url, engine, _ = server
    whole = _message(base_url)
    assert whole == ("".join(ANALYSIS), PREAMBLE, [], "stop")
    assert _streamed(base_url) == whole
    assert_async_engine_idle(engine)


def test_include_reasoning_false_drops_the_analysis_and_its_token_ids(server):
    """include_reasoning false: no reasoning, and the token ids start with the first message
    that is not analysis (its `<|start|>`), streamed or not."""
    base_url, engine, model_dir = server
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    chain_ids = [tokenizer.get_added_vocab().get(piece) or tokenizer.encode(piece, add_special_tokens=False)[0]
                 for piece in CHAIN[1:]]
    after_analysis = chain_ids[CHAIN.index("<|start|>") - 1:]
    choice = _chat(base_url, tools=TOOLS, include_reasoning=False, return_token_ids=True).json()["choices"][0]
    assert "reasoning" not in choice["message"] or choice["message"]["reasoning"] is None
    assert choice["token_ids"] == after_analysis
    streamed_ids = []
    for line in _chat(base_url, tools=TOOLS, include_reasoning=False, return_token_ids=True,
                      stream=True).text.splitlines():
        if line.startswith("data: {"):
            for chunk_choice in json.loads(line[6:])["choices"]:
                assert not chunk_choice["delta"].get("reasoning")
                streamed_ids += chunk_choice.get("token_ids") or []
    assert streamed_ids == after_analysis
    assert_async_engine_idle(engine)


def test_prompt_renders_tools_earlier_reasoning_tool_results_and_effort_as_gpt_oss_template(server):
    """The input side: the request's tools, an earlier turn's reasoning (`reasoning`, which
    gpt-oss's template reads as `thinking`) and call, the tool's result and reasoning_effort
    reach the template as transformers passes them: the prompt's token ids are those of
    apply_chat_template on the messages in gpt-oss's own form."""
    base_url, engine, model_dir = server
    from transformers import AutoTokenizer

    arguments = {"city": "Paris"}
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Where?"},
                {"role": "assistant", "content": None, "reasoning": "Ask the tool.",
                 "tool_calls": [{"id": "call_1", "type": "function",
                                 "function": {"name": "pick_city", "arguments": json.dumps(arguments)}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "Sunny"}]
    reply = _chat(base_url, messages=messages, tools=TOOLS, reasoning_effort="low", return_token_ids=True,
                  max_tokens=1).json()
    reference_messages = [messages[0], messages[1],
                          {"role": "assistant", "content": "", "thinking": "Ask the tool.",
                           "tool_calls": [{"id": "call_1", "type": "function",
                                           "function": {"name": "pick_city", "arguments": arguments}}]},
                          messages[3]]
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    expected = tokenizer.apply_chat_template(reference_messages, tools=TOOLS, add_generation_prompt=True,
                                             tokenize=False, reasoning_effort="low")
    for part in ("Reasoning: low", "namespace functions {", "type pick_city = (_: {\n// Its name.\ncity: string,\n}",
                 "<|start|>assistant<|channel|>analysis<|message|>Ask the tool.<|end|>",
                 '<|start|>assistant to=functions.pick_city<|channel|>commentary json<|message|>{"city": "Paris"}'
                 '<|call|>',
                 '<|start|>functions.pick_city to=assistant<|channel|>commentary<|message|>"Sunny"<|end|>'):
        assert part in expected, part
    assert reply["prompt_token_ids"] == tokenizer.encode(expected, add_special_tokens=False)
    assert_async_engine_idle(engine)


def test_reasoning_effort_outside_the_choices_is_a_400_naming_it(server):
    base_url, engine, _ = server
    reply = _post(base_url, reasoning_effort="extreme")
    assert reply.status_code == 400
    assert "reasoning_effort" in reply.text
    assert_async_engine_idle(engine)


@pytest.mark.parametrize("streamed", [False, True])
def test_responses_route_gives_reasoning_message_and_function_call_items(server, streamed):
    """/v1/responses runs the same split: a reasoning item, the preamble as output_text and a
    function_call item with the arguments; streamed, the response.completed event holds them."""
    base_url, engine, _ = server
    tools = [{"type": "function", **TOOLS[0]["function"]}]
    reply = httpx.post(f"{base_url}/v1/responses", timeout=60,
                       json={"input": "Where?", "tools": tools, "temperature": 0, "stream": streamed})
    assert reply.status_code == 200, reply.text
    if streamed:
        (completed,) = [json.loads(block.split("data: ", 1)[1]) for block in reply.text.split("\n\n")
                        if block.startswith("event: response.completed")]
        items = completed["response"]["output"]
    else:
        items = reply.json()["output"]
    assert [item["type"] for item in items] == ["reasoning", "message", "function_call"]
    assert items[0]["content"][0]["text"] == "".join(ANALYSIS)
    assert items[1]["content"][0]["text"] == PREAMBLE
    assert (items[2]["name"], items[2]["arguments"]) == ("pick_city", ARGUMENTS)
    assert_async_engine_idle(engine)
