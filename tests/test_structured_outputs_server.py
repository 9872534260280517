"""Structured outputs and tool calls over HTTP, on real `raylm serve` processes and the
openai client: response_format, vLLM's structured_outputs and guided_* fields on chat and
completions (streamed and not, temperature 0 and 1, n=3), tools with every tool_choice,
and bad input (each a 400 naming its field, the server serving on), fuzzer-made and deeply
nested schemas, a compile past its deadline, and the compile worker's death (a 503)."""

from __future__ import annotations

import concurrent.futures
import itertools
import json
import os
import re
import signal
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import jsonschema
import openai
import pytest
import xgrammar as xgr
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers import AutoTokenizer

from raylm.cluster.benchmarks.bench_grammar_compile import WEATHER_SCHEMA

from process_tree import children, cpu_seconds
from server_process import start_servers, stop_server

MODEL = "tiny"
# A chat template of our own, in the Hermes / Qwen 2.5 style: the tools go into a system
# turn, assistant tool calls are written as <tool_call> JSON, tool answers as their turn.
# (The tiny model's context is 256 tokens: the tools are named, not written out in full.)
TOOL_TEMPLATE = """\
{%- if tools %}<|system|>
Tools:{% for tool in tools %} {{ tool.function.name }}{% endfor %}<|end|>
{% endif %}
{%- for message in messages %}
{%- if message.role == "assistant" and message.tool_calls %}<|assistant|>
{%- for call in message.tool_calls %}
<tool_call>
{"name": {{ call.function.name | tojson }}, "arguments": {{ call.function.arguments | tojson }}}
</tool_call>
{%- endfor %}<|end|>
{% elif message.role == "tool" %}<|tool|>
<tool_response>
{{ message.content }}
</tool_response><|end|>
{% else %}<|{{ message.role }}|>
{{ message.content }}<|end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|assistant|>
{% endif %}"""

SCHEMA = WEATHER_SCHEMA
WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]},
                                                    "days": {"type": "integer", "minimum": 1, "maximum": 3}},
                   "required": ["city", "days"]}}}
TIME_TOOL = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {"tz": {"enum": ["UTC", "CET"]}},
                                       "required": ["tz"]}}}
TOOLS = [WEATHER_TOOL, TIME_TOOL]
USER = [{"role": "user", "content": "What is the weather in Paris?"}]


# The plain server's limits: grammars get 0.5 s to compile (the tiny vocabulary's take
# milliseconds), and schemas may nest deep enough for one to take seconds.
COMPILE_SECONDS = 0.5
MAX_DEPTH = 900


@pytest.fixture(scope="module")
def servers(llama_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    """A plain server (no tool parser) and one with tools (`--enable-auto-tool-choice
    --tool-call-parser hermes` and the template above)."""
    root = tmp_path_factory.mktemp("structured_server")
    template = root / "tool_template.jinja"
    template.write_text(TOOL_TEMPLATE)
    common = [str(llama_dir), "--served-model-name", MODEL, "--max-model-len", "256"]
    started = start_servers([
        (common + ["--max-grammar-compile-seconds", str(COMPILE_SECONDS), "--max-json-schema-depth", str(MAX_DEPTH)],
         root / "plain.log"),
        (common + ["--enable-auto-tool-choice", "--tool-call-parser", "hermes", "--chat-template", str(template)],
         root / "tools.log")])
    try:
        yield {"plain": started[0][1], "tools": started[1][1], "tools_pid": started[1][0].pid}
    finally:
        for process, _ in started:
            process.terminate()
        for process, _ in started:
            stop_server(process)


def _client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def plain(servers) -> openai.OpenAI:
    return _client(servers["plain"])


@pytest.fixture(scope="module")
def tools_client(servers) -> openai.OpenAI:
    return _client(servers["tools"])


@pytest.fixture(scope="module")
def compiler(llama_dir: Path) -> xgr.GrammarCompiler:
    tokenizer = AutoTokenizer.from_pretrained(str(llama_dir))
    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=512, stop_token_ids=[2])
    return xgr.GrammarCompiler(info, cache_enabled=False)


def _check_text(text: str, finish_reason: str, validate, grammar: xgr.CompiledGrammar) -> bool:
    """A finished answer validates; one cut by max_tokens is a prefix the grammar accepts."""
    if finish_reason == "stop":
        validate(text)
        return True
    assert finish_reason == "length"
    matcher = xgr.GrammarMatcher(grammar)
    assert matcher.accept_string(text), text
    return False


def _chat(client: openai.OpenAI, stream: bool, **kwargs) -> list[tuple[str, str]]:
    """(text, finish_reason) per choice, streamed or not."""
    if not stream:
        response = client.chat.completions.create(model=MODEL, messages=USER, **kwargs)
        return [(c.message.content, c.finish_reason) for c in sorted(response.choices, key=lambda c: c.index)]
    texts: dict[int, str] = {}
    reasons: dict[int, str] = {}
    for chunk in client.chat.completions.create(model=MODEL, messages=USER, stream=True, **kwargs):
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + (choice.delta.content or "")
            if choice.finish_reason:
                reasons[choice.index] = choice.finish_reason
    return [(texts[i], reasons[i]) for i in sorted(texts)]


def _complete(client: openai.OpenAI, stream: bool, **kwargs) -> list[tuple[str, str]]:
    if "response_format" in kwargs:  # vLLM's field on completions; the openai client has it for chat only
        kwargs["extra_body"] = {**kwargs.get("extra_body", {}), "response_format": kwargs.pop("response_format")}
    if not stream:
        response = client.completions.create(model=MODEL, prompt="Weather report as JSON:", **kwargs)
        return [(c.text, c.finish_reason) for c in sorted(response.choices, key=lambda c: c.index)]
    texts: dict[int, str] = {}
    reasons: dict[int, str] = {}
    for chunk in client.completions.create(model=MODEL, prompt="Weather report as JSON:", stream=True, **kwargs):
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + choice.text
            if choice.finish_reason:
                reasons[choice.index] = choice.finish_reason
    return [(texts[i], reasons[i]) for i in sorted(texts)]


@pytest.mark.parametrize("route", ["chat", "completions"])
@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_json_schema_answers_validate(plain: openai.OpenAI, compiler, route: str, stream: bool,
                                      temperature: float) -> None:
    grammar = compiler.compile_json_schema(json.dumps(SCHEMA), max_whitespace_cnt=20)
    n = 1 if temperature == 0.0 else 3
    response_format = {"type": "json_schema", "json_schema": {"name": "weather", "schema": SCHEMA, "strict": True}}
    call = _chat if route == "chat" else _complete
    answers = call(plain, stream, max_tokens=200, temperature=temperature, n=n, seed=4,
                   response_format=response_format)
    assert len(answers) == n
    finished = [_check_text(text, reason, lambda t: jsonschema.validate(json.loads(t), SCHEMA), grammar)
                for text, reason in answers]
    assert any(finished) or n == 1


@pytest.mark.parametrize("stream", [False, True])
def test_vllm_fields_constrain_chat_and_completions(plain: openai.OpenAI, stream: bool) -> None:
    cases = [
        ({"structured_outputs": {"regex": r"[A-Z][a-z]{2,5} \d{1,2}"}},
         lambda t: re.fullmatch(r"[A-Z][a-z]{2,5} \d{1,2}", t)),
        ({"guided_regex": r"(ab|cd){2,3}!"}, lambda t: re.fullmatch(r"(ab|cd){2,3}!", t)),
        ({"structured_outputs": {"choice": ["sunny", "rainy", "a \"storm\""]}},
         lambda t: t in ("sunny", "rainy", 'a "storm"')),
        ({"guided_choice": ["yes", "no"]}, lambda t: t in ("yes", "no")),
        ({"structured_outputs": {"grammar": 'root ::= "t=" [0-9] [0-9]? "C"'}},
         lambda t: re.fullmatch(r"t=[0-9][0-9]?C", t)),
        ({"guided_grammar": 'start: "x" ("," "x")*'}, lambda t: re.fullmatch(r"x(,x)*", t)),
        ({"guided_json": SCHEMA}, lambda t: jsonschema.validate(json.loads(t), SCHEMA) is None),
        ({"structured_outputs": {"json": json.dumps(SCHEMA), "disable_any_whitespace": True}},
         lambda t: t == json.dumps(json.loads(t)) and jsonschema.validate(json.loads(t), SCHEMA) is None),
        ({"response_format": {"type": "json_object"}}, lambda t: isinstance(json.loads(t), dict)),
    ]
    for extra_body, matches in cases:
        for call in (_chat, _complete):
            for text, reason in call(plain, stream, max_tokens=120, temperature=1.0, n=3, seed=9,
                                     extra_body=extra_body):
                assert reason == "length" or matches(text), (extra_body, text)


def _check_call(call, tools: list[dict]) -> None:
    """A tool call names one of the tools, has an id, and its arguments validate."""
    tool = next(t for t in tools if t["function"]["name"] == call.function.name)
    assert call.id and call.type == "function"
    jsonschema.validate(json.loads(call.function.arguments), tool["function"]["parameters"])


def _stream_tool_calls(client: openai.OpenAI, **kwargs) -> dict[int, tuple[str, list[dict], str]]:
    """Per choice of a streamed chat: its content, its tool calls put together from the
    deltas, and its finish_reason."""
    content: dict[int, str] = {}
    calls: dict[int, dict[int, dict]] = {}
    finish_reason: dict[int, str] = {}
    for chunk in client.chat.completions.create(model=MODEL, stream=True, **kwargs):
        for choice in chunk.choices:
            content[choice.index] = content.get(choice.index, "") + (choice.delta.content or "")
            own = calls.setdefault(choice.index, {})
            for delta in choice.delta.tool_calls or ():
                if delta.index not in own:
                    assert delta.id and delta.type == "function" and delta.function.name
                    own[delta.index] = {"id": delta.id, "name": delta.function.name, "arguments": ""}
                else:
                    assert delta.id is None and delta.function.name is None
                own[delta.index]["arguments"] += delta.function.arguments or ""
            if choice.finish_reason:
                finish_reason[choice.index] = choice.finish_reason
    return {index: (content[index], [calls[index][i] for i in sorted(calls[index])], finish_reason[index])
            for index in sorted(content)}


def _cut_replies(client: openai.OpenAI, text: str, ends: list[int], cuts: dict[str, int], kwargs: dict):
    """For each cut (a name -> max_tokens): the request unstreamed, after checking that its
    stream adds up to the same content, calls and finish_reason, which is "length". Yields
    (where, the cut text, the choice, its calls as (name, arguments))."""
    for where, max_tokens in cuts.items():
        cut = text[:ends[max_tokens]]
        response = client.chat.completions.create(model=MODEL, max_tokens=max_tokens, **kwargs).choices[0]
        calls = [(call.function.name, call.function.arguments) for call in response.message.tool_calls or ()]
        content, streamed, finish_reason = _stream_tool_calls(client, max_tokens=max_tokens, **kwargs)[0]
        assert (content, [(c["name"], c["arguments"]) for c in streamed], finish_reason) == \
            (response.message.content or "", calls, response.finish_reason), (where, cut)
        assert response.finish_reason == "length", (where, cut)
        yield where, cut, response, calls


def _calls(message) -> list[tuple[str, object]]:
    return [(call.function.name, json.loads(call.function.arguments)) for call in message.tool_calls]


def test_named_tool_choice_calls_that_function(tools_client: openai.OpenAI) -> None:
    named = {"type": "function", "function": {"name": "get_weather"}}
    kwargs = dict(messages=USER, tools=TOOLS, tool_choice=named, max_tokens=120, temperature=1.0, n=3, seed=1)
    response = tools_client.chat.completions.create(model=MODEL, **kwargs)
    for choice in response.choices:
        (call,) = choice.message.tool_calls
        assert call.function.name == "get_weather"
        if choice.finish_reason == "stop":  # vLLM's (and OpenAI's) reason for a named function
            _check_call(call, TOOLS)
    assert any(choice.finish_reason == "stop" for choice in response.choices)
    # Streamed with the same seed: the same calls, as deltas.
    streamed = _stream_tool_calls(tools_client, **kwargs)
    for choice in response.choices:
        content, calls, finish_reason = streamed[choice.index]
        assert content == "" and finish_reason == choice.finish_reason
        assert [(c["name"], c["arguments"]) for c in calls] == [
            (c.function.name, c.function.arguments) for c in choice.message.tool_calls]


def test_required_tool_choice_calls_one_or_more_tools(tools_client: openai.OpenAI) -> None:
    for parallel in (None, False):
        kwargs = dict(messages=USER, tools=TOOLS, tool_choice="required", max_tokens=160, temperature=1.0, n=4,
                      seed=3, parallel_tool_calls=parallel)
        response = tools_client.chat.completions.create(model=MODEL, **kwargs)
        called = [c for c in response.choices if c.finish_reason == "tool_calls"]
        assert called
        for choice in called:
            assert choice.message.tool_calls and choice.message.content is None
            for call in choice.message.tool_calls:
                _check_call(call, TOOLS)
            assert len({call.id for call in choice.message.tool_calls}) == len(choice.message.tool_calls)
            assert parallel is None or len(choice.message.tool_calls) == 1
        streamed = _stream_tool_calls(tools_client, **kwargs)
        for choice in called:
            content, calls, finish_reason = streamed[choice.index]
            assert content == "" and finish_reason == "tool_calls"
            assert [(c["name"], json.loads(c["arguments"])) for c in calls] == _calls(choice.message)


def _token_ids_of(llama_dir: Path, keep) -> list[int]:
    tokenizer = AutoTokenizer.from_pretrained(str(llama_dir))
    return [i for i in range(len(tokenizer)) if (text := tokenizer.decode([i])) and keep(text)]


# The reference for a "required" reply cut short: each call whose name and "parameters" key
# were written, with its arguments' text as far as it goes (the replies here are written
# without whitespace and their arguments are flat objects).
_CUT_CALL = re.compile(r'\{"name":"([^"]*)","parameters":(\{[^}]*\}?)?')


@pytest.mark.parametrize("choice", ["required", "named"])
def test_a_tool_call_reply_cut_by_max_tokens_streams_as_it_answers(tools_client: openai.OpenAI, llama_dir: Path,
                                                                   choice: str) -> None:
    """Cut by max_tokens inside a name, inside arguments or between calls, the streamed deltas
    add up to the message the same tokens give unstreamed: the calls written so far (the last
    with its arguments as far as they go), no content, finish_reason "length"."""
    # Greedy, without whitespace (the random model would write nothing else), and for
    # "required" never closing the list, so that the calls go on past any cut.
    banned = _token_ids_of(llama_dir, lambda text: not text.strip() or (choice == "required" and "]" in text))
    tool_choice = "required" if choice == "required" else {"type": "function", "function": {"name": "get_weather"}}
    kwargs = dict(messages=USER, tools=TOOLS, tool_choice=tool_choice, temperature=0.0,
                  logit_bias={str(token): -100 for token in banned})
    full = tools_client.chat.completions.create(model=MODEL, max_tokens=100, logprobs=True, **kwargs).choices[0]
    text, ends, tokens_to = _text_and_token_counts(full)

    if choice == "required":
        first_arguments = text.index('"parameters":') + len('"parameters":')
        first_end = text.index("},{") + 2
        second_name = text.index('"name":"', first_end) + len('"name":"')
        cuts = {"inside the first name": tokens_to(text.index('"name":"') + len('"name":"') + 2),
                "inside the first arguments": tokens_to(first_arguments + 3),
                "after the first call": tokens_to(first_end), "after its comma": tokens_to(first_end + 1),
                "inside the second name": tokens_to(second_name + 2),
                "inside the second arguments": tokens_to(text.index('"parameters":', second_name) + 16)}
    else:
        cuts = {"inside the arguments": tokens_to(3), "inside a value": tokens_to(text.index(":") + 3)}
    for where, cut, response, calls in _cut_replies(tools_client, text, ends, cuts, kwargs):
        if choice == "named":
            assert calls == [("get_weather", cut)] and response.message.content is None, (where, cut)
            continue
        expected = [(match[1], match[2] or "") for match in _CUT_CALL.finditer(cut)]
        if expected:
            assert calls == expected and response.message.content is None, (where, cut)
        else:  # no call named yet: the text is all there is
            assert not calls and response.message.content == cut, (where, cut)


@pytest.mark.parametrize("choice", ["required", "named", "auto"])
def test_n2_with_one_choice_cut_by_max_tokens_streams_as_it_answers(tools_client: openai.OpenAI, choice: str) -> None:
    """n=2, sampled with a seed: a max_tokens past the shorter reply's end and inside the
    longer one's last arguments cuts that one and leaves the other whole. Each choice's
    stream adds up to its unstreamed message, and each keeps its own finish_reason ("auto":
    Hermes replies of one or two calls, made so by a regex)."""
    tool_choice = {"required": "required", "auto": "auto"}.get(choice, {"type": "function",
                                                                        "function": {"name": "get_weather"}})
    whole_reason = "stop" if choice == "named" else "tool_calls"
    kwargs = dict(messages=USER, tools=TOOLS, tool_choice=tool_choice, temperature=1.0, n=2)
    if choice == "auto":
        kwargs["extra_body"] = {"structured_outputs": {"regex": HERMES_REPLY + f"({HERMES_SECOND_CALL})?"}}
    for seed in range(20):
        full = tools_client.chat.completions.create(model=MODEL, max_tokens=160, logprobs=True, seed=seed,
                                                    **kwargs).choices
        if any(c.finish_reason != whole_reason for c in full):
            continue
        short, long = sorted(full, key=lambda c: len(c.logprobs.content))
        tokens = [entry.token for entry in long.logprobs.content]
        ends = list(itertools.accumulate(len(token) for token in tokens))  # ends[k - 1]: k tokens' text
        arguments = long.message.tool_calls[-1].function.arguments
        start = "".join(tokens).rindex(arguments)
        max_tokens = next((k for k in range(len(short.logprobs.content) + 1, len(tokens))
                           if start < ends[k - 1] < start + len(arguments)), None)
        if max_tokens is not None:
            break
    else:
        pytest.fail("no seed gave a longer reply whose last arguments go on past the shorter one's end")
    response = tools_client.chat.completions.create(model=MODEL, max_tokens=max_tokens, seed=seed, **kwargs)
    reasons = {c.index: c.finish_reason for c in response.choices}
    assert reasons == {short.index: whole_reason, long.index: "length"}
    # The cut reply: the longer one's calls, the last with its arguments' text up to the cut.
    whole_calls = [(c.function.name, c.function.arguments) for c in long.message.tool_calls]
    cut = response.choices[long.index].message
    assert cut.content == long.message.content  # None, or for "auto" the text before the calls
    assert [(c.function.name, c.function.arguments) for c in cut.tool_calls] == \
        whole_calls[:-1] + [(whole_calls[-1][0], "".join(tokens)[start:ends[max_tokens - 1]])]
    assert _calls(response.choices[short.index].message) == _calls(short.message)
    streamed = _stream_tool_calls(tools_client, max_tokens=max_tokens, seed=seed, **kwargs)
    for answer in response.choices:
        content, calls, finish_reason = streamed[answer.index]
        assert (content, [(c["name"], c["arguments"]) for c in calls], finish_reason) == \
            (answer.message.content or "", [(c.function.name, c.function.arguments) for c in answer.message.tool_calls],
             answer.finish_reason), answer.index


# The model's reply for "auto", made to be a Hermes tool call by a regex (the random model
# would not write one by itself); the hermes parser finds the call in it. A second call may
# follow the first.
HERMES_CALL = (r'<tool_call>\n\{"name": "get_weather", "arguments": \{"city": "(Paris|Rome)", "days": [1-3]\}\}'
               r'\n</tool_call>')
HERMES_REPLY = r"(Let me check\. )?" + HERMES_CALL
HERMES_SECOND_CALL = r'\n<tool_call>\n\{"name": "get_time", "arguments": \{"tz": "(UTC|CET)"\}\}\n</tool_call>'
# The reference for a Hermes reply cut short: each call whose name and "arguments" key were
# written, with its arguments' text as far as it goes (the arguments here are flat objects).
_CUT_HERMES_CALL = re.compile(r'<tool_call>\n\{"name": "([^"]*)", "arguments":(?: (\{[^}]*\}?)?)?')


def test_auto_reply_cut_by_max_tokens_streams_as_it_answers(tools_client: openai.OpenAI) -> None:
    """tool_choice "auto" with the hermes parser, cut by max_tokens in the content, in a
    tag, a name or arguments, between calls, inside the last closing tag and right after it
    (the calls whole, the reply not ended): the streamed
    deltas add up to the message the same tokens give unstreamed, which is the calls whose
    name was written (the last with its arguments as far as they go) after the content
    before them, or, cut before any name, the text as content; finish_reason "length"."""
    kwargs = dict(messages=USER, tools=TOOLS, tool_choice="auto", temperature=0.0,
                  extra_body={"structured_outputs": {"regex": r"Let me check\. " + HERMES_CALL + HERMES_SECOND_CALL}})
    full = tools_client.chat.completions.create(model=MODEL, max_tokens=180, logprobs=True, **kwargs).choices[0]
    assert full.finish_reason == "tool_calls" and [c.function.name for c in full.message.tool_calls] == \
        ["get_weather", "get_time"]
    text, ends, tokens_to = _text_and_token_counts(full)

    first_tag, first_end = text.index("<tool_call>"), text.index("</tool_call>") + len("</tool_call>")
    second_tag = text.index("<tool_call>", first_end)
    cuts = {"inside the content": tokens_to(len("Let me")), "inside the first tag": tokens_to(first_tag + 5),
            "after the first tag": tokens_to(first_tag + len("<tool_call>\n")),
            "inside the first name": tokens_to(text.index('"name": "') + len('"name": "') + 3),
            "inside the first arguments": tokens_to(text.index('"arguments": ') + len('"arguments": ') + 5),
            "after the first call": tokens_to(first_end), "inside the second tag": tokens_to(second_tag + 5),
            "inside the second name": tokens_to(text.index('"name": "', second_tag) + len('"name": "') + 3),
            "inside the second arguments": tokens_to(text.index('"tz"', second_tag) + 2),
            "inside the last closing tag": tokens_to(text.rindex("</tool_call>") + 5),
            "after the last call, before the end of the reply": len(ends) - 2}  # the last token: </s>
    assert text[:ends[-2]].endswith("</tool_call>"), text
    for where, cut, response, calls in _cut_replies(tools_client, text, ends, cuts, kwargs):
        expected = [(match[1], match[2] or "") for match in _CUT_HERMES_CALL.finditer(cut)]
        assert calls == expected, (where, cut)
        assert response.message.content == ("Let me check. " if expected else cut), (where, cut)


def test_auto_tool_choice_parses_the_models_calls(tools_client: openai.OpenAI) -> None:
    response = tools_client.chat.completions.create(model=MODEL, messages=USER, tools=TOOLS, max_tokens=120,
                                                    temperature=1.0, n=3, seed=5,
                                                    extra_body={"structured_outputs": {"regex": HERMES_REPLY}})
    for choice in response.choices:
        assert choice.finish_reason == "tool_calls"
        assert choice.message.content in (None, "Let me check. ")
        (call,) = choice.message.tool_calls
        _check_call(call, TOOLS)
    content, calls, finish_reason = _stream_tool_calls(
        tools_client, messages=USER, tools=TOOLS, tool_choice="auto", max_tokens=120, temperature=0.0,
        extra_body={"structured_outputs": {"regex": HERMES_REPLY}})[0]
    assert finish_reason == "tool_calls" and content in ("", "Let me check. ")
    assert [c["name"] for c in calls] == ["get_weather"]
    jsonschema.validate(json.loads(calls[0]["arguments"]), WEATHER_TOOL["function"]["parameters"])
    # A reply without a call is content, finished as usual.
    plain_reply = tools_client.chat.completions.create(model=MODEL, messages=USER, tools=TOOLS, max_tokens=20,
                                                       extra_body={"guided_choice": ["It is sunny."]})
    choice = plain_reply.choices[0]
    assert choice.message.content == "It is sunny." and not choice.message.tool_calls
    assert choice.finish_reason == "stop"


def test_streamed_tool_calls_carry_every_token_id_held_back_text_included(servers) -> None:
    """With return_token_ids, a chunk whose text the hermes parser holds back (it may start
    a call) still goes out, with an empty delta and its token ids, as vLLM's do: the streamed
    ids are the whole reply's, as the non-streamed choice has them."""
    body = {"model": MODEL, "messages": USER, "tools": TOOLS, "max_tokens": 120, "temperature": 0.0,
            "structured_outputs": {"regex": HERMES_REPLY}, "return_token_ids": True}
    url = f"{servers['tools']}/v1/chat/completions"
    whole = httpx.post(url, json=body, timeout=120).json()
    (choice,) = whole["choices"]
    assert choice["finish_reason"] == "tool_calls" and len(choice["token_ids"]) > 10
    streamed_ids: list[int] = []
    with httpx.stream("POST", url, json={**body, "stream": True}, timeout=120) as response:
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                for chunk_choice in json.loads(line[6:])["choices"]:
                    streamed_ids += chunk_choice["token_ids"] or []
    assert streamed_ids == choice["token_ids"]


def test_tools_and_tool_calls_go_through_the_chat_template(tools_client: openai.OpenAI, llama_dir: Path) -> None:
    """The prompt the server builds is the template's rendering of the tools and of a
    conversation holding an assistant's tool call and the tool's answer."""
    tokenizer = AutoTokenizer.from_pretrained(str(llama_dir))
    arguments = '{"city": "Paris", "days": 2}'
    messages = USER + [
        {"role": "assistant", "content": None,
         "tool_calls": [{"id": "call_1", "type": "function",
                         "function": {"name": "get_weather", "arguments": arguments}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "22 C, sunny"}]
    response = tools_client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, tool_choice="none",
                                                    max_tokens=2)
    template_messages = [USER[0], {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": json.loads(arguments)}}]},
        {"role": "tool", "content": "22 C, sunny", "tool_call_id": "call_1"}]
    expected = tokenizer.apply_chat_template(template_messages, chat_template=TOOL_TEMPLATE, tools=TOOLS,
                                             tokenize=False, add_generation_prompt=True)
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}' in expected
    assert "Tools: get_weather get_time" in expected
    assert response.usage.prompt_tokens == len(tokenizer.encode(expected, add_special_tokens=False))
    # tool_choice "none": the reply is text, never parsed into calls.
    assert response.choices[0].message.tool_calls in (None, [])


# ------------------------------------------------------------------ bad input
def _post(url: str, route: str, body: dict) -> httpx.Response:
    base = {"model": MODEL, "max_tokens": 4}
    if route == "chat":
        base["messages"] = USER
    else:
        base["prompt"] = "hi"
    return httpx.post(f"{url}/v1/{route}/completions" if route == "chat" else f"{url}/v1/completions",
                      json={**base, **body}, timeout=60)


def _nested(depth: int) -> dict:
    schema: dict = {"type": "integer"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}, "required": ["a"]}
    return schema


# vLLM's legacy structural tag: free text until the trigger "<", then <weather>{...}</weather>.
LEGACY_TAG = {"type": "structural_tag", "triggers": ["<"],
              "structures": [{"begin": "<weather>", "schema": WEATHER_TOOL["function"]["parameters"],
                              "end": "</weather>"}]}

BAD_REQUESTS = [
    ("chat", {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "foo"}}}},
     "response_format", "Unsupported type"),
    ("completions", {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format",
     "needs json_schema.schema"),
    ("chat", {"structured_outputs": {"regex": "(unclosed"}}, "structured_outputs", "parenthesis"),
    ("completions", {"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs", "exactly one"),
    ("completions", {"structured_outputs": {"regex": "a", "colour": "red"}}, "structured_outputs", "colour"),
    ("chat", {"guided_grammar": "root ::= missing"}, "guided_grammar", "not defined"),
    ("completions", {"guided_json": '{"type": '}, "guided_json", "not valid JSON"),
    ("completions", {"guided_choice": []}, "guided_choice", "non-empty"),
    ("chat", {"guided_regex": "a+", "response_format": {"type": "json_object"}}, "guided_regex", "cannot be combined"),
    ("chat", {"response_format": {"type": "json_schema",
                                  "json_schema": {"name": "x", "schema": _nested(MAX_DEPTH // 2 + 1)}}},
     "response_format", "--max-json-schema-depth"),
    ("completions", {"guided_regex": "a" * 70000}, "guided_regex", "--max-structured-output-chars"),
    ("chat", {"tools": TOOLS}, "tool_choice", "--enable-auto-tool-choice"),
    ("chat", {"tools": TOOLS, "tool_choice": "auto"}, "tool_choice", "--enable-auto-tool-choice"),
    ("chat", {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice",
     "'nope'"),
    ("chat", {"tool_choice": "required"}, "tool_choice", "needs `tools`"),
    ("chat", {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "foo"}}}],
              "tool_choice": "required"}, "tools", "Unsupported type"),
    ("chat", {"tools": TOOLS, "tool_choice": "required", "guided_regex": "a"}, "tool_choice", "cannot be combined"),
    ("chat", {"tools": [WEATHER_TOOL] * 200, "tool_choice": "none"}, "tools", "--max-tools"),
    # A call names its function only: OpenAI refuses a name given twice, whatever tool_choice.
    ("chat", {"tools": [WEATHER_TOOL, TIME_TOOL, WEATHER_TOOL], "tool_choice": "none"}, "tools",
     "'get_weather' twice (tools[0] and tools[2])"),
    ("chat", {"tools": [TIME_TOOL, {"type": "function", "function": {"name": "get_time"}}], "tool_choice": "required"},
     "tools", "'get_time' twice"),
    # A string is no list of choices (its characters were taken for them).
    ("completions", {"structured_outputs": {"choice": "yes"}}, "structured_outputs", "non-empty list of strings"),
    # Empty strings weigh nothing as characters but each is an alternative of the grammar.
    ("completions", {"structured_outputs": {"choice": [""] * 40000}}, "structured_outputs",
     "--max-structured-output-chars"),
    ("completions", {"structured_outputs": {"json_object": True, "disable_any_whitespace": "yes"}},
     "structured_outputs", "true or false"),
    # Grammars with no finite sentence: refused before the request starts.
    ("completions", {"structured_outputs": {"json": {"$ref": "#"}}}, "structured_outputs", "allows no output"),
    ("chat", {"guided_grammar": 'root ::= root "a"'}, "guided_grammar", "allows no output"),
    ("chat", {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"$defs": [1]}}}],
              "tool_choice": "required"}, "tools", "$defs of function 'f' must be an object"),
    # vLLM's legacy structural tag, in response_format or structured_outputs: checked before it compiles.
    ("completions", {"structured_outputs": {"structural_tag": {**LEGACY_TAG, "triggers": []}}}, "structured_outputs",
     "structural_tag.triggers must be a non-empty list"),
    ("chat", {"response_format": {**LEGACY_TAG, "triggers": ["<tool"]}}, "response_format",
     "structures[0].begin '<weather>' must start with exactly one of the triggers"),
    ("chat", {"response_format": {**LEGACY_TAG, "structures": [{"begin": "<w>", "end": "</w>"}]}}, "response_format",
     "missing: schema"),
    ("completions", {"response_format": {**LEGACY_TAG, "structures": [
        {"begin": "<w>", "schema": {"type": "foo"}, "end": "</w>"}]}}, "response_format", "Unsupported type"),
    ("chat", {"response_format": {**LEGACY_TAG, "format": {"type": "any_text"}}}, "response_format", "not both"),
    ("chat", {"response_format": {"type": "structural_tag"}}, "response_format", "needs format, or structures"),
    ("completions", {"structured_outputs": {"structural_tag": json.dumps(
        {**LEGACY_TAG, "structures": [{"begin": "<" + "w" * 70000, "schema": {}, "end": ""}]})}},
     "structured_outputs", "--max-structured-output-chars"),
    ("chat", {"response_format": {**LEGACY_TAG, "structures": [{"begin": "<w>", "schema": _nested(MAX_DEPTH // 2),
                                                                 "end": "</w>"}]}},
     "response_format", "--max-json-schema-depth"),
]


@pytest.mark.parametrize("route, body, param, message", BAD_REQUESTS)
def test_bad_constraint_is_a_400_naming_its_field(servers, plain: openai.OpenAI, route: str, body: dict, param: str,
                                                  message: str) -> None:
    response = _post(servers["plain"], route, body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and message in error["message"], error
    # The server goes on serving, constrained requests too.
    ok = plain.completions.create(model=MODEL, prompt="hi", max_tokens=3, extra_body={"guided_choice": ["ok"]})
    assert ok.choices[0].text == "ok"


def test_structural_tags_in_either_form_constrain_the_answer(servers, llama_dir: Path) -> None:
    """vLLM's structural tag in response_format, legacy and xgrammar's form, and the legacy
    one in structured_outputs: each <weather> the model opens holds JSON valid against the
    schema. The trigger's token is favoured, so that the random model opens some."""
    trigger = AutoTokenizer.from_pretrained(str(llama_dir)).encode("<", add_special_tokens=False)[0]
    schema = WEATHER_TOOL["function"]["parameters"]
    current = {"type": "structural_tag", "format": {"type": "triggered_tags", "triggers": ["<"], "tags": [
        {"type": "tag", "begin": "<weather>", "content": {"type": "json_schema", "json_schema": schema},
         "end": "</weather>"}]}}
    opened = 0
    for field in ({"response_format": LEGACY_TAG}, {"response_format": current},
                  {"structured_outputs": {"structural_tag": json.dumps(LEGACY_TAG)}}):
        response = _post(servers["plain"], "completions", {**field, "max_tokens": 80, "temperature": 1.0, "n": 2,
                                                             "seed": 4, "logit_bias": {str(trigger): 8}})
        assert response.status_code == 200, response.text
        for choice in response.json()["choices"]:
            text, pos = choice["text"], 0
            for match in re.finditer(r"<weather>(.*?)</weather>", text, re.S):
                assert "<" not in text[pos:match.start()], text
                jsonschema.validate(json.loads(match.group(1)), schema)
                pos, opened = match.end(), opened + 1
            assert choice["finish_reason"] == "length" or "<" not in text[pos:], text
    assert opened >= 3


# Fuzzer-made schemas: the JSON-schema vocabulary the issue names, nested at random, and
# schemas with wrong values in it. Each gets a 200 whose answer validates (or, cut short,
# is a prefix the grammar accepts) or a 400 naming response_format; never a hang or a 500.
_leaves = st.one_of(
    st.builds(lambda low, span: {"type": "integer", "minimum": low, "maximum": low + span},
              st.integers(-50, 50), st.integers(0, 20)),
    st.lists(st.text("abcxyz", min_size=1, max_size=3), min_size=1, max_size=4, unique=True).map(
        lambda values: {"enum": values}),
    st.sampled_from(["^[a-z]{1,4}$", "^[0-9]{2}$", "^(on|off)$"]).map(lambda p: {"type": "string", "pattern": p}),
    st.integers(1, 4).map(lambda n: {"type": "string", "maxLength": n}),
    st.just({"type": "boolean"}), st.just({"type": "null"}),
    # Wrong values: what xgrammar must refuse rather than crash on.
    st.sampled_from([{"type": "foo"}, {"type": "integer", "minimum": 5, "maximum": 1}, {"enum": []},
                     {"type": "string", "pattern": "[a-"}, {"properties": 3}, {"type": 7}]),
)


def _objects(children: st.SearchStrategy) -> st.SearchStrategy:
    return st.dictionaries(st.text("abcdef", min_size=1, max_size=3), children, min_size=1, max_size=3).flatmap(
        lambda properties: st.lists(st.sampled_from(sorted(properties)), unique=True).map(
            lambda required: {"type": "object", "properties": properties, "required": required}))


_schemas = st.recursive(_leaves, lambda children: st.one_of(
    _objects(children),
    st.builds(lambda items, low, extra: {"type": "array", "items": items, "minItems": low, "maxItems": low + extra},
              children, st.integers(0, 2), st.integers(0, 2)),
    st.lists(children, min_size=2, max_size=3).map(lambda options: {"anyOf": options}),
), max_leaves=10)


@settings(max_examples=25, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(schema=_schemas)
def test_fuzzer_made_schemas_get_a_valid_answer_or_a_400(servers, compiler, schema: dict) -> None:
    response = _post(servers["plain"], "completions", {
        "max_tokens": 60, "temperature": 1.0,
        "response_format": {"type": "json_schema", "json_schema": {"name": "fuzz", "schema": schema}}})
    if response.status_code == 400:
        assert response.json()["error"]["param"] == "response_format", response.text
        return
    assert response.status_code == 200, response.text
    choice = response.json()["choices"][0]
    grammar = compiler.compile_json_schema(json.dumps(schema), max_whitespace_cnt=20)
    _check_text(choice["text"], choice["finish_reason"], lambda t: jsonschema.validate(json.loads(t), schema),
                grammar)


def test_deeply_nested_schema_past_its_compile_deadline_is_a_400_and_its_compile_is_stopped(servers, compiler) -> None:
    """A schema nested 200 levels deep (within this server's depth limit) compiles for
    seconds: the request is answered 400 once its 0.5 s deadline has passed, the server
    answers others meanwhile, and the compile is stopped then. Asserted on what the server
    answers: had the compile gone on (a compile thread cannot be stopped), the same schema
    sent once that compile would have finished (timed here, on the same vocabulary) would be
    served from the cache, not refused again at its deadline."""
    url = servers["plain"]
    client = _client(url)
    schema = _nested(200)
    deep = {"response_format": {"type": "json_schema", "json_schema": {"name": "deep", "schema": schema}}}
    start = time.monotonic()
    response = _post(url, "chat", deep)
    refused = time.monotonic()
    assert refused - start >= COMPILE_SECONDS  # refused at the deadline, not before
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "response_format" and f"did not compile within {COMPILE_SECONDS:g} s" in error["message"]
    assert httpx.get(url + "/health", timeout=10).status_code == 200
    reply = client.chat.completions.create(model=MODEL, messages=USER, max_tokens=40,
                                           response_format={"type": "json_object"})
    choice = reply.choices[0]
    assert choice.finish_reason == "length" or isinstance(json.loads(choice.message.content), dict)
    compile_start = time.perf_counter()
    compiler.compile_json_schema(json.dumps(schema), max_whitespace_cnt=20)
    compile_seconds = time.perf_counter() - compile_start
    assert compile_seconds > 2 * COMPILE_SECONDS
    time.sleep(max(0.0, start + 2 * compile_seconds - time.monotonic()))
    again = _post(url, "completions", deep)
    assert again.status_code == 400 and "did not compile" in again.json()["error"]["message"], again.text


def _chain_grammar(num_rules: int, tag: str) -> str:
    """An EBNF grammar of chained rules, each beginning with the next (58 KB for 2,000):
    xgrammar's compile time grows about as the cube of their number (2,000 take about 5 s
    on one core)."""
    rules = ["root ::= r0"] + [f'r{i} ::= r{i + 1} "{tag}{i}" | "y"' for i in range(num_rules - 1)]
    return "\n".join(rules + [f'r{num_rules - 1} ::= "z"'])


def test_slow_grammars_sent_at_once_do_not_make_an_ordinary_schema_wait(servers) -> None:
    """One client's three slow grammars in flight (each refused at its deadline) leave the
    compiling of another request's JSON schema alone: it is answered 200, with JSON that
    validates. (With a fixed set of compile threads, each held by a slow grammar until it
    finishes, the schema's compile would wait behind them past its own deadline.)"""
    url = servers["plain"]
    slow = [{"structured_outputs": {"grammar": _chain_grammar(2000, tag)}} for tag in ("p", "q", "r")]
    with concurrent.futures.ThreadPoolExecutor(len(slow)) as pool:
        refused = [pool.submit(_post, url, "completions", body) for body in slow]
        time.sleep(0.2)  # the slow compiles have started
        assert not any(future.done() for future in refused)
        answer = _post(url, "completions", {"max_tokens": 60, "temperature": 1.0, "response_format": {
            "type": "json_schema", "json_schema": {"name": "weather", "schema": SCHEMA}}})
        for future in refused:
            response = future.result()
            assert response.status_code == 400 and "did not compile" in response.json()["error"]["message"]
    assert answer.status_code == 200, answer.text
    choice = answer.json()["choices"][0]
    if choice["finish_reason"] == "stop":
        jsonschema.validate(json.loads(choice["text"]), SCHEMA)


def _compile_worker(server_pid: int, timeout: float = 30.0) -> tuple[int, int]:
    """The server's grammar compile worker and its child that is compiling (the one that has
    used CPU: a spare child waits without using any)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for pid in children(server_pid):
            try:
                command = open(f"/proc/{pid}/cmdline", "rb").read()
            except OSError:
                continue
            if b"compile_worker_process" not in command:
                continue
            busy = [child for child in children(pid) if cpu_seconds(child) >= 0.05]
            if busy:
                return pid, busy[0]
        time.sleep(0.02)
    raise AssertionError("the server's compile worker is not compiling")


def test_the_compile_workers_death_is_a_503_and_the_next_request_compiles(servers) -> None:
    """The compile worker killed while it compiles a request's grammar (as the OOM killer
    would): that request is a 503 (the server's fault, not the grammar's, and worth a
    retry), and the next constrained request starts a new worker and is served."""
    url = servers["tools"]
    slow = {"structured_outputs": {"grammar": _chain_grammar(2000, "k")}}
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        pending = pool.submit(_post, url, "completions", slow)
        worker, _ = _compile_worker(servers["tools_pid"])
        os.kill(worker, signal.SIGKILL)
        response = pending.result()
    assert response.status_code == 503, response.text
    assert response.json()["error"]["type"] == "ServiceUnavailableError"
    again = _post(url, "completions", {"max_tokens": 20, "response_format": {"type": "json_object"}})
    assert again.status_code == 200, again.text


def _text_and_token_counts(choice) -> tuple[str, list[int], Callable[[int], int]]:
    """A choice's text from its logprobs' tokens, where each token's text ends in it (0
    first), and how many of its tokens it takes to write the text's first `chars` characters."""
    ends = [0]
    for entry in choice.logprobs.content:
        ends.append(ends[-1] + len(entry.token))

    def tokens_to(chars: int) -> int:
        return next(count for count, end in enumerate(ends) if end >= chars)

    return "".join(entry.token for entry in choice.logprobs.content), ends, tokens_to
