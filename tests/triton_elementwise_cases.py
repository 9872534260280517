"""The fused pointwise Triton kernels (raylm.kernels.triton_elementwise) against the fp32
PyTorch reference of cluster/benchmarks/gpu_elementwise_check.py, on the CPU under Triton's
interpreter: RMSNorm plain and with the residual add (Llama's weight and Gemma's 1 + weight),
SiLU-and-mul, the rotary embedding in place (queries and keys as one tensor and as two,
partial rotary dimensions, GQA); bf16, fp16 and fp32; 1 to 19 rows (one row
a program: the GPU check, stage a, runs prefill sizes).

Not collected by the suite: `tests/test_triton_elementwise.py` runs this file in a pytest
subprocess with TRITON_INTERPRET=1, which must be set before the kernels are decorated and
would otherwise make every later test in the process interpret its kernels. The
interpreter truncates fp32 -> bf16 casts where a GPU rounds to nearest, so the comparison
with the models' PyTorch path counts natively only (the `cuda` tests there).
"""

from __future__ import annotations

import os

import pytest
import torch

from raylm.cluster.benchmarks import gpu_elementwise_check as check

if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("runs under TRITON_INTERPRET=1 only (tests/test_triton_elementwise.py starts it)",
                allow_module_level=True)

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def ops():
    pytest.importorskip("triton")
    from raylm.kernels import triton_elementwise
    return triton_elementwise


def assert_passed(result: dict, dtype: torch.dtype) -> None:
    assert check.passed(result, dtype, native=False), result


@pytest.mark.parametrize("dtype", check.TOLERANCE, ids=str)
@pytest.mark.parametrize("rows,hidden", check.NORM_SHAPES)
@pytest.mark.parametrize("with_residual", [False, True], ids=["plain", "fused_add"])
def test_rms_norm_matches_the_fp32_reference(ops, rows, hidden, dtype, with_residual):
    assert_passed(check.check_rms_norm(ops, rows, hidden, dtype, CPU, 0.0, with_residual), dtype)


@pytest.mark.parametrize("dtype", check.TOLERANCE, ids=str)
@pytest.mark.parametrize("with_residual", [False, True], ids=["plain", "fused_add"])
def test_gemma_rms_norm_scales_by_one_plus_weight(ops, dtype, with_residual):
    assert_passed(check.check_rms_norm(ops, 7, 896, dtype, CPU, 1.0, with_residual), dtype)


@pytest.mark.parametrize("dtype", check.TOLERANCE, ids=str)
@pytest.mark.parametrize("rows,d", check.SILU_SHAPES)
def test_silu_and_mul_matches_the_fp32_reference(ops, rows, d, dtype):
    assert_passed(check.check_silu_and_mul(ops, rows, d, dtype, CPU), dtype)


@pytest.mark.parametrize("dtype", check.TOLERANCE, ids=str)
@pytest.mark.parametrize("shape", check.ROTARY_SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("separate_key", [False, True], ids=["qk_together", "q_and_k"])
def test_rotary_embedding_matches_the_fp32_reference_in_place(ops, shape, dtype, separate_key):
    assert_passed(check.check_rotary(ops, *shape, dtype, CPU, separate_key), dtype)


@pytest.mark.parametrize("dtype", check.TOLERANCE, ids=str)
@pytest.mark.parametrize("shape", check.ROTARY_SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("qk_norm", [False, True], ids=["rotary", "qk_norm"])
def test_rotary_stores_keys_and_values_into_the_cache_in_the_same_launch(ops, shape, dtype, qk_norm):
    assert_passed(check.check_rotary_fused(ops, *shape, dtype, CPU, qk_norm), dtype)


def test_stage_a_records_every_case_and_passes_them(ops):
    records = check.check_elementwise(torch.float32, CPU, dry_run=True)
    assert {r["kernel"] for r in records} == {"rms_norm", "fused_add_rms_norm", "silu_and_mul", "rotary_embedding"}
    assert all(r["passed"] for r in records), [r for r in records if not r["passed"]]


def test_zero_rows_launch_nothing(ops):
    x = torch.empty(0, 64)
    weight = torch.ones(64)
    assert ops.rms_norm(x, weight, 1e-6).shape == (0, 64)
    assert ops.fused_add_rms_norm(x, x.clone(), weight, 1e-6)[0].shape == (0, 64)
    assert ops.silu_and_mul(torch.empty(0, 128)).shape == (0, 64)
    ops.rotary_embedding_(torch.empty(0, dtype=torch.int64), x, None, check.cos_sin_cache(8, 64, torch.float32, CPU),
                          64, 64)
