"""The Triton attention kernels with attention sinks (gpt-oss) against the PyTorch reference
(raylm.kernels.torch_attention, itself checked against Hugging Face's eager attention in
tests/test_gpt_oss.py), under Triton's interpreter. Not collected by the suite:
`tests/test_gpt_oss.py` runs this file in a pytest subprocess with TRITON_INTERPRET=1 (see
tests/triton_interpreter_cases.py for why)."""

from __future__ import annotations

import importlib
import os

import pytest
import torch

from paged_steps import build_cached_step as build_step
from raylm.kernels import torch_attention as reference

if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("runs under TRITON_INTERPRET=1 only (tests/test_gpt_oss.py starts it)", allow_module_level=True)

TOLERANCE = {torch.float32: 1e-3, torch.bfloat16: 3e-2}


@pytest.fixture(scope="module")
def kernels():
    pytest.importorskip("triton")
    return {name: importlib.import_module(f"raylm.kernels.{name}")
            for name in ("triton_decode_attention", "triton_prefill_attention")}


def sinks_for(num_heads: int, seed: int) -> torch.Tensor:
    """Spread around 0, one far above every score (its head's output near 0), one far below."""
    sinks = torch.randn(num_heads, generator=torch.Generator().manual_seed(seed)) * 2
    sinks[0], sinks[-1] = 30.0, -30.0
    return sinks


def relative_error(out: torch.Tensor, expected: torch.Tensor) -> float:
    return ((out.float() - expected.float()).abs().max() / expected.float().abs().max()).item()


@pytest.mark.parametrize("dtype,num_splits,window", [
    (torch.float32, 1, None), (torch.float32, 3, None), (torch.bfloat16, 2, None), (torch.float32, 1, 33),
    (torch.float32, 3, 130)])
def test_decode_with_sinks_matches_reference_the_sink_entering_a_split_softmax_once(kernels, dtype, num_splits,
                                                                                      window):
    # Three 64-token partitions and a part of one (split-K 3), a window of 130 inside them.
    seq_lens = [200, 1, 40, 150]
    query, k_cache, v_cache, md = build_step([1] * 4, seq_lens, num_heads=8, num_kv_heads=2, head_size=64,
                                             block_size=16, dtype=dtype, seed=num_splits, sliding_window=window)
    sinks = sinks_for(8, num_splits)
    out = kernels["triton_decode_attention"].paged_decode_attention(
        query, k_cache, v_cache, md, 0.125, out=torch.full_like(query, float("nan")), num_splits=num_splits,
        sliding_window=window, sinks=sinks)
    expected = reference.paged_attention(query, k_cache, v_cache, md, 0.125, sliding_window=window, sinks=sinks)
    assert relative_error(out, expected) < TOLERANCE[dtype]
    without = reference.paged_attention(query, k_cache, v_cache, md, 0.125, sliding_window=window)
    assert relative_error(without, expected) > 0.1  # the sinks matter here


@pytest.mark.parametrize("dtype,window", [(torch.float32, None), (torch.float32, 17), (torch.bfloat16, 40)])
def test_prefill_with_sinks_matches_reference(kernels, dtype, window):
    # A prompt longer than a tile of queries, a chunk after cached tokens, decode rows.
    query_lens, seq_lens = [90, 12, 1, 1], [90, 75, 50, 3]
    query, k_cache, v_cache, md = build_step(query_lens, seq_lens, num_heads=4, num_kv_heads=2, head_size=64,
                                             block_size=8, dtype=dtype, seed=7, sliding_window=window)
    sinks = sinks_for(4, 11)
    out = kernels["triton_prefill_attention"].paged_prefill_attention(
        query, k_cache, v_cache, md, 0.3, out=torch.full_like(query, float("nan")), sliding_window=window,
        sinks=sinks)
    expected = reference.paged_attention(query, k_cache, v_cache, md, 0.3, sliding_window=window, sinks=sinks)
    assert relative_error(out, expected) < TOLERANCE[dtype]


def test_warm_up_launches_the_sink_variants_of_a_layer_with_sinks(kernels, monkeypatch):
    from raylm.kernels import backend

    launched = []
    decode, prefill = kernels["triton_decode_attention"], kernels["triton_prefill_attention"]
    for module, name in ((decode, "_paged_decode_kernel"), (decode, "_merge_partitions_kernel"),
                         (prefill, "_paged_prefill_kernel")):
        kernel = getattr(module, name)

        class Recording:
            def __init__(self, kernel, name):
                self.kernel, self.name = kernel, name

            def __getitem__(self, grid):
                def launch(*args, **kwargs):
                    launched.append((self.name, kwargs.get("HAS_SINKS")))
                    return self.kernel[grid](*args, **kwargs)
                return launch

        monkeypatch.setattr(module, name, Recording(kernel, name))
    k_cache, v_cache = torch.randn(4, 16, 2, 64), torch.randn(4, 16, 2, 64)
    backend.launch_every_variant(8, 2, 64, 0.125, k_cache, v_cache, 1024, has_sinks=True)  # split counts 1, 2
    assert {name for name, _ in launched} == {"_paged_decode_kernel", "_merge_partitions_kernel",
                                              "_paged_prefill_kernel"}
    assert all(has_sinks for _, has_sinks in launched)


def test_llm_on_the_triton_backend_generates_hf_greedy_tokens_for_gpt_oss(kernels, tmp_path):
    from hf_reference import hf_greedy
    from raylm.engine import LLM, SamplingParams
    from tiny_models import build_tiny_gpt_oss

    model_dir = build_tiny_gpt_oss(tmp_path / "gpt_oss", seed=3)
    prompts = [[5, 17, 33, 2, 9, 101, 44, 12, 60, 7, 88, 3], [250, 11]]  # the first past the window of 8
    llm = LLM(model=str(model_dir), dtype="float32", attention_backend="triton", max_model_len=32, max_num_seqs=4,
              max_num_batched_tokens=32)  # the warm-up's full-budget prefill runs interpreted too
    try:
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                               SamplingParams(temperature=0.0, max_tokens=4), use_tqdm=False)
    finally:
        llm.shutdown()
    for prompt, output in zip(prompts, outputs):
        assert output.outputs[0].token_ids == hf_greedy(model_dir, prompt, 4)
