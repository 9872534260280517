"""vLLM's token ids in the server's responses, on a real `raylm serve --return-tokens-as-token-ids`:
`return_token_ids` gives the prompt's and each choice's token ids, equal to `LLM.generate`'s and
decoding to the text, streamed as whole; logprobs name each token `token_id:{id}` (the
server's flag, or the request's `return_tokens_as_token_ids`, which overrides it), and those
names are the ids the engine's logprobs rank."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest
from server_process import running_server

from raylm.engine.llm import LLM
from raylm.engine.sampling_params import SamplingParams

MODEL = "tiny-llama"
ENGINE_KWARGS = dict(num_gpu_blocks_override=512)
PROMPTS = ["The quick brown fox", "Hello, world!"]
MESSAGES = [{"role": "user", "content": "Paged attention stores"}]
# n=2 samples, seeded: the server's and LLM.generate's are the same draws.
SAMPLED = dict(n=2, temperature=1.0, seed=7, max_tokens=8)


@pytest.fixture(scope="module")
def server(llama_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    log = tmp_path_factory.mktemp("token_ids_server") / "server.log"
    with running_server([str(llama_dir), "--served-model-name", MODEL, "--return-tokens-as-token-ids",
                         "--num-gpu-blocks-override", str(ENGINE_KWARGS["num_gpu_blocks_override"])], log) as (_, url):
        yield url


@pytest.fixture(scope="module")
def llm(llama_dir: Path) -> LLM:
    llm = LLM(str(llama_dir), **ENGINE_KWARGS)
    yield llm
    llm.shutdown()


def post(server: str, route: str, body: dict) -> httpx.Response:
    return httpx.post(f"{server}/v1/{route}", json={"model": MODEL, **body}, timeout=120)


def post_json(server: str, route: str, body: dict) -> dict:
    response = post(server, route, body)
    assert response.status_code == 200, response.text
    return response.json()


def stream_chunks(server: str, route: str, body: dict) -> list[dict]:
    chunks = []
    with httpx.stream("POST", f"{server}/v1/{route}", json={"model": MODEL, "stream": True, **body},
                      timeout=120) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line[len("data: "):]))
    assert chunks and "error" not in chunks[-1], chunks[-1]
    return chunks


def joined(chunks: list[dict]) -> dict[int, dict]:
    """Per choice index, a streamed completion's or chat's pieces joined: text, token_ids,
    the prompt_token_ids each chunk carried (a list of them), logprobs tokens."""
    choices: dict[int, dict] = {}
    for chunk in chunks:
        for choice in chunk["choices"]:
            joined_choice = choices.setdefault(choice["index"], {"text": "", "token_ids": [], "prompt_token_ids": [],
                                                                 "tokens": []})
            joined_choice["text"] += choice["text"] if "text" in choice else choice["delta"].get("content") or ""
            joined_choice["token_ids"] += choice["token_ids"] or []
            prompt_ids = choice.get("prompt_token_ids") or chunk.get("prompt_token_ids")
            if prompt_ids is not None:
                joined_choice["prompt_token_ids"].append(prompt_ids)
            logprobs = choice["logprobs"]
            if logprobs is not None:
                joined_choice["tokens"] += (logprobs["tokens"] if "tokens" in logprobs
                                            else [entry["token"] for entry in logprobs["content"]])
    return choices


def chat_prompt_ids(llm: LLM) -> list[int]:
    """The chat request's prompt as the server makes it: the chat template, then the
    tokenizer without special tokens added."""
    tokenizer = llm.get_tokenizer()
    text = tokenizer.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    return tokenizer.encode(text, add_special_tokens=False)


def assert_decodes_to(llm: LLM, token_ids: list[int], text: str) -> None:
    """`text` is the tokenizer's decode of `token_ids`, less what the server's incremental
    detokenizer holds back at the end (the bytes of a character not yet whole, which a
    whole decode writes as U+FFFD)."""
    decoded = llm.get_tokenizer().decode(token_ids, skip_special_tokens=True)
    assert decoded.startswith(text) and set(decoded[len(text):]) <= {"\ufffd"}, (decoded, text)


def name(token_id: int) -> str:
    return f"token_id:{token_id}"


def parse(token: str) -> int:
    prefix, _, digits = token.partition(":")
    assert prefix == "token_id" and digits.isdigit(), token
    return int(digits)


# ------------------------------------------------------------ return_token_ids
def test_completion_token_ids_equal_llm_generate_and_decode_to_the_text(server, llm):
    body = {"prompt": PROMPTS, "return_token_ids": True, **SAMPLED}
    response = post_json(server, "completions", body)
    expected = llm.generate(PROMPTS, SamplingParams(**SAMPLED), use_tqdm=False)
    choices = {choice["index"]: choice for choice in response["choices"]}
    assert sorted(choices) == [0, 1, 2, 3]
    for prompt_index, output in enumerate(expected):
        for completion in output.outputs:
            choice = choices[prompt_index * SAMPLED["n"] + completion.index]
            assert choice["prompt_token_ids"] == output.prompt_token_ids
            assert choice["token_ids"] == list(completion.token_ids) and choice["text"] == completion.text
            assert_decodes_to(llm, choice["token_ids"], choice["text"])
    assert response["usage"]["completion_tokens"] == sum(len(c["token_ids"]) for c in choices.values())
    # Streamed: the same ids, the prompt's once per choice (its first chunk), vLLM's way.
    streamed = joined(stream_chunks(server, "completions", body))
    assert sorted(streamed) == sorted(choices)
    for index, choice in choices.items():
        assert streamed[index]["token_ids"] == choice["token_ids"] and streamed[index]["text"] == choice["text"]
        assert streamed[index]["prompt_token_ids"] == [choice["prompt_token_ids"]]


def test_chat_token_ids_equal_llm_generate_streamed_and_not(server, llm):
    body = {"messages": MESSAGES, "return_token_ids": True, **SAMPLED}
    response = post_json(server, "chat/completions", body)
    prompt_ids = chat_prompt_ids(llm)
    expected = llm.generate({"prompt_token_ids": prompt_ids}, SamplingParams(**SAMPLED), use_tqdm=False)[0]
    # vLLM's chat places the prompt's ids once, on the response; each choice has its own.
    assert response["prompt_token_ids"] == prompt_ids
    choices = {choice["index"]: choice for choice in response["choices"]}
    assert sorted(choices) == [0, 1]
    for completion in expected.outputs:
        choice = choices[completion.index]
        assert choice["token_ids"] == list(completion.token_ids)
        assert choice["message"]["content"] == completion.text
        assert_decodes_to(llm, choice["token_ids"], completion.text)
    chunks = stream_chunks(server, "chat/completions", body)
    streamed = joined(chunks)
    for index, choice in choices.items():
        assert streamed[index]["token_ids"] == choice["token_ids"]
        assert streamed[index]["text"] == choice["message"]["content"]
        # In the chunk that opens the choice with the assistant's role, and no other.
        assert streamed[index]["prompt_token_ids"] == [prompt_ids]
    openers = [chunk for chunk in chunks if chunk["prompt_token_ids"] is not None]
    assert [chunk["choices"][0]["delta"]["role"] for chunk in openers] == ["assistant", "assistant"]


def test_without_return_token_ids_no_ids_are_returned(server):
    response = post_json(server, "completions", {"prompt": PROMPTS[0], "max_tokens": 2, "return_token_ids": False})
    assert response["choices"][0]["token_ids"] is None and response["choices"][0]["prompt_token_ids"] is None
    chat = post_json(server, "chat/completions", {"messages": MESSAGES, "max_tokens": 2})
    assert chat["prompt_token_ids"] is None and chat["choices"][0]["token_ids"] is None


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_echo_with_return_token_ids_returns_the_prompt_as_ids_and_its_logprobs(server, llm, stream):
    """vLLM's echo with return_token_ids: the prompt comes back as prompt_token_ids, not as
    text; its logprobs (and the generated tokens') are there, each named by id."""
    body = {"prompt": PROMPTS[1], "echo": True, "logprobs": 1, "return_token_ids": True, "max_tokens": 5,
            "temperature": 0}
    expected = llm.generate(PROMPTS[1], SamplingParams(temperature=0, max_tokens=5), use_tqdm=False)[0]
    if stream:
        (choice,) = joined(stream_chunks(server, "completions", body)).values()
        (prompt_ids,) = choice["prompt_token_ids"]
    else:
        (whole,) = post_json(server, "completions", body)["choices"]
        choice = {**whole, "tokens": whole["logprobs"]["tokens"]}
        prompt_ids = whole["prompt_token_ids"]
    assert prompt_ids == expected.prompt_token_ids
    assert choice["token_ids"] == list(expected.outputs[0].token_ids)
    assert choice["text"] == expected.outputs[0].text
    assert choice["tokens"] == [name(t) for t in expected.prompt_token_ids + list(expected.outputs[0].token_ids)]


# ------------------------------------------------------- token_id:{id} names
def test_completion_logprobs_name_tokens_by_id_the_ids_the_engines_ranks_describe(server, llm):
    num_logprobs = 3
    expected = llm.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=6, logprobs=num_logprobs),
                            use_tqdm=False)[0].outputs[0]
    body = {"prompt": PROMPTS[0], "max_tokens": 6, "temperature": 0, "logprobs": num_logprobs,
            "return_token_ids": True}
    (choice,) = post_json(server, "completions", body)["choices"]
    logprobs = choice["logprobs"]
    assert choice["token_ids"] == list(expected.token_ids)
    assert [parse(token) for token in logprobs["tokens"]] == choice["token_ids"]
    for token_id, top, entry in zip(choice["token_ids"], logprobs["top_logprobs"], expected.logprobs):
        served = {parse(token): logprob for token, logprob in top.items()}
        ranked = {alt_id for alt_id, alt in entry.items() if alt.rank <= num_logprobs}
        assert set(served) == ranked | {token_id} and len(ranked) == num_logprobs
        assert min(ranked, key=lambda alt_id: entry[alt_id].rank) == token_id  # greedy: the chosen is rank 1
        for alt_id, logprob in served.items():
            assert logprob == pytest.approx(entry[alt_id].logprob, abs=1e-5)
    # The offsets still count the text's characters, not those of the `token_id:` names.
    texts = [entry[token_id].decoded_token for token_id, entry in zip(expected.token_ids, expected.logprobs)]
    assert logprobs["text_offset"] == [sum(len(t) for t in texts[:i]) for i in range(len(texts))]
    # Streamed, the same names; a request's return_tokens_as_token_ids false turns the flag off.
    streamed = joined(stream_chunks(server, "completions", body))
    assert streamed[0]["tokens"] == logprobs["tokens"]
    (plain,) = post_json(server, "completions", {**body, "return_tokens_as_token_ids": False})["choices"]
    assert plain["logprobs"]["tokens"] == texts
    assert set(plain["logprobs"]["top_logprobs"][0]) == {entry.decoded_token for entry in expected.logprobs[0].values()}


def test_chat_logprobs_name_tokens_by_id_with_vllms_bytes(server, llm):
    """The chosen token's bytes stay its text's and an alternative's are its name's, as in vLLM."""
    top_logprobs = 2
    expected = llm.generate({"prompt_token_ids": chat_prompt_ids(llm)},
                            SamplingParams(temperature=0, max_tokens=5, logprobs=top_logprobs),
                            use_tqdm=False)[0].outputs[0]
    body = {"messages": MESSAGES, "max_tokens": 5, "temperature": 0, "logprobs": True, "top_logprobs": top_logprobs}
    (choice,) = post_json(server, "chat/completions", body)["choices"]
    content = choice["logprobs"]["content"]
    assert [parse(entry["token"]) for entry in content] == list(expected.token_ids)
    for served, token_id, entry in zip(content, expected.token_ids, expected.logprobs):
        assert served["bytes"] == list(entry[token_id].decoded_token.encode())
        assert served["logprob"] == pytest.approx(entry[token_id].logprob, abs=1e-5)
        by_rank = sorted((alt for alt in entry if entry[alt].rank <= top_logprobs), key=lambda a: entry[a].rank)
        assert [parse(alt["token"]) for alt in served["top_logprobs"]] == by_rank
        assert [alt["bytes"] for alt in served["top_logprobs"]] == [list(name(a).encode()) for a in by_rank]
    streamed = joined(stream_chunks(server, "chat/completions", body))
    assert streamed[0]["tokens"] == [entry["token"] for entry in content]
    (plain,) = post_json(server, "chat/completions", {**body, "return_tokens_as_token_ids": False})["choices"]
    assert [entry["token"] for entry in plain["logprobs"]["content"]] == [
        entry[token_id].decoded_token for token_id, entry in zip(expected.token_ids, expected.logprobs)]


# ------------------------------------------------------------------- errors
@pytest.mark.parametrize("route,base", [("completions", {"prompt": "Hi"}), ("chat/completions", {"messages": MESSAGES})])
@pytest.mark.parametrize("field", ["return_token_ids", "return_tokens_as_token_ids"])
def test_a_field_that_is_no_boolean_is_a_400_naming_it(server, route, base, field):
    for value in ("perhaps", [True], {"x": 1}, 2):
        response = post(server, route, {**base, "max_tokens": 1, field: value})
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["param"] == field and error["code"] == 400, error
    assert post(server, route, {**base, "max_tokens": 1, field: True}).status_code == 200
