"""The OpenAI-compatible server, as a real `raylm serve` process driven by the official
`openai` client: results equal `LLM.generate`'s, errors have OpenAI's shape and leave the
server serving, many streams run at once, and disconnected clients leave nothing behind."""

from __future__ import annotations

import asyncio
import json
import re
import time
from pathlib import Path

import httpx
import openai
import pytest
from server_process import free_port, running_server  # noqa: F401 - free_port is imported by other tests

from raylm.engine.llm import LLM
from raylm.engine.sampling_params import SamplingParams

API_KEY = "test-key"
MODEL = "tiny-llama"
ENGINE_KWARGS = dict(num_gpu_blocks_override=512)
PROMPTS = ["The quick brown fox", "Paged attention stores", "Hello, world!", "for i in range(10):"]


@pytest.fixture(scope="module")
def server_log(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("server") / "server.log"


@pytest.fixture(scope="module")
def server(llama_dir: Path, server_log: Path):
    log = server_log
    with running_server([str(llama_dir), "--api-key", API_KEY, "--served-model-name", MODEL,
                         "--num-gpu-blocks-override", str(ENGINE_KWARGS["num_gpu_blocks_override"])], log) as (_, url):
        yield url


@pytest.fixture(scope="module")
def client(server: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=server + "/v1", api_key=API_KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def llm(llama_dir: Path) -> LLM:
    llm = LLM(str(llama_dir), **ENGINE_KWARGS)
    yield llm
    llm.shutdown()


def greedy(llm: LLM, prompts, max_tokens: int = 16, **kwargs) -> list:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, **kwargs)
    return llm.generate(prompts, params, use_tqdm=False)


def stream_text(stream) -> tuple[dict[int, str], dict[int, str | None], object]:
    """Joins a completion or chat stream: text and finish reason per choice, and usage."""
    texts: dict[int, str] = {}
    reasons: dict[int, str | None] = {}
    usage = None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            piece = choice.text if hasattr(choice, "text") else (choice.delta.content or "")
            texts[choice.index] = texts.get(choice.index, "") + piece
            if choice.finish_reason is not None:
                assert reasons.get(choice.index) is None, "a choice finished twice"
                reasons[choice.index] = choice.finish_reason
    return texts, reasons, usage


# ----------------------------------------------------------------- basics
def test_models_health_version_and_tokenize(server, client, llm):
    assert [m.id for m in client.models.list().data] == [MODEL]
    auth = {"Authorization": f"Bearer {API_KEY}"}  # every route but /health and /metrics needs it
    assert httpx.get(server + "/version", headers=auth).json()["version"]
    tokens = httpx.post(server + "/tokenize", json={"prompt": PROMPTS[0]}, headers=auth).json()
    assert tokens["tokens"] == llm.get_tokenizer().encode(PROMPTS[0]) and tokens["count"] == len(tokens["tokens"])
    text = httpx.post(server + "/detokenize", json={"tokens": tokens["tokens"]}, headers=auth).json()["prompt"]
    assert text == PROMPTS[0]


def test_greedy_completion_equals_llm_generate(client, llm):
    expected = greedy(llm, PROMPTS)
    response = client.completions.create(model=MODEL, prompt=PROMPTS, max_tokens=16, temperature=0)
    assert response.object == "text_completion"
    assert [c.text for c in sorted(response.choices, key=lambda c: c.index)] == [o.outputs[0].text for o in expected]
    assert response.usage.prompt_tokens == sum(len(o.prompt_token_ids) for o in expected)
    assert response.usage.completion_tokens == sum(len(o.outputs[0].token_ids) for o in expected)
    assert response.usage.total_tokens == response.usage.prompt_tokens + response.usage.completion_tokens


def test_streamed_completion_equals_llm_generate_and_reports_usage(client, llm):
    expected = greedy(llm, PROMPTS[1])[0].outputs[0]
    stream = client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=16, temperature=0, stream=True,
                                       stream_options={"include_usage": True})
    texts, reasons, usage = stream_text(stream)
    assert texts == {0: expected.text} and reasons == {0: expected.finish_reason}
    assert usage.completion_tokens == len(expected.token_ids)


@pytest.mark.parametrize("chat", [False, True])
def test_continuous_usage_stats_puts_each_choices_usage_so_far_in_every_chunk(client, llm, chat):
    # vLLM's stream_options.continuous_usage_stats was accepted and ignored: usage came once.
    options = {"include_usage": True, "continuous_usage_stats": True}
    common = dict(model=MODEL, max_tokens=6, temperature=1.0, n=2, stream=True, stream_options=options,
                  extra_body={"ignore_eos": True})
    if chat:
        messages = [{"role": "user", "content": PROMPTS[0]}]
        tokenizer = llm.get_tokenizer()
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        prompt_tokens = len(tokenizer.encode(text, add_special_tokens=False))
        chunks = list(client.chat.completions.create(messages=messages, **common))
    else:
        prompt_tokens = len(llm.get_tokenizer().encode(PROMPTS[0]))
        chunks = list(client.completions.create(prompt=PROMPTS[0], **common))
    so_far = {0: 0, 1: 0}
    for chunk in chunks[:-1]:
        (choice,) = chunk.choices
        assert chunk.usage.prompt_tokens == prompt_tokens
        assert chunk.usage.completion_tokens >= so_far[choice.index]
        assert chunk.usage.total_tokens == prompt_tokens + chunk.usage.completion_tokens
        so_far[choice.index] = chunk.usage.completion_tokens
    assert so_far == {0: 6, 1: 6}
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12


def test_token_id_prompt_equals_text_prompt(client, llm):
    token_ids = llm.get_tokenizer().encode(PROMPTS[2])
    expected = greedy(llm, PROMPTS[2])[0].outputs[0].text
    response = client.completions.create(model=MODEL, prompt=token_ids, max_tokens=16, temperature=0)
    assert response.choices[0].text == expected
    batch = client.completions.create(model=MODEL, prompt=[token_ids, token_ids[:3]], max_tokens=4, temperature=0)
    assert len(batch.choices) == 2 and batch.choices[0].text == expected[:len(batch.choices[0].text)]


def test_greedy_chat_equals_llm_chat_streamed_and_not(client, llm):
    messages = [{"role": "user", "content": "Hello, how are you?"}]
    expected = llm.chat(messages, SamplingParams(temperature=0, max_tokens=16), use_tqdm=False)[0].outputs[0]
    response = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=16, temperature=0)
    assert response.object == "chat.completion"
    assert response.choices[0].message.role == "assistant"
    assert response.choices[0].message.content == expected.text
    assert response.choices[0].finish_reason == expected.finish_reason
    assert response.usage.completion_tokens == len(expected.token_ids)
    stream = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=16, temperature=0,
                                            stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant" and chunks[0].object == "chat.completion.chunk"
    texts, reasons, usage = stream_text(iter(chunks))
    assert texts == {0: expected.text} and reasons == {0: expected.finish_reason}
    assert usage.prompt_tokens == response.usage.prompt_tokens


def test_n_samples_each_finish_once_streamed_and_not(client):
    response = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=8, temperature=1.0, n=3,
                                         seed=1)
    assert sorted(c.index for c in response.choices) == [0, 1, 2]
    assert len(response.choices) <= response.usage.completion_tokens <= 3 * 8
    stream = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], n=3,
                                            max_tokens=8, temperature=1.0, seed=1, stream=True)
    texts, reasons, _ = stream_text(stream)
    assert sorted(reasons) == [0, 1, 2] and all(reasons.values())


def test_completion_logprobs_match_llm_generate(client, llm):
    expected = greedy(llm, PROMPTS[3], max_tokens=6, logprobs=2)[0].outputs[0]
    response = client.completions.create(model=MODEL, prompt=PROMPTS[3], max_tokens=6, temperature=0, logprobs=2)
    logprobs = response.choices[0].logprobs
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == len(logprobs.top_logprobs) == 6
    # Tokens are decoded one by one (a lone byte of a UTF-8 character reads as U+FFFD),
    # and text_offset counts the characters of those token strings, as in vLLM.
    assert logprobs.text_offset == [sum(len(t) for t in logprobs.tokens[:i]) for i in range(6)]
    for position, (token_id, entry) in enumerate(zip(expected.token_ids, expected.logprobs)):
        assert logprobs.token_logprobs[position] == pytest.approx(entry[token_id].logprob, abs=1e-4)
        assert 1 <= len(logprobs.top_logprobs[position]) <= 3
        assert max(logprobs.top_logprobs[position].values()) == pytest.approx(logprobs.token_logprobs[position],
                                                                              abs=1e-4)  # greedy: the top one


def test_return_tokens_as_token_ids_in_a_request_names_tokens_by_id_on_a_server_without_the_flag(client, llm):
    expected = greedy(llm, PROMPTS[3], max_tokens=4, logprobs=1)[0].outputs[0]
    response = client.completions.create(model=MODEL, prompt=PROMPTS[3], max_tokens=4, temperature=0, logprobs=1,
                                         extra_body={"return_tokens_as_token_ids": True})
    assert response.choices[0].logprobs.tokens == [f"token_id:{token_id}" for token_id in expected.token_ids]
    plain = client.completions.create(model=MODEL, prompt=PROMPTS[3], max_tokens=4, temperature=0, logprobs=1)
    assert plain.choices[0].logprobs.tokens == [entry[token_id].decoded_token
                                                for token_id, entry in zip(expected.token_ids, expected.logprobs)]


def test_echo_prepends_the_prompt_with_prompt_logprobs(client):
    response = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=4, temperature=0, echo=True,
                                         logprobs=1)
    choice = response.choices[0]
    assert choice.text.startswith(PROMPTS[0])
    assert choice.logprobs.token_logprobs[0] is None and choice.logprobs.token_logprobs[-1] is not None
    assert len(choice.logprobs.tokens) == response.usage.prompt_tokens + response.usage.completion_tokens


def test_chat_logprobs_have_openai_shape(client):
    response = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}],
                                              max_tokens=5, temperature=0, logprobs=True, top_logprobs=3)
    content = response.choices[0].logprobs.content
    assert len(content) == response.usage.completion_tokens
    for entry in content:
        assert entry.bytes == list(entry.token.encode())
        assert len(entry.top_logprobs) == 3
        assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob, abs=1e-4)


def test_stop_string_cuts_the_text_streamed_and_not(client, llm):
    full = greedy(llm, PROMPTS[0], max_tokens=24, ignore_eos=True)[0].outputs[0].text
    stop = full[5:9]
    expected = full[:full.index(stop)]
    response = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=24, temperature=0, stop=stop,
                                         extra_body={"ignore_eos": True})
    choice = response.choices[0]
    assert (choice.text, choice.finish_reason, choice.model_extra["stop_reason"]) == (expected, "stop", stop)
    stream = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=24, temperature=0, stop=[stop],
                                       stream=True, extra_body={"ignore_eos": True})
    texts, reasons, _ = stream_text(stream)
    assert texts == {0: expected} and reasons == {0: "stop"}


# ----------------------------------------------------------------- errors
LONG_PROMPT = [5] * 300  # the tiny model's context is 256 tokens

CHAT = [{"role": "user", "content": "Hi"}]

# case: (route, body, status, the error's "param": the request field it names)
BAD_REQUESTS = {
    "negative temperature": ("/v1/completions", {"prompt": "Hi", "temperature": -1}, 400, "temperature"),
    "n zero": ("/v1/completions", {"prompt": "Hi", "n": 0}, 400, "n"),
    "n above the limit": ("/v1/completions", {"prompt": "x", "n": 1_000_000, "temperature": 1}, 400, "n"),
    "best_of above the limit": ("/v1/completions", {"prompt": "x", "best_of": 20_000, "temperature": 1}, 400,
                                "best_of"),
    "top_p above one": ("/v1/completions", {"prompt": "Hi", "top_p": 1.5}, 400, "top_p"),
    "top_k below -1": ("/v1/completions", {"prompt": "Hi", "top_k": -2}, 400, "top_k"),
    "best_of below n": ("/v1/completions", {"prompt": "Hi", "n": 2, "best_of": 1, "temperature": 1}, 400, "best_of"),
    # The error named best_of, which the request did not set.
    "greedy n above one": ("/v1/completions", {"prompt": "Hi", "n": 3, "temperature": 0}, 400, "n"),
    "chat greedy n above one": ("/v1/chat/completions", {"messages": CHAT, "n": 2, "temperature": 0}, 400, "n"),
    "greedy best_of above one": ("/v1/completions", {"prompt": "Hi", "best_of": 3, "temperature": 0}, 400,
                                 "best_of"),
    "negative max_tokens": ("/v1/completions", {"prompt": "Hi", "max_tokens": -1}, 400, "max_tokens"),
    "min_tokens above max_tokens": ("/v1/completions", {"prompt": "Hi", "max_tokens": 2, "min_tokens": 3}, 400,
                                    "min_tokens"),
    "empty stop string": ("/v1/completions", {"prompt": "Hi", "stop": [""]}, 400, "stop"),
    "prompt over context": ("/v1/completions", {"prompt": LONG_PROMPT}, 400, "prompt"),
    "100,000-character prompt": ("/v1/completions", {"prompt": "Hello world " * 8_334}, 400, "prompt"),
    "prompt plus max_tokens over context": ("/v1/completions", {"prompt": [5] * 200, "max_tokens": 100}, 400,
                                            "max_tokens"),
    "token id outside vocabulary": ("/v1/completions", {"prompt": [10**6]}, 400, "prompt"),
    "empty prompt list": ("/v1/completions", {"prompt": []}, 400, "prompt"),
    "token-id prompt of booleans": ("/v1/completions", {"prompt": [True, False]}, 400, "prompt"),
    "token-id prompt with a numeric string": ("/v1/completions", {"prompt": [["5", 6]]}, 400, "prompt"),
    "stop_token_ids of booleans": ("/v1/completions", {"prompt": "Hi", "stop_token_ids": [True]}, 400,
                                   "stop_token_ids"),
    "/detokenize tokens of booleans": ("/detokenize", {"tokens": [True, 5]}, 400, "tokens"),
    "logit_bias out of range": ("/v1/completions", {"prompt": "Hi", "logit_bias": {"5": 500}}, 400, "logit_bias"),
    "logit_bias key not a token id": ("/v1/completions", {"prompt": "Hi", "logit_bias": {"a": 1}}, 400,
                                      "logit_bias"),
    "logit_bias token outside vocabulary": ("/v1/completions", {"prompt": "Hi", "logit_bias": {"100000": 1}}, 400,
                                            "logit_bias"),
    "logprobs above the vocabulary": ("/v1/completions", {"prompt": "Hi", "logprobs": 100_000}, 400, "logprobs"),
    "stream_options without stream": ("/v1/completions", {"prompt": "Hi", "stream_options": {}}, 400,
                                      "stream_options"),
    "suffix": ("/v1/completions", {"prompt": "Hi", "suffix": "x"}, 400, "suffix"),
    "missing prompt": ("/v1/completions", {"max_tokens": 4}, 400, "prompt"),
    "prompt of wrong type": ("/v1/completions", {"prompt": {"a": 1}}, 400, "prompt"),
    "max_tokens of wrong type": ("/v1/completions", {"prompt": "Hi", "max_tokens": "many"}, 400, "max_tokens"),
    "empty messages": ("/v1/chat/completions", {"messages": []}, 400, "messages"),
    "message without a role": ("/v1/chat/completions", {"messages": [{"content": "Hi"}]}, 400, "messages"),
    "image content part": ("/v1/chat/completions", {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "x"}}]}]}, 400, "messages"),
    "text part whose text is a number": ("/v1/chat/completions", {"messages": [{"role": "user", "content": [
        {"type": "text", "text": 5}]}]}, 400, "messages"),
    "text part without text": ("/v1/chat/completions", {"messages": [{"role": "user", "content": [
        {"type": "text"}]}]}, 400, "messages"),
    "/tokenize text part whose text is a list": ("/tokenize", {"messages": [{"role": "user", "content": [
        {"type": "text", "text": ["a", "b"]}]}]}, 400, "messages"),
    "top_logprobs above 20": ("/v1/chat/completions", {"messages": CHAT, "logprobs": True, "top_logprobs": 21}, 400,
                              "top_logprobs"),
    "top_logprobs without logprobs": ("/v1/chat/completions", {"messages": CHAT, "top_logprobs": 2}, 400,
                                      "top_logprobs"),
    "chat negative temperature": ("/v1/chat/completions", {"messages": CHAT, "temperature": -1}, 400, "temperature"),
    "chat over context": ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi " * 300}]}, 400,
                          "messages"),
    "unknown model": ("/v1/completions", {"prompt": "Hi", "model": "gpt-17"}, 404, "model"),
    "empty cache_salt": ("/v1/completions", {"prompt": "Hi", "cache_salt": ""}, 400, "cache_salt"),
    "cache_salt over 1024 characters": ("/v1/chat/completions", {"messages": CHAT, "cache_salt": "s" * 1025}, 400,
                                        "cache_salt"),
    "cache_salt of wrong type": ("/v1/completions", {"prompt": "Hi", "cache_salt": 7}, 400, "cache_salt"),
}


def _check_error(response: httpx.Response, status: int, param: str | None = None) -> None:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert isinstance(error["message"], str) and error["message"]
    assert isinstance(error["type"], str) and error["code"] == status
    assert "param" in error
    if param is not None:
        assert error["param"] == param, error


@pytest.mark.parametrize("case", list(BAD_REQUESTS))
def test_bad_request_gets_openai_error_naming_its_field_and_server_keeps_serving(server, client, case):
    path, body, status, param = BAD_REQUESTS[case]
    body = {"model": MODEL, **body}
    response = httpx.post(server + path, json=body, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60)
    _check_error(response, status, param)
    assert client.completions.create(model=MODEL, prompt="Hi", max_tokens=2).choices[0].finish_reason


def test_a_tool_call_whose_arguments_nest_past_pythons_json_parser_is_kept_as_text(server, client):
    # The arguments are handed to the chat template as an object when they parse; 100,000
    # brackets raised RecursionError in json.loads, a 500.
    call = {"id": "call-1", "type": "function", "function": {"name": "f", "arguments": "[" * 100_000}}
    messages = [*CHAT, {"role": "assistant", "content": "", "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "call-1", "content": "1"}]
    response = httpx.post(server + "/v1/chat/completions", json={"model": MODEL, "messages": messages, "max_tokens": 2},
                          headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60)
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["finish_reason"] in ("length", "stop")


def test_bad_streamed_request_names_its_field_too(server):
    body = {"model": MODEL, "prompt": "Hi", "stream": True, "n": 2, "best_of": 3, "temperature": 1}
    response = httpx.post(server + "/v1/completions", json=body, headers={"Authorization": f"Bearer {API_KEY}"})
    _check_error(response, 400, "best_of")


def test_malformed_json_is_400(server, client):
    response = httpx.post(server + "/v1/completions", content=b'{"prompt": "Hi",',
                          headers={"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"})
    _check_error(response, 400)
    assert client.completions.create(model=MODEL, prompt="Hi", max_tokens=2).choices[0].text is not None


@pytest.mark.parametrize("body,says", [
    (b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", "nests deeper than its JSON parser goes"),
    (b'{"prompt": "\xff\xfe"}', "not UTF-8 text: invalid start byte at byte 12"),
    (b'{"prompt": "Hi", "seed": ' + b"9" * 5000 + b"}", "Exceeds the limit (4300 digits)"),
], ids=["nested 100,000 deep", "not UTF-8", "a 5,000-digit integer"])
def test_a_body_json_loads_raises_on_is_400_saying_why(server, client, body, says):
    # FastAPI answers these "There was an error parsing the body", whatever the cause.
    response = httpx.post(server + "/v1/completions", content=body,
                          headers={"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"})
    _check_error(response, 400)
    assert says in response.json()["error"]["message"], response.text
    assert client.completions.create(model=MODEL, prompt="Hi", max_tokens=2).choices[0].finish_reason


def test_missing_or_wrong_api_key_is_401_and_openai_client_raises(server, client):
    for headers in ({}, {"Authorization": "Bearer wrong"}):
        _check_error(httpx.post(server + "/v1/completions", json={"prompt": "Hi"}, headers=headers), 401)
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server + "/v1", api_key="wrong", max_retries=0).models.list()
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL, prompt=LONG_PROMPT)
    assert httpx.get(server + "/health").status_code == 200  # not behind the key
    assert client.completions.create(model=MODEL, prompt="Hi", max_tokens=2).choices[0].finish_reason


# ------------------------------------------------------------- under load
def test_64_concurrent_streams_are_complete_and_correct(server, llm):
    prompts = [f"{PROMPTS[i % len(PROMPTS)]} {i}" for i in range(64)]
    expected = [o.outputs[0].text for o in greedy(llm, prompts, max_tokens=16, ignore_eos=True)]
    client = openai.AsyncOpenAI(base_url=server + "/v1", api_key=API_KEY, max_retries=0, timeout=120)

    async def one(prompt: str) -> tuple[str, str | None, int]:
        stream = await client.completions.create(model=MODEL, prompt=prompt, max_tokens=16, temperature=0,
                                                 stream=True, stream_options={"include_usage": True},
                                                 extra_body={"ignore_eos": True})
        text, reason, tokens = "", None, 0
        async for chunk in stream:
            if chunk.usage is not None:
                tokens = chunk.usage.completion_tokens
            for choice in chunk.choices:
                text += choice.text
                reason = choice.finish_reason or reason
        return text, reason, tokens

    async def main():
        try:
            return await asyncio.gather(*[one(p) for p in prompts])
        finally:
            await client.close()

    results = asyncio.run(main())
    assert [r[0] for r in results] == expected
    assert all(r[1] == "length" and r[2] == 16 for r in results)


def _metric(text: str, name: str) -> float:
    match = re.search(rf"^{re.escape(name)}(?:{{[^}}]*}})? ([0-9.e+-]+)$", text, re.MULTILINE)
    assert match, f"{name} not in /metrics"
    return float(match.group(1))


def test_disconnected_clients_leave_no_running_request_and_no_block(server):
    async def start_and_leave(http: httpx.AsyncClient, index: int) -> None:
        body = {"model": MODEL, "prompt": f"{PROMPTS[0]} {index}", "max_tokens": 200, "ignore_eos": True,
                "temperature": 0, "stream": True}
        async with http.stream("POST", server + "/v1/completions", json=body,
                               headers={"Authorization": f"Bearer {API_KEY}"}) as response:
            assert response.status_code == 200
            events = 0
            async for line in response.aiter_lines():
                events += line.startswith("data:")
                if events >= 3:
                    return  # leaving the block closes the connection mid-stream

    async def main():
        async with httpx.AsyncClient(timeout=60, limits=httpx.Limits(max_keepalive_connections=0)) as http:
            await asyncio.gather(*[start_and_leave(http, i) for i in range(8)])

    asyncio.run(main())
    deadline = time.monotonic() + 30
    while True:
        metrics = httpx.get(server + "/metrics").text
        running = _metric(metrics, "raylm:num_requests_running")
        waiting = _metric(metrics, "raylm:num_requests_waiting")
        used = _metric(metrics, "raylm:num_kv_cache_blocks_used")
        if running == waiting == used == 0:
            break
        assert time.monotonic() < deadline, f"still running={running} waiting={waiting} blocks={used}"
        time.sleep(0.2)
    assert _metric(metrics, "raylm:kv_cache_usage_perc") == 0


def wait_idle(server: str, timeout: float = 30) -> None:
    """Until no request runs or waits and no KV block is held."""
    deadline = time.monotonic() + timeout
    while True:
        metrics = httpx.get(server + "/metrics").text
        state = [_metric(metrics, name) for name in ("raylm:num_requests_running", "raylm:num_requests_waiting",
                                                     "raylm:num_kv_cache_blocks_used")]
        if state == [0, 0, 0]:
            return
        assert time.monotonic() < deadline, f"still running, waiting, blocks held: {state}"
        time.sleep(0.2)


@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions"])
def test_a_client_that_leaves_a_non_streamed_request_aborts_it_without_a_traceback(server, server_log, route):
    # The disconnect was raised as an unhandled CancelledError: uvicorn logged "Exception in
    # ASGI application" and ~50 lines of traceback for every client that left.
    # 204,800 tokens, of which the 512 KV blocks hold 8,192 at a time: thousands of steps,
    # seconds of work even for the tiny model; the client leaves after one.
    body = {"model": MODEL, "max_tokens": 200, "ignore_eos": True, "temperature": 1, "n": 1024,
            **({"prompt": PROMPTS[0]} if route == "/v1/completions" else {"messages": CHAT})}
    tracebacks = server_log.read_text().count("Traceback")
    generated = _metric(httpx.get(server + "/metrics").text, "raylm:generation_tokens_total")
    try:
        response = httpx.post(server + route, json=body, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=1.0)
    except httpx.ReadTimeout:
        response = None
    assert response is None, f"answered before the client left: {response.status_code} {response.text[:300]}"
    wait_idle(server)
    # It was stopped, not run to the end.
    assert _metric(httpx.get(server + "/metrics").text, "raylm:generation_tokens_total") - generated < 1024 * 200
    assert server_log.read_text().count("Traceback") == tracebacks, server_log.read_text()[-3000:]


def test_metrics_count_tokens_and_latencies(server, client):
    client.completions.create(model=MODEL, prompt="Hi", max_tokens=4, temperature=0)
    metrics = httpx.get(server + "/metrics").text
    assert _metric(metrics, "raylm:prompt_tokens_total") > 0
    assert _metric(metrics, "raylm:generation_tokens_total") >= 4
    assert _metric(metrics, "raylm:time_to_first_token_seconds_count") >= 1
    assert _metric(metrics, "raylm:e2e_request_latency_seconds_count") >= 1
    assert _metric(metrics, "raylm:time_per_output_token_seconds_count") >= 1
    assert _metric(metrics, "raylm:num_preemptions_total") >= 0
    assert 'finished_reason="length"' in metrics
    json.dumps(metrics)  # plain text


def test_metrics_show_prefix_cache_hits_of_a_repeated_prompt(server, client):
    # 40 tokens: two full blocks of 16 can be found in the cache the second time.
    prompt = list(range(100, 140))
    before = httpx.get(server + "/metrics").text
    for _ in range(2):
        client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0)
    after = httpx.get(server + "/metrics").text
    queries = _metric(after, "raylm:prefix_cache_queries_total") - _metric(before, "raylm:prefix_cache_queries_total")
    hits = _metric(after, "raylm:prefix_cache_hits_total") - _metric(before, "raylm:prefix_cache_hits_total")
    assert queries == 2 * len(prompt) and hits == 32


@pytest.mark.parametrize("route", ["completions", "chat"])
def test_cache_salt_shares_prefix_cache_hits_only_within_one_salt(server, client, route):
    # 40 prompt tokens (the chat template adds a few): two full blocks of 16 hit the cache.
    prompt = list(range(200, 240)) if route == "completions" else " ".join(["salted"] * 40)

    def hits_of(salt: str | None) -> int:
        before = _metric(httpx.get(server + "/metrics").text, "raylm:prefix_cache_hits_total")
        extra = {} if salt is None else {"cache_salt": salt}
        if route == "completions":
            client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0, extra_body=extra)
        else:
            client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": prompt}], max_tokens=2,
                                           temperature=0, extra_body=extra)
        return _metric(httpx.get(server + "/metrics").text, "raylm:prefix_cache_hits_total") - before

    assert hits_of(f"{route}-a") == 0
    assert hits_of(f"{route}-b") == 0
    assert hits_of(None) == 0
    assert hits_of(f"{route}-a") >= 32
    assert hits_of(f"{route}-b") >= 32


def test_use_beam_search_returns_the_n_best_beams(server, llm):
    from raylm.engine import BeamSearchParams

    prompt = [5, 17, 300, 42, 9, 77]
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 6, "temperature": 0, "n": 2, "best_of": 3,
            "use_beam_search": True}
    response = httpx.post(server + "/v1/completions", json=body, headers={"Authorization": f"Bearer {API_KEY}"},
                          timeout=60)
    assert response.status_code == 200, response.text
    choices = response.json()["choices"]
    expected = llm.beam_search([{"prompt_token_ids": prompt}], BeamSearchParams(beam_width=3, max_tokens=6))[0]
    assert [c["text"] for c in choices] == [s.text for s in expected.sequences[:2]]
    assert [c["index"] for c in choices] == [0, 1]


def test_use_beam_search_with_sampling_settings_is_a_400_naming_the_field(server):
    body = {"model": MODEL, "prompt": "Hi", "best_of": 2, "temperature": 0.8, "use_beam_search": True}
    response = httpx.post(server + "/v1/completions", json=body, headers={"Authorization": f"Bearer {API_KEY}"},
                          timeout=60)
    _check_error(response, 400)
    assert response.json()["error"]["param"] == "temperature"


def test_unset_sampling_fields_take_the_models_generation_config_defaults():
    from raylm.deploy.protocol import CompletionRequest

    model_defaults = {"repetition_penalty": 1.3, "temperature": 0.6, "top_k": 20}
    params = CompletionRequest(prompt="x", top_k=5).to_sampling_params(16, model_defaults)
    # Unset fields take the model's defaults; set ones keep the request's; the rest vLLM's.
    assert (params.repetition_penalty, params.temperature, params.top_k, params.top_p) == (1.3, 0.6, 5, 1.0)
    plain = CompletionRequest(prompt="x").to_sampling_params(16, {})
    assert (plain.repetition_penalty, plain.temperature, plain.top_k) == (1.0, 1.0, 0)


def test_prompt_logprobs_are_in_the_completion_body(server, llm):
    prompt = [5, 17, 300, 42, 9]
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 1, "temperature": 0, "prompt_logprobs": 2}
    response = httpx.post(server + "/v1/completions", json=body, headers={"Authorization": f"Bearer {API_KEY}"},
                          timeout=60)
    assert response.status_code == 200, response.text
    served = response.json()["choices"][0]["prompt_logprobs"]
    expected = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(temperature=0, max_tokens=1,
                                                                           prompt_logprobs=2),
                            use_tqdm=False)[0].prompt_logprobs
    assert served[0] is None and len(served) == len(prompt)
    for position in range(1, len(prompt)):
        # JSON object keys are strings; each entry holds the prompt token and the top 2.
        entry = {int(token): value for token, value in served[position].items()}
        assert set(entry) == set(expected[position])
        assert entry[prompt[position]]["logprob"] == pytest.approx(expected[position][prompt[position]].logprob,
                                                                  abs=1e-5)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_echo_with_logprobs_and_n_2_scores_the_prompt_and_every_generated_token(client, llm, stream):
    # The prompt's logprobs used to come once per sample, so each choice's generated tokens
    # lined up with the second copy of the prompt's entries and read null logprobs.
    params = dict(n=2, temperature=1.0, seed=3, max_tokens=4)
    response = client.completions.create(model=MODEL, prompt=PROMPTS[1], echo=True, logprobs=1, stream=stream,
                                         **params)
    chunks = list(response) if stream else [response]
    tokens: dict[int, list[str]] = {}
    served: dict[int, list[float | None]] = {}
    for chunk in chunks:
        for choice in chunk.choices:
            tokens.setdefault(choice.index, []).extend(choice.logprobs.tokens)
            served.setdefault(choice.index, []).extend(choice.logprobs.token_logprobs)
    assert sorted(served) == [0, 1]
    for index, choice in served.items():
        assert len(tokens[index]) == len(choice)
        assert choice[0] is None and None not in choice[1:], choice
    expected = llm.generate(PROMPTS[1], SamplingParams(logprobs=1, prompt_logprobs=1, **params), use_tqdm=False)[0]
    prompt_ids = expected.prompt_token_ids
    for completion in expected.outputs:
        reference = [expected.prompt_logprobs[p][prompt_ids[p]].logprob for p in range(1, len(prompt_ids))]
        reference += [entry[token].logprob for token, entry in zip(completion.token_ids, completion.logprobs)]
        choice = served[completion.index]
        assert len(choice) == len(prompt_ids) + len(completion.token_ids)
        assert choice[1:] == pytest.approx(reference, abs=1e-4)


def test_stream_events_keep_unicode_line_separators_escaped():
    import json as json_module

    from raylm.deploy.serving_engine import sse

    event = sse({"choices": [{"index": 0, "text": "a\u2028b\u0085c\u2029d é"}]})
    # One line of JSON per event even for clients that split on every Unicode line break.
    assert len(event.strip("\n").splitlines()) == 1
    assert json_module.loads(event[len("data: "):])["choices"][0]["text"] == "a\u2028b\u0085c\u2029d é"


def test_a_request_chat_template_is_refused_unless_the_server_trusts_it(server):
    # The shared server runs without --trust-request-chat-template (tests/test_request_limits.py
    # runs one with it, where such a template is rendered).
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2,
            "chat_template": "{{ messages[0]['content'] }}"}
    response = httpx.post(server + "/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {API_KEY}"},
                          timeout=60)
    _check_error(response, 400)
    assert response.json()["error"]["param"] == "chat_template"
