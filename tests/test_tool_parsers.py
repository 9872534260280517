"""Tool-call parsing: each parser (hermes, llama3_json, mistral) and the replies of
tool_choice "required" and a named function, on replies written as these model families
write them; streamed, the deltas must add up to what the whole reply parses to."""

from __future__ import annotations

import json
import random
import re

import pytest

from raylm.deploy.tool_calls import NamedToolParser, RequiredToolParser, ToolCallStreamer, parse_reply
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


def _stream(parser, text: str, seed: int | None, cut: bool = False) -> tuple[str, list[dict]]:
    """Feeds the text in random pieces (1 to 7 characters, as tokens come; all at once for
    seed None), the last with the engine's `cut`; returns the content and the calls the
    deltas add up to."""
    rng = random.Random(seed)
    streamer = ToolCallStreamer(parser)
    content = ""
    calls: list[dict] = []
    pos = 0
    while pos < len(text) or not text:
        piece = text[pos:pos + (len(text) if seed is None else rng.randint(1, 7))]
        pos += len(piece)
        new_content, deltas = streamer.feed(piece, final=pos >= len(text), cut=cut)
        content += new_content or ""
        for delta in deltas or ():
            if "id" in delta:
                assert delta["index"] == len(calls) and delta["type"] == "function"
                calls.append({"id": delta["id"], "name": delta["function"]["name"], "arguments": ""})
            else:
                assert "name" not in delta["function"], "a call's name is sent once, with its id"
            calls[delta["index"]]["arguments"] += delta["function"]["arguments"]
        if not text:
            break
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


# REQUIRED_REPLY cut short (max_tokens) and the calls it gives: those whose name and
# "parameters" key were written, the last with its arguments' text as far as it goes.
REQUIRED_CUTS = [
    (30, []),  # inside the first call's head: no call, the text is the content
    (45, [("get_weather", '{"city')]),
    (58, [("get_weather", '{"city": "Paris"}')]),  # between the calls
    (59, [("get_weather", '{"city": "Paris"}')]),
    (70, [("get_weather", '{"city": "Paris"}')]),  # inside the second name
    (85, [("get_weather", '{"city": "Paris"}')]),
    (len('[{"name": "get_weather", "parameters": {"city": "Paris"}},\n {"name": "get_time", "parameters": '),
     [("get_weather", '{"city": "Paris"}'), ("get_time", "")]),
]


@pytest.mark.parametrize("length, expected", REQUIRED_CUTS)
def test_required_reply_cut_short_gives_the_calls_named_so_far_streamed_or_not(length: int, expected: list) -> None:
    cut = REQUIRED_REPLY[:length]
    parsed = RequiredToolParser().parse(cut, final=True)
    assert [(call.name, call.arguments) for call in parsed.calls] == expected
    assert parsed.content == ("" if expected else cut)
    # Streamed in pieces, or in one delta that both names a call and ends the reply: the same.
    for seed in (*range(3), None):
        if seed is None:
            content, deltas = ToolCallStreamer(RequiredToolParser()).feed(cut, final=True)
            content = content or ""
            calls = [{"name": d["function"]["name"], "arguments": d["function"]["arguments"]} for d in deltas or ()]
        else:
            content, calls = _stream(RequiredToolParser(), cut, seed)
        assert (content, [(c["name"], c["arguments"]) for c in calls]) == (parsed.content, expected)


# Replies of two calls with content before them where the format has it, for "auto" replies
# cut by max_tokens: (parser, text, the calls' names and arguments, the regex of the point
# from which a call counts as named: its argument key's colon, or Mistral's [ARGS]).
AUTO_CALLS = [("get_weather", '{"city": "Paris", "days": 2}'), ("get_time", '{"tz": "CET"}')]
AUTO_REPLIES = [
    ("hermes", "Let me check.\n" + "\n".join(f'<tool_call>\n{{"name": "{name}", "arguments": {arguments}}}\n'
                                            "</tool_call>" for name, arguments in AUTO_CALLS), r'"arguments":'),
    ("llama3_json", "<|python_tag|>" + "; ".join(f'{{"name": "{name}", "parameters": {arguments}}}'
                                                 for name, arguments in AUTO_CALLS), r'"parameters":'),
    ("mistral", "Checking.[TOOL_CALLS][" + ", ".join(f'{{"name": "{name}", "arguments": {arguments}}}'
                                                     for name, arguments in AUTO_CALLS) + "]", r'"arguments":'),
    ("mistral", "".join(f"[TOOL_CALLS]{name}[ARGS]{arguments}" for name, arguments in AUTO_CALLS), r"\[ARGS\]"),
]
_CONTENT_END = {"hermes": "<tool_call>", "llama3_json": "<|python_tag|>", "mistral": "[TOOL_CALLS]"}


def _cut_reference(parser_name: str, text: str, named_at: str, length: int) -> tuple[str, list[tuple[str, str]]]:
    """What a reply cut after `length` characters gives, by its layout: each call whose name
    was written (its marker's end is within the cut), with its arguments' text up to the
    cut; the content before the first call, or all the text when no call was named."""
    calls = []
    for (name, arguments), marker in zip(AUTO_CALLS, re.finditer(named_at, text)):
        if length >= marker.end():
            start = text.index(arguments, marker.end())
            calls.append((name, arguments[:max(0, length - start)]))
    return (text[:text.index(_CONTENT_END[parser_name])] if calls else text[:length]), calls


@pytest.mark.parametrize("parser_name, text, named_at", AUTO_REPLIES,
                         ids=["hermes", "llama3_json", "mistral", "mistral_named"])
def test_auto_reply_cut_anywhere_gives_the_calls_named_so_far_streamed_or_not(parser_name: str, text: str,
                                                                              named_at: str) -> None:
    """Cut by max_tokens after every character (in the content, in a marker, a name, the
    arguments, between calls), the unstreamed message and the stream's deltas, in random
    pieces or in one delta, agree with the reference by the reply's layout."""
    parser = get_tool_parser(parser_name)
    for length in range(len(text) + 1):
        cut = text[:length]
        expected = _cut_reference(parser_name, text, named_at, length)
        parsed = parse_reply(parser, cut, "length")
        assert (parsed.content, [(call.name, call.arguments) for call in parsed.calls]) == expected, cut
        for seed in (0, 1, None):
            content, calls = _stream(parser, cut, seed, cut=True)
            assert (content, [(call["name"], call["arguments"]) for call in calls]) == expected, (cut, seed)
    # Whole (or cut at a call's end), every call is complete JSON.
    assert [(name, json.loads(arguments)) for name, arguments in _cut_reference(parser_name, text, named_at,
                                                                               len(text))[1]] == \
        [(name, json.loads(arguments)) for name, arguments in AUTO_CALLS]


def test_named_reply_is_the_arguments() -> None:
    arguments = '{"city": "Paris", "days": 3}'
    parsed = NamedToolParser("get_weather").parse(arguments, final=True)
    assert parsed.content == "" and parsed.calls[0].name == "get_weather" and parsed.calls[0].arguments == arguments
    content, calls = _stream(NamedToolParser("get_weather"), arguments, 0)
    assert content == "" and calls == [{"id": calls[0]["id"], "name": "get_weather", "arguments": arguments}]


def test_named_call_is_named_with_the_first_answer_text_or_the_replys_end():
    """While a reasoning model thinks the answer's text is empty: no call is sent yet (vLLM
    names it with the first answer delta); a reply cut before any answer text gives the call
    with empty arguments at its end, as its unstreamed message does (vLLM #40148)."""
    streamer = ToolCallStreamer(NamedToolParser("get_weather"))
    assert streamer.feed("", final=False) == (None, None)
    _, deltas = streamer.feed('{"city"', final=False)
    assert deltas[0]["function"] == {"name": "get_weather", "arguments": '{"city"'}
    cut = ToolCallStreamer(NamedToolParser("get_weather"))
    assert cut.feed("", final=False) == (None, None)
    _, deltas = cut.feed("", final=True, cut=True)
    assert deltas[0]["function"] == {"name": "get_weather", "arguments": ""}
    parsed = parse_reply(NamedToolParser("get_weather"), "", "length")
    assert [(c.name, c.arguments) for c in parsed.calls] == [("get_weather", "")]


# ------------------------------------------------------------ incremental parsing
# The stream reads each delta once (tool_parsers/incremental.py); what it answers after every
# delta must be what `parse` answers for the text so far, and its deltas those of a stream
# that re-parses the whole text at every delta (ReparseStreamer, the reference below).
PARSERS = {"hermes": lambda: get_tool_parser("hermes"), "llama3_json": lambda: get_tool_parser("llama3_json"),
           "mistral": lambda: get_tool_parser("mistral"), "required": RequiredToolParser,
           "named": lambda: NamedToolParser("f")}
# Replies beyond the recorded ones: numbers and literals as arguments (which the decoder
# reads as "1" in "1.x"), Unicode whitespace, escapes, arguments before the name, empty
# lists and trailing commas, and calls by name with values of every kind.
EDGE_REPLIES = [
    '{"name": "f", "arguments": 12}', '{"name": "f", "arguments": -1.5e3}', '{"name": "f", "arguments": true}',
    '<tool_call>{"name": "f", "arguments": 1.}</tool_call>', '[TOOL_CALLS]f[ARGS]1.5e+2[TOOL_CALLS]g[ARGS]-Infinity',
    '[TOOL_CALLS]f[ARGS] null', '<tool_call>\u00a0{\u00a0"name"\u00a0:"f","arguments":{"a":"\\u00e9"}}',
    '{"name": "f\\\\n", "parameters": {}} ; {"parameters": {"x": [1,2]}, "name": "g"};',
    '[TOOL_CALLS] [{"name": "a", "arguments": {}}, ]', '[TOOL_CALLS][]', '<tool_call>"str"</tool_call>',
]
# What mutations insert: JSON's structure, numbers, literals, markers and call heads.
MUTATION_PIECES = ['{', '}', '[', ']', '"', '\\', ':', ',', ';', ' ', '\n', '\u00a0', '1', '0', '.', 'e', '-', '+',
                   'x', 'n', 'u', 'l', 'true', 'null', 'NaN', '-Infinity', '"name"', '"arguments"', '"parameters"',
                   '<tool_call>', '</tool_call>', '[TOOL_CALLS]', '[ARGS]', '<|python_tag|>', '"f"',
                   '{"name": "f", "arguments": ', '{"name": "g", "parameters": ', '1.5e+3', '12', '"a\\"b"', '\\n']


def _replies() -> list[tuple[str, str]]:
    replies = [(name, text) for name, cases in CASES.items() for text, _, _ in cases]
    replies.append(("required", REQUIRED_REPLY))
    replies += [(name, text) for text in EDGE_REPLIES for name in ("hermes", "llama3_json", "mistral", "required")]
    return replies


def _mutated_replies(count: int, seed: int) -> list[tuple[str, str]]:
    """Replies with up to three insertions, deletions or cuts each, and some read by the
    parsers of tool_choice "required" and a named function instead."""
    rng = random.Random(seed)
    replies, out = _replies(), []
    for _ in range(count):
        name, text = rng.choice(replies)
        for _ in range(rng.randint(0, 3) if rng.random() < 0.8 else 0):
            pos, op = rng.randint(0, len(text)), rng.random()
            if op < 0.4:
                text = text[:pos] + rng.choice(MUTATION_PIECES) + text[pos:]
            elif op < 0.7:
                text = text[:pos] + text[pos + rng.randint(1, 3):]
            else:
                text = text[:pos]
        out.append(("named" if rng.random() < 0.1 else name, text))
    return out


def _pieces(text: str, rng: random.Random, longest: int = 5) -> list[str]:
    pieces, pos = [], 0
    while pos < len(text):
        pieces.append(text[pos:pos + rng.randint(0, longest)])
        pos += len(pieces[-1])
    return pieces or [""]


def _as_parsed(incremental_parse, final: bool) -> tuple[str, list[tuple[str, str]]]:
    view, log = incremental_parse.view(final), incremental_parse.log
    calls = list(incremental_parse.completed[:view.calls_done]) + ([view.active] if view.active else [])
    return log.slice(0, view.content_end), \
        [(call.name, call.arguments(log, 0, call.arguments_length(log.length))) for call in calls]


def assert_incremental_parse_answers_what_parse_answers(parser, text: str, rng: random.Random, label: str) -> None:
    """Feeds the text in random pieces to the parser's incremental parse and checks, after
    every piece, final or not, that it answers what `parse` of the text so far answers."""
    incremental_parse, read = parser.incremental(), ""
    for piece in _pieces(text, rng):
        incremental_parse.feed(piece)
        read += piece
        for final in (False, True):
            parsed = parser.parse(read, final)
            assert _as_parsed(incremental_parse, final) == \
                (parsed.content, [(call.name, call.arguments) for call in parsed.calls]), (label, read, final)


def test_incremental_parse_answers_what_parse_answers_after_every_delta() -> None:
    rng = random.Random(0)
    for name, text in _mutated_replies(1500, seed=0):
        assert_incremental_parse_answers_what_parse_answers(PARSERS[name](), text, rng, name)


class ReparseStreamer:
    """The reference: parses the whole text at every delta and sends what is new (the
    streamer as it was before the incremental parse)."""

    def __init__(self, parser) -> None:
        self.parser, self.text, self.content_sent, self.arguments_sent = parser, "", 0, []

    def feed(self, delta_text: str, final: bool, cut: bool = False) -> tuple[str | None, list[dict] | None]:
        self.text += delta_text
        parsed = self.parser.parse(self.text, final)
        if final and not parsed.tools_called:
            so_far = self.parser.parse(self.text, False)
            if self.arguments_sent or (cut and so_far.tools_called):
                parsed = so_far
        content = parsed.content[self.content_sent:]
        self.content_sent = max(self.content_sent, len(parsed.content))
        deltas = []
        for index, call in enumerate(parsed.calls):
            if index < len(self.arguments_sent):
                if call.arguments[self.arguments_sent[index]:]:
                    deltas.append({"index": index,
                                   "function": {"arguments": call.arguments[self.arguments_sent[index]:]}})
                    self.arguments_sent[index] = len(call.arguments)
            elif index == len(self.arguments_sent):
                deltas.append({"index": index, "type": "function",
                               "function": {"name": call.name, "arguments": call.arguments}})
                self.arguments_sent.append(len(call.arguments))
        return content or None, deltas or None


def assert_streamed_deltas_are_the_reparsing_streams(make_parser, text: str, rng: random.Random) -> None:
    """Streams the text in random pieces through `ToolCallStreamer` and `ReparseStreamer`
    (each over a parser `make_parser()` gives) and checks that every piece's content and
    deltas are the same."""
    streamer, reference = ToolCallStreamer(make_parser()), ReparseStreamer(make_parser())
    pieces, cut = _pieces(text, rng), rng.random() < 0.5  # the last piece ended for its length or not
    for index, piece in enumerate(pieces):
        final = index == len(pieces) - 1
        content, deltas = streamer.feed(piece, final, cut)
        for delta in deltas or ():
            delta.pop("id", None)  # ids are random
        assert (content, deltas) == reference.feed(piece, final, cut), (text, index)


def test_streamed_deltas_are_those_of_a_stream_that_reparses_the_whole_text() -> None:
    rng = random.Random(1)
    for name, text in _mutated_replies(1500, seed=1):
        assert_streamed_deltas_are_the_reparsing_streams(PARSERS[name], text, rng)


def _long_reply(name: str, size: int) -> str:
    """A reply of about `size` characters in the parser's format: three calls, one with long
    string arguments and nested values (content first where the format has content)."""
    rng = random.Random(size)
    words = " ".join(rng.choice(["lorem", "ipsum", "dolor", "ünïcode ✓", 'say "hi"', "a\\b", "x\ny"])
                     for _ in range(size // 7))
    arguments = [json.dumps({"text": words, "items": [1, 2.5, None, True, {"k": "v"}]}), '{"city": "Paris"}',
                 '{"n": -3}']
    names = ["write", "get_weather", "count"]
    if name == "hermes":
        return "Let me do that.\n" + "".join(f'<tool_call>\n{{"name": "{n}", "arguments": {a}}}\n</tool_call>\n'
                                             for n, a in zip(names, arguments))
    if name == "llama3_json":
        return "<|python_tag|>" + "; ".join(f'{{"name": "{n}", "parameters": {a}}}' for n, a in zip(names, arguments))
    if name == "mistral":
        return "Sure.[TOOL_CALLS][" + ", ".join(f'{{"name": "{n}", "arguments": {a}}}'
                                                for n, a in zip(names, arguments)) + "]"
    if name == "mistral_named":
        return "".join(f"[TOOL_CALLS]{n}[ARGS]{a}" for n, a in zip(names, arguments))
    if name == "required":
        return "[" + ", ".join(f'{{"name": "{n}", "parameters": {a}}}' for n, a in zip(names, arguments)) + "]"
    return arguments[0]  # named


LONG_REPLY_PARSERS = {**PARSERS, "mistral_named": PARSERS["mistral"]}


def _tokens(text: str) -> list[str]:
    """The text as a byte-level BPE tokenizer splits it: never across a word, a run of
    spaces or a punctuation mark, and words in pieces of at most four characters."""
    import re
    pieces = re.findall(r"\s+|\w+|[^\w\s]", text)
    return [piece[i:i + 4] for piece in pieces for i in range(0, len(piece), 4)]


@pytest.mark.parametrize("name", sorted(LONG_REPLY_PARSERS))
def test_long_reply_streamed_a_token_at_a_time_adds_up_to_its_parse(name: str) -> None:
    parser = LONG_REPLY_PARSERS[name]()
    text = _long_reply(name, 100_000)
    tokens = _tokens(text)
    assert "".join(tokens) == text and len(tokens) > 20_000
    streamer, content, calls = ToolCallStreamer(parser), "", []
    for index, token in enumerate(tokens):
        new_content, deltas = streamer.feed(token, final=index == len(tokens) - 1)
        content += new_content or ""
        for delta in deltas or ():
            if "id" in delta:
                calls.append([delta["function"]["name"], ""])
            calls[delta["index"]][1] += delta["function"]["arguments"]
    parsed = parser.parse(text, final=True)
    assert len(parsed.calls) == (1 if name == "named" else 3)
    assert (content, calls) == (parsed.content, [[call.name, call.arguments] for call in parsed.calls])


@pytest.mark.parametrize("name", sorted(LONG_REPLY_PARSERS))
def test_streaming_reads_each_character_a_bounded_number_of_times(name: str, monkeypatch) -> None:
    """Counts the characters a stream reads: the whole texts handed to `parse`, the deltas
    and what is read back from the text so far. Linear in the reply's length, where a
    parse of the whole text at every delta reads the square of it."""
    from raylm.deploy.tool_parsers import incremental
    from raylm.deploy.tool_parsers.base import ToolParser

    read = [0]

    def counted(method):
        def reading(self, text, *args):
            read[0] += len(text)
            return method(self, text, *args)
        return reading

    def counted_slice(self, start: int, end: int) -> str:
        piece = log_slice(self, start, end)
        read[0] += len(piece)
        return piece

    log_slice = incremental.TextLog.slice
    monkeypatch.setattr(incremental.TextLog, "slice", counted_slice)
    for parser_class in {type(LONG_REPLY_PARSERS[name]()), ToolParser}:
        if "parse" in vars(parser_class):
            monkeypatch.setattr(parser_class, "parse", counted(vars(parser_class)["parse"]))
    per_size = {}
    for size in (10_000, 40_000):
        read[0] = 0
        streamer = ToolCallStreamer(LONG_REPLY_PARSERS[name]())
        tokens = _tokens(_long_reply(name, size))
        for index, token in enumerate(tokens):
            read[0] += len(token)
            streamer.feed(token, final=index == len(tokens) - 1)
        per_size[size] = read[0] / sum(map(len, tokens))
    # Each character is read a few times (the delta, a window, a slice sent on, a decode).
    assert max(per_size.values()) < 6, per_size
    assert per_size[40_000] < 1.2 * per_size[10_000], per_size


@pytest.mark.parametrize("parser_name", ["hermes", "llama3_json", "mistral"])
def test_arguments_nested_past_the_decoders_reach_are_content_not_an_error(parser_name: str) -> None:
    """The decoder raises RecursionError on them (a 500 when it reached the server)."""
    arguments = '{"a": ' + "[" * 5000 + "]" * 5000 + "}"
    text = {"hermes": f'<tool_call>\n{{"name": "f", "arguments": {arguments}}}\n</tool_call>',
            "llama3_json": f'{{"name": "f", "parameters": {arguments}}}',
            "mistral": f"[TOOL_CALLS]f[ARGS]{arguments}"}[parser_name]
    parsed = get_tool_parser(parser_name).parse(text, final=True)
    assert parsed.content == text and not parsed.calls
    _stream(get_tool_parser(parser_name), text, 0)  # streamed, it raises nothing either
