"""The Ray Serve application takes the LoRA settings as a Serve config's `args` (what
deploy/serve_config.yaml spells): the adapters are model names, `model` selects one (its
tokens, return_token_ids, are peft's greedy ones up to near-ties), and runtime loading works
behind its switch. The server's other keys reach the replica's app too
(return_tokens_as_token_ids names the logprobs' tokens by id)."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from lora_adapters import assert_peft_greedy, build_lora_adapter
from test_api_server import free_port

ray = pytest.importorskip("ray")
serve = pytest.importorskip("ray.serve")

APP_NAME = "raylm-lora-test"
MODEL = "tiny"
PROMPT = [5, 17, 33, 101, 64, 9, 250, 31]
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def adapters(tmp_path_factory, llama_dir: Path) -> Path:
    root = tmp_path_factory.mktemp("serve_adapters")
    build_lora_adapter(llama_dir, root / "a", rank=8, seed=1)
    build_lora_adapter(llama_dir, root / "b", rank=4, targets=("q_proj", "v_proj"), seed=2)
    return root


@pytest.fixture(scope="module")
def serve_url(ray_cluster, llama_dir: Path, adapters: Path):
    from raylm.deploy.serve_app import app_builder

    # As a Serve config's args: engine, server and deployment keys side by side.
    args = {"model": str(llama_dir), "served_model_name": MODEL, "dtype": "float32", "max_model_len": 128,
            "enable_lora": True, "max_loras": 2, "max_lora_rank": 8, "lora_modules": [f"a={adapters / 'a'}"],
            "allow_runtime_lora_updating": True, "allowed_lora_dirs": [str(adapters)],
            "return_tokens_as_token_ids": True, "num_replicas": 1, "replica_cpus": 0.25}
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    serve.run(app_builder(args), name=APP_NAME, route_prefix="/")
    yield f"http://127.0.0.1:{port}"
    serve.delete(APP_NAME)
    serve.shutdown()


def assert_peft_tokens(url: str, model: str, llama_dir: Path, adapter: Path | None) -> None:
    """The greedy completion of PROMPT under `model` is peft's under `adapter`, token by token
    up to near-ties; its logprobs name the same tokens `token_id:{id}` (the Serve key)."""
    body = {"model": model, "prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True,
            "logprobs": 0, "return_token_ids": True}
    response = httpx.post(url + "/v1/completions", json=body, timeout=60)
    assert response.status_code == 200, response.text
    (choice,) = response.json()["choices"]
    assert choice["prompt_token_ids"] == PROMPT
    assert_peft_greedy(llama_dir, adapter, PROMPT, choice["token_ids"], MAX_TOKENS, model)
    assert choice["logprobs"]["tokens"] == [f"token_id:{token}" for token in choice["token_ids"]]


def test_serve_app_serves_the_adapters_its_args_name(serve_url, llama_dir, adapters):
    models = {card["id"]: card for card in httpx.get(serve_url + "/v1/models", timeout=30).json()["data"]}
    assert set(models) == {MODEL, "a"} and models["a"]["parent"] == MODEL
    assert_peft_tokens(serve_url, "a", llama_dir, adapters / "a")
    response = httpx.post(serve_url + "/v1/load_lora_adapter", timeout=60,
                          json={"lora_name": "b", "lora_path": str(adapters / "b")})
    assert response.status_code == 200, response.text
    assert_peft_tokens(serve_url, "b", llama_dir, adapters / "b")
    assert_peft_tokens(serve_url, MODEL, llama_dir, None)
    # Each is told apart: a's tokens are not b's.
    with pytest.raises(AssertionError, match="token"):
        assert_peft_tokens(serve_url, "a", llama_dir, adapters / "b")


def test_runtime_loading_needs_one_replica_and_the_router_keys_adapters_apart(llama_dir, adapters):
    """A load request reaches one replica, so runtime loading with several is refused before
    anything starts; with LoRA on, the prefix router learns the base model's names (any other
    `model` is an adapter, keyed apart: tests/test_prefix_router.py)."""
    from raylm.deploy.serve_app import app_builder, keyer_arguments
    from raylm.deploy.server_args import DeploymentArgs, ServerArgs
    from raylm.engine.arg_utils import EngineArgs

    args = {"model": str(llama_dir), "served_model_name": MODEL, "enable_lora": True,
            "allow_runtime_lora_updating": True, "allowed_lora_dirs": [str(adapters)], "max_replicas": 2}
    with pytest.raises(ValueError, match=r"allow_runtime_lora_updating .* needs a single engine replica"):
        app_builder(args)
    server_args = ServerArgs(served_model_name=[MODEL])
    two = DeploymentArgs(num_replicas=2)
    lora = keyer_arguments(EngineArgs(model=str(llama_dir), enable_lora=True), server_args, two)
    assert lora["base_model_names"] == [MODEL]
    assert keyer_arguments(EngineArgs(model=str(llama_dir)), server_args, two)["base_model_names"] is None
