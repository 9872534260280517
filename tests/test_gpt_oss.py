"""gpt-oss (`GptOssForCausalLM`) against Hugging Face transformers on a tiny random checkpoint
in fp32 (`build_tiny_gpt_oss`: sliding and full layers, attention sinks, YaRN, biased experts
with the clamped SwiGLU): greedy tokens and logprobs through `LLM.generate` on the default
CPU backend and the PyTorch reference, prompts longer than the window, chunked prefill, a
prefix-cache hit. Its pieces are checked one by one against transformers' own: attention with
sinks (HF's eager attention), the experts and router (GptOssExperts, GptOssTopKRouter), YaRN's
frequencies. Backends without sinks refuse such layers."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine_checks import assert_engine_idle, tensor_parallel_llm
from hf_reference import assert_logprobs_match_hf, cached_hf_greedy, hf_log_softmax
from raylm.engine import LLM, SamplingParams
from tiny_models import build_tiny_gpt_oss, random_prompts_spanning

MAX_TOKENS = 10
# (attention backend, engine settings): the machine's default backend and the reference,
# a token budget that chunks every prompt past 24 tokens, two tensor-parallel Ray workers
# (2 query heads and their sinks, 1 KV head, half of every expert each), and two with
# expert parallelism (whole experts, 3 + 2).
CASES = {"cpu": ("cpu", {}), "torch": ("torch", {}), "cpu-small-chunks": ("cpu", dict(max_num_batched_tokens=24)),
         "cpu-tp2": ("cpu", dict(tensor_parallel_size=2)),
         "torch-tp2-ep": ("torch", dict(tensor_parallel_size=2, enable_expert_parallel=True))}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return build_tiny_gpt_oss(tmp_path_factory.mktemp("gpt_oss") / "model", seed=3)


@pytest.fixture(scope="module", params=list(CASES), ids=list(CASES))
def gpt_oss_llm(request, model_dir):
    backend, settings = CASES[request.param][0], dict(CASES[request.param][1])
    with tensor_parallel_llm(request, model_dir, settings.pop("tensor_parallel_size", 1), dtype="float32",
                             attention_backend=backend, max_model_len=256, max_num_seqs=16, **settings) as llm:
        yield llm


def test_greedy_tokens_equal_hf_generate_for_prompts_longer_than_the_window(gpt_oss_llm, model_dir):
    prompts = random_prompts_spanning(8, seed=1, min_len=1, max_len=60)
    assert max(map(len, prompts)) > 8 * 3  # several windows past the sliding layers' 8
    outputs = gpt_oss_llm.generate([{"prompt_token_ids": p} for p in prompts],
                                   SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS), use_tqdm=False)
    for prompt, output in zip(prompts, outputs):
        assert output.outputs[0].token_ids == cached_hf_greedy(model_dir, tuple(prompt), MAX_TOKENS)
    assert_engine_idle(gpt_oss_llm.llm_engine)


def test_sampled_top_and_prompt_logprobs_match_hf_log_softmax_within_1e_4(gpt_oss_llm, model_dir):
    prompts = random_prompts_spanning(3, seed=2, min_len=3, max_len=50)
    params = SamplingParams(temperature=0.0, max_tokens=6, logprobs=3, prompt_logprobs=2, ignore_eos=True)
    outputs = gpt_oss_llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert_logprobs_match_hf(model_dir, prompts, outputs, top_k=3)


def test_a_prefix_cache_hit_gives_hf_tokens_and_logprobs(gpt_oss_llm, model_dir):
    prompt = random_prompts_spanning(1, seed=3, min_len=45, max_len=45)[0]
    params = SamplingParams(temperature=0.0, max_tokens=6, logprobs=2, ignore_eos=True)
    gpt_oss_llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
    again = gpt_oss_llm.generate([{"prompt_token_ids": prompt + [7]}], params, use_tqdm=False)[0]
    assert again.num_cached_tokens >= 32  # two full blocks of 16 from the first request
    assert again.outputs[0].token_ids == cached_hf_greedy(model_dir, tuple(prompt + [7]), 6)
    completion, reference = again.outputs[0], hf_log_softmax(model_dir, prompt + [7] + again.outputs[0].token_ids)
    for step, (token, entry) in enumerate(zip(completion.token_ids, completion.logprobs)):
        assert entry[token].logprob == pytest.approx(reference[len(prompt) + step, token].item(), abs=1e-4)


# ---- the pieces, against transformers' own --------------------------------------------------

def _hf_eager_attention_with_sinks(q, k, v, sinks, scale, window):
    """transformers' gpt-oss eager attention (q [Lq, Hq, D] at the last Lq of L positions, k and
    v [L, Hkv, D]) -> [Lq, Hq, D]."""
    from types import SimpleNamespace

    from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward

    query_len, seq_len = q.shape[0], k.shape[0]
    distance = torch.arange(seq_len - query_len, seq_len)[:, None] - torch.arange(seq_len)[None, :]
    allowed = (distance >= 0) & ((distance < window) if window else True)
    mask = torch.zeros(query_len, seq_len).masked_fill_(~allowed, float("-inf"))[None, None]
    module = SimpleNamespace(num_key_value_groups=q.shape[1] // k.shape[1], sinks=sinks, training=False)
    out, _ = eager_attention_forward(module, q.transpose(0, 1)[None], k.transpose(0, 1)[None],
                                     v.transpose(0, 1)[None], mask, scale)
    return out[0]


@pytest.mark.parametrize("backend", ["torch", "cpu"])
@pytest.mark.parametrize("window", [None, 5])
def test_paged_attention_with_sinks_equals_hf_eager_attention(backend, window):
    """Two sequences in one step, one prefilling its last 7 of 21 tokens (a chunk after
    cached context), one decoding at 13: each equals HF's eager attention with sinks."""
    from raylm.kernels.attention_metadata import AttentionMetadata
    from raylm.kernels.backend import get_attention_backend

    attention = get_attention_backend(backend)
    torch.manual_seed(0)
    num_heads, num_kv_heads, head_size, block_size, scale = 4, 2, 16, 4, 0.25
    sinks = torch.randn(num_heads) * 2
    seq_lens, query_lens = [21, 13], [7, 1]
    k_cache = torch.zeros(16, block_size, num_kv_heads, head_size)
    v_cache = torch.zeros_like(k_cache)
    block_tables = torch.tensor([[3, 1, 4, 0, 9, 2], [5, 7, 6, 8, 0, 0]], dtype=torch.int32)
    keys = [torch.randn(n, num_kv_heads, head_size) for n in seq_lens]
    values = [torch.randn(n, num_kv_heads, head_size) for n in seq_lens]
    for i, n in enumerate(seq_lens):
        slots = torch.tensor([int(block_tables[i, t // block_size]) * block_size + t % block_size for t in range(n)])
        attention.write_kv_cache(keys[i], values[i], k_cache, v_cache, slots)
    queries = [torch.randn(n, num_heads, head_size) for n in query_lens]
    md = AttentionMetadata(slot_mapping=torch.full((8,), -1, dtype=torch.long),
                           query_start_loc=torch.tensor([0, 7, 8], dtype=torch.int32),
                           seq_lens=torch.tensor(seq_lens, dtype=torch.int32), block_tables=block_tables,
                           max_query_len=7, max_seq_len=21, query_lens_list=query_lens, seq_lens_list=seq_lens)
    out = attention.paged_attention(torch.cat(queries), k_cache, v_cache, md, scale, sliding_window=window,
                                    sinks=sinks)
    expected = torch.cat([_hf_eager_attention_with_sinks(queries[i], keys[i], values[i], sinks, scale, window)
                          for i in range(2)])
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    without = attention.paged_attention(torch.cat(queries), k_cache, v_cache, md, scale, sliding_window=window)
    assert (out - without).abs().max() > 1e-2  # the sinks matter at this size


def test_triton_kernels_with_sinks_match_the_reference_under_the_interpreter():
    """tests/triton_sinks_cases.py: decode single-pass and split-K, prefill/extend, windowed."""
    pytest.importorskip("triton")
    from triton_interpreter import assert_cases_pass_under_the_interpreter

    assert_cases_pass_under_the_interpreter("triton_sinks_cases.py", timeout_s=600)


def test_a_backend_without_sinks_refuses_a_layer_with_them():
    import dataclasses

    from raylm.kernels.backend import BACKEND_NAMES, get_attention_backend
    from raylm.models.attention import Attention

    assert all(get_attention_backend(name).supports_sinks for name in BACKEND_NAMES
               if name != "triton" or pytest.importorskip("triton"))
    without = dataclasses.replace(get_attention_backend("torch"), name="no-sinks", supports_sinks=False)
    layer = Attention(4, 16, 0.25, 2, has_sinks=True)
    with pytest.raises(ValueError, match="attention_backend 'no-sinks' has no attention sinks"):
        layer.attn_backend = without
    Attention(4, 16, 0.25, 2).attn_backend = without  # a layer without sinks runs there


def test_experts_with_biases_and_clamped_swiglu_equal_hf_gpt_oss_experts():
    """torch_moe.fused_experts ("swigluoai", biases) on the weights transformers' GptOssExperts
    holds, de-interleaved into the fused layout as the loader does, and the router's choice."""
    from transformers import GptOssConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts, GptOssTopKRouter

    from raylm.kernels import torch_moe

    config = GptOssConfig(hidden_size=32, intermediate_size=24, num_local_experts=5, num_experts_per_tok=2,
                          swiglu_limit=0.7, num_attention_heads=4, num_key_value_heads=2, head_dim=8)
    torch.manual_seed(0)
    experts, router = GptOssExperts(config), GptOssTopKRouter(config)
    for param in (*experts.parameters(), *router.parameters()):
        torch.nn.init.normal_(param, 0.0, 0.3)
    x = torch.randn(9, 32)
    with torch.no_grad():
        _, hf_scores, hf_ids = router(x)
        expected = experts(x, hf_ids, hf_scores)
        weights, ids = torch_moe.fused_topk_softmax_after(router(x)[0], 2)
        gate_up, bias = experts.gate_up_proj, experts.gate_up_proj_bias
        w13 = torch.cat([gate_up[:, :, 0::2], gate_up[:, :, 1::2]], dim=2).transpose(1, 2)
        w13_bias = torch.cat([bias[:, 0::2], bias[:, 1::2]], dim=1)
        out = torch_moe.fused_experts(x, w13, experts.down_proj.transpose(1, 2), weights, ids, w13_bias=w13_bias,
                                      w2_bias=experts.down_proj_bias, activation="swigluoai", swiglu_limit=0.7)
    assert torch.equal(ids, hf_ids) and torch.allclose(weights, hf_scores, atol=1e-6)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("truncate", [True, False])
def test_yarn_frequencies_and_attention_factor_equal_transformers(truncate):
    from transformers import GptOssConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from raylm.models.rotary_embedding import _attention_factor, _inverse_frequencies, rope_parameters_from_config

    config = GptOssConfig(hidden_size=64, head_dim=32, num_attention_heads=2, num_key_value_heads=1,
                          max_position_embeddings=1024,
                          rope_parameters=dict(rope_type="yarn", rope_theta=150000.0, factor=8.0, beta_fast=32.0,
                                               beta_slow=1.0, truncate=truncate, original_max_position_embeddings=128))
    inv_freq, attention_factor = ROPE_INIT_FUNCTIONS["yarn"](config)
    params = rope_parameters_from_config(config)
    assert torch.equal(_inverse_frequencies(32, params, 1024), inv_freq)
    assert _attention_factor(params, 1024) == pytest.approx(attention_factor, rel=1e-12)


# ---- MXFP4 checkpoints ---------------------------------------------------------------------

FP4_CODE_VALUES = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]


def _mxfp4_pair(generator: torch.Generator, shape: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random FP4 codes and E8M0 scales for a weight of `shape` [..., R, C]: (blocks uint8
    [..., R, C / 32, 16], scales uint8 [..., R, C / 32], the values they stand for, computed by
    hand: code value * 2 ** (scale - 127))."""
    *lead, rows, cols = shape
    codes = torch.randint(0, 16, (*lead, rows, cols // 32, 32), generator=generator, dtype=torch.uint8)
    scales = torch.randint(118, 125, (*lead, rows, cols // 32), generator=generator, dtype=torch.uint8)
    blocks = codes[..., 0::2] | (codes[..., 1::2] << 4)  # the even element in the low nibble
    values = torch.tensor(FP4_CODE_VALUES)[codes.long()] * torch.pow(2.0, scales.double() - 127).float()[..., None]
    return blocks, scales, values.reshape(*lead, rows, cols)


@pytest.fixture(scope="module")
def mxfp4_dirs(tmp_path_factory) -> tuple[Path, Path, dict[str, torch.Tensor]]:
    """(an MXFP4 checkpoint, the same model with those expert weights stored dense as
    transformers holds them, the dense values by layer name): intermediate_size 64, so both
    expert weights' inputs are whole blocks of 32."""
    import json

    from safetensors.torch import load_file, save_file

    root = tmp_path_factory.mktemp("gpt_oss_mxfp4")
    dense = build_tiny_gpt_oss(root / "dense", seed=4, intermediate_size=64)
    tensors = load_file(str(dense / "model.safetensors"))
    generator = torch.Generator().manual_seed(5)
    quantized, values = dict(tensors), {}
    for name in [n for n in tensors if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        dense_shape = tensors[name].shape  # [E, in, out]
        blocks, scales, weight = _mxfp4_pair(generator, (dense_shape[0], dense_shape[2], dense_shape[1]))
        del quantized[name]
        quantized[name + "_blocks"], quantized[name + "_scales"] = blocks, scales
        tensors[name] = values[name] = weight.transpose(1, 2).contiguous()
    save_file(tensors, str(dense / "model.safetensors"), metadata={"format": "pt"})
    mxfp4 = root / "mxfp4"
    mxfp4.mkdir()
    for file in dense.iterdir():
        if file.name != "model.safetensors":
            (mxfp4 / file.name).write_bytes(file.read_bytes())
    save_file(quantized, str(mxfp4 / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((mxfp4 / "config.json").read_text())
    unquantized = ["model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": unquantized}
    (mxfp4 / "config.json").write_text(json.dumps(config))
    return mxfp4, dense, values


def test_mxfp4_blocks_dequantize_to_the_values_their_codes_and_scales_stand_for(monkeypatch):
    from raylm.models import mxfp4

    blocks, scales, values = _mxfp4_pair(torch.Generator().manual_seed(0), (3, 6, 64))
    assert torch.equal(mxfp4.dequantize_mxfp4(blocks, scales, torch.float32), values)
    monkeypatch.setattr(mxfp4, "_ROWS_PER_CHUNK", 5)  # 18 rows in chunks of 5, the last short
    assert torch.equal(mxfp4.dequantize_mxfp4(blocks, scales, torch.float32), values)
    dequantize_mxfp4 = mxfp4.dequantize_mxfp4
    # One byte by hand: codes 0x3 (1.5, low nibble, first) and 0xA (-1.0), scale 2 ** (129 - 127).
    one = dequantize_mxfp4(torch.tensor([[0xA3] + [0] * 15], dtype=torch.uint8), torch.tensor([129], dtype=torch.uint8),
                           torch.float32)
    assert one[:2].tolist() == [6.0, -4.0] and not one[2:].any()


def test_an_mxfp4_checkpoint_loads_its_experts_dequantized_and_generates_as_hf_on_the_dense_values(mxfp4_dirs):
    mxfp4, dense, values = mxfp4_dirs
    llm = LLM(model=str(mxfp4), dtype="float32", max_model_len=128, max_num_seqs=4)
    try:
        model = llm.llm_engine.executor.driver_worker.model_runner.model
        experts = model.model.layers[1].mlp.experts
        gate_up = values["model.layers.1.mlp.experts.gate_up_proj"]  # [E, H, 2I], gate at even columns
        assert torch.equal(experts.w13_weight, torch.cat([gate_up[:, :, 0::2], gate_up[:, :, 1::2]], 2).transpose(1, 2))
        assert torch.equal(experts.w2_weight, values["model.layers.1.mlp.experts.down_proj"].transpose(1, 2))
        prompts = random_prompts_spanning(3, seed=6, min_len=5, max_len=40)
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                               SamplingParams(temperature=0.0, max_tokens=6), use_tqdm=False)
        for prompt, output in zip(prompts, outputs):
            assert output.outputs[0].token_ids == cached_hf_greedy(dense, tuple(prompt), 6)
    finally:
        llm.shutdown()


def test_quantization_configs_other_than_gpt_oss_mxfp4_are_refused():
    from types import SimpleNamespace

    from raylm.models.gpt_oss import GptOssForCausalLM
    from raylm.models.llama import LlamaForCausalLM
    from raylm.models.mxfp4 import refuse_quantization_config

    mxfp4 = SimpleNamespace(quantization_config={"quant_method": "mxfp4"})
    refuse_quantization_config(mxfp4, GptOssForCausalLM)
    with pytest.raises(ValueError, match="LlamaForCausalLM does not read"):
        refuse_quantization_config(mxfp4, LlamaForCausalLM)
    with pytest.raises(ValueError, match="quant_method must be 'mxfp4' for GptOssForCausalLM, got 'fp8'"):
        GptOssForCausalLM(SimpleNamespace(quantization_config={"quant_method": "fp8"}))


def test_quantization_rule_mxfp4_or_online_fp8_for_gpt_oss():
    """The engine's check (`get_quant_config`, run before any weight is read): MXFP4 is
    gpt-oss's (its model class dequantizes it, no linear layer is quantized), online fp8
    quantizes its 16/32-bit checkpoint (tests/test_fp8_moe.py), an FP8 gpt-oss checkpoint is
    refused, and an unknown method is refused by name."""
    from types import SimpleNamespace

    from raylm.models.quantization import get_quant_config

    def config(architecture: str, quantization_config: dict | None, **fields) -> SimpleNamespace:
        return SimpleNamespace(architectures=[architecture], quantization_config=quantization_config, **fields)

    gpt_oss_mxfp4 = config("GptOssForCausalLM", {"quant_method": "mxfp4"}, num_local_experts=4)
    assert get_quant_config(gpt_oss_mxfp4, None) is None
    with pytest.raises(ValueError, match="quantization 'fp8' does not match the checkpoint's quant_method 'mxfp4'"):
        get_quant_config(gpt_oss_mxfp4, "fp8")
    with pytest.raises(ValueError, match="quant_method 'mxfp4'.*GptOssForCausalLM only, not architectures "
                                         r"\['LlamaForCausalLM'\]"):
        get_quant_config(config("LlamaForCausalLM", {"quant_method": "mxfp4"}), None)
    with pytest.raises(ValueError, match=r"gpt-oss checkpoints quantized with quant_method 'fp8' are not read"):
        get_quant_config(config("GptOssForCausalLM", {"quant_method": "fp8"}, num_local_experts=4), None)
    online = get_quant_config(config("GptOssForCausalLM", None, num_local_experts=4), "fp8")
    assert online is not None and not online.scheme.checkpoint_is_fp8
    with pytest.raises(ValueError, match="quant_method 'bitsandbytes'.*which raylm does not read"):
        get_quant_config(config("GptOssForCausalLM", {"quant_method": "bitsandbytes"}, num_local_experts=4), None)
    dense_fp8 = get_quant_config(config("LlamaForCausalLM", {"quant_method": "fp8"}), None)
    assert dense_fp8 is not None and dense_fp8.method == "fp8"
