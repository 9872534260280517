"""Embeddings (runner="pooling", `LLM.embed`) against Hugging Face transformers' AutoModel on
the same tiny decoder, in fp32: the final norm's hidden states pooled at the last token, the
first, or averaged, L2-normalized, within 1e-4."""

from __future__ import annotations

import pytest
import torch

from engine_checks import assert_engine_idle, tensor_parallel_llm
from hf_reference import hf_embedding
from raylm.engine import LLM, PoolingParams, SamplingParams
from tiny_models import build_tiny_model, random_prompts_spanning

TOLERANCE = 1e-4


def assert_embeddings_equal_hf(model_dir, prompts, outputs, pooling_type="LAST", normalize=True) -> None:
    assert [output.prompt_token_ids for output in outputs] == prompts
    for prompt, output in zip(prompts, outputs):
        reference = hf_embedding(model_dir, prompt, pooling_type, normalize)
        torch.testing.assert_close(torch.tensor(output.outputs.embedding), reference, atol=TOLERANCE, rtol=0)


def as_token_prompts(prompts: list[list[int]]) -> list[dict]:
    return [{"prompt_token_ids": prompt} for prompt in prompts]


# vLLM's defaults (chunked prefill and prefix caching on), and a budget that chunks prompts
# of up to 60 tokens over several steps, beside other prompts' chunks.
LAST_MODES = {"default": {}, "small-chunks": dict(max_num_batched_tokens=24)}


@pytest.fixture(scope="module", params=list(LAST_MODES))
def last_llm(request, llama_dir):
    llm = LLM(model=str(llama_dir), dtype="float32", runner="pooling", **LAST_MODES[request.param])
    yield llm
    llm.shutdown()


def test_last_token_embeddings_equal_hf_for_mixed_lengths(last_llm, llama_dir):
    prompts = random_prompts_spanning(12, seed=1, min_len=1, max_len=60)
    outputs = last_llm.embed(as_token_prompts(prompts), use_tqdm=False)
    assert_embeddings_equal_hf(llama_dir, prompts, outputs)
    assert all(abs(torch.tensor(o.outputs.embedding).norm().item() - 1.0) < 1e-5 for o in outputs)
    assert_engine_idle(last_llm.llm_engine)


def test_prefix_cache_hits_give_the_same_embedding(last_llm, llama_dir):
    # The second run finds the prompts' full blocks cached and computes only their tails.
    prompts = random_prompts_spanning(4, seed=2, min_len=33, max_len=60)
    kv = last_llm.llm_engine.scheduler.kv_cache_manager
    first = last_llm.embed(as_token_prompts(prompts), use_tqdm=False)
    hits = kv.prefix_cache_hits
    second = last_llm.embed(as_token_prompts(prompts), use_tqdm=False)
    assert kv.prefix_cache_hits > hits
    torch.testing.assert_close(torch.tensor([o.outputs.embedding for o in first]),
                               torch.tensor([o.outputs.embedding for o in second]), atol=1e-6, rtol=0)
    assert_embeddings_equal_hf(llama_dir, prompts, second)
    assert_engine_idle(last_llm.llm_engine)


@pytest.mark.parametrize("pooling_type", ["MEAN", "CLS"])
def test_mean_and_cls_pooling_equal_hf_and_run_whole_prompts(llama_dir, pooling_type):
    llm = LLM(model=str(llama_dir), dtype="float32", runner="pooling", max_model_len=128,
              pooler_config={"pooling_type": pooling_type, "normalize": False})
    try:
        engine = llm.llm_engine
        # Both pool rows a chunk or a cache hit would skip: the engine runs whole prompts.
        assert not engine.engine_config.scheduler_config.enable_chunked_prefill
        assert not engine.engine_config.cache_config.enable_prefix_caching
        prompts = random_prompts_spanning(6, seed=4, min_len=1, max_len=100)
        outputs = llm.embed(as_token_prompts(prompts), use_tqdm=False)
        assert_embeddings_equal_hf(llama_dir, prompts, outputs, pooling_type, normalize=False)
        # The request's normalize overrides the engine's.
        normalized = llm.embed(as_token_prompts(prompts[:2]), pooling_params=PoolingParams(normalize=True),
                               use_tqdm=False)
        assert_embeddings_equal_hf(llama_dir, prompts[:2], normalized, pooling_type, normalize=True)
        assert_engine_idle(engine)
    finally:
        llm.shutdown()


def test_truncate_prompt_tokens_pools_the_last_tokens_and_long_prompts_are_refused(last_llm, llama_dir):
    max_model_len = last_llm.llm_engine.model_config.max_model_len
    prompt = random_prompts_spanning(2, seed=5, min_len=max_model_len + 10, max_len=max_model_len + 10)[0]
    with pytest.raises(ValueError, match="truncate_prompt_tokens"):
        last_llm.embed(as_token_prompts([prompt]), use_tqdm=False)
    (output,) = last_llm.embed(as_token_prompts([prompt]), truncate_prompt_tokens=20, use_tqdm=False)
    assert_embeddings_equal_hf(llama_dir, [prompt[-20:]], [output])
    (output,) = last_llm.embed(as_token_prompts([prompt]), truncate_prompt_tokens=-1, use_tqdm=False)
    assert output.prompt_token_ids == prompt[-max_model_len:]
    with pytest.raises(ValueError, match="empty"):
        last_llm.embed(as_token_prompts([[]]), use_tqdm=False)
    assert_engine_idle(last_llm.llm_engine)


def test_text_prompts_are_tokenized_like_the_hf_tokenizer(last_llm, llama_dir):
    from transformers import AutoTokenizer

    texts = ["The quick brown fox", "Paged attention stores keys and values."]
    outputs = last_llm.embed(texts, use_tqdm=False)
    tokenizer = AutoTokenizer.from_pretrained(str(llama_dir))
    assert_embeddings_equal_hf(llama_dir, [tokenizer.encode(text) for text in texts], outputs)


def test_dimensions_only_for_matryoshka_models(llama_dir, tmp_path):
    llm = LLM(model=str(llama_dir), dtype="float32", runner="pooling", max_model_len=64)
    try:
        with pytest.raises(ValueError, match="Matryoshka"):
            llm.embed(["hello"], pooling_params=PoolingParams(dimensions=16), use_tqdm=False)
    finally:
        llm.shutdown()
    model_dir = build_tiny_model(tmp_path / "matryoshka", "llama", seed=7, matryoshka_dimensions=[16, 64])
    llm = LLM(model=str(model_dir), dtype="float32", runner="pooling")
    try:
        prompt = [5, 6, 7, 8, 9]
        (output,) = llm.embed(as_token_prompts([prompt]), pooling_params=PoolingParams(dimensions=16),
                              use_tqdm=False)
        # The first 16 values of the pooled state, normalized after the cut.
        reference = torch.nn.functional.normalize(hf_embedding(model_dir, prompt, normalize=False)[:16], dim=-1)
        torch.testing.assert_close(torch.tensor(output.outputs.embedding), reference, atol=TOLERANCE, rtol=0)
        with pytest.raises(ValueError, match=r"matryoshka_dimensions \[16, 64\]"):
            llm.embed(["hello"], pooling_params=PoolingParams(dimensions=32), use_tqdm=False)
        assert_engine_idle(llm.llm_engine)
    finally:
        llm.shutdown()


def test_a_pooling_engine_refuses_generate_and_a_generating_engine_refuses_embed(last_llm, llama_dir):
    with pytest.raises(ValueError, match="runner='pooling'"):
        last_llm.generate(["hello"], SamplingParams(max_tokens=2), use_tqdm=False)
    assert_engine_idle(last_llm.llm_engine)
    llm = LLM(model=str(llama_dir), dtype="float32", max_model_len=64)
    try:
        with pytest.raises(ValueError, match="runner='pooling'"):
            llm.embed(["hello"], use_tqdm=False)
        with pytest.raises(ValueError, match="runner='pooling'"):
            llm.llm_engine.add_request("0", "hello", PoolingParams())
        assert_engine_idle(llm.llm_engine)
    finally:
        llm.shutdown()


def test_task_embed_is_the_older_spelling_of_the_pooling_runner(llama_dir):
    from raylm.engine import EngineArgs

    config = EngineArgs(model=str(llama_dir), task="embed").create_engine_config()
    assert config.model_config.runner_type == "pooling"
    assert config.model_config.pooler_config.pooling_type == "LAST"
    assert config.model_config.pooler_config.normalize
    with pytest.raises(ValueError, match="pooling_type must be one of LAST, MEAN, CLS"):
        EngineArgs(model=str(llama_dir), runner="pooling", pooler_config={"pooling_type": "MAX"}).create_engine_config()
    with pytest.raises(ValueError, match="pooler_config applies to runner='pooling'"):
        EngineArgs(model=str(llama_dir), pooler_config={"pooling_type": "LAST"}).create_engine_config()


def test_tensor_parallel_embeddings_equal_a_single_worker(request, llama_dir):
    prompts = random_prompts_spanning(6, seed=8, min_len=1, max_len=60)
    with tensor_parallel_llm(request, llama_dir, 2, dtype="float32", runner="pooling", max_num_batched_tokens=24,
                             max_model_len=128) as llm:
        outputs = llm.embed(as_token_prompts(prompts), use_tqdm=False)
        assert_engine_idle(llm.llm_engine)
    assert_embeddings_equal_hf(llama_dir, prompts, outputs)
