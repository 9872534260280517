"""gpt-oss's harmony replies split by the `openai_gptoss` reasoning parser and the `openai`
tool parser, on hand-built replies whose parts are written out by hand (vLLM's rules:
analysis -> reasoning, final and preambles -> content, messages to functions.NAME -> calls
with the body as arguments, other recipients dropped). Every reply is also streamed cut at
every boundary, and a token at a time, and must add up to the unstreamed split."""

from __future__ import annotations

import pytest

from tiny_models import build_harmony_tokenizer

WEATHER_CALL = ('<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>'
                '{"city":"Paris"}<|call|>')

# (reply, reasoning, content, calls) with tools (the openai tool parser reading the content).
CASES = {
    "analysis then final": (
        "<|channel|>analysis<|message|>Two plus two.<|end|><|start|>assistant<|channel|>final<|message|>Four.",
        "Two plus two.", "Four.", []),
    "final with its return token": (
        "<|channel|>analysis<|message|>Easy.<|end|><|start|>assistant<|channel|>final<|message|>Four.<|return|>",
        "Easy.", "Four.", []),
    "two analysis messages joined by a newline": (
        "<|channel|>analysis<|message|>First.<|end|><|start|>assistant<|channel|>analysis<|message|>Second.<|end|>"
        "<|start|>assistant<|channel|>final<|message|>Done.",
        "First.\nSecond.", "Done.", []),
    "preamble then a call with <|constrain|>json": (
        "<|channel|>analysis<|message|>Need weather.<|end|><|start|>assistant<|channel|>commentary<|message|>"
        "Checking.<|end|>" + WEATHER_CALL,
        "Need weather.", "Checking.", [("get_weather", '{"city":"Paris"}')]),
    "the recipient in the role's header, a bare json": (
        '<|channel|>analysis<|message|>Call it.<|end|><|start|>assistant to=functions.get_weather<|channel|>'
        'commentary json<|message|>{"city": "Rome"}<|call|>',
        "Call it.", None, [("get_weather", '{"city": "Rome"}')]),
    "a call without an end token (the engine dropped <|call|>)": (
        '<|channel|>analysis<|message|>Go.<|end|><|start|>assistant<|channel|>commentary to=functions.f '
        '<|constrain|>json<|message|>{"x": [1, 2]}',
        "Go.", None, [("f", '{"x": [1, 2]}')]),
    "arguments that are not JSON are passed on as written": (
        "<|channel|>analysis<|message|>Hm.<|end|><|start|>assistant<|channel|>commentary to=functions.f "
        "<|constrain|>json<|message|>{city: Paris<|call|>",
        "Hm.", None, [("f", "{city: Paris")]),
    "a built-in tool's recipient is neither call nor content": (
        "<|channel|>analysis to=browser.search code<|message|>{\"query\": \"x\"}<|call|>",
        None, None, []),
    "no analysis at all": (
        "<|channel|>final<|message|>Just this.", None, "Just this.", []),
    "cut inside the analysis": (
        "<|channel|>analysis<|message|>Halfway thr", "Halfway thr", None, []),
    "cut inside a header": (
        "<|channel|>analysis<|message|>Think.<|end|><|start|>assistant<|channel|>fin", "Think.", None, []),
    "text that looks like a marker's start stays text": (
        "<|channel|>analysis<|message|>a <| b <|en<|end|><|start|>assistant<|channel|>final<|message|>x <|st y",
        "a <| b <|en", "x <|st y", []),
}


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory):
    return build_harmony_tokenizer(tmp_path_factory.mktemp("harmony"))


def _parsers(tokenizer, with_tools: bool):
    from raylm.deploy.reasoning_parsers import get_reasoning_parser
    from raylm.deploy.tool_parsers import get_tool_parser

    tool_parser = get_tool_parser("openai") if with_tools else None
    return get_reasoning_parser("openai_gptoss", tokenizer).for_tool_parser(tool_parser), tool_parser


def _unstreamed(tokenizer, reply: str, with_tools: bool = True, in_reasoning: bool = True) -> tuple:
    from raylm.deploy.tool_calls import parse_reply

    reasoning_parser, tool_parser = _parsers(tokenizer, with_tools)
    split = reasoning_parser.split(reply, in_reasoning)
    if tool_parser is None:
        return split.reasoning, split.content, []
    parsed = parse_reply(tool_parser, split.content or "", "stop")
    return split.reasoning, parsed.content or None, [(call.name, call.arguments) for call in parsed.calls]


def _streamed(tokenizer, pieces: list[str], with_tools: bool = True, in_reasoning: bool = True) -> tuple:
    """The deltas' sums, as serving_chat's stream makes them."""
    from raylm.deploy.tool_calls import ToolCallStreamer

    reasoning_parser, tool_parser = _parsers(tokenizer, with_tools)
    splitter = reasoning_parser.streamer(in_reasoning)
    calls_streamer = ToolCallStreamer(tool_parser) if tool_parser is not None else None
    reasoning, content, calls = "", "", []
    for index, piece in enumerate(pieces):
        final = index == len(pieces) - 1
        reasoning_delta, content_delta = splitter.feed(piece, final)
        reasoning += reasoning_delta
        if calls_streamer is None:
            content += content_delta
            continue
        content_delta, call_deltas = calls_streamer.feed(content_delta, final=final)
        content += content_delta or ""
        for delta in call_deltas or ():
            if "id" in delta:
                calls.append([delta["function"]["name"], ""])
            calls[delta["index"]][1] += delta["function"]["arguments"]
    return reasoning or None, content or None, [tuple(call) for call in calls]


@pytest.mark.parametrize("case", CASES)
def test_unstreamed_split_is_vllms(tokenizer, case):
    reply, reasoning, content, calls = CASES[case]
    assert _unstreamed(tokenizer, reply) == (reasoning, content, calls)


@pytest.mark.parametrize("case", CASES)
def test_stream_cut_anywhere_adds_up_to_the_unstreamed_split(tokenizer, case):
    reply, reasoning, content, calls = CASES[case]
    for cut in range(len(reply) + 1):
        assert _streamed(tokenizer, [reply[:cut], reply[cut:]]) == (reasoning, content, calls), cut
    tokens = [tokenizer.decode([token_id], skip_special_tokens=False)
              for token_id in tokenizer.encode(reply, add_special_tokens=False)]
    assert "".join(tokens) == reply
    assert _streamed(tokenizer, tokens) == (reasoning, content, calls)
    assert _streamed(tokenizer, list(reply)) == (reasoning, content, calls)


def test_without_a_tool_parser_calls_are_left_out_of_the_content(tokenizer):
    """vLLM's parse_chat_output: the content is final messages and preambles only."""
    reply = CASES["preamble then a call with <|constrain|>json"][0] + \
        "<|start|>assistant<|channel|>final<|message|>Sunny."
    expected = ("Need weather.", "Checking.\nSunny.", [])
    assert _unstreamed(tokenizer, reply, with_tools=False) == expected
    for cut in range(len(reply) + 1):
        assert _streamed(tokenizer, [reply[:cut], reply[cut:]], with_tools=False) == expected


def test_a_constrained_answer_is_the_final_message_after_the_header_tokens(tokenizer):
    """Under structured outputs the grammar starts after the header's tokens as the tokenizer
    spells them, and the content is the final message alone (the preamble before it is not
    what the grammar constrained), streamed cut anywhere or whole; a parser without the
    markers as tokens has no such end."""
    from raylm.deploy.reasoning_parsers import get_reasoning_parser

    parser = get_reasoning_parser("openai_gptoss", tokenizer)
    assert parser.reasoning_end_token_ids() == tokenizer.encode("<|channel|>final<|message|>",
                                                                add_special_tokens=False)
    assert get_reasoning_parser("openai_gptoss", None).reasoning_end_token_ids() is None
    constrained = parser.for_constrained_answer()
    reply = CASES["preamble then a call with <|constrain|>json"][0].split("<|start|>assistant<|channel|>commentary to")[0] \
        + '<|start|>assistant<|channel|>final<|message|>{"ok": true}<|return|>'
    split = constrained.split(reply, True, tokenizer.encode(reply, add_special_tokens=False))
    assert (split.reasoning, split.content) == ("Need weather.", '{"ok": true}')
    assert parser.split(reply, True).content == 'Checking.\n{"ok": true}'
    for cut in range(len(reply) + 1):
        streamer = constrained.streamer(True)
        parts = [streamer.feed(reply[:cut], False), streamer.feed(reply[cut:], True)]
        assert ("".join(p[0] for p in parts), "".join(p[1] for p in parts)) == ("Need weather.", '{"ok": true}')


def test_a_prompt_that_opened_the_final_message_makes_the_reply_content(tokenizer):
    from raylm.deploy.reasoning_parsers import get_reasoning_parser

    parser = get_reasoning_parser("openai_gptoss", tokenizer)
    assert parser.starts_in_reasoning("<|start|>user<|message|>Hi<|end|><|start|>assistant", None)
    assert not parser.starts_in_reasoning("<|start|>assistant<|channel|>final<|message|>", None)
    assert _unstreamed(tokenizer, "Hello there.<|return|>", in_reasoning=False) == (None, "Hello there.", [])
    assert _streamed(tokenizer, ["Hello", " there.<|ret", "urn|>"], in_reasoning=False) == \
        (None, "Hello there.", [])


def test_reasoning_tokens_and_span_are_the_analysis_bodies_and_what_precedes_the_answer(tokenizer):
    """Usage's reasoning tokens are the analysis bodies' tokens; include_reasoning false hides
    the tokens up to the `<|end|>` of the last message before the answer's."""
    from raylm.deploy.reasoning_parsers import get_reasoning_parser

    parser = get_reasoning_parser("openai_gptoss", tokenizer)
    first, second = "Ray places one worker.", "Tensor parallelism."
    reply = (f"<|channel|>analysis<|message|>{first}<|end|><|start|>assistant<|channel|>analysis<|message|>{second}"
             f"<|end|><|start|>assistant<|channel|>final<|message|>Done.<|return|>")
    ids = tokenizer.encode(reply, add_special_tokens=False)
    body_tokens = len(tokenizer.encode(first, add_special_tokens=False)) + \
        len(tokenizer.encode(second, add_special_tokens=False))
    assert parser.count_reasoning_tokens(ids, True) == body_tokens
    # The special tokens cut the encoding: the reply's ids before its final message's are
    # those of the text before it.
    final_start = len(tokenizer.encode(reply[:reply.index("<|start|>assistant<|channel|>final")],
                                       add_special_tokens=False))
    assert tokenizer.decode(ids[final_start:], skip_special_tokens=False) == \
        "<|start|>assistant<|channel|>final<|message|>Done.<|return|>"
    assert parser.reasoning_token_span(ids, True) == (final_start, final_start - body_tokens)
    assert parser.reasoning_token_span(ids[:final_start - 1], True)[0] == final_start - 1  # no answer yet: all
    assert parser.reasoning_token_span(ids, False) == (0, 0)


def test_the_openai_tool_parser_needs_the_harmony_reasoning_parser():
    from raylm.deploy.server_args import ServerArgs

    assert ServerArgs(enable_auto_tool_choice=True, tool_call_parser="openai").reasoning_parser == "openai_gptoss"
    with pytest.raises(ValueError, match="openai_gptoss"):
        ServerArgs(enable_auto_tool_choice=True, tool_call_parser="openai", reasoning_parser="qwen3")


# What mutations insert into the replies above: the markers, headers' words and text.
MUTATION_PIECES = ["<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|call|>", "<|return|>", "<|constrain|>",
                   "assistant", "analysis", "final", "commentary", " to=functions.g", " to=browser.open", "json",
                   "<|", "|>", "<", "x", " ", "\n", '{"a": 1}']


def test_mutated_replies_stream_as_they_split_whole(tokenizer):
    """Replies with up to four random insertions (markers, header words, text), deletions or
    cuts, streamed in random pieces: the deltas add up to the unstreamed split, with tools
    and without."""
    import random

    rng = random.Random(7)
    replies = [reply for reply, *_ in CASES.values()]
    for _ in range(300):
        text = rng.choice(replies)
        for _ in range(rng.randint(1, 4)):
            pos, op = rng.randint(0, len(text)), rng.random()
            if op < 0.6:
                text = text[:pos] + rng.choice(MUTATION_PIECES) + text[pos:]
            elif op < 0.85:
                text = text[:pos] + text[pos + rng.randint(1, 4):]
            else:
                text = text[:pos]
        pieces, pos = [], 0
        while pos < len(text):
            size = rng.randint(0, 6)
            pieces.append(text[pos:pos + size])
            pos += size
        pieces.append("")
        with_tools = rng.random() < 0.7
        assert _streamed(tokenizer, pieces, with_tools) == _unstreamed(tokenizer, text, with_tools), text
        # The tool parser alone, on whatever text: its stream is its parse too.
        assert _tool_parser_streamed(pieces) == _tool_parser_parsed(text), text


def _tool_parser_parsed(text: str) -> tuple:
    from raylm.deploy.tool_calls import parse_reply
    from raylm.deploy.tool_parsers import get_tool_parser

    parsed = parse_reply(get_tool_parser("openai"), text, "stop")
    return parsed.content or None, [(call.name, call.arguments) for call in parsed.calls]


def _tool_parser_streamed(pieces: list[str]) -> tuple:
    from raylm.deploy.tool_calls import ToolCallStreamer
    from raylm.deploy.tool_parsers import get_tool_parser

    streamer, content, calls = ToolCallStreamer(get_tool_parser("openai")), "", []
    for index, piece in enumerate(pieces):
        content_delta, call_deltas = streamer.feed(piece, final=index == len(pieces) - 1)
        content += content_delta or ""
        for delta in call_deltas or ():
            if "id" in delta:
                calls.append([delta["function"]["name"], ""])
            calls[delta["index"]][1] += delta["function"]["arguments"]
    return content or None, [tuple(call) for call in calls]
