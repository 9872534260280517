"""The fused pointwise Triton kernels (kernels/triton_elementwise.py: RMSNorm with the
residual add, SiLU-and-mul, rotary embedding): their interpreter cases (in a subprocess),
their tiles compiled for an H100 without a GPU, and natively on a GPU (`cuda` marker)
against the fp32 reference and the models' PyTorch path, through the layer modules too.

The interpreter cases live in `tests/triton_elementwise_cases.py`: TRITON_INTERPRET must be
set before any kernel is decorated, so it runs in a pytest subprocess of its own.
"""

from __future__ import annotations

import pytest
import torch

from triton_interpreter import assert_cases_pass_under_the_interpreter


def _has_triton() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def test_kernels_match_the_fp32_reference_under_the_interpreter():
    """tests/triton_elementwise_cases.py: every kernel in bf16, fp16 and fp32, hidden sizes
    4096, 5120, 896 and 64, 1 to 19 rows (the GPU check runs 1 to 8192), GQA and partial rotary dimensions, interpreted."""
    pytest.importorskip("triton")
    assert_cases_pass_under_the_interpreter("triton_elementwise_cases.py", timeout_s=600)


def test_the_layers_keep_their_cpu_paths_off_cuda():
    from raylm.kernels import cuda_ops

    assert cuda_ops.usable(torch.ones(2, 8), torch.ones(8)) is None


# Compiled ahead of time for an H100 (sm_90a) down to a cubin, no GPU needed (as the
# attention tiles in tests/test_triton_kernels.py): Llama-3-8B's sizes, the widest row the
# norm takes in one pass, a head size and rotary dim that are no powers of two.
ELEMENTWISE_SHAPES = [(4096, 14336, 128, 128), (16384, 53248, 128, 64), (5120, 13824, 80, 40)]


def _elementwise_variants():
    from raylm.cluster.benchmarks.gpu_kernel_check import elementwise_variants

    for dtype in (torch.bfloat16, torch.float32):
        for shape in ELEMENTWISE_SHAPES:
            for variant in elementwise_variants(dtype, *shape):
                name = f"{variant.name}-{str(dtype).removeprefix('torch.')}"
                yield pytest.param(variant, id=name.replace(" ", ""))


@pytest.mark.parametrize("variant", list(_elementwise_variants()) if _has_triton() else [])
def test_pointwise_tiles_compile_for_sm90_without_spilling(variant):
    from raylm.cluster.benchmarks.gpu_kernel_check import compile_resources

    report = compile_resources(variant)
    assert report["stack_bytes"] == 0 and report["local_bytes"] == 0, report
    assert report["registers"] <= 128, report


# ---- natively on a GPU ------------------------------------------------------------------------

@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
def test_kernels_compiled_natively_match_the_reference_and_the_pytorch_path(dtype):
    """Stage a's pointwise cases at their small sizes, natively: within a few units of the
    last place of the fp32 reference and of the models' PyTorch path."""
    from raylm.cluster.benchmarks.gpu_elementwise_check import check_elementwise

    records = check_elementwise(dtype, torch.device("cuda"), dry_run=True)
    failed = [r for r in records if not r["passed"]]
    assert records and not failed, failed


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_layer_modules_on_cuda_run_the_kernels_and_match_their_pytorch_path(monkeypatch, dtype):
    from raylm.cluster.benchmarks.gpu_kernel_check import count_compiled_variants
    from raylm.kernels import cuda_ops
    from raylm.models.activation import SiluAndMul
    from raylm.models.rmsnorm import GemmaRMSNorm, RMSNorm
    from raylm.models.rotary_embedding import RotaryEmbedding

    device = torch.device("cuda")
    gen = torch.Generator().manual_seed(0)
    rows, hidden, heads, kv_heads, head_size = 9, 896, 14, 2, 64
    norms = [RMSNorm(hidden, 1e-6), GemmaRMSNorm(hidden, 1e-6)]
    for norm in norms:
        norm.weight.data = torch.rand(hidden, generator=gen) + 0.5
    rope = RotaryEmbedding(head_size, 32, 512, {"rope_type": "default", "rope_theta": 10000.0})
    modules = [m.to(device, dtype) for m in (*norms, rope)]
    x = torch.randn(rows, hidden, generator=gen).to(device, dtype)
    residual = torch.randn(rows, hidden, generator=gen).to(device, dtype)
    gate_up = torch.randn(rows, 2 * 4864, generator=gen).to(device, dtype)
    qkv = torch.randn(rows, (heads + 2 * kv_heads) * head_size, generator=gen).to(device, dtype)
    positions = torch.randint(0, 512, (rows,), generator=gen).to(device)
    q_size, k_size = heads * head_size, kv_heads * head_size

    def run_layers() -> list[torch.Tensor]:
        outputs = []
        for norm in modules[:2]:
            outputs.append(norm(x.clone()))
            outputs.extend(norm(x.clone(), residual.clone()))
        outputs.append(SiluAndMul()(gate_up))
        outputs.append(rope.rotate(positions, qkv.clone()[:, :q_size + k_size]))
        q, k = qkv.clone()[:, :q_size], qkv.clone()[:, q_size:q_size + k_size]
        outputs.extend(rope(positions, q, k))
        return [out.clone() for out in outputs]

    compiled_before = count_compiled_variants()
    fused = run_layers()
    assert count_compiled_variants() > compiled_before  # the kernels ran
    monkeypatch.setattr(cuda_ops, "_module", False)
    eager = run_layers()
    tolerance = {torch.float32: 1e-5, torch.bfloat16: 1.6e-2}[dtype]
    for out, expected in zip(fused, eager):
        assert out.shape == expected.shape and out.dtype == expected.dtype
        assert ((out.float() - expected.float()).abs().max() / expected.float().abs().max()).item() <= tolerance
