"""Phi-3 (fused qkv_proj / gate_up_proj checkpoints, partial rotary, LongRoPE, a sliding
window, tied embeddings) and Granite (Llama with embedding, residual, attention and logits
multipliers) through `LLM.generate`, against Hugging Face transformers on the same tiny
random checkpoints, in fp32.

LongRoPE: raylm picks the long factors for an engine whose max_model_len passes
original_max_position_embeddings (32 here), as vLLM does; transformers picks them for a
sequence longer than that. The two agree on prompts longer than 32 tokens at max_model_len
128, and on every sequence at max_model_len 32 (short factors); the last test pins what
raylm does where they differ."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from engine_checks import assert_engine_idle, tensor_parallel_llm
from hf_reference import assert_logprobs_match_hf, cached_hf_greedy, hf_log_softmax
from raylm.engine import LLM, SamplingParams
from raylm.models.rotary_embedding import get_rope, rope_parameters_from_config
from raylm.parallel import MergedColumnParallelLinear, QKVParallelLinear, override_tensor_parallel
from tiny_models import (PHI3_LONG_FACTOR, PHI3_ORIGINAL_MAX_POSITION, PHI3_SHORT_FACTOR, build_tiny_granite,
                         build_tiny_phi3, random_prompts)

MAX_TOKENS = 12
ENGINE_KWARGS = dict(dtype="float32", max_model_len=128, max_num_seqs=16)
# Past LongRoPE's original 32 positions from the first token on, and past the 24-token window.
MIN_PROMPT, MAX_PROMPT = PHI3_ORIGINAL_MAX_POSITION + 1, 90

BUILDERS = {
    "phi3-longrope": lambda path: build_tiny_phi3(path, seed=20),  # partial rotary, LongRoPE
    "phi4-mini": lambda path: build_tiny_phi3(path, seed=23, tie_word_embeddings=True),  # ... and tied
    "phi3-window": lambda path: build_tiny_phi3(path, seed=21, longrope=False, sliding_window=24),  # Phi-3-mini
    "granite": lambda path: build_tiny_granite(path, seed=22),
    "granite-tied": lambda path: build_tiny_granite(path, seed=24, tie_word_embeddings=True),  # Granite 3.x
}
# TP=2 cuts the fused qkv_proj (one KV head a rank) and gate_up_proj per rank.
CASES = [(arch, 1) for arch in BUILDERS] + [("phi3-longrope", 2), ("granite", 2)]


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("phi3_granite")
    return {arch: build(root / arch) for arch, build in BUILDERS.items()}


@pytest.fixture(scope="module", params=CASES, ids=[f"{arch}-tp{tp}" for arch, tp in CASES])
def arch_llm(request, model_dirs):
    arch, tensor_parallel_size = request.param
    with tensor_parallel_llm(request, model_dirs[arch], tensor_parallel_size, **ENGINE_KWARGS) as llm:
        yield model_dirs[arch], llm


def generate_greedy(llm: LLM, prompts: list[list[int]], **params) -> list:
    return llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, **params), use_tqdm=False)


def assert_tokens_equal_hf(model_dir: Path, prompts: list[list[int]], outputs) -> None:
    for prompt, output in zip(prompts, outputs):
        assert output.outputs[0].token_ids == cached_hf_greedy(model_dir, tuple(prompt), MAX_TOKENS)


def test_greedy_tokens_equal_hf_generate_for_a_batch_of_varied_prompts(arch_llm):
    model_dir, llm = arch_llm
    prompts = random_prompts(12, seed=1, min_len=MIN_PROMPT, max_len=MAX_PROMPT)
    assert_tokens_equal_hf(model_dir, prompts, generate_greedy(llm, prompts))
    assert_engine_idle(llm.llm_engine)


def test_sampled_top_and_prompt_logprobs_match_hf_log_softmax(arch_llm):
    model_dir, llm = arch_llm
    prompts = random_prompts(4, seed=2, min_len=MIN_PROMPT, max_len=MAX_PROMPT)
    outputs = generate_greedy(llm, prompts, logprobs=5, prompt_logprobs=3, ignore_eos=True)
    assert_logprobs_match_hf(model_dir, prompts, outputs, top_k=5, abs_tol=1e-4)


@pytest.mark.parametrize("arch", ["phi3-longrope", "granite"])
def test_chunked_prefill_and_a_prefix_cache_hit_equal_hf(model_dirs, arch):
    # 24-token chunks: every prompt is prefilled in several steps beside others' decodes; the
    # second batch starts with 48 tokens of the first's first prompt, cached.
    model_dir = model_dirs[arch]
    llm = LLM(model=str(model_dir), max_num_batched_tokens=24, enable_prefix_caching=True, **ENGINE_KWARGS)
    first = random_prompts(4, seed=3, min_len=50, max_len=MAX_PROMPT)
    second = [first[0][:48] + tail for tail in random_prompts(2, seed=4, min_len=5, max_len=30)]
    try:
        first_outputs = generate_greedy(llm, first)
        second_outputs = generate_greedy(llm, second)
        assert_engine_idle(llm.llm_engine)
    finally:
        llm.shutdown()
    assert all(output.num_cached_tokens >= 32 for output in second_outputs)
    assert_tokens_equal_hf(model_dir, first + second, first_outputs + second_outputs)


@pytest.mark.parametrize("arch", ["phi3-longrope", "phi3-window", "granite"])
def test_torch_attention_backend_equals_hf(model_dirs, arch):
    model_dir = model_dirs[arch]
    llm = LLM(model=str(model_dir), attention_backend="torch", **ENGINE_KWARGS)
    prompts = random_prompts(4, seed=5, min_len=MIN_PROMPT, max_len=MAX_PROMPT)
    try:
        outputs = generate_greedy(llm, prompts, logprobs=5, prompt_logprobs=3, ignore_eos=True)
    finally:
        llm.shutdown()
    assert_logprobs_match_hf(model_dir, prompts, outputs, top_k=5, abs_tol=1e-4)
    assert_tokens_equal_hf(model_dir, prompts, outputs)


def test_phi3_within_the_original_context_rotates_with_the_short_factors_as_hf(model_dirs):
    # max_model_len 32: no sequence can pass the original context, so both pick the short factors.
    model_dir = model_dirs["phi4-mini"]
    llm = LLM(model=str(model_dir), **{**ENGINE_KWARGS, "max_model_len": PHI3_ORIGINAL_MAX_POSITION})
    prompts = random_prompts(6, seed=6, min_len=3, max_len=PHI3_ORIGINAL_MAX_POSITION - MAX_TOKENS)
    try:
        outputs = generate_greedy(llm, prompts, logprobs=5, prompt_logprobs=3, ignore_eos=True)
    finally:
        llm.shutdown()
    assert_logprobs_match_hf(model_dir, prompts, outputs, top_k=5, abs_tol=1e-4)
    assert_tokens_equal_hf(model_dir, prompts, outputs)


def test_phi3_short_prompt_of_a_long_context_engine_rotates_with_the_long_factors(model_dirs, tmp_path):
    # vLLM's rule, where transformers would take the short factors for a sequence this short:
    # the reference is HF with its short factors replaced by the long ones.
    from transformers import AutoConfig, AutoModelForCausalLM

    model_dir = model_dirs["phi3-longrope"]
    config = AutoConfig.from_pretrained(str(model_dir))
    config.rope_parameters["short_factor"] = list(PHI3_LONG_FACTOR)
    long_only = AutoModelForCausalLM.from_pretrained(str(model_dir), config=config, dtype=torch.float32).eval()
    prompt = random_prompts(1, seed=7, min_len=20, max_len=20)[0]
    llm = LLM(model=str(model_dir), **ENGINE_KWARGS)
    try:
        (output,) = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(max_tokens=1, prompt_logprobs=0),
                                 use_tqdm=False)
    finally:
        llm.shutdown()
    with torch.no_grad():
        expected = torch.log_softmax(long_only(torch.tensor([prompt])).logits[0], dim=-1)
    ours = [output.prompt_logprobs[i][prompt[i]].logprob for i in range(1, len(prompt))]
    theirs = [expected[i - 1, prompt[i]].item() for i in range(1, len(prompt))]
    assert ours == pytest.approx(theirs, abs=1e-4)
    # ... and the factor sets differ enough here that the check above could fail.
    short = hf_log_softmax(model_dir, prompt)
    assert max(abs(short[i - 1, prompt[i]].item() - t) for i, t in zip(range(1, len(prompt)), theirs)) > 1e-2


def test_phi3_rope_settings_read_from_transformers_4_and_5_configs_agree():
    # 4.x kept partial_rotary_factor and original_max_position_embeddings beside rope_scaling.
    from transformers import Phi3Config

    factors = dict(short_factor=PHI3_SHORT_FACTOR, long_factor=PHI3_LONG_FACTOR)
    v4 = SimpleNamespace(rope_theta=10000.0, rope_scaling={"type": "longrope", **factors}, partial_rotary_factor=0.75,
                         original_max_position_embeddings=32)
    v5 = Phi3Config(hidden_size=64, num_attention_heads=4, partial_rotary_factor=0.75,
                    original_max_position_embeddings=32, rope_scaling={"rope_type": "longrope", **factors})
    expected = {"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.75,
                "original_max_position_embeddings": 32, **factors}
    assert rope_parameters_from_config(v4) == expected
    assert rope_parameters_from_config(v5) == expected


@pytest.mark.parametrize("tp_size,num_kv_heads", [(2, 2), (4, 2), (4, 1)])
def test_phi3_fused_checkpoint_tensors_load_per_rank_as_their_parts_do(tp_size, num_kv_heads):
    # Every rank cuts its q heads, its (possibly replicated) KV heads and its gate and up rows
    # out of the fused tensor, exactly as it does from q/k/v and gate/up loaded apart.
    hidden, head_size, num_heads, intermediate = 16, 4, 8, 12
    generator = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(n * head_size, hidden, generator=generator) for n in (num_heads, num_kv_heads, num_kv_heads))
    gate, up = torch.randn(intermediate, hidden, generator=generator), torch.randn(intermediate, hidden,
                                                                                  generator=generator)
    for rank in range(tp_size):
        with override_tensor_parallel(rank, tp_size):
            fused_qkv, split_qkv = (QKVParallelLinear(hidden, head_size, num_heads, num_kv_heads) for _ in range(2))
            fused_mlp, split_mlp = (MergedColumnParallelLinear(hidden, [intermediate] * 2) for _ in range(2))
        fused_qkv.weight.weight_loader(fused_qkv.weight, torch.cat([q, k, v]), None)
        for shard_id, part in zip("qkv", (q, k, v)):
            split_qkv.weight.weight_loader(split_qkv.weight, part, shard_id)
        fused_mlp.weight.weight_loader(fused_mlp.weight, torch.cat([gate, up]), None)
        for shard_id, part in enumerate((gate, up)):
            split_mlp.weight.weight_loader(split_mlp.weight, part, shard_id)
        assert torch.equal(fused_qkv.weight, split_qkv.weight)
        assert torch.equal(fused_mlp.weight, split_mlp.weight)


@pytest.mark.parametrize("rope, message", [
    ({"short_factor": [1.0] * 8, "original_max_position_embeddings": 32}, "long_factor"),
    ({"short_factor": [1.0] * 8, "long_factor": [2.0] * 8}, "original_max_position_embeddings"),
    ({"short_factor": [1.0] * 6, "long_factor": [2.0] * 6, "original_max_position_embeddings": 32},
     r"short_factor must hold rotary_dim / 2 = 8 positive finite numbers, got \[1.0"),
])
def test_longrope_settings_that_cannot_be_applied_are_errors_naming_the_field(rope, message):
    with pytest.raises(ValueError, match=message):
        get_rope(16, 32, {"rope_type": "longrope", "rope_theta": 10000.0, **rope})


LONGROPE = {"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0] * 8, "long_factor": [2.0] * 8,
            "original_max_position_embeddings": 16}


@pytest.mark.parametrize("rope, message", [
    # Division by zero in the attention factor's default, sqrt(1 + ln(64 / orig) / ln(orig)).
    ({**LONGROPE, "original_max_position_embeddings": 0}, "original_max_position_embeddings must be a positive"),
    ({**LONGROPE, "original_max_position_embeddings": 1}, "original_max_position_embeddings must be at least 2"),
    # Zero factors make inverse frequencies infinite, cos and sin NaN; the unused set is checked too.
    ({**LONGROPE, "long_factor": [0.0] * 8}, "long_factor must hold rotary_dim / 2 = 8 positive finite"),
    ({**LONGROPE, "short_factor": [1.0] * 7 + [-1.0]}, "short_factor must hold rotary_dim / 2 = 8 positive finite"),
    # cos and sin times zero: no position information at all.
    ({**LONGROPE, "attention_factor": 0.0}, "attention_factor must be a positive finite number, got 0.0"),
    ({"rope_type": "default", "rope_theta": 0.0}, "rope_theta must be a positive finite number, got 0.0"),
    ({"rope_type": "linear", "rope_theta": 10000.0, "factor": 0}, "factor must be a positive finite number, got 0"),
    # Rotary over an odd number of dimensions, or more than a head has: the kernels' shapes break.
    ({"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.3125},
     "partial_rotary_factor 0.3125 rotates 5 of each head's 16 dimensions"),
    ({"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 1.5},
     "partial_rotary_factor 1.5 rotates 24 of each head's 16 dimensions"),
    ({"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.0},
     "partial_rotary_factor 0.0 rotates 0 of each head's 16 dimensions"),
])
def test_rope_settings_that_make_cos_sin_nan_or_break_the_kernels_are_errors_naming_the_field(rope, message):
    """Values transformers' config accepts (or only warns about) but that turn the rotary
    table into NaN (the engine then failed every request at its first token, blaming the
    weights), divide by zero, or crash the rotary kernel at the first forward."""
    with pytest.raises(ValueError, match=message):
        get_rope(16, 64, rope)


def test_a_zero_rope_theta_of_a_transformers_4_config_is_refused_not_replaced_by_the_default():
    """transformers 4.x keeps rope_theta beside rope_scaling: a 0 there took the default base
    (10000), where transformers' model makes NaN."""
    params = rope_parameters_from_config(SimpleNamespace(rope_theta=0.0, rope_scaling=None))
    with pytest.raises(ValueError, match="rope_theta must be a positive finite number, got 0.0"):
        get_rope(16, 64, params)
    assert rope_parameters_from_config(SimpleNamespace(rope_scaling=None))["rope_theta"] == 10000.0


@pytest.mark.parametrize("arch", ["phi3-longrope", "phi4-mini", "granite", "granite-tied"])
def test_forward_in_two_pipeline_stages_equals_hf(model_dirs, arch):
    """pipeline_parallel_size covers Phi-3 and Granite (Llama's stages): the second stage's
    tied LM head, Granite's logits scaling and embedding multiplier in the right stage."""
    from stage_logits import logits_in_stages

    prompt = random_prompts(1, seed=7, min_len=MIN_PROMPT, max_len=MIN_PROMPT + 10)[0]
    logits = logits_in_stages(model_dirs[arch], prompt, pp_size=2)
    assert (torch.log_softmax(logits, dim=-1) - hf_log_softmax(model_dirs[arch], prompt)).abs().max() < 1e-4
