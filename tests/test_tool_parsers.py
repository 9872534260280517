"""Tool-call parsing: each parser (hermes, llama3_json, mistral) and the replies of
tool_choice "required" and a named function, on replies written as these model families
write them; streamed, the deltas must add up to what the whole reply parses to."""

from __future__ import annotations

import json
import random

import pytest

from raylm.deploy.tool_calls import NamedToolParser, RequiredToolParser, ToolCallStreamer
from raylm.deploy.tool_parsers import get_tool_parser

# (reply text, expected content, expected [(name, arguments as a Python value)]). The
# replies follow each family's documented format: Qwen 2.5 / Hermes 2 Pro tags, Llama 3.1
# JSON (with and without <|python_tag|>), Mistral's [TOOL_CALLS] in its two tokenizer
# generations; and replies that call nothing.
WEATHER = {"location": "San Francisco, CA", "unit": "fahrenheit"}
CASES = {
    "hermes": [
        ('<tool_call>\n{"name": "get_current_weather", "arguments": {"location": "San Francisco, CA", '
         '"unit": "fahrenheit"}}\n</tool_call>', "", [("get_current_weather", WEATHER)]),
        ('Let me check both cities.\n<tool_call>\n{"name": "get_current_weather", "arguments": {"location": '
         '"Paris"}}\n</tool_call>\n<tool_call>\n{"name": "get_current_weather", "arguments": {"location": '
         '"Rome, \\"Italy\\"", "days": [1, 2]}}\n</tool_call>', "Let me check both cities.\n",
         [("get_current_weather", {"location": "Paris"}),
          ("get_current_weather", {"location": 'Rome, "Italy"', "days": [1, 2]})]),
        ('<tool_call>\n{"arguments": {"query": "ünïcode ✓"}, "name": "search"}\n</tool_call>', "",
         [("search", {"query": "ünïcode ✓"})]),
        ("The weather in Paris is 22 °C and sunny.", "The weather in Paris is 22 °C and sunny.", []),
        ("Use <tool_call> tags like this: <tool_call>oops", "Use <tool_call> tags like this: <tool_call>oops", []),
    ],
    "llama3_json": [
        ('{"name": "get_current_weather", "parameters": {"location": "San Francisco, CA", "unit": "fahrenheit"}}',
         "", [("get_current_weather", WEATHER)]),
        ('<|python_tag|>{"name": "get_time", "parameters": {"tz": "UTC"}}; {"name": "get_current_weather", '
         '"parameters": {"location": "Paris"}}', "",
         [("get_time", {"tz": "UTC"}), ("get_current_weather", {"location": "Paris"})]),
        ('{"name": "noop", "parameters": {}}', "", [("noop", {})]),
        ("It is sunny in Paris today.", "It is sunny in Paris today.", []),
        ('{"answer": 42}', '{"answer": 42}', []),
    ],
    "mistral": [
        ('[TOOL_CALLS] [{"name": "get_current_weather", "arguments": {"location": "San Francisco, CA", '
         '"unit": "fahrenheit"}}]', "", [("get_current_weather", WEATHER)]),
        ('Checking.[TOOL_CALLS][{"name": "a", "arguments": {"x": 1}}, {"name": "b", "arguments": {"y": [true, null]}}]',
         "Checking.", [("a", {"x": 1}), ("b", {"y": [True, None]})]),
        ('[TOOL_CALLS]get_current_weather[ARGS]{"location": "Paris"}[TOOL_CALLS]get_time[ARGS]{"tz": "CET"}', "",
         [("get_current_weather", {"location": "Paris"}), ("get_time", {"tz": "CET"})]),
        ("No tools needed: it is 4.", "No tools needed: it is 4.", []),
    ],
}


def _all_cases() -> list[tuple[str, str, str, list]]:
    return [(name, *case) for name, cases in CASES.items() for case in cases]


@pytest.mark.parametrize("parser_name, text, content, calls", _all_cases())
def test_parser_finds_the_calls_of_a_whole_reply(parser_name: str, text: str, content: str, calls: list) -> None:
    parsed = get_tool_parser(parser_name).parse(text, final=True)
    assert parsed.content == content
    assert [(call.name, json.loads(call.arguments)) for call in parsed.calls] == calls
    assert all(call.complete for call in parsed.calls)


def _stream(parser, text: str, seed: int) -> tuple[str, list[dict]]:
    """Feeds the text in random pieces (1 to 7 characters, as tokens come); returns the
    content and the calls the deltas add up to."""
    rng = random.Random(seed)
    streamer = ToolCallStreamer(parser)
    content = ""
    calls: list[dict] = []
    pos = 0
    while pos < len(text):
        piece = text[pos:pos + rng.randint(1, 7)]
        pos += len(piece)
        new_content, deltas = streamer.feed(piece, final=pos >= len(text))
        content += new_content or ""
        for delta in deltas or ():
            if "id" in delta:
                assert delta["index"] == len(calls) and delta["type"] == "function"
                calls.append({"id": delta["id"], "name": delta["function"]["name"], "arguments": ""})
            else:
                assert "name" not in delta["function"], "a call's name is sent once, with its id"
            calls[delta["index"]]["arguments"] += delta["function"]["arguments"]
    return content, calls


@pytest.mark.parametrize("parser_name, text, content, calls", _all_cases())
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_streamed_deltas_add_up_to_the_whole_reply(parser_name: str, text: str, content: str, calls: list,
                                                   seed: int) -> None:
    streamed_content, streamed_calls = _stream(get_tool_parser(parser_name), text, seed)
    assert streamed_content == content
    assert [(call["name"], json.loads(call["arguments"])) for call in streamed_calls] == calls
    assert len({call["id"] for call in streamed_calls}) == len(calls)


def test_streaming_holds_back_a_marker_being_written() -> None:
    streamer = ToolCallStreamer(get_tool_parser("hermes"))
    assert streamer.feed("Sure. <tool", final=False) == ("Sure. ", None)
    content, deltas = streamer.feed('_call>\n{"name": "f", "arguments": {', final=False)
    assert content is None and deltas[0]["function"] == {"name": "f", "arguments": "{"}
    # A held-back prefix that never becomes the marker is content at the end.
    other = ToolCallStreamer(get_tool_parser("hermes"))
    assert other.feed("a <tool", final=False) == ("a ", None)
    assert other.feed("s>", final=True) == ("<tools>", None)


def test_mistral_ids_are_nine_alphanumerics() -> None:
    parser = get_tool_parser("mistral")
    ids = {parser.make_tool_call_id() for _ in range(50)}
    assert len(ids) == 50 and all(len(i) == 9 and i.isalnum() for i in ids)
    assert get_tool_parser("hermes").make_tool_call_id().startswith("chatcmpl-tool-")


def test_unknown_parser_names_the_choices() -> None:
    with pytest.raises(ValueError, match="hermes, llama3_json, mistral"):
        get_tool_parser("nope")


REQUIRED_REPLY = '[{"name": "get_weather", "parameters": {"city": "Paris"}},\n {"name": "get_time", "parameters": {}}]'


def test_required_reply_is_a_list_of_calls() -> None:
    parsed = RequiredToolParser().parse(REQUIRED_REPLY, final=True)
    assert parsed.content == ""
    assert [(c.name, json.loads(c.arguments)) for c in parsed.calls] == [("get_weather", {"city": "Paris"}),
                                                                       ("get_time", {})]
    for seed in range(3):
        content, calls = _stream(RequiredToolParser(), REQUIRED_REPLY, seed)
        assert content == "" and [(c["name"], json.loads(c["arguments"])) for c in calls] == \
            [("get_weather", {"city": "Paris"}), ("get_time", {})]


def test_required_reply_cut_short_is_text_without_calls() -> None:
    cut = REQUIRED_REPLY[:30]
    parsed = RequiredToolParser().parse(cut, final=True)
    assert parsed.content == cut and not parsed.calls
    # Streamed, the call announced before the cut stands, and no text follows it as content.
    content, calls = _stream(RequiredToolParser(), REQUIRED_REPLY[:45], 0)
    assert content == "" and calls[0]["name"] == "get_weather"
    assert REQUIRED_REPLY[:45].endswith(calls[0]["arguments"])


def test_named_reply_is_the_arguments() -> None:
    arguments = '{"city": "Paris", "days": 3}'
    parsed = NamedToolParser("get_weather").parse(arguments, final=True)
    assert parsed.content == "" and parsed.calls[0].name == "get_weather" and parsed.calls[0].arguments == arguments
    content, calls = _stream(NamedToolParser("get_weather"), arguments, 0)
    assert content == "" and calls == [{"id": calls[0]["id"], "name": "get_weather", "arguments": arguments}]
