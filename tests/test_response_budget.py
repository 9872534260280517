"""What requests hold in memory, bounded: each request's response and its sequences' prompt
copies (--max-response-tokens), and all responses in flight together
(--max-response-tokens-in-flight, 429 with Retry-After past it), on a real `raylm serve` over
a tiny model with a 32k context."""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import pytest
from server_process import running_server
from tiny_models import build_tiny_model

MODEL = "tiny-long"
MAX_RESPONSE_TOKENS = 100_000
LONG_PROMPT = [7] * 20_000


@pytest.fixture(scope="module")
def long_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("long_model") / "llama", "llama", max_position_embeddings=32768)


@pytest.fixture(scope="module")
def server(long_model: Path, tmp_path_factory: pytest.TempPathFactory):
    log = tmp_path_factory.mktemp("budget_server") / "server.log"
    with running_server([str(long_model), "--served-model-name", MODEL, "--num-gpu-blocks-override", "4096",
                         "--max-response-tokens", str(MAX_RESPONSE_TOKENS),
                         "--max-response-tokens-in-flight", str(MAX_RESPONSE_TOKENS)], log) as (_, base_url):
        yield base_url


def post(base_url: str, body: dict, timeout: float = 120) -> httpx.Response:
    return httpx.post(base_url + "/v1/completions", json={"model": MODEL, **body}, timeout=timeout)


def test_each_sequences_copy_of_a_long_prompt_counts_against_max_response_tokens(server):
    # Every sequence copies its prompt's token ids (8 bytes a token): n=16384 on a 128k-token
    # prompt asked for 17 GB while each limit held. A copied token counts 1/64: 512 sequences
    # of 20,000 tokens are 160,000.
    response = post(server, {"prompt": LONG_PROMPT, "n": 512, "temperature": 1, "max_tokens": 1})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "n" and "copied into each of best_of 512 sequences" in error["message"], error
    # 64 sequences of it (20,000 counted) are served.
    response = post(server, {"prompt": LONG_PROMPT, "n": 64, "temperature": 1, "max_tokens": 1})
    assert response.status_code == 200, response.text
    assert len(response.json()["choices"]) == 64


def test_prompt_ids_returned_in_each_choice_count_against_max_response_tokens(server):
    # return_token_ids puts the prompt's ids in each of the n choices, some 32 bytes an id by
    # the time the body is written: 1/16 token each. 64 choices of 20,000 ids are 80,000, with
    # the copies' 20,000 and the 64 tokens past 100,000.
    body = {"prompt": LONG_PROMPT, "n": 64, "temperature": 1, "max_tokens": 1, "return_token_ids": True}
    response = post(server, body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "n" and "returned as ids in each of n 64 choices" in error["message"], error
    assert "would hold 100,064 tokens" in error["message"], error
    # 32 choices (40,032) are served, each with the prompt's ids.
    response = post(server, {**body, "n": 32})
    assert response.status_code == 200, response.text
    assert [choice["prompt_token_ids"] == LONG_PROMPT for choice in response.json()["choices"]] == [True] * 32


def first_chunk_status(base_url: str, path: str, body: dict) -> int:
    """The status of a streamed request, which is closed (and so aborted) after its first
    event."""
    with httpx.stream("POST", base_url + path, json={"model": MODEL, "stream": True, **body}, timeout=120) as response:
        if response.status_code == 200:
            lines = response.iter_lines()
            next(line for line in lines if line.startswith("data: "))
        return response.status_code


def test_past_the_tokens_in_flight_a_request_gets_429_with_retry_after_until_others_end(server):
    # Each request within --max-response-tokens, up to --max-concurrent-requests (1024) of
    # them asked for 1024 x 2^22 tokens together, some 2 TiB. The holder's client reads one
    # event and no more: its 30,000 tokens of events (7 MB) cannot all be sent, so it stays
    # in flight, as a slow reader's stream does, until its client leaves.
    big = {"prompt": "Hi", "n": 3, "temperature": 1, "max_tokens": 24_000}  # 72,001 of the 100,000
    holder = httpx.stream("POST", server + "/v1/completions", timeout=120, json={
        "model": MODEL, "prompt": "Hi", "max_tokens": 30_000, "ignore_eos": True, "stream": True})  # 30,001
    with holder as held:
        assert held.status_code == 200
        lines = held.iter_lines()  # kept: a dropped iterator closes the connection
        next(line for line in lines if line.startswith("data: "))
        refused = post(server, big)
        assert refused.status_code == 429, refused.text
        error = refused.json()["error"]
        assert error["type"] == "RateLimitError" and "--max-response-tokens-in-flight" in error["message"], error
        assert "hold 30,001 of the 100,000 tokens" in error["message"] and "asks for 72,001" in error["message"]
        assert refused.headers["retry-after"] == "1"
        chat = httpx.post(server + "/v1/chat/completions", timeout=120, json={
            "model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "n": 3, "temperature": 1,
            "max_tokens": 24_000})
        assert chat.status_code == 429, chat.text
        small = post(server, {"prompt": "Hi", "max_tokens": 4})  # what fits beside it is served
        assert small.status_code == 200, small.text
    # The holder's client left: its request is aborted and its tokens given back.
    deadline = time.monotonic() + 30
    while (status := first_chunk_status(server, "/v1/completions", big)) == 429 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert status == 200


def test_the_default_budget_is_a_quarter_of_memory_at_512_bytes_a_token():
    from raylm.deploy.response_budget import default_response_tokens_in_flight, memory_limit_bytes
    from raylm.deploy.server_args import ServerArgs

    mem_total = next(int(line.split()[1]) * 1024 for line in Path("/proc/meminfo").read_text().splitlines()
                     if line.startswith("MemTotal:"))
    assert 0 < memory_limit_bytes() <= mem_total
    assert default_response_tokens_in_flight(1) == memory_limit_bytes() // 4 // 512
    assert default_response_tokens_in_flight(10**15) == 10**15  # never below one request's limit
    with pytest.raises(ValueError, match="below max_response_tokens"):
        ServerArgs(max_response_tokens_in_flight=1000)
