"""What requests hold in memory, bounded: each request's response and its sequences' prompt
copies (--max-response-tokens), on a real `raylm serve` over a tiny model with a 32k
context."""

from __future__ import annotations

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
                         "--max-response-tokens", str(MAX_RESPONSE_TOKENS)], log) as (_, base_url):
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
