"""`/rerank`, `/score` and `/classify` through the Ray Serve app (ingress and one engine
replica of a one-label Qwen2ForSequenceClassification, which runner "auto" pools): the
routes relay like any other, and the answers equal Hugging Face's classifier on the same
weights."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
import torch

from hf_reference import hf_classifier_logits
from server_process import free_port

ray = pytest.importorskip("ray")
serve = pytest.importorskip("ray.serve")

APP = "raylm-score-test"


@pytest.fixture(scope="module")
def cross_encoder_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tiny_models import build_tiny_classifier

    return build_tiny_classifier(tmp_path_factory.mktemp("serve-score") / "ce", "qwen2", num_labels=1, seed=31)


@pytest.fixture(scope="module")
def served(ray_cluster, cross_encoder_dir: Path):
    from raylm.deploy.serve_app import build_serve_app

    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    app = build_serve_app({"model": str(cross_encoder_dir), "num_gpu_blocks_override": 64, "device": "cpu",
                           "max_model_len": 128}, {}, num_replicas=1, replica_cpus=0.25, ingress_cpus=0.1)
    serve.run(app, name=APP, route_prefix="/")
    yield f"http://127.0.0.1:{port}"
    serve.delete(APP)
    serve.shutdown()


def test_rerank_score_and_classify_through_serve_equal_hf(served, cross_encoder_dir):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(cross_encoder_dir))
    query = "What splits attention heads across devices?"
    documents = ["The quick brown fox jumps over the lazy dog.",
                 "Tensor parallelism splits attention heads and MLP columns across devices."]
    expected = [torch.sigmoid(hf_classifier_logits(cross_encoder_dir,
                                                   tokenizer(text=query, text_pair=d)["input_ids"]))[0].item()
                for d in documents]
    reply = httpx.post(served + "/v2/rerank", json={"query": query, "documents": documents}, timeout=60)
    assert reply.status_code == 200, reply.text
    results = reply.json()["results"]
    assert [r["index"] for r in results] == sorted(range(2), key=expected.__getitem__, reverse=True)
    assert [r["relevance_score"] for r in results] == pytest.approx(sorted(expected, reverse=True), abs=1e-4)
    scores = httpx.post(served + "/v1/score", json={"text_1": query, "text_2": documents}, timeout=60).json()
    assert [item["score"] for item in scores["data"]] == pytest.approx(expected, abs=1e-4)
    probs = httpx.post(served + "/classify", json={"input": [query]}, timeout=60).json()["data"][0]["probs"]
    assert probs == pytest.approx([torch.sigmoid(hf_classifier_logits(cross_encoder_dir,
                                                                      tokenizer.encode(query)))[0].item()], abs=1e-4)
    bad = httpx.post(served + "/rerank", json={"query": query, "documents": []}, timeout=60)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "documents"
