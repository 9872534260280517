"""The Triton kernels: their interpreter cases (in a subprocess), the tiles' register use
compiled for an H100 without a GPU, native runs against the fp32 reference on a GPU (`cuda`
marker), and the backend choice.

The interpreter cases live in `tests/triton_interpreter_cases.py`: TRITON_INTERPRET must be
set before any kernel is decorated, triton.language's own helpers included, so it would
leak into every later test of this process; one pytest subprocess runs them instead.
"""

from __future__ import annotations

import os

import pytest
import torch

from triton_interpreter import assert_cases_pass_under_the_interpreter


def test_kernels_match_the_reference_under_the_interpreter():
    """tests/triton_interpreter_cases.py: decode (with and without split-K), prefill/extend,
    KV write and an LLM on the Triton backend against HF, interpreted on the CPU."""
    pytest.importorskip("triton")
    assert_cases_pass_under_the_interpreter("triton_interpreter_cases.py", timeout_s=900)


def test_dispatcher_splits_long_contexts_of_small_batches_only():
    pytest.importorskip("triton")
    from raylm.kernels.triton_decode_attention import choose_num_splits as choose

    # H100: 132 SMs.
    assert choose(num_seqs=1, num_kv_heads=8, max_seq_len=32768, num_sms=132) > 1
    assert choose(num_seqs=256, num_kv_heads=8, max_seq_len=32768, num_sms=132) == 1
    assert choose(num_seqs=1, num_kv_heads=8, max_seq_len=300, num_sms=132) == 1


# ---- GPU compile rules ----------------------------------------------------------------------

# Compiled ahead of time for an H100 (sm_90a) down to a cubin with the ptxas that ships with
# triton, no GPU needed, and read back with its cuobjdump: the tiles each launcher picks
# (kernels/triton_*_attention.py) must leave no stack frame (spilled registers). One
# variant per kernel and dtype at the largest head size, where pressure is highest; the
# device check (cluster/benchmarks/gpu_kernel_check.py) reports every variant natively.
def _heaviest_variants():
    from raylm.cluster.benchmarks.gpu_kernel_check import launch_variants

    for dtype, head_size, group in ((torch.bfloat16, 64, 8), (torch.bfloat16, 128, 4), (torch.bfloat16, 256, 8),
                                    (torch.float32, 64, 1), (torch.float32, 128, 1), (torch.float32, 256, 4)):
        variants = launch_variants(dtype, group, head_size, max_model_len=4096)
        prefills = [v for v in variants if v.name.startswith("prefill")]
        largest_prefill = max(prefills, key=lambda v: v.constexprs["BLOCK_M"])
        for variant in variants:
            if variant.name in ("decode", "decode_split_k") or variant is largest_prefill:
                name = f"{variant.name}-{str(dtype).removeprefix('torch.')}-d{head_size}-gqa{group}"
                yield pytest.param(variant, id=name.replace(" ", ""))
    # A sliding-window, soft-capped layer (Gemma 2's): its own compiled variants.
    for variant in launch_variants(torch.bfloat16, 2, 256, max_model_len=8192, sliding_window=4096, soft_cap=50.0):
        if variant.name in ("decode", "decode_split_k") or variant.name.startswith(("merge", "prefill")):
            yield pytest.param(variant, id=f"{variant.name}-windowed-softcap-bf16-d256-gqa2".replace(" ", ""))
    # gpt-oss's layers (head size 64, 8 query heads per KV head, a 128-token window): with sinks.
    for variant in launch_variants(torch.bfloat16, 8, 64, max_model_len=4096, sliding_window=128, sinks=True):
        if variant.name in ("decode", "decode_split_k") or variant.name.startswith(("merge BLOCK_S=8", "prefill")):
            yield pytest.param(variant, id=f"{variant.name}-sinks-windowed-bf16-d64-gqa8".replace(" ", ""))


@pytest.mark.parametrize("variant", list(_heaviest_variants()))
def test_kernel_tiles_compile_for_sm90_without_spilling(variant):
    pytest.importorskip("triton")
    from raylm.cluster.benchmarks.gpu_kernel_check import compile_resources

    report = compile_resources(variant)
    assert report["stack_bytes"] == 0 and report["local_bytes"] == 0, report
    assert report["registers"] <= 255


def test_every_prefill_tile_a_launcher_can_pick_is_listed_for_the_warm_up():
    pytest.importorskip("triton")
    from raylm.kernels.triton_prefill_attention import block_m_variants, prefill_tiles

    for dtype in (torch.bfloat16, torch.float32):
        for group in (1, 3, 4, 8):
            for head_size in (64, 128, 256):
                listed = set(block_m_variants(dtype, group, head_size))
                picked = {prefill_tiles(dtype, group, head_size, n)["BLOCK_M"] for n in range(1, 300)}
                assert picked == listed


def test_interpreted_kernels_do_not_leak_into_the_process():
    pytest.importorskip("triton")
    from triton.runtime.jit import JITFunction

    from raylm.kernels import triton_decode_attention

    assert "TRITON_INTERPRET" not in os.environ
    assert isinstance(triton_decode_attention._paged_decode_kernel, JITFunction)


# ---- natively on a GPU ------------------------------------------------------------------------

@pytest.mark.cuda
@pytest.mark.parametrize("config", range(9))
def test_kernels_compiled_natively_match_the_fp32_reference(config):
    """The device check's stage a at its small sizes: decode with and without split-K,
    prefill/extend, KV write, for one of its dtype x head size x GQA configurations."""
    from raylm.cluster.benchmarks.gpu_kernel_check import CONFIGS, check_config

    dtype, head_size, group = CONFIGS[config]
    records = check_config(dtype, head_size, group, torch.device("cuda"), dry_run=True, seed=config)
    failed = [r for r in records if not r["passed"]]
    assert records and not failed, failed


# ---- backend choice -------------------------------------------------------------------------


def test_backend_is_the_one_named_else_the_machines_default():
    from raylm.kernels.backend import default_backend_name, get_attention_backend

    assert get_attention_backend("torch").name == "torch"

    # CPU: the native kernel when it builds here, else the PyTorch reference.
    expected = "triton" if torch.cuda.is_available() else default_backend_name()
    assert get_attention_backend().name == expected
    assert expected in ("triton", "cpu", "torch")


def test_unknown_backend_name_is_a_value_error_naming_the_choices():
    from raylm.kernels.backend import get_attention_backend

    with pytest.raises(ValueError, match="triton"):
        get_attention_backend("flash")
