"""What a CUDA decode step launches per decoder layer, and what it computes, on the CPU:
the layers take their CUDA branches (`cuda_ops.interpreted_on_cpu`) with the Triton
attention backend, every Triton kernel under the interpreter (`tests/decode_launches.py`).

Not collected by the suite: `tests/test_decode_launches.py` runs this file in a pytest
subprocess with TRITON_INTERPRET=1 (set before any kernel is decorated) and the CPU's own
fast paths switched off, as CUDA has none of them.
"""

from __future__ import annotations

import os
from collections import Counter

import pytest
import torch

import decode_launches
from tiny_models import build_tiny_model, save_random_model_with_random_norms

if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("runs under TRITON_INTERPRET=1 only (tests/test_decode_launches.py starts it)",
                allow_module_level=True)

# Long enough that the batch-1 decode graph takes the split-K decode and its merge, as the
# 8B check's engine does (a graph's split count is that of max_model_len).
MAX_MODEL_LEN = 2048
ARCHS = ("llama", "qwen2", "qwen3")

# One decoder layer of a decode step: the four GEMMs (qkv with Qwen2's bias in its epilogue,
# o, gate_up, down), the input norm with the previous layer's residual add and the
# post-attention one (fused add + RMSNorm), rotary with Qwen3's q/k norms and the KV-cache
# write, split-K decode attention and its merge, SiLU-and-mul.
LAYER_LAUNCHES = Counter({"aten:linear": 4, "triton:_rms_norm_kernel": 2, "triton:_rotary_embedding_kernel": 1,
                          "triton:_paged_decode_kernel": 1, "triton:_merge_partitions_kernel": 1,
                          "triton:_silu_and_mul_kernel": 1})
# Outside the layers: the embedding gather and the final norm (with the last residual add).
MODEL_LAUNCHES = Counter({"aten:embedding": 1, "triton:_rms_norm_kernel": 1})


def _qwen3_config():
    from transformers import Qwen3Config

    return Qwen3Config(vocab_size=512, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=32, num_hidden_layers=2, max_position_embeddings=MAX_MODEL_LEN,
                       rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("decode_launches")
    dirs = {arch: build_tiny_model(root / arch, arch, seed=index, max_position_embeddings=MAX_MODEL_LEN)
            for index, arch in enumerate(ARCHS[:2])}
    # Random norm weights, so that the q/k norms matter.
    dirs["qwen3"] = save_random_model_with_random_norms(root / "qwen3", _qwen3_config(), seed=2)
    return dirs


@pytest.mark.parametrize("arch", ARCHS)
def test_each_decoder_layer_of_a_decode_step_launches_ten_kernels(model_dirs, arch):
    # Batches of 1 and 3 through one runner (building it is most of a case's time).
    runner = decode_launches.decode_runner(model_dirs[arch], torch.bfloat16, max_model_len=MAX_MODEL_LEN)
    for batch_size in (1, 3):
        launches, _ = decode_launches.count_decode_launches(runner, decode_launches.decode_inputs(runner, 40,
                                                                                                  batch_size))
        for index in range(len(runner.model.model.stage_layers)):
            assert launches.layer(index) == LAYER_LAUNCHES, (batch_size, launches.describe())
        assert launches.by_section["model"] == MODEL_LAUNCHES, (batch_size, launches.describe())


def _greedy_steps(runner, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    """Each prompt's greedy tokens from a prefill step, then decode steps, all eager."""
    from raylm.engine.sampling_params import SamplingParams
    from raylm.engine.step import ExecuteModelRequest, ScheduledRequest

    greedy = SamplingParams(temperature=0.0, max_tokens=new_tokens)
    tables = [[1 + i] for i in range(len(prompts))]  # a block each holds every token here
    step = [ScheduledRequest(i, list(p), 0, tables[i], len(p), greedy, resumed=True) for i, p in enumerate(prompts)]
    lengths = [len(p) for p in prompts]
    tokens: list[list[int]] = [[] for _ in prompts]
    for _ in range(new_tokens):
        out = runner.execute_model(ExecuteModelRequest(requests=step))
        for t in out.outputs:
            tokens[t.req_id].append(t.token_id)
        step = [ScheduledRequest(t.req_id, [t.token_id], lengths[t.req_id], tables[t.req_id],
                                 len(prompts[t.req_id]), None) for t in out.outputs]
        lengths = [n + 1 for n in lengths]
    return tokens


@pytest.mark.parametrize("arch", ARCHS)
def test_the_cuda_path_gives_hugging_faces_greedy_tokens(model_dirs, arch):
    """fp32 prefill and decode steps through the fused kernels (rotary with the q/k norms
    and the KV write, the norms with the residual adds) against HF greedy decoding."""
    from hf_reference import hf_greedy
    from raylm.kernels import cuda_ops

    prompts = [[5, 17, 300, 42, 9], [400, 8, 8]]
    runner = decode_launches.decode_runner(model_dirs[arch], torch.float32, max_model_len=MAX_MODEL_LEN)
    with cuda_ops.interpreted_on_cpu(), torch.inference_mode():
        tokens = _greedy_steps(runner, prompts, 4)
    assert tokens == [hf_greedy(model_dirs[arch], p, 4) for p in prompts]
