"""`POST /v1/embeddings` on a real HTTP server (uvicorn over the app, in this process so that
the test can read the engine's KV pool) against Hugging Face transformers' AutoModel: float
and base64 encodings, OpenAI-style 400s, and no KV block held after any request."""

from __future__ import annotations

import base64

import numpy as np
import pytest
import torch

from engine_checks import assert_async_engine_idle
from hf_reference import hf_embedding
from server_process import InProcessServer

MAX_MODEL_LEN = 64


@pytest.fixture(scope="module")
def server(llama_dir):
    from raylm.deploy.limits import RequestLimits
    from raylm.deploy.server_args import ServerArgs
    from raylm.engine import AsyncLLMEngine, EngineArgs

    engine = AsyncLLMEngine.from_engine_args(EngineArgs(
        model=str(llama_dir), dtype="float32", runner="pooling", max_model_len=MAX_MODEL_LEN,
        max_num_batched_tokens=24, disable_log_stats=True))
    try:
        with InProcessServer(engine, ServerArgs(limits=RequestLimits(max_prompts_per_request=4))) as base_url:
            yield base_url, engine
    finally:
        engine.shutdown()


def post(base_url: str, body: dict):
    import httpx

    return httpx.post(f"{base_url}/v1/embeddings", json=body, timeout=60)


def test_float_embeddings_of_texts_and_token_ids_equal_hf(server, llama_dir):
    from transformers import AutoTokenizer

    base_url, engine = server
    texts = ["The quick brown fox", "Ray places one worker actor on each GPU of the cluster."]
    token_ids = [list(range(5, 45)), [7]]
    tokenizer = AutoTokenizer.from_pretrained(str(llama_dir))
    expected_prompts = [tokenizer.encode(text) for text in texts]
    reply = post(base_url, {"model": str(llama_dir), "input": texts})
    assert reply.status_code == 200, reply.text
    body = reply.json()
    assert body["object"] == "list" and body["id"].startswith("embd-")
    assert [item["index"] for item in body["data"]] == [0, 1]
    assert all(item["object"] == "embedding" for item in body["data"])
    assert body["usage"] == {"prompt_tokens": sum(map(len, expected_prompts)),
                             "total_tokens": sum(map(len, expected_prompts)), "completion_tokens": 0,
                             "completion_tokens_details": None, "prompt_tokens_details": None}
    for prompt, item in zip(expected_prompts, body["data"]):
        torch.testing.assert_close(torch.tensor(item["embedding"]), hf_embedding(llama_dir, prompt), atol=1e-4, rtol=0)
    reply = post(base_url, {"input": token_ids})
    assert reply.status_code == 200, reply.text
    for prompt, item in zip(token_ids, reply.json()["data"]):
        torch.testing.assert_close(torch.tensor(item["embedding"]), hf_embedding(llama_dir, prompt), atol=1e-4, rtol=0)
    # One list of token ids is one input.
    reply = post(base_url, {"input": token_ids[0]})
    assert len(reply.json()["data"]) == 1 and reply.json()["usage"]["prompt_tokens"] == len(token_ids[0])
    assert_async_engine_idle(engine)


def test_base64_decodes_to_the_float_embedding(server):
    base_url, engine = server
    inputs = [[11, 12, 13, 14, 15] * 6, [20, 21]]
    floats = post(base_url, {"input": inputs}).json()["data"]
    encoded = post(base_url, {"input": inputs, "encoding_format": "base64"}).json()["data"]
    for as_floats, as_base64 in zip(floats, encoded):
        decoded = np.frombuffer(base64.b64decode(as_base64["embedding"]), dtype="<f4")
        # Two requests: the second reads the first's cached blocks, so they round apart slightly.
        np.testing.assert_allclose(decoded, np.asarray(as_floats["embedding"], dtype=np.float32), atol=1e-6, rtol=0)
    assert_async_engine_idle(engine)


def test_truncate_prompt_tokens_pools_the_last_tokens(server, llama_dir):
    base_url, engine = server
    prompt = list(range(4, 4 + MAX_MODEL_LEN + 20))
    reply = post(base_url, {"input": [prompt], "truncate_prompt_tokens": 10})
    assert reply.status_code == 200, reply.text
    assert reply.json()["usage"]["prompt_tokens"] == 10
    torch.testing.assert_close(torch.tensor(reply.json()["data"][0]["embedding"]),
                               hf_embedding(llama_dir, prompt[-10:]), atol=1e-4, rtol=0)
    assert_async_engine_idle(engine)


@pytest.mark.parametrize("body, param, words", [
    ({"input": []}, "input", "empty"),
    ({"input": ""}, "input", "empty"),
    ({"input": ["fine", ""]}, "input", "empty"),
    ({"input": [[5, 6], []]}, "input", "empty"),
    ({"input": list(range(4, 4 + MAX_MODEL_LEN + 1))}, "input", "maximum context length"),
    ({"input": ["a", "b", "c", "d", "e"]}, "input", "at most 4"),
    ({"input": "hello", "dimensions": 8}, "dimensions", "Matryoshka"),
    ({"input": "hello", "truncate_prompt_tokens": MAX_MODEL_LEN + 1}, "truncate_prompt_tokens", "max_model_len"),
    ({"input": "hello", "truncate_prompt_tokens": 0}, "truncate_prompt_tokens", "positive"),
    ({"input": [600]}, "input", "vocabulary"),
    ({"input": "hello", "model": "other"}, "model", "does not exist"),
    # vLLM's priority field, as on completions: this server schedules fcfs (it was ignored).
    ({"input": "hello", "priority": 1}, "priority", "scheduling policy"),
])
def test_bad_requests_are_400s_naming_the_field(server, body, param, words):
    base_url, engine = server
    reply = post(base_url, body)
    expected = 404 if param == "model" else 400
    assert reply.status_code == expected, reply.text
    error = reply.json()["error"]
    assert error["param"] == param and words in error["message"], error
    assert_async_engine_idle(engine)


def test_an_encoding_format_other_than_float_or_base64_is_a_400(server):
    base_url, engine = server
    reply = post(base_url, {"input": "hello", "encoding_format": "int8"})
    assert reply.status_code == 400 and "encoding_format" in reply.text


def test_a_pooling_server_refuses_completions(server):
    import httpx

    base_url, engine = server
    reply = httpx.post(f"{base_url}/v1/completions", json={"prompt": "hello", "max_tokens": 2}, timeout=60)
    assert reply.status_code == 400 and "runner='pooling'" in reply.json()["error"]["message"]
    assert_async_engine_idle(engine)


@pytest.mark.parametrize("body, param", [
    ({"input": [True, False]}, "input"),  # read laxly: token ids 1 and 0
    ({"input": [[5, 6], [True]]}, "input"),
    ({"input": [5.0, 6.0]}, "input"),
    ({"input": ["5", 6]}, "input"),  # read laxly: token ids 5 and 6
    ({"input": "hello", "truncate_prompt_tokens": True}, "truncate_prompt_tokens"),  # read laxly: the last token
    ({"input": "hello", "truncate_prompt_tokens": "5"}, "truncate_prompt_tokens"),
    ({"input": "hello", "truncate_prompt_tokens": 2.0}, "truncate_prompt_tokens"),
    ({"input": "hello", "dimensions": True}, "dimensions"),
    ({"input": "hello", "normalize": "yes"}, "normalize"),
    ({"input": "hello", "add_special_tokens": 0}, "add_special_tokens"),
    ({"input": "hello", "priority": True}, "priority"),
])
def test_json_types_are_not_coerced_into_token_ids_or_sizes(server, body, param):
    """A JSON boolean, float or string where an integer (or a boolean) is meant is a 400
    naming the field, not read as another value (PoolingParams refuses a bool
    truncate_prompt_tokens; the HTTP layer used to turn `true` into 1 before it saw it)."""
    base_url, engine = server
    reply = post(base_url, body)
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["param"] == param or param in error["message"], error
    assert post(base_url, {"input": [5, 6]}).status_code == 200
    assert_async_engine_idle(engine)
