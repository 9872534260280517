"""Gemma 3 (`Gemma3ForCausalLM`) through the engine against Hugging Face transformers on the
same tiny random checkpoint, in fp32: three windowed layers of 20 tokens and one global
(prompts of 150-300 tokens), the global layers' rope linearly scaled, per-head q/k norms,
with chunked prefill (a 64-token budget) and prefix-cache hits, on the native CPU attention
kernels and the PyTorch reference, in process and over two tensor-parallel Ray workers (each
holding 2 of the 4 query heads and 1 of the 2 KV heads, with their per-head norms)."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from engine_checks import assert_greedy_twice_with_full_prefix_hits, tensor_parallel_llm
from hf_reference import assert_logprobs_match_hf, hf_greedy, hf_log_softmax, hf_model
from raylm.engine import LLM, SamplingParams
from raylm.engine.config import load_hf_config
from raylm.models.gemma3 import gemma3_rope_parameters
from raylm.models.sliding_window import layer_sliding_windows
from stage_logits import logits_in_stages
from tiny_models import build_tiny_gemma3, random_prompts

WINDOW = 20
MAX_TOKENS = 10
ENGINE_KWARGS = dict(dtype="float32", max_num_seqs=8, max_model_len=400, max_num_batched_tokens=64,
                     enable_prefix_caching=True, enable_chunked_prefill=True)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return build_tiny_gemma3(tmp_path_factory.mktemp("gemma3") / "model", sliding_window=WINDOW, seed=3)


@pytest.fixture(scope="module", params=["cpu", "torch"])
def llm(request, model_dir):
    llm = LLM(model=str(model_dir), attention_backend=request.param, **ENGINE_KWARGS)
    model = llm.llm_engine.executor.driver_worker.model_runner.model
    assert {layer.self_attn.attn.attn_backend.name for layer in model.model.layers} == {request.param}
    yield llm
    llm.shutdown()


@pytest.fixture(scope="module")
def tp2_llm(request, model_dir):
    with tensor_parallel_llm(request, model_dir, 2, attention_backend="cpu", **ENGINE_KWARGS) as llm:
        yield llm


def prompts_with_a_shared_prefix() -> list[list[int]]:
    """Four prompts of 150-300 tokens; the last two begin with the first one's first 150."""
    prompts = random_prompts(2, seed=1, min_len=150, max_len=300)
    return prompts + [prompts[0][:150] + tail for tail in random_prompts(2, seed=2, min_len=10, max_len=40)]


def test_windows_and_rotary_tables_follow_the_layer_types(llm, model_dir):
    config = llm.llm_engine.engine_config
    assert config.model_config.layer_sliding_windows == [WINDOW, WINDOW, None, WINDOW]
    assert config.cache_config.sliding_window is None  # the global layer reads every block
    # Each layer's cos/sin table against HF's rotary embedding of its layer type.
    hf = hf_model(str(model_dir))
    model = llm.llm_engine.executor.driver_worker.model_runner.model
    positions = torch.arange(300)[None]
    for layer, layer_type in zip(model.model.layers, hf.config.layer_types):
        cos, sin = hf.model.rotary_emb(torch.zeros(1, dtype=torch.float32), positions, layer_type)
        half = cos.shape[-1] // 2
        table = layer.self_attn.rotary_emb.cos_sin_cache[:300]
        torch.testing.assert_close(table, torch.cat([cos[0, :, :half], sin[0, :, :half]], dim=-1))


def test_greedy_tokens_equal_hf_generate_with_chunks_and_prefix_hits(llm, model_dir):
    prompts = prompts_with_a_shared_prefix()
    expected = [hf_greedy(model_dir, prompt, MAX_TOKENS) for prompt in prompts]
    # No block is freed early (the global layer reads them all), so every full one hits.
    assert_greedy_twice_with_full_prefix_hits(llm, prompts, expected, MAX_TOKENS)


def test_sampled_top_and_prompt_logprobs_match_hf_log_softmax(llm, model_dir):
    prompts = random_prompts(2, seed=4, min_len=100, max_len=160)
    params = SamplingParams(temperature=0.0, max_tokens=6, logprobs=5, prompt_logprobs=3, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert_logprobs_match_hf(model_dir, prompts, outputs, top_k=5, abs_tol=1e-4)


def test_two_tensor_parallel_ray_workers_give_hf_greedy_tokens_with_chunks_and_prefix_hits(tp2_llm, model_dir):
    prompts = prompts_with_a_shared_prefix()
    expected = [hf_greedy(model_dir, prompt, MAX_TOKENS) for prompt in prompts]
    assert_greedy_twice_with_full_prefix_hits(tp2_llm, prompts, expected, MAX_TOKENS)


def test_two_tensor_parallel_ray_workers_give_hf_top_and_prompt_logprobs(tp2_llm, model_dir):
    prompts = random_prompts(2, seed=4, min_len=100, max_len=160)
    params = SamplingParams(temperature=0.0, max_tokens=6, logprobs=5, prompt_logprobs=3, ignore_eos=True)
    outputs = tp2_llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert_logprobs_match_hf(model_dir, prompts, outputs, top_k=5, abs_tol=1e-4)


@pytest.mark.parametrize("pp_size", [1, 2])
def test_forward_without_attention_metadata_in_pipeline_stages_equals_hf(model_dir, pp_size):
    # One causal sequence through the PyTorch attention, whole or in two pipeline stages.
    prompt = random_prompts(1, seed=5, min_len=120, max_len=120)[0]
    logits = logits_in_stages(model_dir, prompt, pp_size)
    assert (torch.log_softmax(logits, dim=-1) - hf_log_softmax(model_dir, prompt)).abs().max() < 1e-4


@pytest.mark.parametrize("change", ["window", "local_rope_base", "global_rope_scaling"])
def test_the_test_config_s_windows_and_rotary_bases_change_hf_outputs(model_dir, change):
    # Guards the tests above: a model that ignored any of these would otherwise still pass.
    from transformers import AutoModelForCausalLM

    config = load_hf_config(str(model_dir))
    if change == "window":
        config.sliding_window = 4096
    elif change == "local_rope_base":
        config.rope_parameters["sliding_attention"]["rope_theta"] = 1_000_000.0
    else:
        config.rope_parameters["full_attention"] = {"rope_type": "default", "rope_theta": 1_000_000.0}
    changed = AutoModelForCausalLM.from_pretrained(str(model_dir), config=config, dtype=torch.float32).eval()
    prompt = random_prompts(1, seed=6, min_len=120, max_len=120)[0]
    with torch.no_grad():
        logits = changed(torch.tensor([prompt])).logits[0]
    assert (torch.log_softmax(logits, dim=-1) - hf_log_softmax(model_dir, prompt)).abs().max() > 1e-2


def test_rope_parameters_read_alike_from_transformers_4_keys_and_transformers_5_layout(tmp_path):
    # A gemma-3-4b text config.json as transformers 4 wrote it, loaded by transformers 5
    # (which nests rope_parameters by layer type) and as transformers 4 held it.
    old_keys = dict(rope_theta=1_000_000.0, rope_local_base_freq=10_000.0,
                    rope_scaling={"factor": 8.0, "rope_type": "linear"})
    (tmp_path / "config.json").write_text(json.dumps(dict(
        architectures=["Gemma3ForCausalLM"], model_type="gemma3_text", num_hidden_layers=7, sliding_window=1024,
        sliding_window_pattern=6, **old_keys)))
    expected = {"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1_000_000.0},
                "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0}}
    loaded = load_hf_config(str(tmp_path))
    v4 = SimpleNamespace(model_type="gemma3_text", num_hidden_layers=7, sliding_window=1024,
                         max_position_embeddings=131_072, sliding_window_pattern=6, **old_keys)
    assert gemma3_rope_parameters(loaded) == gemma3_rope_parameters(v4) == expected
    assert layer_sliding_windows(loaded) == layer_sliding_windows(v4) == [1024] * 5 + [None, 1024]
    # Neither key: Gemma3TextConfig's defaults (bases 1M and 10k, one global layer in 6).
    bare = SimpleNamespace(model_type="gemma3_text", num_hidden_layers=7, sliding_window=1024)
    assert gemma3_rope_parameters(bare) == {"full_attention": {"rope_type": "default", "rope_theta": 1_000_000.0},
                                            "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0}}
    assert layer_sliding_windows(bare) == [1024] * 5 + [None, 1024]
