"""allowed_token_ids, bad_words, truncate_prompt_tokens and detokenize in the completions and
chat requests of a real `raylm serve`: greedy tokens are the best of Hugging Face's logits
with the masks applied by hand, a truncated prompt gives HF's tokens on its last k tokens,
detokenize=false the same ids with no text; sizes past their bounds are a 400 whose OpenAI
error body names the field, checked before anything runs, and the server keeps serving."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
from server_process import running_server

from hf_reference import assert_hf_greedy
from token_mask_reference import assert_masked_greedy
from raylm.engine.sampling_params import MAX_BAD_WORD_CHARS, MAX_BAD_WORDS

MODEL = "tiny-llama"
MAX_MODEL_LEN = 256
VOCAB = 512
PROMPT = "The quick brown fox jumps over"
ALLOWED = [3, 17, 40, 99, 123, 200, 256, 301, 377, 402, 450, 511]
GREEDY = dict(temperature=0.0, max_tokens=8, ignore_eos=True, return_token_ids=True)


@pytest.fixture(scope="module")
def server(llama_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    log = tmp_path_factory.mktemp("token_masks_server") / "server.log"
    with running_server([str(llama_dir), "--served-model-name", MODEL, "--max-model-len", str(MAX_MODEL_LEN),
                         "--num-gpu-blocks-override", "128"], log) as (_, url):
        yield url


def post(server: str, route: str, body: dict) -> httpx.Response:
    return httpx.post(f"{server}/v1/{route}", json={"model": MODEL, **body}, timeout=120)


def complete(server: str, body: dict) -> dict:
    response = post(server, "completions", {"prompt": PROMPT, **GREEDY, **body})
    assert response.status_code == 200, response.text
    return response.json()


def test_completions_allowed_token_ids_give_the_best_allowed_tokens(server, llama_dir):
    result = complete(server, {"allowed_token_ids": ALLOWED})
    choice = result["choices"][0]
    assert set(choice["token_ids"]) <= set(ALLOWED)
    assert_masked_greedy(llama_dir, choice["prompt_token_ids"], choice["token_ids"], allowed=ALLOWED)


def test_chat_allowed_token_ids_give_the_best_allowed_tokens(server, llama_dir):
    response = post(server, "chat/completions", {"messages": [{"role": "user", "content": PROMPT}],
                                                 "allowed_token_ids": ALLOWED, **GREEDY})
    assert response.status_code == 200, response.text
    result = response.json()
    tokens = result["choices"][0]["token_ids"]
    assert_masked_greedy(llama_dir, result["prompt_token_ids"], tokens, allowed=ALLOWED)


def test_completions_bad_words_ban_the_word_where_it_would_end(server, llama_dir):
    free = complete(server, {})["choices"][0]
    # The server's tokenizer is the model's: a word of two of the free output's tokens that
    # tokenizes back to them (the ban then bites where the output had them).
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(llama_dir))
    for k in range(len(free["token_ids"]) - 1):
        pair = free["token_ids"][k:k + 2]
        word = tokenizer.decode(pair)
        if word == word.lstrip() and tokenizer.encode(word, add_special_tokens=False) == pair:
            break
    else:
        pytest.fail(f"no word of two tokens in {free['token_ids']}")
    sequences = [pair]
    spaced = tokenizer.encode(" " + word, add_special_tokens=False)
    if spaced[0] != pair[0] and len(spaced) == 2:
        sequences.append(spaced)
    choice = complete(server, {"bad_words": [word]})["choices"][0]
    assert choice["token_ids"] != free["token_ids"]
    assert_masked_greedy(llama_dir, choice["prompt_token_ids"], choice["token_ids"], bad_sequences=sequences)


def test_truncate_prompt_tokens_runs_the_prompts_last_tokens(server, llama_dir):
    whole = complete(server, {})["choices"][0]["prompt_token_ids"]
    for route, body in (("completions", {"prompt": PROMPT}),
                        ("chat/completions", {"messages": [{"role": "user", "content": PROMPT}]})):
        response = post(server, route, {**body, **GREEDY, "truncate_prompt_tokens": 4})
        assert response.status_code == 200, response.text
        result = response.json()
        prompt_ids = result["prompt_token_ids"] if route.startswith("chat") else result["choices"][0][
            "prompt_token_ids"]
        assert len(prompt_ids) == 4 and result["usage"]["prompt_tokens"] == 4
        if route == "completions":
            assert prompt_ids == whole[-4:]
        assert_hf_greedy(llama_dir, prompt_ids, result["choices"][0]["token_ids"], route)
    # A prompt longer than the context runs when truncated to fit it.
    long_prompt = list(range(3, 3 + MAX_MODEL_LEN + 40))
    response = post(server, "completions", {"prompt": long_prompt, "truncate_prompt_tokens": 100, **GREEDY})
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["prompt_token_ids"] == long_prompt[-100:]


def test_detokenize_false_returns_the_ids_without_text(server):
    with_text = complete(server, {})["choices"][0]
    ids_only = complete(server, {"detokenize": False})["choices"][0]
    assert ids_only["token_ids"] == with_text["token_ids"]
    assert with_text["text"] and ids_only["text"] == ""


@pytest.mark.parametrize("body, param", [
    ({"allowed_token_ids": []}, "allowed_token_ids"),
    ({"allowed_token_ids": [1, VOCAB]}, "allowed_token_ids"),
    ({"allowed_token_ids": [-1]}, "allowed_token_ids"),
    ({"allowed_token_ids": list(range(VOCAB)) + [1]}, "allowed_token_ids"),
    ({"bad_words": ["a"] * (MAX_BAD_WORDS + 1)}, "bad_words"),
    ({"bad_words": ["b" * (MAX_BAD_WORD_CHARS + 1)]}, "bad_words"),
    ({"bad_words": ["~^|`" * 60 + str(i) for i in range(10)]}, "bad_words"),  # > 1,024 tokens
    ({"truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
    ({"truncate_prompt_tokens": -2}, "truncate_prompt_tokens"),
    ({"truncate_prompt_tokens": MAX_MODEL_LEN + 1}, "truncate_prompt_tokens"),
    ({"detokenize": False, "stop": ["x"]}, "stop"),
    ({"detokenize": "no"}, "detokenize"),  # lax parsing read it as false
    ({"truncate_prompt_tokens": True}, "truncate_prompt_tokens"),
])
@pytest.mark.parametrize("route", ["completions", "chat/completions"])
def test_out_of_bounds_fields_are_a_400_naming_them(server, route, body, param):
    prompt = {"prompt": PROMPT} if route == "completions" else {"messages": [{"role": "user", "content": PROMPT}]}
    response = post(server, route, {**prompt, "max_tokens": 2, **body})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and param in error["message"], error
    assert complete(server, {"max_tokens": 2})["choices"][0]["token_ids"]  # still serving


def test_a_truncated_request_gets_no_prefix_key(llama_dir):
    # The prefix-aware router keys a request by its prompt's first blocks, which a truncated
    # prompt never prefills: such a request is routed as one without a key.
    import json

    from transformers import AutoTokenizer

    from raylm.deploy.prefix_key import PrefixKeyer

    keyer = PrefixKeyer(AutoTokenizer.from_pretrained(str(llama_dir)), 4, max_blocks=64)
    bodies = {"/v1/completions": {"prompt": list(range(5, 40))},
              "/v1/chat/completions": {"messages": [{"role": "user", "content": PROMPT}]}}
    for route, body in bodies.items():
        assert keyer.key(route, json.dumps(body).encode()) is not None
        assert keyer.key(route, json.dumps({**body, "truncate_prompt_tokens": 8}).encode()) is None
