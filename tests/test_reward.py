"""`LLM.reward` (vLLM's pooling task "token_classify") on a sequence classifier, as reward
models such as Skywork-Reward are (`*ForSequenceClassification`, one label): every prompt
token's head output through the classifier's activation. The reference is Hugging Face
transformers on the same tiny random weights, in fp32: the model's own `score` head applied
to its decoder's final hidden state at every position (HF's sequence classifier computes
exactly these, then keeps the last), through the sigmoid (one label) or the softmax."""

from __future__ import annotations

import pytest
import torch

from engine_checks import assert_async_engine_idle, assert_engine_idle
from hf_reference import hf_classifier
from raylm.engine import LLM, PoolingParams
from tiny_models import build_tiny_classifier, random_prompts_spanning

TOLERANCE = 1e-4


def hf_token_logits(model_dir, prompt: list[int]) -> torch.Tensor:
    """[len(prompt), num_labels]: HF's score head at every position of one unpadded prompt."""
    model = hf_classifier(str(model_dir))
    with torch.no_grad():
        hidden = getattr(model, model.base_model_prefix)(torch.tensor([prompt])).last_hidden_state
        return model.score(hidden)[0].float()


def as_token_prompts(prompts: list[list[int]]) -> list[dict]:
    return [{"prompt_token_ids": prompt} for prompt in prompts]


def assert_rewards_equal_hf(model_dir, prompts, outputs, activation) -> None:
    assert [output.prompt_token_ids for output in outputs] == prompts
    for prompt, output in zip(prompts, outputs):
        torch.testing.assert_close(output.outputs.data, activation(hf_token_logits(model_dir, prompt)),
                                   atol=TOLERANCE, rtol=0)


@pytest.fixture(scope="module")
def reward_dir(tmp_path_factory):
    return build_tiny_classifier(tmp_path_factory.mktemp("reward") / "llama", "llama", num_labels=1, seed=21)


@pytest.fixture(scope="module")
def reward_model(reward_dir):
    # A budget that chunks prompts of up to 60 tokens over several steps, beside others.
    llm = LLM(model=str(reward_dir), dtype="float32", max_model_len=128, max_num_batched_tokens=24)
    yield llm
    llm.shutdown()


def test_reward_is_hf_head_at_every_token_through_the_sigmoid(reward_model, reward_dir):
    assert "token_classify" in reward_model.llm_engine.model_config.supported_pooling_tasks
    prompts = random_prompts_spanning(6, seed=1, min_len=1, max_len=60)
    outputs = reward_model.reward(as_token_prompts(prompts), use_tqdm=False)
    assert [tuple(output.outputs.data.shape) for output in outputs] == [(len(p), 1) for p in prompts]
    assert_rewards_equal_hf(reward_dir, prompts, outputs, torch.sigmoid)
    assert_engine_idle(reward_model.llm_engine)


def test_use_activation_false_returns_hf_logits_and_the_last_row_is_classify(reward_model, reward_dir):
    prompts = random_prompts_spanning(3, seed=2, min_len=20, max_len=50)
    rewards = reward_model.reward(as_token_prompts(prompts), pooling_params=PoolingParams(use_activation=False),
                                  use_tqdm=False)
    assert_rewards_equal_hf(reward_dir, prompts, rewards, lambda logits: logits)
    classified = reward_model.classify(as_token_prompts(prompts), use_tqdm=False)
    for reward, classes in zip(rewards, classified):
        torch.testing.assert_close(reward.outputs.data[-1].sigmoid(), torch.tensor(classes.outputs.probs),
                                   atol=TOLERANCE, rtol=0)


def test_a_cached_prefix_is_computed_again_for_every_tokens_rows(reward_model, reward_dir):
    """Cached tokens have no hidden states: a reward request reads no cached prefix (and
    counts no lookup), so it returns every row even after classify cached its blocks."""
    prompts = random_prompts_spanning(2, seed=3, min_len=40, max_len=60)
    kv = reward_model.llm_engine.scheduler.kv_cache_manager
    reward_model.classify(as_token_prompts(prompts), use_tqdm=False)
    reward_model.classify(as_token_prompts(prompts), use_tqdm=False)
    hits, queries = kv.prefix_cache_hits, kv.prefix_cache_queries
    assert hits > 0  # the blocks are cached
    outputs = reward_model.reward(as_token_prompts(prompts), use_tqdm=False)
    assert (kv.prefix_cache_hits, kv.prefix_cache_queries) == (hits, queries)
    assert_rewards_equal_hf(reward_dir, prompts, outputs, torch.sigmoid)
    assert_engine_idle(reward_model.llm_engine)


def test_a_tight_kv_pool_returns_every_row_once_and_leaks_nothing(reward_dir):
    """Few KV blocks and a small token budget: each prompt is chunked over several steps,
    the next admitted beside the last chunk of the one before; each returns its rows once,
    as HF computes them, and every block is back in the pool."""
    llm = LLM(model=str(reward_dir), dtype="float32", max_model_len=64, max_num_batched_tokens=16,
              num_gpu_blocks_override=6, block_size=16)
    try:
        prompts = random_prompts_spanning(6, seed=4, min_len=40, max_len=60)
        outputs = llm.reward(as_token_prompts(prompts), use_tqdm=False)
        assert_rewards_equal_hf(reward_dir, prompts, outputs, torch.sigmoid)
        assert_engine_idle(llm.llm_engine)
    finally:
        llm.shutdown()


def test_two_labels_go_through_the_softmax(tmp_path):
    model_dir = build_tiny_classifier(tmp_path / "qwen2", "qwen2", num_labels=2, seed=22)
    llm = LLM(model=str(model_dir), dtype="float32", max_model_len=64)
    try:
        prompts = random_prompts_spanning(2, seed=5, min_len=5, max_len=30)
        outputs = llm.reward(as_token_prompts(prompts), use_tqdm=False)
        assert_rewards_equal_hf(model_dir, prompts, outputs, lambda logits: logits.softmax(-1))
    finally:
        llm.shutdown()


def test_models_without_a_classifier_head_refuse_reward(llama_dir):
    embedder = LLM(model=str(llama_dir), runner="pooling", dtype="float32", max_model_len=64)
    try:
        with pytest.raises(ValueError, match="LLM.reward needs a model that serves the pooling task 'token_classify'"):
            embedder.reward("hello")
    finally:
        embedder.shutdown()
    generator = LLM(model=str(llama_dir), dtype="float32", max_model_len=64)
    try:
        with pytest.raises(ValueError, match="pooling model"):
            generator.reward("hello")
    finally:
        generator.shutdown()


# ------------------------------------------------------------------ POST /pooling
@pytest.fixture(scope="module")
def reward_server(reward_dir):
    from server_process import InProcessServer

    from raylm.deploy.server_args import ServerArgs
    from raylm.engine import AsyncLLMEngine, EngineArgs

    engine = AsyncLLMEngine.from_engine_args(EngineArgs(model=str(reward_dir), dtype="float32", max_model_len=64,
                                                        max_num_batched_tokens=24, disable_log_stats=True))
    try:
        with InProcessServer(engine, ServerArgs()) as base_url:
            yield base_url, engine
    finally:
        engine.shutdown()


def pool(base_url: str, body: dict):
    import httpx

    return httpx.post(f"{base_url}/pooling", json=body, timeout=60)


@pytest.mark.parametrize("use_activation", [None, False])
def test_pooling_route_token_classify_is_every_tokens_reward(reward_server, reward_dir, use_activation):
    base_url, engine = reward_server
    prompts = random_prompts_spanning(2, seed=6, min_len=10, max_len=50)
    body = {"input": prompts, "task": "token_classify"}
    if use_activation is not None:
        body["use_activation"] = use_activation
    reply = pool(base_url, body)
    assert reply.status_code == 200, reply.text
    answer = reply.json()
    assert answer["object"] == "list" and answer["id"].startswith("pool-")
    assert answer["usage"]["prompt_tokens"] == sum(map(len, prompts))
    activation = torch.sigmoid if use_activation is None else (lambda logits: logits)
    for index, (prompt, item) in enumerate(zip(prompts, answer["data"])):
        assert (item["index"], item["object"]) == (index, "pooling")
        torch.testing.assert_close(torch.tensor(item["data"]), activation(hf_token_logits(reward_dir, prompt)),
                                   atol=TOLERANCE, rtol=0)
    assert_async_engine_idle(engine)


def test_pooling_route_defaults_to_the_models_task(reward_server, reward_dir):
    prompt = random_prompts_spanning(1, seed=7, min_len=10, max_len=20)[0]
    reply = pool(reward_server[0], {"input": prompt})
    assert reply.status_code == 200, reply.text
    torch.testing.assert_close(torch.tensor(reply.json()["data"][0]["data"]),
                               hf_token_logits(reward_dir, prompt)[-1].sigmoid(), atol=TOLERANCE, rtol=0)


@pytest.mark.parametrize("body, param", [
    ({"task": "embed"}, "task"),  # a classifier does not embed
    ({"task": "token_embed"}, "task"),
    ({"task": "token_classify", "normalize": True}, "normalize"),
    ({"task": "token_classify", "truncate_prompt_tokens": 65}, "truncate_prompt_tokens"),
])
def test_pooling_route_refuses_what_the_model_or_task_does_not_serve(reward_server, body, param):
    reply = pool(reward_server[0], {"input": [1, 2, 3], **body})
    assert reply.status_code == 400, reply.text
    assert reply.json()["error"]["param"] == param, reply.text
