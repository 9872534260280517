"""`/v1/embeddings` through the Ray Serve app (ingress, prefix-aware router, two engine
replicas of a bare `LlamaModel` checkpoint, which runner "auto" pools).

An embeddings input is a prompt with no template, prefilled as a completion's is, so the
router keys it as a completion (its first input's block hashes): inputs that share an
instruction prefix reach the replica that caches it, as decoder embedding models are used
(e5-mistral's "Instruct: ...\\nQuery: "). The answers equal Hugging Face's AutoModel pooled at
the last token. A pooling engine that caches nothing (MEAN or CLS) is not keyed at all.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import httpx
import pytest
import torch

from hf_reference import hf_embedding
from server_process import free_port

ray = pytest.importorskip("ray")
serve = pytest.importorskip("ray.serve")

APP = "raylm-embed-test"
ENGINE = "RaylmDeployment"
BLOCK = 16
PREFIX_BLOCKS = 3


@pytest.fixture(scope="module")
def base_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tiny_models import build_tiny_base_model

    return build_tiny_base_model(tmp_path_factory.mktemp("serve-embed") / "e5-tiny", "llama", seed=6)


# ------------------------------------------------------------------ keys
def test_an_embedding_input_is_keyed_as_the_same_completion_prompt(base_model_dir):
    from raylm.deploy.prefix_key import COMPLETIONS_ROUTE, EMBEDDINGS_ROUTE, PrefixKeyer, block_hash_key
    from raylm.engine.tokenizer import get_tokenizer

    tokenizer = get_tokenizer(str(base_model_dir), False, None, "auto")
    keyer = PrefixKeyer(tokenizer, BLOCK, max_blocks=64)

    def key(route: str, body: dict) -> tuple[bytes, ...] | None:
        found = keyer.key(route, json.dumps(body).encode())
        return None if found is None else found.block_hashes

    text = "Instruct: find the passage about paged attention\nQuery: " * 4
    token_ids = list(range(5, 5 + 3 * BLOCK + 5))
    assert key(EMBEDDINGS_ROUTE, {"input": text}) == key(COMPLETIONS_ROUTE, {"prompt": text})
    assert key(EMBEDDINGS_ROUTE, {"input": text}) == block_hash_key(tokenizer.encode(text), BLOCK)
    # A list of inputs goes where its first input's prefix is; token ids key as they are.
    assert key(EMBEDDINGS_ROUTE, {"input": [token_ids, [7, 8]]}) == block_hash_key(token_ids, BLOCK)
    assert key(EMBEDDINGS_ROUTE, {"input": token_ids}) == block_hash_key(token_ids, BLOCK)
    # truncate_prompt_tokens keeps the input's last tokens: its first blocks are never cached.
    assert key(EMBEDDINGS_ROUTE, {"input": token_ids, "truncate_prompt_tokens": 20}) is None


def test_only_a_pooling_engine_that_caches_prefixes_is_keyed(base_model_dir):
    from raylm.deploy.serve_app import keyer_arguments
    from raylm.deploy.server_args import DeploymentArgs, ServerArgs
    from raylm.engine import EngineArgs

    two = DeploymentArgs.from_values({"num_replicas": 2})
    assert keyer_arguments(EngineArgs(model=str(base_model_dir)), ServerArgs(), two) is not None  # LAST
    for pooling_type in ("MEAN", "CLS"):
        mean = EngineArgs(model=str(base_model_dir), pooler_config={"pooling_type": pooling_type})
        assert keyer_arguments(mean, ServerArgs(), two) is None


# ------------------------------------------------------------- a real app
@pytest.fixture(scope="module")
def served(ray_cluster, base_model_dir: Path):
    from raylm.deploy.serve_app import build_serve_app

    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    app = build_serve_app({"model": str(base_model_dir), "num_gpu_blocks_override": 256, "device": "cpu",
                           "max_model_len": 256}, {}, num_replicas=2, replica_cpus=0.25, ingress_cpus=0.1,
                          router_stats_period_s=0.3)
    serve.run(app, name=APP, route_prefix="/")
    yield f"http://127.0.0.1:{port}"
    serve.delete(APP)
    serve.shutdown()


def _cached_blocks() -> dict[str, set[bytes]]:
    """Each engine replica's reported cached block hashes, by replica id."""
    found = {}
    for entry in ray.util.list_named_actors(all_namespaces=True):
        name = entry["name"] if isinstance(entry, dict) else entry
        if name.startswith(f"SERVE_REPLICA::{APP}#{ENGINE}#"):
            report = ray.get(ray.get_actor(name, namespace="serve").record_routing_stats.remote(), timeout=30)
            blob, width = report["cached_block_hashes"], report["key_hash_bytes"]
            found[name.rsplit("#", 1)[1]] = {blob[i:i + width] for i in range(0, len(blob), width)}
    return found


def _decisions(url: str) -> dict[str, float]:
    text = httpx.get(url + "/metrics", timeout=30).text
    return {kind: float(value) for kind, value in re.findall(r'raylm:router_requests_total\{decision="(\w+)"\} (\S+)',
                                                             text)}


def _embed(url: str, inputs: list[list[int]]) -> list[list[float]]:
    response = httpx.post(url + "/v1/embeddings", json={"input": inputs}, timeout=60)
    assert response.status_code == 200, response.text
    return [item["embedding"] for item in sorted(response.json()["data"], key=lambda item: item["index"])]


def test_embeddings_through_serve_equal_hf_and_share_a_prefix_on_one_replica(served, base_model_dir):
    from raylm.deploy.prefix_key import block_hash_key

    url = served
    before = _decisions(url)
    prefixes = [[(seed * 7919 + i * 31) % 500 + 5 for i in range(PREFIX_BLOCKS * BLOCK)] for seed in range(2)]
    queries = [[9, 10, 11], [12, 13, 14, 15]]
    for query in queries:
        for prefix in prefixes:
            inputs = [prefix + query]
            (embedding,) = _embed(url, inputs)
            torch.testing.assert_close(torch.tensor(embedding), hf_embedding(base_model_dir, inputs[0]), atol=1e-4,
                                       rtol=0)
    after = _decisions(url)
    delta = {kind: after.get(kind, 0.0) - before.get(kind, 0.0) for kind in after}
    # Each prefix's first request found it nowhere; its second went where it was cached.
    assert delta.get("no_match") == 2 and delta.get("prefix_match") == 2, delta
    cached = _cached_blocks()
    for prefix in prefixes:
        holders = [replica for replica, blocks in cached.items() if set(block_hash_key(prefix, BLOCK)) <= blocks]
        assert len(holders) == 1, (holders, cached.keys())
