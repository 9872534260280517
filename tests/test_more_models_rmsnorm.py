"""Qwen3 and Gemma 2 (RMSNorm families beyond Llama) through `LLM.generate`, against
Hugging Face transformers on the same tiny random checkpoints, in fp32, at tensor
parallel sizes 1 and 2."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine_checks import ENGINE_MODES, tensor_parallel_llm
from hf_reference import assert_logprobs_match_hf, hf_greedy, hf_log_softmax, hf_model
from raylm.engine import LLM, SamplingParams
from raylm.engine.config import ModelConfig, load_hf_config
from raylm.models import get_model
from raylm.models.forward_context import set_forward_context
from tiny_models import random_prompts, save_random_model_with_random_norms

VOCAB_SIZE = 512
MAX_TOKENS = 12

# head_dim 32 differs from hidden_size / num_attention_heads (16) in both.
_COMMON = dict(vocab_size=VOCAB_SIZE, hidden_size=64, intermediate_size=128, num_attention_heads=4,
               num_key_value_heads=2, head_dim=32, max_position_embeddings=256, rms_norm_eps=1e-6,
               bos_token_id=1, eos_token_id=2)


def qwen3_config():
    from transformers import Qwen3Config

    return Qwen3Config(**_COMMON, num_hidden_layers=3, tie_word_embeddings=True)


def gemma2_config():
    from transformers import Gemma2Config

    # Caps far below the released models' (50 and 30) so that they change these tiny
    # models' logits (see the test below); query_pre_attn_scalar differs from head_dim.
    # The window covers max_position_embeddings, so the sliding layers attend to the full
    # context, as raylm does.
    return Gemma2Config(**_COMMON, num_hidden_layers=4, pad_token_id=0, query_pre_attn_scalar=24,
                        attn_logit_softcapping=4.0, final_logit_softcapping=3.0, sliding_window=256)


CONFIGS = {"qwen3": qwen3_config, "gemma2": gemma2_config}


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("more_models_rmsnorm")
    return {arch: save_random_model_with_random_norms(root / arch, make(), seed=index)
            for index, (arch, make) in enumerate(CONFIGS.items())}


CASES = [(arch, tp) for arch in CONFIGS for tp in (1, 2)]


@pytest.fixture(scope="module", params=CASES, ids=[f"{arch}-tp{tp}" for arch, tp in CASES])
def arch_llm(request, model_dirs):
    arch, tensor_parallel_size = request.param
    with tensor_parallel_llm(request, model_dirs[arch], tensor_parallel_size, dtype="float32", max_model_len=128,
                             max_num_seqs=32) as llm:
        yield model_dirs[arch], llm


def test_greedy_tokens_equal_hf_generate_for_a_batch_of_varied_prompts(arch_llm):
    model_dir, llm = arch_llm
    prompts = random_prompts(20, seed=1, min_len=1, max_len=60)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                           SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS), use_tqdm=False)
    for prompt, output in zip(prompts, outputs):
        assert output.outputs[0].token_ids == hf_greedy(model_dir, prompt, MAX_TOKENS)


def test_sampled_top_and_prompt_logprobs_match_hf_log_softmax(arch_llm):
    model_dir, llm = arch_llm
    prompts = random_prompts(6, seed=2, min_len=3, max_len=40)
    params = SamplingParams(temperature=0.0, max_tokens=8, logprobs=5, prompt_logprobs=3, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert_logprobs_match_hf(model_dir, prompts, outputs, top_k=5, abs_tol=1e-4)


def test_gemma2_chunked_prefill_and_mixed_batches_equal_hf_generate(model_dirs):
    # Chunks attend to earlier chunks through the masked (not square causal) soft-capped
    # path, and decodes share steps with prefills.
    model_dir = model_dirs["gemma2"]
    llm = LLM(model=str(model_dir), dtype="float32", max_model_len=128, max_num_seqs=32,
              **ENGINE_MODES["small-chunks"])
    prompts = random_prompts(8, seed=4, min_len=20, max_len=60)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                           SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS), use_tqdm=False)
    llm.shutdown()
    for prompt, output in zip(prompts, outputs):
        assert output.outputs[0].token_ids == hf_greedy(model_dir, prompt, MAX_TOKENS)


def test_gemma2_forward_without_attention_metadata_is_one_causal_sequence(model_dirs):
    model_dir = str(model_dirs["gemma2"])
    config = ModelConfig(model=model_dir, tokenizer=model_dir, dtype=torch.float32, max_model_len=128,
                         hf_config=load_hf_config(model_dir))
    model = get_model(config, torch.device("cpu"))
    prompt = random_prompts(1, seed=5, min_len=30, max_len=30)[0]
    with torch.no_grad(), set_forward_context(None):
        logits = model.compute_logits(model(torch.tensor(prompt), torch.arange(len(prompt))))
    assert (torch.log_softmax(logits, dim=-1) - hf_log_softmax(model_dirs["gemma2"], prompt)).abs().max() < 1e-4


@pytest.mark.parametrize("cap", ["attn_logit_softcapping", "final_logit_softcapping"])
def test_gemma2_test_config_soft_cap_changes_hf_logits(model_dirs, cap):
    # Guards the tests above: with caps that never bite they would not check the caps.
    from transformers import AutoModelForCausalLM

    model_dir = str(model_dirs["gemma2"])
    input_ids = torch.tensor([random_prompts(1, seed=3, min_len=40, max_len=40)[0]])
    uncapped = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, **{cap: None}).eval()
    with torch.no_grad():
        difference = hf_model(model_dir)(input_ids).logits - uncapped(input_ids).logits
    assert difference.abs().max() > 1e-2
