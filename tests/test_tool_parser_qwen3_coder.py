"""The qwen3_coder tool parser (Qwen3-Coder and Qwen3.5's XML calls): replies written as
the models write them against calls read by hand with vLLM's rules; parameter values typed
by the tool's schema as vLLM types them; streamed in any chunking, the deltas add up to the
unstreamed reply, and the incremental parse answers what `parse` answers after every delta;
calls rendered by a chat template of the model's kind read back as they were given."""

from __future__ import annotations

import json
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from raylm.deploy.tool_calls import ToolCallStreamer, parse_reply
from raylm.deploy.tool_parsers import TOOL_PARSERS, get_tool_parser
from raylm.deploy.tool_parsers.qwen3_coder import Qwen3CoderToolParser, convert_parameter_value

from test_tool_parsers import _pieces, _stream, _tokens, assert_incremental_parse_answers_what_parse_answers, \
    assert_streamed_deltas_are_the_reparsing_streams

WEATHER_TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"},
                                     "ratio": {"type": "number"}, "metric": {"type": "boolean"},
                                     "where": {"type": "object"}, "hours": {"type": "array"},
                                     "note": {"type": ["string", "null"]}}}}}
FILE_TOOL = {"type": "function", "function": {"name": "write_file", "parameters": {
    "type": "object", "properties": {"path": {"type": "string"}, "content": {"type": "string"}}}}}
TOOLS = [WEATHER_TOOL, FILE_TOOL]


def call(name: str, **parameters: str) -> str:
    """A call as Qwen3-Coder's chat template writes it: each value on lines of its own."""
    body = "".join(f"<parameter={key}>\n{value}\n</parameter>\n" for key, value in parameters.items())
    return f"<tool_call>\n<function={name}>\n{body}</function>\n</tool_call>"


CODE = 'def f(x):\n    if x < 2:\n        return "<tiny>"\n    return x\n'
# (reply, expected content, expected [(name, arguments as a Python value)]); the arguments
# by hand, by vLLM's rules.
CASES = [
    ("Let me check.\n" + call("get_weather", city="Paris", days="3"), "Let me check.\n",
     [("get_weather", {"city": "Paris", "days": 3})]),
    # Every type: a string kept verbatim (quotes, a newline inside), numbers (3.0 is 3), a
    # boolean, an object and an array as JSON, a type list read as a Python literal.
    (call("get_weather", city='Rome, "Italy"\nnorth', ratio="3.0", metric="true", where='{"lat": 41.9}',
          hours="[1, 2]", note="12"), "",
     [("get_weather", {"city": 'Rome, "Italy"\nnorth', "ratio": 3, "metric": True, "where": {"lat": 41.9},
                       "hours": [1, 2], "note": 12})]),
    # Two blocks, text between them dropped; a string holding code with '<' and a newline at
    # its end (only the one before </parameter> goes).
    (call("write_file", path="a.py", content=CODE) + "\nand\n" + call("get_weather", city="Oslo"), "",
     [("write_file", {"path": "a.py", "content": CODE}), ("get_weather", {"city": "Oslo"})]),
    # Two functions in one block, parameters written on one line.
    ("<tool_call><function=get_weather><parameter=city>Bern</parameter></function>"
     "<function=write_file><parameter=path>/tmp/x</parameter></function></tool_call>", "",
     [("get_weather", {"city": "Bern"}), ("write_file", {"path": "/tmp/x"})]),
    # No tags: the function alone is a call, the text before it the content.
    ("Sure: <function=get_weather>\n<parameter=city>\nLima\n</parameter>\n</function>", "Sure: ",
     [("get_weather", {"city": "Lima"})]),
    # null in any case is null, whatever the type; values that do not read as their type stay
    # text; booleans other than true are false; a key the schema lacks stays text.
    (call("get_weather", city="NULL", days="many", ratio="1e999", metric="yes", where="{'lat': 1}", extra="7"),
     "", [("get_weather", {"city": None, "days": "many", "ratio": "1e999", "metric": False, "where": {"lat": 1},
                           "extra": "7"})]),
    # A function the tools lack: every value text. Unclosed at the reply's end: still a call.
    ("<tool_call>\n<function=lookup>\n<parameter=n>\n5\n</parameter>\n<parameter=q>\nab",
     "", [("lookup", {"n": "5", "q": "ab"})]),
    # A parameter that ends at the next one (no </parameter>), and one whose value keeps
    # newlines beyond the first and last.
    ("<tool_call>\n<function=get_weather>\n<parameter=city>\nKyiv\n<parameter=note>\n\n\nx\n\n</parameter>\n"
     "</function>\n</tool_call>", "", [("get_weather", {"city": "Kyiv", "note": "\n\nx\n"})]),
    # No calls: plain text, a Hermes JSON call in the tags, the markers mentioned.
    ("It is 22 °C in Paris.", "It is 22 °C in Paris.", []),
    ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
     '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>', []),
    # A function's name without its '>': not calls (all content), as in vLLM.
    ("A <tool_call><function=get_weather</function></tool_call>",
     "A <tool_call><function=get_weather</function></tool_call>", []),
]
# A parameter's key without its '>': all content unstreamed, as in vLLM; a stream has sent
# the call by then, and it stands (tool_calls.ToolCallStreamer; the reparse test below).
MALFORMED = ["<function=f>\n<parameter=city</parameter>\n</function>",
             call("get_weather", city="Oslo") + "<tool_call><function=f><parameter=a</function></tool_call>"]


def _parser() -> Qwen3CoderToolParser:
    return get_tool_parser("qwen3_coder", TOOLS)


def test_registered_under_both_of_vllms_names():
    assert TOOL_PARSERS["qwen3_coder"] is TOOL_PARSERS["qwen3_xml"] is Qwen3CoderToolParser
    assert get_tool_parser("qwen3_xml", TOOLS).tools == TOOLS


@pytest.mark.parametrize("text, content, calls", CASES)
def test_parse_finds_the_calls_of_a_whole_reply(text, content, calls):
    parsed = _parser().parse(text, final=True)
    assert parsed.content == content
    assert [(c.name, json.loads(c.arguments)) for c in parsed.calls] == calls
    assert all(c.complete for c in parsed.calls)


@pytest.mark.parametrize("text", MALFORMED)
def test_a_key_without_its_end_makes_the_reply_content(text):
    assert _parser().parse(text, final=True).content == text and not _parser().parse(text, final=True).calls


@pytest.mark.parametrize("text, content, calls", CASES)
def test_streamed_deltas_add_up_to_the_whole_reply_in_any_chunking(text, content, calls):
    whole = _parser().parse(text, final=True)
    for seed in range(8):
        streamed_content, streamed = _stream(_parser(), text, seed)
        assert streamed_content == content
        # The very text of the arguments, not only its value.
        assert [(c["name"], c["arguments"]) for c in streamed] == [(c.name, c.arguments) for c in whole.calls]


def test_arguments_are_the_json_vllm_dumps_and_strings_stream_as_written():
    text = call("write_file", path="a.py", content="x = 1\nprint(x)")
    assert _parser().parse(text, final=True).calls[0].arguments == \
        json.dumps({"path": "a.py", "content": "x = 1\nprint(x)"}, ensure_ascii=False)
    streamer = ToolCallStreamer(_parser())
    _, deltas = streamer.feed('<tool_call>\n<function=write_file>\n<parameter=content>\nx = 1\npri', final=False)
    # The name with "{", the key, the string so far but the newline that may end it... here
    # the newline is followed by text, so it is sent.
    assert deltas[0]["function"] == {"name": "write_file", "arguments": '{"content": "x = 1\\npri'}
    _, deltas = streamer.feed("nt(x)\n</param", final=False)
    assert deltas[0]["function"] == {"arguments": "nt(x)"}  # the newline and "</param" held back
    _, deltas = streamer.feed("eter>\n<parameter=path>\nNul", final=False)
    assert deltas[0]["function"] == {"arguments": '", "path": '}  # a string that may be null waits
    _, deltas = streamer.feed("l\n</parameter>\n</function>", final=False)
    assert deltas[0]["function"] == {"arguments": "null}"}
    other = ToolCallStreamer(_parser())
    _, deltas = other.feed("<function=get_weather><parameter=days>12", final=False)
    assert deltas[0]["function"] == {"name": "get_weather", "arguments": '{"days": '}  # a number waits for its end
    assert other.feed("3</parameter>", final=False)[1][0]["function"] == {"arguments": "123"}


def test_a_key_written_twice_reads_as_vllms_dict():
    text = "<tool_call>\n<function=f>\n<parameter=a>\n1\n</parameter>\n<parameter=b>\n2\n</parameter>\n" \
           "<parameter=a>\n3\n</parameter>\n</function>\n</tool_call>"
    arguments = _parser().parse(text, final=True).calls[0].arguments
    assert arguments == '{"a": "1", "b": "2", "a": "3"}'
    assert list(json.loads(arguments).items()) == [("a", "3"), ("b", "2")]  # vLLM's dict: first place, last value


# vLLM's conversion, case by case: (value, schema type, expected).
CONVERSIONS = [
    ("hello", "string", "hello"), ("  12 ", "string", "  12 "), ("null", "string", None), ("Null", "integer", None),
    ("42", "integer", 42), ("-7", "int64", -7), ("4.5", "integer", "4.5"), ("x", "uint", "x"),
    ("2.5", "number", 2.5), ("2.0", "number", 2), ("1e3", "float", 1000), ("nan", "number", "nan"),
    ("inf", "number", "inf"), ("abc", "number", "abc"),
    ("true", "boolean", True), ("TRUE", "bool", True), ("false", "boolean", False), ("1", "boolean", False),
    ('{"a": [1, null]}', "object", {"a": [1, None]}), ("[1, 2]", "array", [1, 2]),
    ("{'a': None}", "object", {"a": None}), ("{bad", "object", "{bad"), ("(1, 2)", "custom", (1, 2)),
    ("plain words", "custom", "plain words"), ("'quoted'", "any", "quoted"),
]


@pytest.mark.parametrize("value, kind, expected", CONVERSIONS)
def test_parameter_values_convert_by_their_schema_type(value, kind, expected):
    assert convert_parameter_value(value, "k", {"k": {"type": kind}}) == expected


def test_keys_without_a_type_or_schema_stay_text():
    assert convert_parameter_value("3", "k", {"k": {"description": "no type"}}) == "3"
    assert convert_parameter_value("3", "k", {"other": {"type": "integer"}}) == "3"
    assert convert_parameter_value("3", "k", {}) == "3"


# ------------------------------------------------------------ incremental parsing
EDGE_REPLIES = [
    "<tool_call><function=f>", "<function=f><parameter=a>null", "<function=f><parameter=a>\nnul",
    "<function=f><parameter=a>\nNULL\n", "<tool_call>\n<function=f>\n<parameter=a>\n\n</parameter>",
    "x <tool_call></tool_call> y <function=f>", "<tool_call>\n<function=get_weather>\n<parameter=days>\n1",
    "<function=f></function><tool_call><function=g></function></tool_call><function=h></function>",
    "<tool_call><function=f><parameter=a>v</tool_call><function=g>", "<tool_call><function=f</tool_call>",
    "<function=f><parameter=a<parameter=b>1", "<function=f><parameter=a>1</function></parameter>",
    "<tool_call><function=write_file><parameter=content>a\n</tool_c",
]
MUTATION_PIECES = ["<tool_call>", "</tool_call>", "<function=", "</function>", "<parameter=", "</parameter>",
                   "<function=get_weather>", "<parameter=days>", "<parameter=city>", ">", "<", "</", "\n", "\n\n",
                   "null", "NuLl", "3", "1.5", "true", "[1]", '{"a": 1}', '"', "\\", " ", "é", "x"]


def _replies(count: int, seed: int) -> list[str]:
    """The cases and edge replies with up to three insertions, deletions or cuts each."""
    rng = random.Random(seed)
    base, out = [text for text, _, _ in CASES] + MALFORMED + EDGE_REPLIES, []
    for _ in range(count):
        text = rng.choice(base)
        for _ in range(rng.randint(0, 3)):
            pos, op = rng.randint(0, len(text)), rng.random()
            if op < 0.5:
                text = text[:pos] + rng.choice(MUTATION_PIECES) + text[pos:]
            elif op < 0.8:
                text = text[:pos] + text[pos + rng.randint(1, 3):]
            else:
                text = text[:pos]
        out.append(text)
    return out


def test_incremental_parse_answers_what_parse_answers_after_every_delta():
    rng = random.Random(0)
    for text in _replies(600, seed=0):
        assert_incremental_parse_answers_what_parse_answers(_parser(), text, rng, text)


def test_streamed_deltas_are_those_of_a_stream_that_reparses_the_whole_text():
    rng = random.Random(1)
    for text in _replies(600, seed=1):
        assert_streamed_deltas_are_the_reparsing_streams(_parser, text, rng)


def test_a_reply_cut_anywhere_gives_the_same_calls_streamed_or_not():
    """Cut by max_tokens after every character: the unstreamed message is what the stream's
    deltas add up to; from the function's '>' on, the call is there."""
    text = "Let me.\n" + call("get_weather", city="Paris", days="3") + "\n" + call("write_file", path="b", content=CODE)
    for length in range(len(text) + 1):
        cut = text[:length]
        parsed = parse_reply(_parser(), cut, "length")
        for seed in (0, None):
            content, calls = _stream(_parser(), cut, seed, cut=True)
            assert (content, [(c["name"], c["arguments"]) for c in calls]) == \
                (parsed.content, [(c.name, c.arguments) for c in parsed.calls]), cut
        names = [name for name in ("get_weather", "write_file") if f"<function={name}>" in cut]
        assert [c.name for c in parsed.calls] == names
        assert parsed.content == ("Let me.\n" if names else cut)


# Values of every kind, and the text a model writes for them (strings without the markers).
_TEXT = st.lists(st.sampled_from(list("ab <>/=\n\"\\é{}[]:,") + ["null", "<tool", "</param", "\n</", "<parameter"]),
                 max_size=12).map("".join).filter(lambda s: "<parameter=" not in s and "</parameter>" not in s
                                             and "</function>" not in s and "</tool_call>" not in s)
_VALUES = st.one_of(st.tuples(st.just("string"), _TEXT),
                    st.tuples(st.just("integer"), st.integers(-10**6, 10**6)),
                    st.tuples(st.just("boolean"), st.booleans()),
                    st.tuples(st.just("array"), st.lists(st.integers(-9, 9), max_size=3)))


@settings(max_examples=150, deadline=None)
@given(calls=st.lists(st.dictionaries(st.sampled_from(["a", "b", "code"]), _VALUES, max_size=3), min_size=1,
                      max_size=3).map(lambda params: [(f"f_{index}", p) for index, p in enumerate(params)]),
       lead=st.sampled_from(["", "Sure.\n", "<tool "]), cuts=st.lists(st.integers(0, 400), max_size=6))
def test_rendered_calls_read_back_as_written_streamed_in_any_chunking(calls, lead, cuts):
    """Calls written as the template writes them parse back to their values (a string
    verbatim; one that reads null is null), and the stream cut anywhere adds up to it."""
    tools = [{"type": "function", "function": {"name": name, "parameters": {"type": "object", "properties": {
        key: {"type": kind} for key, (kind, _) in parameters.items()}}}} for name, parameters in calls]
    text = lead + "".join(
        call(name, **{key: value if kind == "string" else json.dumps(value) for key, (kind, value) in params.items()})
        for name, params in calls)
    parser = get_tool_parser("qwen3_coder", tools)
    parsed = parser.parse(text, final=True)
    expected = [(name, {key: (None if kind == "string" and value.lower() == "null" else value)
                        for key, (kind, value) in params.items()}) for name, params in calls]
    assert parsed.content == lead and [(c.name, json.loads(c.arguments)) for c in parsed.calls] == expected
    bounds = sorted({0, len(text), *(c % (len(text) + 1) for c in cuts)})
    streamer, content, streamed = ToolCallStreamer(get_tool_parser("qwen3_coder", tools)), "", []
    for start, end in zip(bounds, bounds[1:]):
        new_content, deltas = streamer.feed(text[start:end], final=end == len(text))
        content += new_content or ""
        for delta in deltas or ():
            if "id" in delta:
                streamed.append([delta["function"]["name"], ""])
            streamed[delta["index"]][1] += delta["function"]["arguments"]
    assert (content, streamed) == (parsed.content, [[c.name, c.arguments] for c in parsed.calls])


def test_long_reply_streamed_a_token_at_a_time_reads_each_character_a_bounded_number_of_times(monkeypatch):
    from raylm.deploy.tool_parsers import incremental

    read = [0]
    log_slice = incremental.TextLog.slice

    def counted_slice(self, start: int, end: int) -> str:
        piece = log_slice(self, start, end)
        read[0] += len(piece)
        return piece

    monkeypatch.setattr(incremental.TextLog, "slice", counted_slice)
    per_character = {}
    for size in (5_000, 20_000):
        rng = random.Random(size)
        lines = ["x = 1\n", "if a < b:\n", '    s = "<p>"\n', "\n", "é ✓ "]
        code = "".join(rng.choice(lines) for _ in range(size // 6))
        text = "Writing.\n" + call("write_file", path="big.py", content=code) + \
            call("get_weather", city="Oslo", days="2")
        tokens = _tokens(text)
        streamer, calls, read[0] = ToolCallStreamer(_parser()), [], 0
        for index, token in enumerate(tokens):
            read[0] += len(token)
            for delta in streamer.feed(token, final=index == len(tokens) - 1)[1] or ():
                if "id" in delta:
                    calls.append([delta["function"]["name"], ""])
                calls[delta["index"]][1] += delta["function"]["arguments"]
        assert calls == [[c.name, c.arguments] for c in _parser().parse(text, final=True).calls]
        per_character[size] = read[0] / len(text)
    # Each character: the delta, its escaped copy sent on, a slice or two; not the square.
    assert max(per_character.values()) < 6, per_character
    assert per_character[20_000] < 1.2 * per_character[5_000], per_character


class _ScanCountingText(str):
    """A reply that counts the characters its `find` calls scan (up to the match, or to the
    end of the range looked in)."""

    scanned = 0

    def find(self, sub: str, start: int = 0, end: int | None = None) -> int:
        at = super().find(sub, start, end)
        _ScanCountingText.scanned += (at if at != -1 else (len(self) if end is None else end)) - start
        return at


@pytest.mark.parametrize("unit", ["<function=f><parameter=a>x</parameter></function>",  # calls without tags
                                  "<parameter=a>x"])  # parameters without their end tags
def test_parse_of_many_calls_or_parameters_scans_each_character_a_bounded_number_of_times(unit):
    """Tagless calls looked for the next `<tool_call>` to the reply's end each, and values
    ended by the next `<parameter=` looked for `</parameter>` likewise: 20,000 calls took
    3 s to parse, 16 times as long as 5,000."""
    per_character = {}
    for count in (1_000, 4_000):
        body = unit * count
        text = body if unit.startswith("<function=") else f"<tool_call><function=f>{body}</function></tool_call>"
        _ScanCountingText.scanned = 0
        parsed = _parser().parse(_ScanCountingText(text), final=True)
        assert len(parsed.calls) == (count if unit.startswith("<function=") else 1)
        per_character[count] = _ScanCountingText.scanned / len(text)
    assert per_character[4_000] < 1.2 * per_character[1_000], per_character


# A chat template that renders earlier assistant turns' calls the way Qwen3-Coder's does
# (written here for the test): the function's name in the tag, its arguments, an object, as
# parameters, strings bare and other values as JSON.
CODER_TEMPLATE = (
    "{%- for message in messages %}<|im_start|>{{ message.role }}\n"
    "{%- if message.content %}{{ message.content }}{% endif %}"
    "{%- for tool_call in message.tool_calls or [] %}"
    "{%- if tool_call.function is defined %}{%- set tool_call = tool_call.function %}{%- endif %}"
    "{{- '\\n<tool_call>\\n<function=' + tool_call.name + '>\\n' }}"
    "{%- for key, value in tool_call.arguments | items %}"
    "{{- '<parameter=' + key + '>\\n' }}{{- value if value is string else value | tojson }}{{- '\\n</parameter>\\n' }}"
    "{%- endfor %}{{- '</function>\\n</tool_call>' }}{%- endfor %}<|im_end|>\n{%- endfor %}")


def test_earlier_turns_calls_render_as_the_model_writes_them_and_read_back():
    """The server hands earlier turns' tool_calls to the template with their arguments as
    objects (serving_chat.template_message, rendered by its ChatTemplateRenderer): a
    Qwen3-Coder-style template writes them in the XML form, which the parser reads back to
    the same calls."""
    from raylm.deploy.chat_template import ChatTemplateRenderer
    from raylm.deploy.protocol import ChatMessage
    from raylm.deploy.serving_chat import template_message

    arguments = {"city": "Paris", "days": 3, "metric": False, "hours": [9, 17], "note": None}
    message = ChatMessage(role="assistant", content=None, tool_calls=[
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": json.dumps(arguments)}}])
    rendered = ChatTemplateRenderer(100_000, 100_000).render(CODER_TEMPLATE, [template_message(message)])
    assert rendered.startswith("<|im_start|>assistant\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n")
    (parsed,) = _parser().parse(rendered, final=True).calls
    assert (parsed.name, json.loads(parsed.arguments)) == ("get_weather", arguments)


def test_a_qwen35_call_in_unclosed_thinking_reads_after_the_reasoning_split_in_any_chunking():
    """As the server streams it: qwen3's reasoning split (which ends the thinking at
    <tool_call><function=) feeds its content to this parser; the deltas add up to the whole
    reply's reasoning and call."""
    from raylm.deploy.reasoning_parsers import get_reasoning_parser

    reply = "<think>\nParis, for 3 days.\n" + call("get_weather", city="Paris", days="3")
    reasoning_parser = get_reasoning_parser("qwen3", None)
    split = reasoning_parser.split(reply, in_reasoning=True)
    assert split.reasoning == "\nParis, for 3 days.\n"
    parsed = parse_reply(_parser(), split.content, "stop")
    assert (parsed.content, [(c.name, json.loads(c.arguments)) for c in parsed.calls]) == \
        ("", [("get_weather", {"city": "Paris", "days": 3})])
    rng = random.Random(0)
    for _ in range(100):
        pieces = _pieces(reply, rng, longest=7)
        reasoning_stream, tool_stream = reasoning_parser.streamer(True), ToolCallStreamer(_parser())
        reasoning, content, arguments = "", "", ""
        for index, piece in enumerate(pieces):
            final = index == len(pieces) - 1
            r, c = reasoning_stream.feed(piece, final=final)
            content_delta, deltas = tool_stream.feed(c, final=final)
            reasoning += r
            content += content_delta or ""
            arguments += "".join(d["function"]["arguments"] for d in deltas or ())
        assert (reasoning, content, arguments) == (split.reasoning, "", parsed.calls[0].arguments)
