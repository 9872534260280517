"""`LLM.generate` against Hugging Face transformers on the same tiny models, in fp32."""

from __future__ import annotations


import pytest

from engine_checks import ENGINE_MODES, assert_engine_idle
from hf_reference import assert_logprobs_match_hf, hf_greedy, hf_log_softmax
from raylm.engine import LLM, SamplingParams
from tiny_models import random_prompts

ARCHS = ("llama", "qwen2", "mistral")
NUM_PROMPTS = 36
MAX_TOKENS = 12


def assert_all_blocks_free(llm: LLM) -> None:
    assert_engine_idle(llm.llm_engine)


# Every architecture under the defaults; Llama under every scheduler mode.
ARCH_MODES = [(arch, "default") for arch in ARCHS] + [("llama", mode) for mode in ENGINE_MODES if mode != "default"]


@pytest.fixture(scope="module", params=ARCH_MODES, ids=[f"{a}-{m}" for a, m in ARCH_MODES])
def arch_llm(request, tiny_model_dirs):
    arch, mode = request.param
    model_dir = tiny_model_dirs[arch]
    llm = LLM(model=str(model_dir), dtype="float32", max_num_seqs=64, **ENGINE_MODES[mode])
    yield model_dir, llm
    llm.shutdown()


def test_greedy_tokens_equal_hf_generate_for_a_batch_of_varied_prompts(arch_llm):
    model_dir, llm = arch_llm
    prompts = random_prompts(NUM_PROMPTS, seed=1, min_len=1, max_len=60)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                           SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS), use_tqdm=False)
    assert [o.prompt_token_ids for o in outputs] == prompts
    for prompt, output in zip(prompts, outputs):
        assert output.outputs[0].token_ids == hf_greedy(model_dir, prompt, MAX_TOKENS)
    assert_all_blocks_free(llm)


def test_sampled_and_top_logprobs_match_hf_log_softmax(arch_llm):
    model_dir, llm = arch_llm
    prompts = random_prompts(6, seed=2, min_len=3, max_len=40)
    params = SamplingParams(temperature=0.0, max_tokens=8, logprobs=5, prompt_logprobs=3, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert_logprobs_match_hf(model_dir, prompts, outputs, top_k=5)
    for prompt, output in zip(prompts, outputs):
        completion = output.outputs[0]
        reference = hf_log_softmax(model_dir, prompt + completion.token_ids)
        assert completion.cumulative_logprob == pytest.approx(
            sum(reference[len(prompt) - 1 + i, t].item() for i, t in enumerate(completion.token_ids)), abs=1e-3)
    assert_all_blocks_free(llm)


@pytest.mark.parametrize("n, best_of", [(1, 1), (2, 2), (3, 3), (2, 3)])
def test_prompt_logprobs_are_scored_once_for_all_samples_and_match_hf(arch_llm, n, best_of):
    # Every sample used to score the prompt again and append to the request's list: a
    # 40-token prompt gave 40, 79 or 118 entries at n = 1, 2 or 3.
    model_dir, llm = arch_llm
    prompt = random_prompts(1, seed=4, min_len=40, max_len=40)[0]
    kv = llm.llm_engine.scheduler.kv_cache_manager
    hits_before = kv.prefix_cache_hits
    params = SamplingParams(n=n, best_of=best_of, temperature=1.0, seed=5, max_tokens=5, logprobs=2,
                            prompt_logprobs=2, ignore_eos=True)
    output = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0]
    assert len(output.outputs) == n
    for completion in output.outputs:
        as_one = type(output)(output.request_id, output.prompt, prompt, output.prompt_logprobs, [completion], True)
        assert_logprobs_match_hf(model_dir, [prompt], [as_one], top_k=2)
    if kv.enable_caching:
        # The first sample scores the prompt; the others read its full blocks from the cache.
        assert kv.prefix_cache_hits - hits_before == (best_of - 1) * (len(prompt) - 1) // kv.block_size * kv.block_size
    assert_all_blocks_free(llm)


@pytest.mark.parametrize("mode", list(ENGINE_MODES))
def test_preemption_under_a_small_kv_pool_keeps_greedy_outputs_equal_to_hf(llama_dir, mode):
    # 24 prompts of ~30 tokens growing to ~54 need 4 blocks each (96 in all); 20 blocks
    # force the scheduler to preempt and recompute.
    llm = LLM(model=str(llama_dir), dtype="float32", num_gpu_blocks_override=20, max_model_len=128,
              max_num_seqs=32, **ENGINE_MODES[mode])
    prompts = random_prompts(24, seed=3, min_len=20, max_len=40)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                           SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True), use_tqdm=False)
    assert llm.llm_engine.scheduler.num_preemptions > 0
    for prompt, output in zip(prompts, outputs):
        reference = hf_greedy(llama_dir, prompt, 24)
        # HF stops at EOS; with ignore_eos raylm goes on, so compare up to HF's length.
        assert output.outputs[0].token_ids[:len(reference)] == reference
    assert_all_blocks_free(llm)
    llm.shutdown()
