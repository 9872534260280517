"""`POST /v1/responses` (OpenAI's Responses API) on a real in-process server: the engine and
the FastAPI app in this process, driven over ASGI by httpx. The model is the tiny one whose
weights write a known chain (tests/responses_client.py): `<think>Ray places</think>` then a
Hermes tool call to pick_city. References: Hugging Face's greedy tokens through
transformers' apply_chat_template, the /v1/chat/completions route on the same messages, and
the `openai` package's Response and stream event types (a test-only dependency), which
parse every body and event."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import httpx
import jsonschema
import pytest
from openai.types.responses import Response

from engine_checks import assert_async_engine_idle
from hf_reference import hf_greedy
from responses_client import EVENTS, QUESTION, AsgiClient, build_pick_city_model

from raylm.deploy.api_server import build_app
from raylm.deploy.server_args import ServerArgs
from raylm.engine.arg_utils import EngineArgs
from raylm.engine.async_llm_engine import AsyncLLMEngine

REASONING = "Ray places"
TOOL = {"type": "function", "name": "pick_city", "description": "Picks a city.",
        "parameters": {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}}, "required": ["city"]}}
CHAT_TOOL = {"type": "function", "function": {k: v for k, v in TOOL.items() if k != "type"}}
INSTRUCTIONS = "Answer in one word."
# A template that writes out every part of a message, so that the prompt shows where each
# input item went: roles, content, reasoning, tool calls and the tool answers' call ids.
HISTORY_TEMPLATE = (
    "{% for m in messages %}<|{{ m.role }}|>"
    "{% if m.reasoning_content is defined %}[thought: {{ m.reasoning_content }}]{% endif %}"
    "{{ m.content if m.content is string else '' }}"
    "{% for c in m.tool_calls or [] %}[call {{ c.id }}: {{ c.function.name }} {{ c.function.arguments | tojson }}]"
    "{% endfor %}{% if m.tool_call_id is defined %}[for {{ m.tool_call_id }}]{% endif %}<|end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
    "{% if reasoning_effort is defined %}[effort: {{ reasoning_effort }}]{% endif %}")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_pick_city_model(tmp_path_factory.mktemp("responses"))


@pytest.fixture(scope="module")
def engine(model_dir: Path):
    engine = AsyncLLMEngine.from_engine_args(EngineArgs(model=str(model_dir), num_gpu_blocks_override=128,
                                                        disable_log_stats=True, dtype="float32"))
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def apps(engine):
    """One engine, four servers: plain; --reasoning-parser qwen3 with hermes tool calls;
    hermes tool calls alone (the thinking is text); the history template with request logs
    (the prompt as rendered)."""
    return {"plain": build_app(engine, ServerArgs()),
            "tools": build_app(engine, ServerArgs(reasoning_parser="qwen3", enable_auto_tool_choice=True,
                                                  tool_call_parser="hermes")),
            "hermes": build_app(engine, ServerArgs(enable_auto_tool_choice=True, tool_call_parser="hermes")),
            "history": build_app(engine, ServerArgs(chat_template=HISTORY_TEMPLATE, enable_log_requests=True))}


# Every request of the module runs on this client's one event loop (see AsgiClient).
CLIENT = AsgiClient()
post, respond, stream = CLIENT.post, CLIENT.respond, CLIENT.stream


@pytest.fixture(scope="module", autouse=True)
def _close_client():
    yield
    CLIENT.close()


def hf_reply(model_dir: Path, messages: list[dict], max_new_tokens: int = 16) -> tuple[list[int], str]:
    """The prompt's ids through the model's chat template, and HF's greedy reply's text."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    prompt = list(getattr(prompt, "input_ids", prompt))
    reply = hf_greedy(model_dir, prompt, max_new_tokens)
    return prompt, tokenizer.decode(reply, skip_special_tokens=True)


def items(response: Response) -> list[tuple]:
    """The output items without their ids: what a stream and a plain answer must agree on."""
    kept = []
    for item in response.output:
        if item.type == "message":
            kept.append(("message", item.status, [part.text for part in item.content]))
        elif item.type == "reasoning":
            kept.append(("reasoning", item.status, [part.text for part in item.content]))
        else:
            kept.append(("function_call", item.status, item.name, item.arguments))
    return kept


def test_text_equals_chat_and_hf_greedy_with_instructions_as_the_system_message(apps, model_dir):
    messages = [{"role": "system", "content": INSTRUCTIONS}, {"role": "user", "content": QUESTION}]
    prompt, expected = hf_reply(model_dir, messages)
    response = respond(apps["plain"], input=QUESTION, instructions=INSTRUCTIONS, metadata={"run": "1"})
    chat = post(apps["plain"], "/v1/chat/completions", {"messages": messages, "temperature": 0}).json()
    assert response.output_text == chat["choices"][0]["message"]["content"] == expected
    assert response.id.startswith("resp_") and response.object == "response" and response.status == "completed"
    assert (response.instructions, response.metadata, response.model) == (INSTRUCTIONS, {"run": "1"},
                                                                          chat["model"])
    usage = response.usage
    assert (usage.input_tokens, usage.output_tokens) == (len(prompt), chat["usage"]["completion_tokens"])
    assert usage.total_tokens == usage.input_tokens + usage.output_tokens


def test_input_items_render_as_the_chat_messages_they_stand_for(apps, model_dir, caplog):
    """input_text parts, a developer message, an earlier turn's reasoning, message and
    function call (one assistant turn), and the call's output (a tool message): the prompt
    is transformers' rendering of those chat messages with the same template (and the
    reasoning effort as the template's `reasoning_effort`)."""
    from transformers import AutoTokenizer

    arguments = '{"city": "Paris"}'
    items_in = [
        {"type": "message", "role": "developer", "content": "Be brief."},
        {"role": "user", "content": [{"type": "input_text", "text": QUESTION}]},
        {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": "Hmm."}]},
        {"type": "message", "role": "assistant", "id": "msg_1", "status": "completed",
         "content": [{"type": "output_text", "text": "Let me look.", "annotations": []}]},
        {"type": "function_call", "call_id": "call_7", "name": "pick_city", "arguments": arguments},
        {"type": "function_call_output", "call_id": "call_7", "output": "Paris it is."},
    ]
    with caplog.at_level(logging.INFO, logger="raylm.deploy.request_logger"):
        respond(apps["history"], input=items_in, instructions=INSTRUCTIONS, reasoning={"effort": "low"},
                max_output_tokens=1)
    (line,) = [r.getMessage() for r in caplog.records if "Received request" in r.getMessage()]
    messages = [{"role": "system", "content": INSTRUCTIONS}, {"role": "developer", "content": "Be brief."},
                {"role": "user", "content": QUESTION},
                {"role": "assistant", "content": "Let me look.", "reasoning_content": "Hmm.",
                 "tool_calls": [{"id": "call_7", "type": "function",
                                 "function": {"name": "pick_city", "arguments": json.loads(arguments)}}]},
                {"role": "tool", "tool_call_id": "call_7", "content": "Paris it is."}]
    expected = AutoTokenizer.from_pretrained(str(model_dir)).apply_chat_template(
        messages, chat_template=HISTORY_TEMPLATE, add_generation_prompt=True, tokenize=False, reasoning_effort="low")
    assert "[effort: low]" in expected
    assert f"prompt: {expected!r}," in line


@pytest.mark.parametrize("streamed", [False, True])
def test_tool_call_comes_back_as_a_function_call_item_after_the_reasoning(apps, streamed):
    body = {"input": QUESTION, "tools": [TOOL]}
    if streamed:
        response = stream(apps["tools"], **body)[-1].response
    else:
        response = respond(apps["tools"], **body)
    chat = post(apps["tools"], "/v1/chat/completions", {"messages": [{"role": "user", "content": QUESTION}],
                                                         "tools": [CHAT_TOOL], "temperature": 0}).json()
    (chat_call,) = chat["choices"][0]["message"]["tool_calls"]
    assert items(response) == [("reasoning", "completed", [REASONING]),
                               ("function_call", "completed", "pick_city", chat_call["function"]["arguments"])]
    assert json.loads(response.output[1].arguments) == {"city": "Paris"}
    assert response.output[1].call_id
    assert response.usage.output_tokens_details.reasoning_tokens == \
        chat["usage"]["completion_tokens_details"]["reasoning_tokens"] > 0
    assert response.tools[0].name == "pick_city" and response.tool_choice == "auto"


@pytest.mark.parametrize("choice", ["required", {"type": "function", "name": "pick_city"}])
def test_forced_tool_choice_is_one_function_call_with_valid_arguments(apps, choice):
    """tool_choice "required" or a named function constrains the reply (no parser needed):
    one function_call item whose arguments the tool's schema accepts, as chat returns it."""
    # parallel_tool_calls false: at most one call (the tiny model would repeat it).
    response = respond(apps["plain"], input=QUESTION, tools=[TOOL], tool_choice=choice, parallel_tool_calls=False,
                       max_output_tokens=60)
    chat_choice = choice if isinstance(choice, str) else {"type": "function", "function": {"name": "pick_city"}}
    chat = post(apps["plain"], "/v1/chat/completions", {
        "messages": [{"role": "user", "content": QUESTION}], "tools": [CHAT_TOOL], "tool_choice": chat_choice,
        "parallel_tool_calls": False, "temperature": 0, "max_completion_tokens": 60}).json()
    calls = [(call.type, call.name, call.arguments) for call in response.output]
    assert calls == [("function_call", c["function"]["name"], c["function"]["arguments"])
                     for c in chat["choices"][0]["message"]["tool_calls"]]
    assert len(calls) == 1
    for _, name, arguments in calls:
        assert name == "pick_city"
        jsonschema.validate(json.loads(arguments), TOOL["parameters"])
    assert response.status == "completed"


@pytest.mark.parametrize("app,body", [
    ("plain", {}),  # one message
    ("tools", {}),  # the reasoning, then a message (no tools: the call is text)
    ("tools", {"tools": [TOOL]}),  # the reasoning, then a function call
    ("hermes", {"tools": [TOOL]}),  # a message (the <think> text), then a function call
    ("tools", {"max_output_tokens": 3}),  # cut while reasoning
    ("tools", {"max_output_tokens": 1}),  # only "<think>": no text at all, an empty message
    ("plain", {"tools": [TOOL], "tool_choice": {"type": "function", "name": "pick_city"}}),  # a forced call
])
def test_stream_adds_up_to_the_unstreamed_response(apps, app, body):
    unstreamed = respond(apps[app], input=QUESTION, **body)
    events = stream(apps[app], input=QUESTION, **body)
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert [e.type for e in events[:2]] == ["response.created", "response.in_progress"]
    final = events[-1]
    assert final.type == f"response.{unstreamed.status}"
    assert items(final.response) == items(unstreamed)
    # The same but for the prefix-cache hits: the stream came second and found the prompt cached.
    cached = final.response.usage.input_tokens_details
    assert final.response.usage.model_copy(update={"input_tokens_details": unstreamed.usage.input_tokens_details}) \
        == unstreamed.usage
    assert cached.cached_tokens == final.response.usage.input_tokens // 16 * 16 - \
        (16 if final.response.usage.input_tokens % 16 == 0 else 0)
    # Each item: added, its deltas, their .done with the whole text, then output_item.done.
    deltas: dict[str, str] = {}
    for event in events:
        if event.type.endswith(".delta"):
            deltas[event.item_id] = deltas.get(event.item_id, "") + event.delta
    done = [e.item for e in events if e.type == "response.output_item.done"]
    added = [e.item.id for e in events if e.type == "response.output_item.added"]
    assert [item.id for item in done] == added == [item.id for item in final.response.output]
    for item in done:
        text = item.arguments if item.type == "function_call" else item.content[0].text
        assert deltas.get(item.id, "") == text
    assert sum(e.type.endswith(".done") and e.type != "response.output_item.done" for e in events) >= len(done)


@pytest.mark.parametrize("body", [{}, {"tools": [TOOL]}])
def test_openai_clients_stream_helper_rebuilds_the_unstreamed_response(apps, model_dir, body):
    """The openai package's own client: `responses.create`, and `responses.stream`, whose
    accumulator rebuilds the response from the events by their indices (and raises on an
    event out of place); its final response is the unstreamed one, ids aside."""
    import openai

    async def both() -> tuple[Response, Response]:
        transport = httpx.ASGITransport(app=apps["tools"])
        async with httpx.AsyncClient(transport=transport, base_url="http://test/v1", timeout=60) as http:
            client = openai.AsyncOpenAI(base_url="http://test/v1", api_key="unused", http_client=http,
                                        max_retries=0)
            created = await client.responses.create(model=model_dir.name, input=QUESTION, temperature=0, **body)
            async with client.responses.stream(model=model_dir.name, input=QUESTION, temperature=0, **body) as events:
                final = await events.get_final_response()
        return created, final

    created, final = CLIENT.run(both())
    assert items(final) == items(created)
    assert final.output_text == created.output_text


@pytest.mark.parametrize("streamed", [False, True])
def test_reply_cut_by_max_output_tokens_is_incomplete(apps, model_dir, streamed):
    _, expected = hf_reply(model_dir, [{"role": "user", "content": QUESTION}], max_new_tokens=2)
    body = {"input": QUESTION, "max_output_tokens": 2}
    response = stream(apps["plain"], **body)[-1].response if streamed else respond(apps["plain"], **body)
    assert (response.status, response.incomplete_details.reason) == ("incomplete", "max_output_tokens")
    assert response.output_text == expected and response.output[-1].status == "incomplete"
    assert response.usage.output_tokens == 2


def test_json_schema_format_constrains_the_text_as_chat_response_format_does(apps):
    schema = {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}}, "required": ["city"],
              "additionalProperties": False}
    response = respond(apps["plain"], input=QUESTION, max_output_tokens=40,
                       text={"format": {"type": "json_schema", "name": "city", "schema": schema, "strict": True}})
    chat = post(apps["plain"], "/v1/chat/completions", {
        "messages": [{"role": "user", "content": QUESTION}], "temperature": 0, "max_completion_tokens": 40,
        "response_format": {"type": "json_schema", "json_schema": {"name": "city", "schema": schema,
                                                                   "strict": True}}}).json()
    assert response.output_text == chat["choices"][0]["message"]["content"]
    assert response.status == "completed"
    jsonschema.validate(json.loads(response.output_text), schema)
    assert response.text.format.type == "json_schema"


@pytest.mark.parametrize("body,status,param", [
    ({"input": []}, 400, "input"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, 400, "input"),
    ({"input": [{"type": {}, "content": []}]}, 400, "input"),  # schemathesis found this a 500
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, 400, "input"),
    ({"tools": [{"type": "web_search"}]}, 400, "tools"),
    ({"tools": [TOOL], "tool_choice": {"type": "function", "name": "other"}}, 400, "tool_choice"),
    ({"tool_choice": "required"}, 400, "tool_choice"),
    ({"max_output_tokens": 0}, 400, "max_output_tokens"),
    ({"max_output_tokens": 10_000}, 400, "max_output_tokens"),
    ({"temperature": -1}, 400, "temperature"),
    ({"text": {"format": {"type": "json_schema", "name": "x"}}}, 400, "text.format"),
    ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "nonsense"}}}}, 400,
     "text.format"),
    ({"background": True}, 400, "background"),
    ({"truncation": "auto"}, 400, "truncation"),
    ({"previous_response_id": "resp_123"}, 404, "previous_response_id"),
    ({"model": "other"}, 404, "model"),
    ({"metadata": {f"k{i}": "v" for i in range(17)}}, 400, "metadata"),
    ({"input": [{"type": "function_call_output", "call_id": "c", "output": [{"type": "input_file"}]}]}, 400,
     "input"),
])
def test_bad_request_is_refused_naming_the_field(apps, body, status, param):
    reply = post(apps["plain"], "/v1/responses", {"input": QUESTION, **body})
    assert reply.status_code == status, reply.text
    error = reply.json()["error"]
    assert error["param"] == param, error
    assert error["message"]


@pytest.mark.parametrize("words", [3_000, 300])  # past --max-prompt-chars; past the context, in tokens
def test_a_prompt_too_long_is_named_input_in_the_message_too(apps, words):
    reply = post(apps["plain"], "/v1/responses", {"input": "word " * words})
    error = reply.json()["error"]
    assert reply.status_code == 400 and error["param"] == "input", error
    assert "input has" in error["message"] and "messages" not in error["message"], error


def test_nulls_stand_for_the_defaults(apps):
    nulls = {name: None for name in ("tools", "tool_choice", "parallel_tool_calls", "store", "background",
                                     "truncation", "text", "reasoning", "metadata", "top_p")}
    response = respond(apps["plain"], input=QUESTION, max_output_tokens=2, **nulls)
    assert (response.tools, response.tool_choice, response.parallel_tool_calls, response.truncation) == \
        ([], "auto", True, "disabled")
    assert response.output_text == respond(apps["plain"], input=QUESTION, max_output_tokens=2).output_text


def test_store_is_accepted_and_nothing_is_stored_as_in_vllm(apps):
    response = respond(apps["plain"], input=QUESTION, store=True, max_output_tokens=1)
    assert response.store is False
    again = post(apps["plain"], "/v1/responses", {"input": QUESTION, "previous_response_id": response.id})
    assert again.status_code == 404 and response.id in again.json()["error"]["message"]


def test_a_failure_after_the_stream_began_is_an_error_event():
    """The chat stream's error body (what it sends when the engine fails mid-reply) becomes
    OpenAI's `error` event, after the text so far, and ends the stream."""
    from raylm.deploy.errors import error_body
    from raylm.deploy.protocol import ChatCompletionResponseStreamChoice, ChatCompletionStreamResponse, DeltaMessage
    from raylm.deploy.protocol_responses import ResponsesRequest
    from raylm.deploy.serving_engine import SSE_DONE, sse
    from raylm.deploy.serving_responses import ResponseEventStream

    async def chat_chunks():
        yield sse(ChatCompletionStreamResponse(id="c", created=0, model="m", choices=[
            ChatCompletionResponseStreamChoice(index=0, delta=DeltaMessage(role="assistant", content="Hi"))]))
        yield sse(error_body("The prompt is bad.", 400, "messages"))
        yield SSE_DONE

    async def translated() -> list[str]:
        events = ResponseEventStream(ResponsesRequest(input="x"), "resp_1", 0, "m")
        return [chunk async for chunk in events.translate(chat_chunks())]

    events = [EVENTS.validate_python(json.loads(block.split("\ndata: ")[1])) for block in CLIENT.run(translated())]
    assert [e.type for e in events] == ["response.created", "response.in_progress", "response.output_item.added",
                                        "response.content_part.added", "response.output_text.delta", "error"]
    assert (events[-1].message, events[-1].param) == ("The prompt is bad.", "input")


def test_ray_serve_router_keys_a_response_as_its_chat_request(model_dir):
    """The prefix-aware router (--ray-serve) keys /v1/responses by the prompt its chat
    request renders: the same key as the chat body with those messages and tools."""
    from transformers import AutoTokenizer

    from raylm.deploy.prefix_key import CHAT_ROUTE, RESPONSES_ROUTE, PrefixKeyer

    keyer = PrefixKeyer(AutoTokenizer.from_pretrained(str(model_dir)), 16, max_blocks=64)
    body = {"input": [{"role": "user", "content": [{"type": "input_text", "text": QUESTION}]}],
            "instructions": INSTRUCTIONS, "tools": [TOOL]}
    chat = {"messages": [{"role": "system", "content": INSTRUCTIONS},
                         {"role": "user", "content": [{"type": "text", "text": QUESTION}]}], "tools": [CHAT_TOOL]}
    key = keyer.key(RESPONSES_ROUTE, json.dumps(body).encode())
    assert key is not None and key.num_tokens >= 16
    assert key == keyer.key(CHAT_ROUTE, json.dumps(chat).encode())
    assert key != keyer.key(RESPONSES_ROUTE, json.dumps({**body, "instructions": "Other."}).encode())


def test_usage_reports_the_prompts_prefix_cache_hits(apps):
    """The same input twice: the second finds every full 16-token block of its prompt
    cached (OpenAI's input_tokens_details.cached_tokens), streamed or not."""
    text = "Explain how prefix caching reuses the keys and values of a shared prompt, in detail."
    first, second = (respond(apps["plain"], input=text, instructions="Be brief.", max_output_tokens=2)
                     for _ in range(2))
    prompt_len = first.usage.input_tokens
    assert prompt_len > 32 and prompt_len % 16
    assert first.usage.input_tokens_details.cached_tokens == 0
    assert second.usage.input_tokens_details.cached_tokens == prompt_len // 16 * 16
    events = stream(apps["plain"], input=text, instructions="Be brief.", max_output_tokens=2)
    assert events[-1].response.usage.input_tokens_details.cached_tokens == prompt_len // 16 * 16


def test_no_kv_blocks_are_left_after_the_requests(engine, apps):
    stream(apps["tools"], input=QUESTION, max_output_tokens=3)
    assert_async_engine_idle(engine)
