"""The reasoning ends where the model writes the end tag's token, for the split into
reasoning and content as for the engine (the grammar of a structured output starts after
that token): a reply that spells `</think>` in smaller pieces ("<", "/", "t", ...) is
still reasoning, and no content shows text the grammar did not constrain.

References: the split made by hand from the reply's token ids (the text decoded before the
end token, and after it), in every chunking of the stream, with a token's text arriving
in a later delta than its id (as a stop string's holdback delays it); and a real server
over a tiny model whose weights spell the tag before writing an answer."""

from __future__ import annotations

import json
import time
from pathlib import Path

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine_checks import assert_engine_idle
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


def _idle(engine) -> None:
    deadline = time.monotonic() + 10
    while engine.engine.has_unfinished_requests() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert_engine_idle(engine.engine)


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
    _idle(engine)
