"""Reasoning outputs over HTTP (`raylm serve --reasoning-parser`), on a tiny model whose
weights write a known reply: `<think>Ray places</think>The quick fox` after a prompt that
ends the generation prompt with a newline, `Ray places</think>The quick fox` after R1's
`<think>`, and `The quick fox` after Qwen3's closed `<think></think>`. The reference is that
chain, built into the weights and tokenized with the model's own tokenizer."""

from __future__ import annotations

import json
from pathlib import Path

import openai
import pytest

from raylm.deploy import cli

from server_process import start_servers, stop_server
from tiny_models import build_tiny_reasoning_model

MODEL = "thinker"
REASONING, ANSWER = "Ray places", "The quick fox"
# The tokens the model writes after the prompt's final newline, one piece each, then EOS.
CHAIN = ["\n", "<think>", "Ray", " places", "</think>", "The", " quick", " fox"]
USER = [{"role": "user", "content": "Where do workers go?"}]
CITY_TOOL = {"type": "function", "function": {
    "name": "pick_city", "parameters": {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}},
                                        "required": ["city"]}}}


# A second model thinks, then calls pick_city in Hermes' tags (Qwen3's tool calls): each JSON
# piece is one added token, since every token of a chain must be a different one.
CALL = ('{"name": "pick_city", ', '"arguments": {"city": "Paris"}}')
TOOL_CHAIN = ["\n", "<think>", "Ray", " places", "</think>", "<tool_call>", *CALL, "</tool_call>"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_reasoning_model(tmp_path_factory.mktemp("thinker"), CHAIN)


@pytest.fixture(scope="module")
def tool_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_reasoning_model(tmp_path_factory.mktemp("caller"), TOOL_CHAIN,
                                      added_tokens=("<tool_call>", "</tool_call>", *CALL))


@pytest.fixture(scope="module")
def servers(model_dir: Path, tool_model_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("reasoning_servers")
    # The template writes the tools' JSON into the prompt: some 190 tokens.
    common = ["--served-model-name", MODEL, "--max-model-len", "256"]
    started = start_servers([
        ([str(model_dir), *common, "--reasoning-parser", "qwen3"], root / "qwen3.log"),
        ([str(model_dir), *common, "--reasoning-parser", "deepseek_r1"], root / "r1.log"),
        ([str(tool_model_dir), *common, "--reasoning-parser", "qwen3", "--enable-auto-tool-choice",
          "--tool-call-parser", "hermes"], root / "tools.log")])
    try:
        yield {"qwen3": _client(started[0][1]), "deepseek_r1": _client(started[1][1]),
               "tools": _client(started[2][1])}
    finally:
        for process, _ in started:
            stop_server(process)


def _client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)


def _tokens(model_dir: Path, text: str) -> int:
    from transformers import AutoTokenizer

    return len(AutoTokenizer.from_pretrained(str(model_dir)).encode(text, add_special_tokens=False))


def _chat(client: openai.OpenAI, **kwargs):
    return client.chat.completions.create(model=MODEL, messages=USER, temperature=0, **kwargs)


def _streamed(client: openai.OpenAI, **kwargs) -> tuple[str | None, str | None, str, object, list]:
    """The stream's reasoning and content (joined deltas), finish_reason, usage and deltas."""
    reasoning, content, finish, usage, deltas = "", "", None, None, []
    for chunk in _chat(client, stream=True, stream_options={"include_usage": True}, **kwargs):
        usage = chunk.usage or usage
        for choice in chunk.choices:
            extra = choice.delta.model_extra or {}
            deltas.append((extra.get("reasoning"), choice.delta.content))
            reasoning += extra.get("reasoning") or ""
            content += choice.delta.content or ""
            finish = choice.finish_reason or finish
    return reasoning or None, content or None, finish, usage, deltas


@pytest.mark.parametrize("parser,template_kwargs", [("qwen3", None), ("deepseek_r1", None),
                                                     ("deepseek_r1", {"think_open": True})])
def test_reasoning_apart_from_content_streamed_or_not(servers, model_dir, parser, template_kwargs):
    client = servers[parser]
    extra = {"chat_template_kwargs": template_kwargs} if template_kwargs else {}
    response = _chat(client, extra_body=extra)
    choice = response.choices[0]
    assert (choice.message.model_extra["reasoning"], choice.message.content) == (REASONING, ANSWER)
    assert choice.finish_reason == "stop"
    # Usage: every token written (the tags and EOS too); reasoning the tokens between the tags.
    written = len(CHAIN) - 1 - (template_kwargs is not None) + 1
    assert response.usage.completion_tokens == written
    assert response.usage.completion_tokens_details.reasoning_tokens == _tokens(model_dir, REASONING)
    reasoning, content, finish, usage, deltas = _streamed(client, extra_body=extra)
    assert (reasoning, content, finish) == (REASONING, ANSWER, "stop")
    assert usage.model_dump() == response.usage.model_dump()
    # No delta carries a tag. (One delta may carry both parts, as in vLLM: a loaded server
    # sends the tokens a slow client has not read yet in one chunk, the tag between them.)
    assert not any("think>" in (r or "") + (c or "") for r, c in deltas)


def test_qwen3_enable_thinking_false_is_all_content(servers):
    extra = {"chat_template_kwargs": {"enable_thinking": False}}
    response = _chat(servers["qwen3"], extra_body=extra)
    message = response.choices[0].message
    assert (message.model_extra["reasoning"], message.content) == (None, ANSWER)
    assert response.usage.completion_tokens_details.reasoning_tokens == 0
    assert _streamed(servers["qwen3"], extra_body=extra)[:3] == (None, ANSWER, "stop")


def test_reply_cut_while_reasoning_is_all_reasoning(servers):
    response = _chat(servers["qwen3"], max_tokens=3)  # <think>, Ray, " places"
    message = response.choices[0].message
    assert (message.model_extra["reasoning"], message.content, response.choices[0].finish_reason) == \
        (REASONING, None, "length")
    assert _streamed(servers["qwen3"], max_tokens=3)[:3] == (REASONING, None, "length")


def test_include_reasoning_false_leaves_it_out(servers):
    response = _chat(servers["qwen3"], extra_body={"include_reasoning": False})
    assert (response.choices[0].message.model_extra["reasoning"], response.choices[0].message.content) == \
        (None, ANSWER)
    assert _streamed(servers["qwen3"], extra_body={"include_reasoning": False})[:2] == (None, ANSWER)
    # JSON true/false only: lax parsing read "no" as false.
    with pytest.raises(openai.BadRequestError, match="include_reasoning"):
        _chat(servers["qwen3"], extra_body={"include_reasoning": "no"})


def _chain_ids(model_dir: Path, pieces: list[str]) -> list[int]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    return [token_id for piece in pieces for token_id in tokenizer.encode(piece, add_special_tokens=False)]


def _token_metadata(client: openai.OpenAI, stream: bool, **extra) -> tuple[list[int], list[str], list[float]]:
    """A reply's token_ids, and its logprobs' tokens and logprobs, joined over the chunks."""
    common = dict(logprobs=True, top_logprobs=1, extra_body={"return_token_ids": True, **extra})
    if not stream:
        choice = _chat(client, **common).choices[0]
        entries = choice.logprobs.content if choice.logprobs else []
        return choice.model_extra["token_ids"], [e.token for e in entries], [e.logprob for e in entries]
    ids, tokens, logprobs = [], [], []
    for chunk in _chat(client, stream=True, **common):
        for choice in chunk.choices:
            ids += choice.model_extra.get("token_ids") or []
            entries = choice.logprobs.content if choice.logprobs else []
            tokens += [e.token for e in entries or ()]
            logprobs += [e.logprob for e in entries or ()]
    return ids, tokens, logprobs


@pytest.mark.parametrize("stream", [False, True])
def test_include_reasoning_false_hides_the_reasonings_token_ids_and_logprobs(servers, model_dir, stream):
    """The reasoning's tokens (<think> through </think>) leave token_ids and logprobs with
    its text; the answer's stay, as the full reply has them."""
    full_ids, full_tokens, full_logprobs = _token_metadata(servers["qwen3"], stream=False)
    reasoning_ids = _chain_ids(model_dir, CHAIN[1:5])  # <think> Ray places </think>
    assert full_ids[:len(reasoning_ids)] == reasoning_ids and len(full_tokens) == len(full_ids)
    answer = len(reasoning_ids)
    ids, tokens, logprobs = _token_metadata(servers["qwen3"], stream, include_reasoning=False)
    assert (ids, tokens) == (full_ids[answer:], full_tokens[answer:])
    assert logprobs == pytest.approx(full_logprobs[answer:], abs=1e-4)
    assert "".join(tokens).startswith(ANSWER)
    # Nothing to hide where thinking is off: every token stays.
    off = {"chat_template_kwargs": {"enable_thinking": False}}
    assert _token_metadata(servers["qwen3"], stream, include_reasoning=False, **off)[0] == \
        _token_metadata(servers["qwen3"], False, **off)[0]


@pytest.mark.parametrize("stream", [False, True])
def test_auto_tool_call_after_reasoning(servers, stream):
    """tool_choice auto: the reasoning apart, the call parsed from the answer after it, no
    content, finish_reason tool_calls; streamed, the deltas add up to the same."""
    if not stream:
        choice = _chat(servers["tools"], tools=[CITY_TOOL]).choices[0]
        calls = [(c.function.name, c.function.arguments) for c in choice.message.tool_calls]
        got = (choice.message.model_extra["reasoning"], choice.message.content, calls, choice.finish_reason)
    else:
        reasoning, content, finish, names, arguments = "", "", None, {}, {}
        for chunk in _chat(servers["tools"], tools=[CITY_TOOL], stream=True):
            for choice in chunk.choices:
                reasoning += (choice.delta.model_extra or {}).get("reasoning") or ""
                content += choice.delta.content or ""
                finish = choice.finish_reason or finish
                for call in choice.delta.tool_calls or ():
                    names[call.index] = names.get(call.index, "") + (call.function.name or "")
                    arguments[call.index] = arguments.get(call.index, "") + (call.function.arguments or "")
        calls = [(names[index], arguments[index]) for index in sorted(names)]
        got = (reasoning or None, content or None, calls, finish)
    reasoning, content, ((name, arguments),), finish = got
    assert (reasoning, content, name, finish) == (REASONING, None, "pick_city", "tool_calls")
    assert json.loads(arguments) == {"city": "Paris"}


def test_earlier_turns_reasoning_reaches_the_chat_template(servers, model_dir):
    """An assistant turn's reasoning, sent as `reasoning` (vLLM's) or `reasoning_content`
    (the older name), renders as transformers renders a message's reasoning_content (what
    Qwen3's template reads)."""
    import httpx
    from transformers import AutoTokenizer

    url = str(servers["qwen3"].base_url).removesuffix("/v1/")
    thought, answer = "Workers go to GPUs.", "To the GPUs."
    expected = AutoTokenizer.from_pretrained(str(model_dir)).apply_chat_template(
        [*USER, {"role": "assistant", "content": answer, "reasoning_content": thought},
         {"role": "user", "content": "And actors?"}], tokenize=True, add_generation_prompt=True)
    expected = list(getattr(expected, "input_ids", expected))
    for name in ("reasoning", "reasoning_content"):
        messages = [*USER, {"role": "assistant", "content": answer, name: thought},
                    {"role": "user", "content": "And actors?"}]
        tokens = httpx.post(url + "/tokenize", json={"model": MODEL, "messages": messages}).json()["tokens"]
        assert tokens == expected
    both = [{"role": "assistant", "content": answer, "reasoning": thought, "reasoning_content": "other"}]
    refused = httpx.post(url + "/v1/chat/completions", json={"model": MODEL, "messages": both})
    assert refused.status_code == 400 and "reasoning_content" in refused.json()["error"]["message"]


@pytest.mark.parametrize("stream", [False, True])
def test_structured_output_constrains_only_the_answer(servers, stream):
    """The regex holds from the token after </think>: the reasoning is the model's own; the
    answer, which the model would write as 'The quick fox', is one of the regex's."""
    extra = {"structured_outputs": {"regex": "(yes|no)"}}
    if stream:
        reasoning, content, finish, _, _ = _streamed(servers["qwen3"], extra_body=extra)
    else:
        message = _chat(servers["qwen3"], extra_body=extra).choices[0].message
        reasoning, content = message.model_extra["reasoning"], message.content
    assert reasoning == REASONING
    assert content in ("yes", "no")
    # Reasoning already ended in the prompt: the grammar holds from the first token.
    off = _chat(servers["qwen3"], extra_body={**extra, "chat_template_kwargs": {"enable_thinking": False}})
    assert off.choices[0].message.content in ("yes", "no")


def test_named_tool_call_is_parsed_from_the_answer(servers):
    response = _chat(servers["deepseek_r1"], tools=[CITY_TOOL],
                     tool_choice={"type": "function", "function": {"name": "pick_city"}})
    message = response.choices[0].message
    assert message.model_extra["reasoning"] == REASONING
    (call,) = message.tool_calls
    assert call.function.name == "pick_city"
    assert json.loads(call.function.arguments)["city"] in ("Paris", "Rome")


def test_unknown_parser_name_is_a_startup_error_naming_the_choices(capsys):
    with pytest.raises(SystemExit) as exited:
        cli.main(["serve", "some-model", "--reasoning-parser", "deepseek"])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert "--reasoning-parser: invalid choice: 'deepseek'" in err and "deepseek_r1" in err and "qwen3" in err, err


def test_offline_grammar_starts_after_the_reasoning_end_token(model_dir):
    """The engine's side, without the server: `reasoning_end_token_id` lets the chain run
    free up to </think>, then the regex holds; without it the regex holds from the start. A
    multi-token end (`reasoning_end_token_ids`, " places</think>") ends the reasoning where
    the output writes its tokens in a row; tokens of it written apart ("Ray", then later
    </think>) do not, and the chain runs on unconstrained."""
    from transformers import AutoTokenizer

    from raylm.engine import LLM, SamplingParams
    from raylm.engine.structured_output.params import StructuredOutputsError, StructuredOutputsParams

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    end_id = tokenizer.convert_tokens_to_ids("</think>")
    prompt = tokenizer.apply_chat_template(USER, tokenize=False, add_generation_prompt=True)
    places_id, ray_id = (tokenizer.encode(piece, add_special_tokens=False)[-1] for piece in (" places", "Ray"))
    llm = LLM(str(model_dir), max_model_len=128, max_num_seqs=4)
    try:
        gated, plain, gated_by_two, never_ended = llm.generate([prompt] * 4, [
            SamplingParams(temperature=0, max_tokens=16,
                           structured_outputs=StructuredOutputsParams(regex="(yes|no)", reasoning_end_token_id=end_id)),
            SamplingParams(temperature=0, max_tokens=16, structured_outputs=StructuredOutputsParams(regex="(yes|no)")),
            SamplingParams(temperature=0, max_tokens=16, structured_outputs=StructuredOutputsParams(
                regex="(yes|no)", reasoning_end_token_ids=[places_id, end_id])),
            SamplingParams(temperature=0, max_tokens=16, structured_outputs=StructuredOutputsParams(
                regex="(yes|no)", reasoning_end_token_ids=[ray_id, end_id]))])
        assert gated.outputs[0].text in ("<think>Ray places</think>yes", "<think>Ray places</think>no")
        assert plain.outputs[0].text in ("yes", "no")
        assert gated_by_two.outputs[0].text == gated.outputs[0].text
        assert never_ended.outputs[0].text.startswith("<think>Ray places</think>The quick fox")
    finally:
        llm.shutdown()
    with pytest.raises(StructuredOutputsError, match="reasoning_end_token_id must be a token id"):
        StructuredOutputsParams(regex="a", reasoning_end_token_id=-1)
    with pytest.raises(StructuredOutputsError, match="reasoning_end_token_ids must be a non-empty list"):
        StructuredOutputsParams(regex="a", reasoning_end_token_ids=[])
