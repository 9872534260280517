"""The reasoning ends where the model writes the end tag's token, for the split into
reasoning and content as for the engine (the grammar of a structured output starts after
that token): a reply that spells `</think>` in smaller pieces ("<", "/", "t", ...) is
still reasoning, and no content shows text the grammar did not constrain.

References: the split made by hand from the reply's token ids (the text decoded before the
end token, and after it), in every chunking of the stream, with a token's text arriving
in a later delta than its id (as a stop string's holdback delays it); and a real server
over a tiny model whose weights spell the tag before writing an answer."""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine_checks import assert_async_engine_idle
from server_process import InProcessServer
from tiny_models import build_tiny_reasoning_model

# One token each in the tiny tokenizer (the tags are added tokens; the rest byte-level).
PIECES = ["<think>", "</think>", "<", "/", "t", "h", "i", "n", "k", ">", "Ray", " places", "x"]
START_TAG, END_TAG = "<think>", "</think>"
# The tiny model writes this after its prompt: the end tag spelled, then an answer, then EOS.
SPELLED_CHAIN = ["\n", "<think>", "Ray", " places", "<", "/", "t", "h", "i", "n", "k", ">", "The", " quick", " fox"]
SPELLED_REPLY = "Ray places</think>The quick fox"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_reasoning_model(tmp_path_factory.mktemp("speller"), SPELLED_CHAIN)


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir))


def _by_hand(tokenizer, token_ids: list[int]) -> tuple[str | None, str | None]:
    """The split of a reply that starts reasoning, from its tokens: the text decoded before
    the end token (a leading start tag dropped), and after it."""
    end_id = tokenizer.convert_tokens_to_ids(END_TAG)
    end = token_ids.index(end_id) if end_id in token_ids else len(token_ids)
    reasoning = tokenizer.decode(token_ids[:end]).removeprefix(START_TAG)
    content = tokenizer.decode(token_ids[end + 1:]) if end < len(token_ids) else ""
    return reasoning or None, content or None


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_streamed_and_whole_splits_end_at_the_end_token_not_its_spelling(tokenizer, data):
    from raylm.deploy.reasoning_parsers import get_reasoning_parser

    parser = get_reasoning_parser("qwen3", tokenizer)
    token_ids = [tokenizer.convert_tokens_to_ids(piece) if piece in (START_TAG, END_TAG)
                 else tokenizer.encode(piece, add_special_tokens=False)[0]
                 for piece in data.draw(st.lists(st.sampled_from(PIECES), max_size=24))]
    expected = _by_hand(tokenizer, token_ids)
    text = tokenizer.decode(token_ids)
    whole = parser.split(text, True, token_ids)
    assert (whole.reasoning, whole.content) == expected
    # Streamed: tokens cut into deltas; a delta's text may come with a later delta.
    cuts = sorted(set(data.draw(st.lists(st.integers(0, len(token_ids)), max_size=8))))
    groups = [token_ids[a:b] for a, b in zip([0, *cuts], [*cuts, len(token_ids)])]
    late = data.draw(st.lists(st.booleans(), min_size=len(groups), max_size=len(groups)))
    streamer = parser.streamer(in_reasoning=True)
    reasoning, content, carried = "", "", ""
    for index, group in enumerate(groups):
        final = index == len(groups) - 1
        carried += tokenizer.decode(group)
        if late[index] and not final:
            delta_text = ""  # held back, as a possible stop string holds it
        else:
            delta_text, carried = carried, ""
        r, c = streamer.feed(delta_text, final, group)
        reasoning, content = reasoning + r, content + c
    assert (reasoning or None, content or None) == expected, (groups, late)


# Qwen3's <tool_call> followed by <function=... ends unclosed thinking too: as a token of
# its own, whichever of it and the end token comes first (pieces: one token or a few each).
CALL_PIECES = ["<think>", "</think>", "<tool_call>", "<tool_", "call>", "<", "/", "think", ">", "<function=f>",
               "<function ", "{", "\n", " ", "Ray"]
IMPLICIT_END_LOOKAHEAD = 8  # tokens after <tool_call> read to confirm it (vLLM's lookahead)


@pytest.fixture(scope="module")
def call_tokenizer(tokenizer):
    call_tokenizer = copy.deepcopy(tokenizer)  # the module's tokenizer stays without <tool_call>
    call_tokenizer.add_tokens(["<tool_call>"])
    return call_tokenizer


def _by_hand_with_calls(tokenizer, token_ids: list[int]) -> tuple[str | None, str | None, int]:
    """The split from the tokens, and how many of them are the reasoning's: the end token ends
    it (after it), or, before it, a <tool_call> token whose next tokens decode to a
    `<function=` or `<function ` after any whitespace (at it: the call is content)."""
    end_id, call_id = tokenizer.convert_tokens_to_ids([END_TAG, "<tool_call>"])
    cut, after, span = len(token_ids), len(token_ids), len(token_ids)
    for index, token_id in enumerate(token_ids):
        lookahead = tokenizer.decode(token_ids[index + 1:index + 1 + IMPLICIT_END_LOOKAHEAD])
        if token_id == end_id:
            cut, after, span = index, index + 1, index + 1
            break
        if token_id == call_id and re.match(r"\s*<function[\s=]", lookahead):
            cut, after, span = index, index, index
            break
    reasoning = tokenizer.decode(token_ids[:cut]).removeprefix(START_TAG)
    return reasoning or None, tokenizer.decode(token_ids[after:]) or None, span


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_the_first_of_the_end_token_and_a_confirmed_tool_call_token_ends_the_reasoning(call_tokenizer, data):
    """Split, streamed split (text arriving late), the token span include_reasoning false
    hides and usage counts, and the token filter all end the reasoning at the same token."""
    from raylm.deploy.reasoning_parsers import get_reasoning_parser

    tokenizer = call_tokenizer
    parser = get_reasoning_parser("qwen3", tokenizer)
    pieces = data.draw(st.lists(st.sampled_from(CALL_PIECES), max_size=16))
    token_ids = [token_id for piece in pieces for token_id in tokenizer.encode(piece, add_special_tokens=False)]
    reasoning_expected, content_expected, span = _by_hand_with_calls(tokenizer, token_ids)
    whole = parser.split(tokenizer.decode(token_ids), True, token_ids)
    assert (whole.reasoning, whole.content) == (reasoning_expected, content_expected)
    assert parser.reasoning_token_span(token_ids, True)[0] == span
    cuts = sorted(set(data.draw(st.lists(st.integers(0, len(token_ids)), max_size=8))))
    groups = [token_ids[a:b] for a, b in zip([0, *cuts], [*cuts, len(token_ids)])]
    late = data.draw(st.lists(st.booleans(), min_size=len(groups), max_size=len(groups)))
    streamer, token_filter = parser.streamer(in_reasoning=True), parser.token_filter()
    reasoning, content, carried, kept_ids = "", "", "", []
    for index, group in enumerate(groups):
        final = index == len(groups) - 1
        carried += tokenizer.decode(group)
        if late[index] and not final:
            delta_text = ""
        else:
            delta_text, carried = carried, ""
        r, c = streamer.feed(delta_text, final, group)
        reasoning, content = reasoning + r, content + c
        kept_ids += token_filter.feed(group, group, streamer.reasoning_ended, final)[0]
        assert (reasoning_expected or "").startswith(reasoning) and (content_expected or "").startswith(content)
    assert (reasoning or None, content or None) == (reasoning_expected, content_expected), (groups, late)
    assert kept_ids == token_ids[span:]


def test_a_tool_call_spelled_in_pieces_does_not_end_the_reasoning(call_tokenizer):
    """Given the token ids, only <tool_call>'s own token opens a call in unclosed thinking;
    the end token still ends it where it comes first."""
    from raylm.deploy.reasoning_parsers import ReasoningSplit, get_reasoning_parser

    parser = get_reasoning_parser("qwen3", call_tokenizer)

    def encode(text: str) -> list[int]:
        return call_tokenizer.encode(text, add_special_tokens=False)

    spelled = [*encode("Ray"), *encode("<tool_"), *encode("call>"), *encode("<function=f>")]
    text = call_tokenizer.decode(spelled)
    assert parser.split(text, True, spelled) == ReasoningSplit(text, None)
    assert parser.split(text, True) == ReasoningSplit("Ray", "<tool_call><function=f>")  # the text alone
    as_token = [*encode("Ray"), *encode("<tool_call>"), *encode("<function=f>")]
    assert parser.split(call_tokenizer.decode(as_token), True, as_token) == \
        ReasoningSplit("Ray", "<tool_call><function=f>")
    closed_first = [*encode("Ray</think>"), *encode("<tool_call><function=f>")]
    assert parser.split(call_tokenizer.decode(closed_first), True, closed_first) == \
        ReasoningSplit("Ray", "<tool_call><function=f>")


# ------------------------------------------------------------------ server
@pytest.fixture(scope="module")
def server(model_dir):
    from raylm.deploy.server_args import ServerArgs
    from raylm.engine import AsyncLLMEngine, EngineArgs

    engine = AsyncLLMEngine.from_engine_args(EngineArgs(model=str(model_dir), max_model_len=128,
                                                        disable_log_stats=True))
    try:
        with InProcessServer(engine, ServerArgs(reasoning_parser="qwen3")) as base_url:
            yield base_url, engine
    finally:
        engine.shutdown()


def _chat(base_url: str, **fields) -> httpx.Response:
    body = {"messages": [{"role": "user", "content": "Where?"}], "temperature": 0, **fields}
    return httpx.post(f"{base_url}/v1/chat/completions", json=body, timeout=60)


def _streamed(reply: httpx.Response) -> tuple[str | None, str | None, list]:
    reasoning, content, calls = "", "", []
    for line in reply.text.splitlines():
        if line.startswith("data: {"):
            for choice in json.loads(line[6:])["choices"]:
                reasoning += choice["delta"].get("reasoning") or ""
                content += choice["delta"].get("content") or ""
                calls += choice["delta"].get("tool_calls") or []
    return reasoning or None, content or None, calls


@pytest.mark.parametrize("fields", [{}, {"structured_outputs": {"regex": "(yes|no)"}},
                                    {"response_format": {"type": "json_object"}}], ids=["plain", "regex", "json"])
def test_a_spelled_end_tag_leaves_the_reply_in_the_reasoning(server, fields):
    """The grammar never started (no end token): nothing of the reply is content, which it
    would otherwise be, unconstrained ("The quick fox" for a regex of yes or no)."""
    base_url, engine = server
    reply = _chat(base_url, **fields)
    assert reply.status_code == 200, reply.text
    message = reply.json()["choices"][0]["message"]
    assert (message["reasoning"], message["content"]) == (SPELLED_REPLY, None)
    streamed = _chat(base_url, stream=True, **fields)
    assert _streamed(streamed)[:2] == (SPELLED_REPLY, None)
    assert_async_engine_idle(engine)
