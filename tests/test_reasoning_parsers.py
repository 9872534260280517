"""Reasoning parsers (deepseek_r1, qwen3): the split of replies written as DeepSeek-R1 and
Qwen3 write them into reasoning and content, against splits made by hand; streamed in any
chunking, the deltas add up to the whole reply's split; where the reply starts (inside the
reasoning or not) from the prompt's end and Qwen3's enable_thinking; the tokens counted as
reasoning; and the grammar of a structured output waiting for the reasoning's end."""

from __future__ import annotations

import copy
import random
from pathlib import Path

import pytest

from raylm.deploy.reasoning_parsers import REASONING_PARSERS, ReasoningSplit, get_reasoning_parser
from raylm.deploy.server_args import ServerArgs

# The parsers of <think> tags (openai_gptoss reads gpt-oss's harmony channels instead:
# test_harmony_parsers.py).
THINK_PARSERS = ["deepseek_r1", "qwen3"]
# (reply, expected reasoning, expected content), for a reply that starts inside the reasoning.
SPLITS = [
    # R1 (template opened <think>): the reply holds the end tag only.
    ("Okay, 9.11 < 9.8.\n</think>\n\n9.8 is greater.", "Okay, 9.11 < 9.8.\n", "\n\n9.8 is greater."),
    # Qwen3 and older R1: the reply opens <think> itself; the tag is dropped.
    ("<think>\nLet me count: 1 2 3.\n</think>\n\nThree.", "\nLet me count: 1 2 3.\n", "\n\nThree."),
    # Cut by max_tokens inside the reasoning: all reasoning, no content.
    ("<think>\nHmm, the user asks", "\nHmm, the user asks", None),
    ("Hmm, the user asks", "Hmm, the user asks", None),
    # Stopped right after the end tag: no content (vLLM's null).
    ("<think>Short.</think>", "Short.", None),
    # No reasoning at all.
    ("</think>Just the answer.", None, "Just the answer."),
    # Text that only looks like tags: a later <think> and a partial end tag stay where they are.
    ("a <think> b </thin c</think>d <think>e</think>", "a <think> b </thin c", "d <think>e</think>"),
    ("<", "<", None),
    ("<think", "<think", None),
    ("</think", "</think", None),
    ("", None, None),
]


def test_registry_and_unknown_parser_name():
    assert sorted(REASONING_PARSERS) == ["deepseek_r1", "openai_gptoss", "qwen3"]
    with pytest.raises(ValueError, match=r"reasoning_parser \(--reasoning-parser\) 'deepseek' is not one of "
                                         r"deepseek_r1, openai_gptoss, qwen3"):
        ServerArgs(reasoning_parser="deepseek")
    with pytest.raises(ValueError, match="reasoning_parser must be one of deepseek_r1, openai_gptoss, qwen3, got 'r1'"):
        ServerArgs.from_values({"reasoning_parser": "r1"})
    assert ServerArgs.from_values({"reasoning_parser": "qwen3"}).reasoning_parser == "qwen3"


@pytest.mark.parametrize("name", THINK_PARSERS)
@pytest.mark.parametrize("reply,reasoning,content", SPLITS)
def test_split_of_a_whole_reply(name, reply, reasoning, content):
    parser = get_reasoning_parser(name, None)
    assert parser.split(reply, in_reasoning=True) == ReasoningSplit(reasoning, content)
    # A reply that starts after the reasoning is all content, tags and all.
    assert parser.split(reply, in_reasoning=False) == ReasoningSplit(None, reply or None)


def _random_cuts(text: str, rng: random.Random) -> list[str]:
    cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(0, 6)))) if len(text) > 1 else []
    bounds = [0, *cuts, len(text)]
    pieces = [text[a:b] for a, b in zip(bounds, bounds[1:])]
    # Empty deltas happen too (a token whose text is not complete yet).
    for _ in range(rng.randint(0, 2)):
        pieces.insert(rng.randrange(len(pieces) + 1), "")
    return pieces


@pytest.mark.parametrize("reply,reasoning,content", SPLITS)
def test_streamed_deltas_add_up_to_the_split_in_any_chunking(reply, reasoning, content):
    assert_streams_add_up(get_reasoning_parser("deepseek_r1", None), reply, reasoning, content)


def assert_streams_add_up(parser, reply: str, reasoning: str | None, content: str | None) -> None:
    """The parser's streamer, fed the reply cut at random 200 times, gives out deltas that
    add up to (reasoning, content)."""
    rng = random.Random(reply)
    for _ in range(200):
        pieces = _random_cuts(reply, rng) or [""]
        streamer = parser.streamer(in_reasoning=True)
        got_reasoning, got_content = "", ""
        for index, piece in enumerate(pieces):
            r, c = streamer.feed(piece, final=index == len(pieces) - 1)
            got_reasoning += r
            got_content += c
            # Nothing is given out that a later delta could take back: what came out so far
            # is a prefix of the whole split.
            assert (reasoning or "").startswith(got_reasoning) and (content or "").startswith(got_content)
        assert (got_reasoning or None, got_content or None) == (reasoning, content), pieces


def test_a_stream_holds_back_only_what_may_be_a_tag():
    streamer = get_reasoning_parser("deepseek_r1", None).streamer(in_reasoning=True)
    assert streamer.feed("<thi", final=False) == ("", "")  # may be the start tag
    assert streamer.feed("s is", final=False) == ("<this is", "")
    assert streamer.feed(" it</", final=False) == (" it", "")  # may be the end tag
    assert streamer.feed("think>", final=False) == ("", "")
    assert streamer.reasoning_ended
    assert streamer.feed(" <done", final=False) == ("", " <done")  # content is never held back


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from transformers import AutoTokenizer

    from tiny_models import build_tokenizer, REASONING_CHAT_TEMPLATE, THINK_TAGS

    path: Path = tmp_path_factory.mktemp("reasoning_tokenizer")
    build_tokenizer(path, 512)
    tokenizer = AutoTokenizer.from_pretrained(str(path))
    tokenizer.add_tokens(list(THINK_TAGS))
    tokenizer.chat_template = REASONING_CHAT_TEMPLATE
    return tokenizer


def _prompt(tokenizer, **kwargs) -> str:
    messages = [{"role": "user", "content": "Which is greater?"}, {"role": "assistant", "content": "<think>x</think>"},
                {"role": "user", "content": "And now?"}]
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **kwargs)


def test_where_the_reply_starts(tokenizer):
    r1, qwen3 = get_reasoning_parser("deepseek_r1", tokenizer), get_reasoning_parser("qwen3", tokenizer)
    # The model opens <think> itself, or the template did (R1): the reply starts reasoning,
    # whatever tags earlier turns hold.
    for kwargs in ({}, {"think_open": True}):
        assert r1.starts_in_reasoning(_prompt(tokenizer, **kwargs), kwargs)
        assert qwen3.starts_in_reasoning(_prompt(tokenizer, **kwargs), kwargs)
    # Qwen3 with thinking off: the template closed an empty <think></think>.
    off = {"enable_thinking": False}
    assert _prompt(tokenizer, **off).endswith("<think></think>")
    assert not qwen3.starts_in_reasoning(_prompt(tokenizer, **off), off)
    assert not qwen3.starts_in_reasoning(_prompt(tokenizer), off)  # the switch alone turns it off
    assert not r1.starts_in_reasoning(_prompt(tokenizer, **off), off)  # the prompt closed it
    assert qwen3.starts_in_reasoning(_prompt(tokenizer), {"enable_thinking": True})


def test_tag_token_ids_and_reasoning_token_count(tokenizer):
    parser = get_reasoning_parser("qwen3", tokenizer)
    start, end = tokenizer.convert_tokens_to_ids(["<think>", "</think>"])
    assert (parser.start_token_id, parser.end_token_id) == (start, end)
    assert not parser.tags_are_special and parser.adjust_skip_special_tokens() is None
    thinking = tokenizer.encode("Let me count.", add_special_tokens=False)
    answer = tokenizer.encode("Three.", add_special_tokens=False)
    assert parser.count_reasoning_tokens([start, *thinking, end, *answer], True) == len(thinking)
    assert parser.count_reasoning_tokens([*thinking, end, *answer], True) == len(thinking)
    assert parser.count_reasoning_tokens([start, *thinking], True) == len(thinking)  # cut while thinking
    assert parser.count_reasoning_tokens([*answer], False) == 0
    # A tokenizer without the tags as tokens: the text split works, ids are unknown.
    plain = get_reasoning_parser("qwen3", None)
    assert plain.end_token_id is None and plain.count_reasoning_tokens([1, 2, 3], True) == 0


# A Qwen3 reply that thinks, then calls a tool (Hermes tags), as --tool-call-parser hermes reads it.
TOOL_REPLY = ('<think>\nThe user wants Paris; <tool_call> comes later.\n</think>\n\nChecking.\n<tool_call>\n'
              '{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>')


def test_tool_calls_are_parsed_from_the_content_after_the_reasoning():
    from raylm.deploy.tool_calls import ToolCallStreamer, parse_reply
    from raylm.deploy.tool_parsers import get_tool_parser

    reasoning_parser, tool_parser = get_reasoning_parser("qwen3", None), get_tool_parser("hermes")
    split = reasoning_parser.split(TOOL_REPLY, in_reasoning=True)
    # The <tool_call> mentioned while thinking is reasoning, not a call.
    assert split.reasoning == "\nThe user wants Paris; <tool_call> comes later.\n"
    parsed = parse_reply(tool_parser, split.content, "stop")
    assert parsed.content == "\n\nChecking.\n"
    assert [(c.name, c.arguments) for c in parsed.calls] == [("get_weather", '{"city": "Paris"}')]
    # Streamed as the server streams it: the reasoning streamer's content feeds the tool streamer.
    rng = random.Random(0)
    for _ in range(100):
        pieces = _random_cuts(TOOL_REPLY, rng)
        reasoning_stream, tool_stream = reasoning_parser.streamer(True), ToolCallStreamer(tool_parser)
        reasoning, content, arguments = "", "", ""
        for index, piece in enumerate(pieces):
            r, c = reasoning_stream.feed(piece, final=index == len(pieces) - 1)
            content_delta, calls = tool_stream.feed(c, final=index == len(pieces) - 1)
            reasoning += r
            content += content_delta or ""
            arguments += "".join(call["function"]["arguments"] for call in calls or ())
        assert (reasoning, content, arguments) == (split.reasoning, parsed.content, parsed.calls[0].arguments)


# Qwen3.5 opening a tool call while still thinking (its XML call format), without </think>:
# (reply, qwen3's reasoning, qwen3's content). deepseek_r1 has no such rule: all reasoning.
XML_CALL = "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>\n</tool_call>"
IMPLICIT_END_SPLITS = [
    ("<think>\nParis, then.\n" + XML_CALL, "\nParis, then.\n", XML_CALL),
    ("Paris.<tool_call><function name=\"f\"></function></tool_call>", "Paris.",
     "<tool_call><function name=\"f\"></function></tool_call>"),
    # A mention of the tag, then the call: the first confirmed tag ends the reasoning.
    ("Use <tool_call> for it. " + XML_CALL, "Use <tool_call> for it. ", XML_CALL),
    # A JSON (Hermes) call, or a tag followed by nothing that opens a function: still reasoning.
    ('<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>',
     '<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>', None),
    ("It ends with <tool_call>\n<func", "It ends with <tool_call>\n<func", None),
    ("<tool_call>\n<functional>", "<tool_call>\n<functional>", None),
    # </think> first: it ends the reasoning, and the call after it is content.
    ("Done.</think>\n" + XML_CALL, "Done.", "\n" + XML_CALL),
    # A call written inside the thinking, then </think>: the call came first.
    (XML_CALL + "</think>Paris", None, XML_CALL + "</think>Paris"),
]


@pytest.mark.parametrize("reply,reasoning,content", IMPLICIT_END_SPLITS)
def test_a_qwen3_tool_call_in_unclosed_thinking_ends_it(reply, reasoning, content):
    qwen3 = get_reasoning_parser("qwen3", None)
    assert qwen3.split(reply, in_reasoning=True) == ReasoningSplit(reasoning, content)
    r1 = get_reasoning_parser("deepseek_r1", None)
    before, _, after = reply.removeprefix("<think>").partition("</think>")
    assert r1.split(reply, in_reasoning=True) == ReasoningSplit(before or None, after or None)
    assert_streams_add_up(qwen3, reply, reasoning, content)


def test_a_stream_holds_a_tool_call_tag_back_until_the_text_after_it_tells():
    streamer = get_reasoning_parser("qwen3", None).streamer(in_reasoning=True)
    assert streamer.feed("Paris <tool_", final=False) == ("Paris ", "")
    assert streamer.feed("call>\n", final=False) == ("", "")
    assert streamer.feed("<func", final=False) == ("", "")
    assert streamer.feed("tion=f>", final=False) == ("", "<tool_call>\n<function=f>")
    assert streamer.reasoning_ended
    streamer = get_reasoning_parser("qwen3", None).streamer(in_reasoning=True)
    assert streamer.feed("<tool_call>\n", final=False) == ("", "")
    assert streamer.feed("{", final=False) == ("<tool_call>\n{", "")  # not a function: reasoning


def test_the_reasoning_token_span(tokenizer):
    """What include_reasoning false hides of the token ids, and usage's reasoning tokens."""
    qwen3, r1 = get_reasoning_parser("qwen3", tokenizer), get_reasoning_parser("deepseek_r1", tokenizer)
    start, end = tokenizer.convert_tokens_to_ids(["<think>", "</think>"])
    thinking = tokenizer.encode("Let me count.", add_special_tokens=False)
    answer = tokenizer.encode("Three.", add_special_tokens=False)
    for parser in (qwen3, r1):
        assert parser.reasoning_token_span([start, *thinking, end, *answer], True) == (len(thinking) + 2, 2)
        assert parser.reasoning_token_span([*thinking, end, *answer], True) == (len(thinking) + 1, 1)
        assert parser.reasoning_token_span([start, *thinking], True) == (len(thinking) + 1, 1)
        assert parser.reasoning_token_span([*answer], False) == (0, 0)
    # The end tag not one token: the ids cannot tell where the reasoning ends, all of it is hidden.
    plain = get_reasoning_parser("qwen3", None)
    assert plain.reasoning_token_span([*thinking, 7, *answer], True) == (len(thinking) + 1 + len(answer), 0)
    # Qwen3.5's call in unclosed thinking: the reasoning ends before <tool_call>'s token.
    tokenizer = copy.deepcopy(tokenizer)  # the module's tokenizer stays as it is
    tokenizer.add_tokens(["<tool_call>"])
    qwen3 = get_reasoning_parser("qwen3", tokenizer)
    call = tokenizer.encode(XML_CALL, add_special_tokens=False)
    assert call[0] == qwen3.implicit_end_token_id
    assert qwen3.reasoning_token_span([start, *thinking, *call], True) == (len(thinking) + 1, 1)
    assert qwen3.count_reasoning_tokens([start, *thinking, *call], True) == len(thinking)
    mention = tokenizer.encode("<tool_call> is a tag.", add_special_tokens=False)
    assert qwen3.reasoning_token_span([*mention, end, *answer], True) == (len(mention) + 1, 1)
    assert r1.reasoning_token_span([start, *thinking, *call], True) == (len(thinking) + 1 + len(call), 1)


def test_a_constrained_answer_ends_the_reasoning_where_its_grammar_starts(tokenizer):
    """Under a grammar the engine starts the answer after </think> or Qwen3's <tool_call>
    token (reasoning_implicit_end_token_id), at once: the split ends the reasoning there too,
    the tag dropped as </think> is, so that the content is what the grammar constrained, and
    without <tool_call> as one token only </think> ends it (the grammar cannot start there)."""
    tokenizer = copy.deepcopy(tokenizer)
    tokenizer.add_tokens(["<tool_call>"])
    start, end, tool_call = tokenizer.convert_tokens_to_ids(["<think>", "</think>", "<tool_call>"])
    qwen3 = get_reasoning_parser("qwen3", tokenizer)
    constrained = qwen3.for_constrained_answer()
    assert qwen3.grammar_start_token_ids() == (end, tool_call)
    thinking = tokenizer.encode("Let me see.", add_special_tokens=False)
    answer = tokenizer.encode('{"city": "Paris"}', add_special_tokens=False)
    ids = [start, *thinking, tool_call, *answer]
    text = tokenizer.decode(ids, skip_special_tokens=False)
    # The tokens after <tool_call> are the grammar's JSON, no <function=: the plain parser
    # keeps it all reasoning; the constrained one ends it at the tag's token.
    assert qwen3.split(text, True, ids) == ReasoningSplit(text.removeprefix("<think>"), None)
    assert constrained.split(text, True, ids) == ReasoningSplit("Let me see.", '{"city": "Paris"}')
    assert constrained.reasoning_token_span(ids, True) == (len(thinking) + 2, 2)
    assert constrained.count_reasoning_tokens(ids, True) == len(thinking)
    # Streamed a token at a time, the same.
    streamer, parts = constrained.streamer(in_reasoning=True), ["", ""]
    for index, token_id in enumerate(ids):
        delta = tokenizer.decode([token_id], skip_special_tokens=False)
        reasoning, content = streamer.feed(delta, index == len(ids) - 1, [token_id])
        parts = [parts[0] + reasoning, parts[1] + content]
    assert parts == ["Let me see.", '{"city": "Paris"}']
    # </think> first still ends it; the plain parser is untouched.
    assert constrained.split("<think>a</think>b", True, [start, *tokenizer.encode("a", add_special_tokens=False), end,
                                                         *tokenizer.encode("b", add_special_tokens=False)]) == \
        ReasoningSplit("a", "b")
    r1 = get_reasoning_parser("deepseek_r1", tokenizer)
    assert qwen3.implicit_end_opens_content and r1.for_constrained_answer().grammar_start_token_ids() == (end, None)
    # Without <tool_call> as one token the grammar waits for </think> alone, and so does the split.
    plain = get_reasoning_parser("qwen3", None).for_constrained_answer()
    assert plain.implicit_end_tag is None and plain.grammar_start_token_ids() == (None, None)
    assert plain.split(XML_CALL, True) == ReasoningSplit(XML_CALL, None)


def test_the_implicit_end_token_of_a_constraint_is_checked():
    from raylm.engine.structured_output.params import StructuredOutputsError, StructuredOutputsParams

    with pytest.raises(StructuredOutputsError, match="reasoning_implicit_end_token_id must be a token id"):
        StructuredOutputsParams(regex="a", reasoning_end_token_id=1, reasoning_implicit_end_token_id=-2)
    with pytest.raises(StructuredOutputsError, match="reasoning_implicit_end_token_id needs reasoning_end_token_id"):
        StructuredOutputsParams(regex="a", reasoning_implicit_end_token_id=2)
    assert StructuredOutputsParams(regex="a", reasoning_end_token_id=1,
                                   reasoning_implicit_end_token_id=2).reasoning_implicit_end_token_id == 2
