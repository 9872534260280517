"""The `priority` field of /v1/completions and /v1/chat/completions over real HTTP, as vLLM's
server has it: accepted under --scheduling-policy priority (the reply equals LLM's greedy
tokens), a 400 with an OpenAI error body naming `priority` under fcfs, and a JSON integer
in range only. The flag and the Serve app key that pick the policy."""

from __future__ import annotations

import argparse

import httpx
import pytest

from hf_reference import hf_greedy
from raylm.deploy.server_args import ServerArgs
from raylm.engine import AsyncLLMEngine, EngineArgs
from raylm.engine.request import MAX_PRIORITY
from server_process import InProcessServer
from test_api_server import _check_error

PROMPT_IDS = [5, 17, 33, 99, 4]
ROUTES = {
    "/v1/completions": {"prompt": PROMPT_IDS},
    "/v1/chat/completions": {"messages": [{"role": "user", "content": "Hi"}]},
}


def _serving(llama_dir, policy: str):
    """A real HTTP server over an engine under `policy`; yields its base URL."""
    engine = AsyncLLMEngine.from_engine_args(EngineArgs(model=str(llama_dir), max_model_len=128, dtype="float32",
                                                        num_gpu_blocks_override=64, scheduling_policy=policy,
                                                        disable_log_stats=True))
    try:
        with InProcessServer(engine, ServerArgs()) as base_url:
            yield base_url
    finally:
        engine.shutdown()


@pytest.fixture(scope="module")
def priority_server(llama_dir):
    yield from _serving(llama_dir, "priority")


@pytest.fixture(scope="module")
def fcfs_server(llama_dir):
    yield from _serving(llama_dir, "fcfs")


def _post(base_url: str, route: str, **fields) -> httpx.Response:
    body = {**ROUTES[route], "max_tokens": 3, "temperature": 0.0, "ignore_eos": True, **fields}
    return httpx.post(base_url + route, json=body, timeout=60)


def test_a_priority_is_served_under_the_priority_policy(priority_server, llama_dir):
    reply = _post(priority_server, "/v1/completions", priority=-3, return_token_ids=True)
    assert reply.status_code == 200, reply.text
    assert reply.json()["choices"][0]["token_ids"] == hf_greedy(llama_dir, PROMPT_IDS, 3)
    reply = _post(priority_server, "/v1/chat/completions", priority=MAX_PRIORITY)
    assert reply.status_code == 200, reply.text


@pytest.mark.parametrize("route", list(ROUTES))
def test_a_nonzero_priority_under_fcfs_is_a_400_naming_the_field(fcfs_server, route):
    reply = _post(fcfs_server, route, priority=1)
    _check_error(reply, 400, "priority")
    assert "priority must be 0 under the 'fcfs' scheduling policy" in reply.json()["error"]["message"]
    # Priority 0 (the default, or said) is served, and the server goes on.
    assert _post(fcfs_server, route, priority=0).status_code == 200
    assert _post(fcfs_server, route).status_code == 200


@pytest.mark.parametrize("value", [True, 1.5, 1.0, "1", MAX_PRIORITY + 1, -(2**63), 10**30])
def test_priority_must_be_a_json_integer_in_range(priority_server, value):
    reply = _post(priority_server, "/v1/completions", priority=value)
    _check_error(reply, 400, "priority")


def test_the_flag_and_the_serve_app_key_pick_the_policy(llama_dir):
    from raylm.deploy.serve_app import app_arguments

    parser = EngineArgs.add_cli_args(argparse.ArgumentParser())
    assert EngineArgs.from_cli_args(parser.parse_args([])).scheduling_policy == "fcfs"
    assert EngineArgs.from_cli_args(parser.parse_args(["--scheduling-policy", "priority"])).scheduling_policy == \
        "priority"
    with pytest.raises(SystemExit):
        parser.parse_args(["--scheduling-policy", "lifo"])
    parsed = app_arguments({"model": str(llama_dir), "scheduling_policy": "priority"})
    assert parsed.engine_kwargs["scheduling_policy"] == "priority"
    with pytest.raises(ValueError, match="scheduling_policy must be one of fcfs, priority"):
        app_arguments({"model": str(llama_dir), "scheduling_policy": "lifo"})
