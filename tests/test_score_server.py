"""`/classify`, `/score` (`/v1/score`) and `/rerank` (`/v1/rerank`, `/v2/rerank`) on a real HTTP
server (uvicorn over the app, in this process so that the test can read the engine's KV
pool) against Hugging Face transformers on the same tiny random weights: a 3-label
classifier, a 1-label cross-encoder and an embedding model; OpenAI-style 400s naming the
field, and no KV block held after any request."""

from __future__ import annotations


import pytest
import torch

from engine_checks import assert_async_engine_idle
from hf_reference import hf_classifier_logits, hf_embedding
from server_process import InProcessServer
from tiny_models import build_tiny_classifier

MAX_MODEL_LEN = 64
QUERY = "What splits attention heads across devices?"
DOCUMENTS = ["The quick brown fox jumps over the lazy dog.",
             "Tensor parallelism splits attention heads and MLP columns across devices.",
             "Ray places one worker actor on each GPU of the cluster."]


def serve(model_dir, **engine_kwargs):
    from raylm.deploy.limits import RequestLimits
    from raylm.deploy.server_args import ServerArgs
    from raylm.engine import AsyncLLMEngine, EngineArgs

    engine = AsyncLLMEngine.from_engine_args(EngineArgs(
        model=str(model_dir), dtype="float32", max_model_len=MAX_MODEL_LEN, max_num_batched_tokens=24,
        disable_log_stats=True, **engine_kwargs))
    try:
        with InProcessServer(engine, ServerArgs(limits=RequestLimits(max_prompts_per_request=4))) as base_url:
            yield base_url, engine
    finally:
        engine.shutdown()


@pytest.fixture(scope="module")
def cross_encoder_dir(tmp_path_factory):
    return build_tiny_classifier(tmp_path_factory.mktemp("score_server") / "ce", "qwen2", num_labels=1, seed=21)


@pytest.fixture(scope="module")
def cross_encoder(cross_encoder_dir):
    yield from serve(cross_encoder_dir)


@pytest.fixture(scope="module")
def classifier_dir(tmp_path_factory):
    return build_tiny_classifier(tmp_path_factory.mktemp("score_server") / "cls", "llama", num_labels=3, seed=22,
                                 id2label={0: "negative", 1: "neutral", 2: "positive"})


@pytest.fixture(scope="module")
def classifier(classifier_dir):
    yield from serve(classifier_dir)


@pytest.fixture(scope="module")
def embedder(llama_dir):
    yield from serve(llama_dir, runner="pooling")


def post(base_url: str, route: str, body: dict):
    import httpx

    return httpx.post(f"{base_url}{route}", json=body, timeout=60)


def hf_pair_score(model_dir, text_1: str, text_2: str) -> tuple[int, float]:
    """(tokens, HF's sigmoid score) of the pair as the tokenizer encodes it."""
    from transformers import AutoTokenizer

    token_ids = AutoTokenizer.from_pretrained(str(model_dir))(text=text_1, text_pair=text_2)["input_ids"]
    return len(token_ids), torch.sigmoid(hf_classifier_logits(model_dir, token_ids))[0].item()


def test_classify_returns_hf_softmax_and_the_id2label_of_the_best(classifier, classifier_dir):
    from transformers import AutoTokenizer

    base_url, engine = classifier
    texts = ["The quick brown fox", "Hello, world! How are you today?"]
    token_ids = [AutoTokenizer.from_pretrained(str(classifier_dir)).encode(text) for text in texts]
    for body_input, prompts in [(texts, token_ids), ([list(range(5, 40))], [list(range(5, 40))])]:
        reply = post(base_url, "/classify", {"model": str(classifier_dir), "input": body_input})
        assert reply.status_code == 200, reply.text
        body = reply.json()
        assert body["object"] == "list" and body["id"].startswith("classify-")
        assert body["usage"]["prompt_tokens"] == sum(map(len, prompts))
        for index, (prompt, item) in enumerate(zip(prompts, body["data"])):
            expected = hf_classifier_logits(classifier_dir, prompt).softmax(-1)
            torch.testing.assert_close(torch.tensor(item["probs"]), expected, atol=1e-4, rtol=0)
            assert item["index"] == index and item["num_classes"] == 3
            assert item["label"] == ["negative", "neutral", "positive"][int(expected.argmax())]
    logits = post(base_url, "/classify", {"input": [token_ids[0]], "use_activation": False}).json()["data"][0]
    torch.testing.assert_close(torch.tensor(logits["probs"]), hf_classifier_logits(classifier_dir, token_ids[0]),
                               atol=1e-4, rtol=0)
    assert_async_engine_idle(engine)


@pytest.mark.parametrize("route", ["/score", "/v1/score"])
def test_score_pairs_are_hf_sigmoid_one_to_one_one_to_n_and_n_to_n(cross_encoder, cross_encoder_dir, route):
    base_url, engine = cross_encoder
    for body, pairs in [
        ({"text_1": QUERY, "text_2": DOCUMENTS[0]}, [(QUERY, DOCUMENTS[0])]),
        ({"text_1": QUERY, "text_2": DOCUMENTS}, [(QUERY, d) for d in DOCUMENTS]),
        ({"data_1": DOCUMENTS[:2], "data_2": [QUERY, QUERY]}, [(d, QUERY) for d in DOCUMENTS[:2]]),  # newer names
    ]:
        reply = post(base_url, route, body)
        assert reply.status_code == 200, reply.text
        response = reply.json()
        assert response["id"].startswith("score-") and response["object"] == "list"
        expected = [hf_pair_score(cross_encoder_dir, *pair) for pair in pairs]
        assert [item["index"] for item in response["data"]] == list(range(len(pairs)))
        assert all(item["object"] == "score" for item in response["data"])
        for item, (_, score) in zip(response["data"], expected):
            assert item["score"] == pytest.approx(score, abs=1e-4)
        assert response["usage"]["prompt_tokens"] == sum(count for count, _ in expected)
    assert_async_engine_idle(engine)


@pytest.mark.parametrize("route", ["/rerank", "/v1/rerank", "/v2/rerank"])
def test_rerank_orders_documents_by_hf_score_and_keeps_the_top_n(cross_encoder, cross_encoder_dir, route):
    base_url, engine = cross_encoder
    expected = [hf_pair_score(cross_encoder_dir, QUERY, document) for document in DOCUMENTS]
    order = sorted(range(len(DOCUMENTS)), key=lambda i: expected[i][1], reverse=True)
    reply = post(base_url, route, {"query": QUERY, "documents": DOCUMENTS})
    assert reply.status_code == 200, reply.text
    body = reply.json()
    assert body["id"].startswith("rerank-")
    assert [result["index"] for result in body["results"]] == order
    for result in body["results"]:
        assert result["relevance_score"] == pytest.approx(expected[result["index"]][1], abs=1e-4)
        assert result["document"] == {"text": DOCUMENTS[result["index"]]}
    total = sum(count for count, _ in expected)
    assert body["usage"] == {"prompt_tokens": total, "total_tokens": total}
    top = post(base_url, route, {"query": QUERY, "documents": DOCUMENTS, "top_n": 2, "return_documents": False})
    assert [result["index"] for result in top.json()["results"]] == order[:2]
    assert all("document" not in result for result in top.json()["results"])
    assert_async_engine_idle(engine)


def test_an_embedding_model_scores_and_reranks_with_the_cosine_of_hf_embeddings(embedder, llama_dir):
    from transformers import AutoTokenizer

    base_url, engine = embedder
    tokenizer = AutoTokenizer.from_pretrained(str(llama_dir))
    query = hf_embedding(llama_dir, tokenizer.encode(QUERY))
    expected = [torch.nn.functional.cosine_similarity(query, hf_embedding(llama_dir, tokenizer.encode(d)), dim=0)
                .item() for d in DOCUMENTS]
    scores = post(base_url, "/score", {"text_1": QUERY, "text_2": DOCUMENTS})
    assert scores.status_code == 200, scores.text
    assert [item["score"] for item in scores.json()["data"]] == pytest.approx(expected, abs=1e-4)
    reranked = post(base_url, "/v1/rerank", {"query": QUERY, "documents": DOCUMENTS, "top_n": 1}).json()
    assert [result["index"] for result in reranked["results"]] == [max(range(3), key=expected.__getitem__)]
    assert_async_engine_idle(engine)


@pytest.mark.parametrize("route, body, param, words", [
    ("/score", {"text_1": [], "text_2": "a"}, "text_1", "empty"),
    ("/score", {"text_1": "a", "data_1": "b", "text_2": "c"}, "data_1", "not both"),
    ("/score", {"text_1": "a", "text_2": ["b", ""]}, "text_2", "empty"),
    ("/score", {"text_1": ["a", "b"], "text_2": ["c", "d", "e"]}, "text_2", "1:1, 1:N or N:N"),
    ("/score", {"text_1": "a", "text_2": ["b"] * 5}, "text_2", "at most 4"),
    ("/score", {"text_1": "Hello, world! " * 30, "text_2": "b"}, "text_2", "maximum context length"),
    ("/score", {"text_1": "a", "text_2": "b", "truncate_prompt_tokens": 0}, "truncate_prompt_tokens", "positive"),
    ("/score", {"text_1": "a", "text_2": "b", "truncate_prompt_tokens": MAX_MODEL_LEN + 1}, "truncate_prompt_tokens",
     "max_model_len"),
    ("/score", {"text_1": "a", "text_2": "b", "use_activation": "yes"}, "use_activation", ""),
    # Shorter than the pair's 3 special tokens: the tokenizer left the pair whole (5 tokens).
    ("/score", {"text_1": "a", "text_2": "b", "truncate_prompt_tokens": 2}, "truncate_prompt_tokens",
     "3 special tokens"),
    ("/score", {"text_1": "a", "text_2": "b", "priority": 1}, "priority", "scheduling policy"),
    ("/score", {"text_1": "a", "text_2": "b", "model": "other"}, "model", "does not exist"),
    ("/rerank", {"query": "", "documents": ["a"]}, "query", "empty"),
    ("/rerank", {"query": "q", "documents": []}, "documents", "empty"),
    ("/rerank", {"query": "q", "documents": ["d"] * 5}, "documents", "at most 4"),
    ("/rerank", {"query": "q", "documents": ["d"], "top_n": -1}, "top_n", ""),
    ("/rerank", {"query": "q", "documents": ["d"], "return_documents": "no"}, "return_documents", ""),
    ("/v2/rerank", {"query": "q", "documents": ["Hello, world! " * 30]}, "documents", "maximum context length"),
    ("/classify", {"input": []}, "input", "empty"),
    ("/classify", {"input": [[5, 6], [600]]}, "input", "vocabulary"),
    ("/classify", {"input": "hello", "normalize": True, "dimensions": 8}, None, None),  # unknown fields ignored
])
def test_bad_requests_are_400s_naming_the_field(cross_encoder, route, body, param, words):
    base_url, engine = cross_encoder
    reply = post(base_url, route, body)
    if param is None:
        assert reply.status_code == 200, reply.text
        return
    assert reply.status_code == (404 if param == "model" else 400), reply.text
    error = reply.json()["error"]
    assert (error["param"] == param or param in error["message"]) and words in error["message"], error
    assert_async_engine_idle(engine)


def test_truncate_prompt_tokens_cuts_pairs_with_the_tokenizer(cross_encoder, cross_encoder_dir):
    from transformers import AutoTokenizer

    base_url, engine = cross_encoder
    text_1, text_2 = QUERY, "Hello, world! " * 30
    reply = post(base_url, "/score", {"text_1": text_1, "text_2": text_2, "truncate_prompt_tokens": 20})
    assert reply.status_code == 200, reply.text
    token_ids = AutoTokenizer.from_pretrained(str(cross_encoder_dir))(
        text=text_1, text_pair=text_2, truncation=True, max_length=20)["input_ids"]
    assert reply.json()["usage"]["prompt_tokens"] == len(token_ids) == 20
    expected = torch.sigmoid(hf_classifier_logits(cross_encoder_dir, token_ids))[0].item()
    assert reply.json()["data"][0]["score"] == pytest.approx(expected, abs=1e-4)
    assert_async_engine_idle(engine)


def test_routes_refuse_models_that_do_not_serve_them(classifier, embedder):
    for (base_url, engine), route, body in [
        (classifier, "/score", {"text_1": "a", "text_2": "b"}),  # three labels: no score
        (classifier, "/rerank", {"query": "a", "documents": ["b"]}),
        (classifier, "/v1/embeddings", {"input": "a"}),
        (embedder, "/classify", {"input": "a"}),
    ]:
        reply = post(base_url, route, body)
        assert reply.status_code == 400, reply.text
        error = reply.json()["error"]
        assert error["param"] == "model" and "does not serve" in error["message"], error
        api = {"/score": "Score API", "/rerank": "Score API", "/v1/embeddings": "Embeddings API",
               "/classify": "Classification API"}[route]
        assert error["message"].startswith(f"This model does not serve the {api}"), error
        assert_async_engine_idle(engine)


def test_priority_reaches_the_engine_requests_under_the_priority_policy(cross_encoder_dir, monkeypatch):
    """Each pair's engine request carries the request's priority (a spy on the real
    EngineCore.add_request, which still runs)."""
    from raylm.engine.engine_core import EngineCore

    priorities = []
    add_request = EngineCore.add_request

    def recording(self, request):
        priorities.append(request.priority)
        add_request(self, request)

    monkeypatch.setattr(EngineCore, "add_request", recording)
    for base_url, engine in serve(cross_encoder_dir, scheduling_policy="priority"):
        for route, body in [("/score", {"text_1": "a", "text_2": ["b", "c"]}),
                            ("/rerank", {"query": "a", "documents": ["b"]}), ("/classify", {"input": ["a"]})]:
            reply = post(base_url, route, {**body, "priority": -3})
            assert reply.status_code == 200, reply.text
        assert_async_engine_idle(engine)
    assert priorities == [-3] * 4
