"""Sleep mode over Ray at tensor-parallel size 2 (each rank loads its shard of pushed
weights through its `weight_loader`s) and over HTTP (RAYLM_SERVER_DEV_MODE's routes behind
the API key; a sleeping server answers 503 and serves again once woken up). Tokens are
compared with Hugging Face's on the weights the model holds."""

from __future__ import annotations

import json
import math
import operator

import httpx
import pytest
import torch

from engine_checks import assert_engine_idle
from hf_reference import cached_hf_greedy
from raylm.engine import LLM
from raylm.engine.engine_core import EngineSleepingError
from server_process import InProcessServer
from test_sleep_mode import ENGINE, GREEDY, assert_hf_tokens, checkpoint_weights, other_llama_dir, prompts  # noqa: F401

API_KEY = "sleep-test-key"
AUTH = {"Authorization": f"Bearer {API_KEY}"}


def test_tensor_parallel_2_sleeps_wakes_and_takes_pushed_weights(ray_cluster, llama_dir, other_llama_dir, prompts):
    llm = LLM(model=str(llama_dir), tensor_parallel_size=2, distributed_executor_backend="ray",
              enable_sleep_mode=True, **ENGINE)
    try:
        # math.inf: no deadline (Ray's wait overflowed converting it to milliseconds).
        assert llm.collective_rpc(operator.attrgetter("tp_rank"), timeout=math.inf) == [0, 1]
        assert_hf_tokens(llm, llama_dir, prompts)
        llm.sleep(level=1)
        with pytest.raises(EngineSleepingError):
            llm.generate([{"prompt_token_ids": prompts[0]}], GREEDY, use_tqdm=False)
        assert_engine_idle(llm.llm_engine)
        llm.wake_up()
        assert_hf_tokens(llm, llama_dir, prompts)

        # A trainer's bad tensor: the workers' error is raised here as it is, and they serve
        # on (it marked them failed: every later call was refused).
        with pytest.raises(ValueError, match="shape"):
            llm.collective_rpc("load_weights", args=([("model.embed_tokens.weight", torch.zeros(3))],))
        llm.sleep(level=2)
        llm.wake_up(tags=["weights"])
        loaded = llm.collective_rpc("load_weights", args=(checkpoint_weights(other_llama_dir),))
        assert loaded[0] == loaded[1] and "model.layers.0.self_attn.qkv_proj.weight" in loaded[0]
        llm.wake_up(tags=["kv_cache"])
        assert_hf_tokens(llm, other_llama_dir, prompts)

        llm.sleep(level=2)
        llm.wake_up()
        llm.collective_rpc("reload_weights")
        assert_hf_tokens(llm, llama_dir, prompts)
        assert_engine_idle(llm.llm_engine)
    finally:
        llm.shutdown()


@pytest.fixture(scope="module")
def server(llama_dir):
    from raylm.deploy.server_args import ServerArgs
    from raylm.engine import AsyncLLMEngine, EngineArgs

    engine = AsyncLLMEngine.from_engine_args(EngineArgs(model=str(llama_dir), enable_sleep_mode=True,
                                                        dtype="float32", max_model_len=256,
                                                        num_gpu_blocks_override=64, disable_log_stats=True))
    monkeypatch = pytest.MonkeyPatch()
    monkeypatch.setenv("RAYLM_SERVER_DEV_MODE", "1")
    try:
        in_process = InProcessServer(engine, ServerArgs(api_key=API_KEY))
        with in_process as base_url:
            yield engine, base_url
    finally:
        monkeypatch.undo()
        engine.shutdown()


def complete(base_url: str, prompt: list[int], **fields) -> httpx.Response:
    return httpx.post(f"{base_url}/v1/completions", headers=AUTH, timeout=60,
                      json={"prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True,
                            "return_token_ids": True, **fields})


def test_dev_routes_need_the_api_key(server):
    _, base_url = server
    assert httpx.get(f"{base_url}/is_sleeping").status_code == 401
    assert httpx.post(f"{base_url}/sleep?level=1").status_code == 401
    assert httpx.get(f"{base_url}/is_sleeping", headers=AUTH).json() == {"is_sleeping": False}


def test_a_sleeping_server_answers_503_and_serves_again_after_wake_up(server, llama_dir, prompts):
    engine, base_url = server
    expected = cached_hf_greedy(llama_dir, tuple(prompts[0]), 8)
    assert complete(base_url, prompts[0]).json()["choices"][0]["token_ids"] == expected
    assert httpx.post(f"{base_url}/sleep?level=1", headers=AUTH).status_code == 200
    assert httpx.get(f"{base_url}/is_sleeping", headers=AUTH).json() == {"is_sleeping": True}
    reply = complete(base_url, prompts[0])
    assert reply.status_code == 503
    assert "wake it up" in reply.json()["error"]["message"]
    assert_engine_idle(engine.engine)
    assert httpx.post(f"{base_url}/wake_up", headers=AUTH).status_code == 200
    assert httpx.get(f"{base_url}/is_sleeping", headers=AUTH).json() == {"is_sleeping": False}
    assert complete(base_url, prompts[0]).json()["choices"][0]["token_ids"] == expected


def test_level_2_over_http_with_reload_weights_through_collective_rpc(server, llama_dir, prompts):
    _, base_url = server
    assert httpx.post(f"{base_url}/sleep?level=2", headers=AUTH).status_code == 200
    assert httpx.post(f"{base_url}/wake_up?tags=weights", headers=AUTH).status_code == 200
    assert httpx.get(f"{base_url}/is_sleeping", headers=AUTH).json() == {"is_sleeping": True}
    reply = httpx.post(f"{base_url}/collective_rpc", headers=AUTH, json={"method": "reload_weights"}, timeout=60)
    assert reply.status_code == 200 and reply.json() == {"results": [None]}
    assert httpx.post(f"{base_url}/wake_up?tags=kv_cache", headers=AUTH).status_code == 200
    assert httpx.post(f"{base_url}/reset_prefix_cache", headers=AUTH).status_code == 200
    expected = cached_hf_greedy(llama_dir, tuple(prompts[1]), 8)
    assert complete(base_url, prompts[1]).json()["choices"][0]["token_ids"] == expected


def test_bad_dev_route_arguments_are_400s_naming_them(server):
    _, base_url = server
    reply = httpx.post(f"{base_url}/sleep?level=3", headers=AUTH)
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "level"
    reply = httpx.post(f"{base_url}/wake_up?tags=kv", headers=AUTH)
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "tags"
    for body, param in [({"method": "no_such_method"}, "method"),
                        ({"method": "mro"}, "method"),  # type's, not the workers'
                        ({"method": "sleep"}, "method"),  # behind the engine's back: it then died stepping
                        ({"method": "execute_model", "args": [None]}, "method"),
                        ({"method": "reload_weights", "args": [1]}, "args"),
                        ({"method": "reload_weights", "kwargs": {"strict": True}}, "args"),
                        ({"method": "list_loras"}, "method")]:  # no LoRA: the workers' RuntimeError was a 500
        reply = httpx.post(f"{base_url}/collective_rpc", headers=AUTH, json=body)
        assert reply.status_code == 400 and reply.json()["error"]["param"] == param, (body, reply.text)
    assert httpx.get(f"{base_url}/is_sleeping", headers=AUTH).json() == {"is_sleeping": False}
    assert complete(base_url, [5, 6, 7]).status_code == 200


def test_sleep_aborts_a_streamed_request_in_flight_with_a_503_event(server, llama_dir, prompts):
    engine, base_url = server
    with httpx.stream("POST", f"{base_url}/v1/completions", headers=AUTH, timeout=60,
                      json={"prompt": prompts[2], "max_tokens": 200, "temperature": 0, "ignore_eos": True,
                            "stream": True}) as stream:
        lines = stream.iter_lines()
        first = next(line for line in lines if line.startswith("data: "))
        assert json.loads(first[len("data: "):])["choices"]
        assert httpx.post(f"{base_url}/sleep?level=1", headers=AUTH).status_code == 200
        events = [line[len("data: "):] for line in lines if line.startswith("data: ")]
    errors = [json.loads(event)["error"] for event in events if event != "[DONE]" and "error" in json.loads(event)]
    assert errors and errors[0]["code"] == 503 and "put to sleep" in errors[0]["message"]
    assert_engine_idle(engine.engine)
    assert httpx.post(f"{base_url}/wake_up", headers=AUTH).status_code == 200
    expected = cached_hf_greedy(llama_dir, tuple(prompts[2]), 8)
    assert complete(base_url, prompts[2]).json()["choices"][0]["token_ids"] == expected


def test_without_dev_mode_there_are_no_sleep_routes(llama_dir, monkeypatch):
    monkeypatch.delenv("RAYLM_SERVER_DEV_MODE", raising=False)
    from raylm.deploy.api_server import build_app
    from raylm.engine import AsyncLLMEngine, EngineArgs

    engine = AsyncLLMEngine.from_engine_args(EngineArgs(model=str(llama_dir), enable_sleep_mode=True,
                                                        num_gpu_blocks_override=16, max_model_len=64,
                                                        disable_log_stats=True))
    try:
        paths = {getattr(route, "path", None) for route in build_app(engine).routes}
        assert not paths & {"/sleep", "/wake_up", "/is_sleeping", "/reset_prefix_cache", "/collective_rpc"}
    finally:
        engine.shutdown()


def test_dev_routes_of_an_engine_without_sleep_mode_are_400s_naming_the_flag(llama_dir, monkeypatch):
    """The flag is named, not `level` or `tags` (the request's fields are fine)."""
    from raylm.deploy.server_args import ServerArgs
    from raylm.engine import AsyncLLMEngine, EngineArgs

    monkeypatch.setenv("RAYLM_SERVER_DEV_MODE", "1")
    engine = AsyncLLMEngine.from_engine_args(EngineArgs(model=str(llama_dir), num_gpu_blocks_override=16,
                                                        max_model_len=64, disable_log_stats=True))
    try:
        with InProcessServer(engine, ServerArgs()) as base_url:
            for route in ("/sleep?level=1", "/wake_up?tags=weights"):
                error = httpx.post(f"{base_url}{route}").json()["error"]
                assert error["code"] == 400 and error["param"] is None, error
                assert "--enable-sleep-mode" in error["message"], error
    finally:
        engine.shutdown()


def test_a_serve_app_with_dev_routes_needs_a_single_replica(llama_dir, monkeypatch):
    """/sleep or a weight push through /collective_rpc reaches one replica: with several,
    the others would serve on, awake or with the old weights. Refused before anything starts."""
    from raylm.deploy.serve_app import app_builder

    monkeypatch.setenv("RAYLM_SERVER_DEV_MODE", "1")
    with pytest.raises(ValueError, match=r"RAYLM_SERVER_DEV_MODE's routes .* need a single engine replica"):
        app_builder({"model": str(llama_dir), "enable_sleep_mode": True, "num_replicas": 2})
