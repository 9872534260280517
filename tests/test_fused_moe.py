"""The fused-experts kernels against the PyTorch reference (`kernels/torch_moe.py`), the
router against Hugging Face's, and the expert weights' sharding and loading.

The native CPU op runs here in fp32 and bf16, on its AVX-512 panels and on ATen's GEMM;
the Triton kernel runs under TRITON_INTERPRET in a child process (the interpreter must be
set before the kernels are decorated, and stays with the process), and is compiled for an
H100 in another (no GPU needed)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from raylm.kernels import cpu_fused_moe, cpu_gemm, torch_moe
from raylm.parallel.checkpoint_slice import CheckpointSlice
from raylm.parallel.fused_moe_weights import FusedMoEWeights, expert_placement
from raylm.parallel.parallel_state import override_tensor_parallel

# (tokens, hidden, intermediate, experts, top_k): a decode row, odd hidden and intermediate
# sizes (bf16 pads both to an even length, the panels to 64 and 32 columns), a prefill-sized
# batch with more tokens than any expert's group holds at once.
SHAPES = [(1, 64, 96, 6, 2), (7, 130, 70, 5, 2), (37, 256, 200, 8, 3), (300, 96, 64, 7, 2)]
# max |kernel - reference| / max |reference|; bf16 rounds x, the weights (both sides) and
# the activation between the GEMMs (the kernel only).
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


def moe_case(tokens: int, hidden: int, intermediate: int, experts: int, top_k: int, dtype: torch.dtype, seed: int):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=gen).to(dtype)
    w13 = (torch.randn(experts, 2 * intermediate, hidden, generator=gen) * 0.1).to(dtype)
    w2 = (torch.randn(experts, hidden, intermediate, generator=gen) * 0.1).to(dtype)
    topk_weights, topk_ids = torch_moe.fused_topk(torch.randn(tokens, experts, generator=gen), top_k, True)
    return x, w13, w2, topk_weights, topk_ids


def relative_error(out: torch.Tensor, expected: torch.Tensor) -> float:
    return ((out.float() - expected.float()).abs().max() / expected.float().abs().max()).item()


def every_other_expert(experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """An expert map for a rank holding experts 0, 2, 4, ...: (expert_map, the global ids it holds)."""
    held = torch.arange(0, experts, 2)
    expert_map = torch.full((experts,), -1, dtype=torch.int32)
    expert_map[held] = torch.arange(len(held), dtype=torch.int32)
    return expert_map, held


# ---- routing ---------------------------------------------------------------------------------

@pytest.mark.parametrize("renormalize", [True, False])
def test_fused_topk_chooses_and_weighs_experts_as_the_hugging_face_routers(renormalize):
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

    config = Qwen3MoeConfig(hidden_size=32, num_experts=7, num_experts_per_tok=3, norm_topk_prob=renormalize)
    router = Qwen3MoeTopKRouter(config)
    torch.nn.init.normal_(router.weight, std=0.3)
    hidden = torch.randn(40, 32)
    with torch.no_grad():
        logits, expected_weights, expected_ids = router(hidden)
    weights, ids = torch_moe.fused_topk(logits, 3, renormalize)
    assert torch.equal(ids, expected_ids)
    torch.testing.assert_close(weights, expected_weights.float(), rtol=0, atol=1e-6)
    if renormalize:
        torch.testing.assert_close(weights.sum(-1), torch.ones(40))


def test_fused_topk_rejects_a_top_k_beyond_the_experts():
    with pytest.raises(ValueError, match=r"top_k must be in \[1, num_experts=4\], got 5"):
        torch_moe.fused_topk(torch.randn(2, 4), 5, True)


# ---- the native CPU op -----------------------------------------------------------------------

def avx512_runs(dtype: torch.dtype) -> bool:
    w = torch.zeros(1, 64, 64, dtype=dtype)
    return cpu_fused_moe.pack_experts(w, w[:, :, :32]) is not None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", SHAPES, ids=[f"T{s[0]}-H{s[1]}-I{s[2]}-E{s[3]}-k{s[4]}" for s in SHAPES])
def test_cpu_avx512_fused_moe_matches_the_reference(shape, dtype):
    if not avx512_runs(dtype):
        pytest.skip(f"no AVX-512 kernel for {dtype} on this CPU")
    x, w13, w2, topk_weights, topk_ids = moe_case(*shape, dtype, seed=sum(shape))
    packed = cpu_fused_moe.pack_experts(w13, w2)
    out = cpu_fused_moe.fused_experts(x, w13, w2, topk_weights, topk_ids, packed=packed)
    expected = torch_moe.fused_experts(x.float(), w13.float(), w2.float(), topk_weights, topk_ids)
    assert out.dtype == dtype and out.shape == x.shape
    assert relative_error(out, expected) < TOLERANCE[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", SHAPES[1:3], ids=[f"T{s[0]}-H{s[1]}" for s in SHAPES[1:3]])
def test_cpu_dense_fused_moe_matches_the_reference(shape, dtype):
    if not cpu_fused_moe.library_loaded():
        pytest.skip("the native library does not build here")
    x, w13, w2, topk_weights, topk_ids = moe_case(*shape, dtype, seed=sum(shape))
    out = torch.ops.raylm.dense_fused_moe(x, w13, w2, topk_weights, topk_ids, None)
    expected = torch_moe.fused_experts(x.float(), w13.float(), w2.float(), topk_weights, topk_ids)
    assert relative_error(out, expected) < TOLERANCE[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("expert_parallel", [False, True])
def test_cpu_fused_moe_with_gpt_oss_biases_and_clamped_swiglu_matches_the_reference(dtype, expert_parallel):
    """The ATen-GEMM op with biases and the swigluoai activation (a limit that bites at this
    scale), even when packed panels exist (they take neither), against the reference."""
    if not cpu_fused_moe.library_loaded():
        pytest.skip("the native library does not build here")
    x, w13, w2, topk_weights, topk_ids = moe_case(33, 64, 48, 6, 2, dtype, seed=9)
    gen = torch.Generator().manual_seed(10)
    b13, b2 = torch.randn(6, 96, generator=gen).to(dtype), torch.randn(6, 64, generator=gen).to(dtype)
    expert_map = None
    if expert_parallel:
        expert_map, held = every_other_expert(6)
        w13, w2, b13, b2 = (t[held].contiguous() for t in (w13, w2, b13, b2))
    options = dict(activation="swigluoai", swiglu_limit=0.3)
    out = cpu_fused_moe.fused_experts(x, w13, w2, topk_weights, topk_ids, expert_map,
                                      packed=cpu_fused_moe.pack_experts(w13, w2), w13_bias=b13, w2_bias=b2, **options)
    expected = torch_moe.fused_experts(x.float(), w13.float(), w2.float(), topk_weights, topk_ids, expert_map,
                                       w13_bias=b13.float(), w2_bias=b2.float(), **options)
    plain = torch_moe.fused_experts(x.float(), w13.float(), w2.float(), topk_weights, topk_ids, expert_map)
    assert relative_error(out, expected) < TOLERANCE[dtype] < relative_error(plain, expected)


@pytest.mark.parametrize("path", ["avx512", "dense"])
def test_cpu_fused_moe_with_an_expert_map_sums_only_the_held_experts(path):
    """A rank holding experts 0, 2, 4, 6 of 8: its weights are those rows, and tokens routed
    only to other experts get zeros."""
    if not cpu_fused_moe.library_loaded() or (path == "avx512" and not avx512_runs(torch.float32)):
        pytest.skip(f"no {path} kernel here")
    x, w13, w2, topk_weights, topk_ids = moe_case(33, 96, 64, 8, 2, torch.float32, seed=3)
    topk_ids[0] = torch.tensor([1, 3])  # a token none of whose experts is held here
    expert_map, held = every_other_expert(8)
    local_w13, local_w2 = w13[held].contiguous(), w2[held].contiguous()
    packed = cpu_fused_moe.pack_experts(local_w13, local_w2) if path == "avx512" else None
    if path == "avx512":
        out = cpu_fused_moe.fused_experts(x, local_w13, local_w2, topk_weights, topk_ids, expert_map, packed)
    else:
        out = torch.ops.raylm.dense_fused_moe(x, local_w13, local_w2, topk_weights, topk_ids, expert_map)
    expected = torch_moe.fused_experts(x, local_w13, local_w2, topk_weights, topk_ids, expert_map)
    assert relative_error(out, expected) < TOLERANCE[torch.float32]
    assert torch.equal(out[0], torch.zeros(96))


def test_cpu_fused_moe_names_an_expert_id_outside_the_experts():
    if not cpu_fused_moe.library_loaded():
        pytest.skip("the native library does not build here")
    x, w13, w2, topk_weights, topk_ids = moe_case(4, 64, 32, 5, 2, torch.float32, seed=4)
    topk_ids[2, 1] = 5
    with pytest.raises(RuntimeError, match=r"topk_ids holds expert 5, outside \[0, 5\)"):
        torch.ops.raylm.dense_fused_moe(x, w13, w2, topk_weights, topk_ids, None)


# ---- the Triton kernel ---------------------------------------------------------------------

# Shapes whose dot tiles are all at least 16 (BLOCK_M 16 or 64, BLOCK_N 64, BLOCK_K 16 or 32);
# bf16 is widened to fp32 before tl.dot under the interpreter. Prints one relative error per
# case; the interpreter truncates fp32 -> bf16 stores where a GPU rounds (hence bf16's looser
# bound).
TRITON_SCRIPT = textwrap.dedent("""
    import os, sys
    os.environ["TRITON_INTERPRET"] = "1"
    import torch
    sys.path.insert(0, {tests!r})
    from test_fused_moe import moe_case, relative_error, every_other_expert
    from raylm.kernels import torch_moe, triton_fused_moe

    for dtype in (torch.float32, torch.bfloat16):
        for tokens, hidden, intermediate, experts, top_k in ((3, 64, 48, 6, 2), (40, 32, 40, 5, 2), (9, 48, 32, 7, 3)):
            x, w13, w2, topk_weights, topk_ids = moe_case(tokens, hidden, intermediate, experts, top_k, dtype, seed=tokens)
            out = triton_fused_moe.fused_experts(x, w13, w2, topk_weights, topk_ids)
            expected = torch_moe.fused_experts(x.float(), w13.float(), w2.float(), topk_weights, topk_ids)
            expert_map, held = every_other_expert(experts)
            w13_held, w2_held = w13[held].contiguous(), w2[held].contiguous()
            out_ep = triton_fused_moe.fused_experts(x, w13_held, w2_held, topk_weights, topk_ids, expert_map)
            expected_ep = torch_moe.fused_experts(x.float(), w13_held.float(), w2_held.float(), topk_weights,
                                                  topk_ids, expert_map)
            print("RESULT", str(dtype), tokens, relative_error(out, expected), relative_error(out_ep, expected_ep))
            # gpt-oss's experts: biases and the clamped SwiGLU (clamps that bite at this scale).
            gen = torch.Generator().manual_seed(tokens)
            b13 = torch.randn(experts, 2 * intermediate, generator=gen).to(dtype)
            b2 = torch.randn(experts, hidden, generator=gen).to(dtype)
            oai = dict(activation="swigluoai", swiglu_limit=0.3)
            out = triton_fused_moe.fused_experts(x, w13, w2, topk_weights, topk_ids, w13_bias=b13, w2_bias=b2, **oai)
            expected = torch_moe.fused_experts(x.float(), w13.float(), w2.float(), topk_weights, topk_ids,
                                               w13_bias=b13.float(), w2_bias=b2.float(), **oai)
            print("RESULT", str(dtype), tokens, relative_error(out, expected), 0.0)
    """)


def test_triton_fused_moe_under_the_interpreter_matches_the_reference():
    pytest.importorskip("triton")
    script = TRITON_SCRIPT.format(tests=str(Path(__file__).parent))
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                            env={**os.environ, "TRITON_INTERPRET": "1"})
    assert result.returncode == 0, result.stderr[-3000:]
    rows = [line.split() for line in result.stdout.splitlines() if line.startswith("RESULT")]
    assert len(rows) == 12
    for _, dtype, tokens, error, error_ep in rows:
        bound = 1e-5 if dtype == "torch.float32" else 3e-2
        assert float(error) < bound and float(error_ep) < bound, (dtype, tokens, error, error_ep)


def test_moe_align_block_size_pads_each_experts_run_to_whole_blocks():
    """Arithmetic by hand: assignments [e1, e0, e1, e2, -, e1] (the fifth to another rank's
    expert) in blocks of 4: expert 0 takes one block, 1 one, 2 one."""
    pytest.importorskip("triton")
    from raylm.kernels.triton_fused_moe import moe_align_block_size

    topk_ids = torch.tensor([[1, 0], [1, 2], [3, 1]])
    expert_map = torch.tensor([0, 1, 2, -1], dtype=torch.int32)
    sorted_ids, expert_ids, num_post = moe_align_block_size(topk_ids, 4, 3, expert_map)
    pad = 6
    assert num_post.tolist() == [12]
    assert sorted_ids[:12].tolist() == [1, pad, pad, pad, 0, 2, 5, pad, 3, pad, pad, pad]
    assert set(sorted_ids[12:].tolist()) <= {pad}
    assert expert_ids.tolist()[:3] == [0, 1, 2] and set(expert_ids.tolist()[3:]) == {-1}


GPU_COMPILE_SCRIPT = """
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from raylm.kernels.triton_fused_moe import _fused_moe_kernel

for dtype, mul in (("bf16", False), ("fp16", True)):
    ptr = "*" + dtype
    types = dict(a_ptr=ptr, b_ptr=ptr, c_ptr="*fp32" if mul else ptr, topk_weights_ptr="*fp32", bias_ptr=ptr,
                 sorted_token_ids_ptr="*i32", expert_ids_ptr="*i32", num_tokens_post_padded_ptr="*i32")
    constexprs = dict(TOP_K=1 if mul else 2, MUL_ROUTED_WEIGHT=mul, BLOCK_M=64, BLOCK_N=64, BLOCK_K=32,
                      DOT_FP32=False, DOT_PRECISION="tf32", HAS_BIAS=mul)  # the biased form too
    signature = {name: "constexpr" if name in constexprs else types.get(name, "i32")
                 for name in _fused_moe_kernel.arg_names}
    triton.compile(ASTSource(fn=_fused_moe_kernel, signature=signature, constexprs=constexprs),
                   target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
"""


def test_triton_fused_moe_compiles_to_an_h100_cubin():
    pytest.importorskip("triton")
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    result = subprocess.run([sys.executable, "-c", GPU_COMPILE_SCRIPT], env=env, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]


# ---- expert weights: placement, sharding, loading -------------------------------------------

def test_expert_placement_gives_the_first_ranks_one_expert_more():
    assert [expert_placement(7, 2, r) for r in range(2)] == [(0, 4), (4, 3)]
    assert [expert_placement(8, 3, r) for r in range(3)] == [(0, 3), (3, 3), (6, 2)]
    assert [expert_placement(4, 4, r) for r in range(4)] == [(0, 1), (1, 1), (2, 1), (3, 1)]


class CountingSlice:
    """A safetensors slice handle that counts the elements read through it."""

    def __init__(self, source, counter: dict[str, int], name: str) -> None:
        self.source, self.counter, self.name = source, counter, name

    def __getitem__(self, window):
        tensor = self.source[window]
        self.counter[self.name] = self.counter.get(self.name, 0) + tensor.numel()
        return tensor


def experts_checkpoint(path: Path, experts: int, hidden: int, intermediate: int) -> dict[str, torch.Tensor]:
    tensors = {}
    for e in range(experts):
        tensors[f"experts.{e}.w1.weight"] = torch.randn(intermediate, hidden)
        tensors[f"experts.{e}.w3.weight"] = torch.randn(intermediate, hidden)
        tensors[f"experts.{e}.w2.weight"] = torch.randn(hidden, intermediate)
    save_file(tensors, str(path))
    return tensors


def load_rank(path: Path, rank: int, world_size: int, expert_parallel: bool, experts: int, hidden: int,
              intermediate: int, counter: dict[str, int]) -> FusedMoEWeights:
    with override_tensor_parallel(rank, world_size, expert_parallel):
        layer = FusedMoEWeights(experts, hidden, intermediate)
    with safe_open(str(path), framework="pt") as f:
        for name in f.keys():
            expert, shard = int(name.split(".")[1]), name.split(".")[2]
            source = f.get_slice(name)
            param = layer.w2_weight if shard == "w2" else layer.w13_weight
            param.weight_loader(param, CheckpointSlice(CountingSlice(source, counter, name),
                                                       tuple(source.get_shape())), (expert, shard))
    return layer


@pytest.mark.parametrize("expert_parallel", [False, True], ids=["tensor-parallel", "expert-parallel"])
def test_each_rank_loads_and_reads_only_its_share_of_the_experts(tmp_path, expert_parallel):
    experts, hidden, intermediate, world_size = 5, 16, 12, 2
    path = tmp_path / "experts.safetensors"
    full = experts_checkpoint(path, experts, hidden, intermediate)
    read: list[dict[str, int]] = []
    for rank in range(world_size):
        counter: dict[str, int] = {}
        layer = load_rank(path, rank, world_size, expert_parallel, experts, hidden, intermediate, counter)
        layer.process_weights_after_loading()
        read.append(counter)
        if expert_parallel:
            first, count = expert_placement(experts, world_size, rank)
            held, size, start = range(first, first + count), intermediate, 0
            assert layer.expert_map.tolist() == [e - first if e in held else -1 for e in range(experts)]
        else:
            held, size, start = range(experts), intermediate // world_size, rank * intermediate // world_size
            assert layer.expert_map is None
        assert layer.w13_weight.shape == (len(held), 2 * size, hidden)
        for local, e in enumerate(held):
            assert torch.equal(layer.w13_weight[local, :size], full[f"experts.{e}.w1.weight"][start:start + size])
            assert torch.equal(layer.w13_weight[local, size:], full[f"experts.{e}.w3.weight"][start:start + size])
            assert torch.equal(layer.w2_weight[local], full[f"experts.{e}.w2.weight"][:, start:start + size])
        # Bytes read: exactly the share kept, nothing of other ranks' experts or shards.
        assert sum(counter.values()) == layer.w13_weight.numel() + layer.w2_weight.numel()
    assert sum(sum(c.values()) for c in read) == sum(t.numel() for t in full.values())


def test_a_checkpoint_without_some_expert_is_an_error_naming_it(tmp_path):
    path = tmp_path / "experts.safetensors"
    full = experts_checkpoint(path, 3, 16, 8)
    del full["experts.1.w3.weight"]
    save_file(full, str(path))
    layer = load_rank(path, 0, 1, False, 3, 16, 8, {})
    with pytest.raises(ValueError, match="lacks 1 expert tensors of a MoE layer: expert 1 w3"):
        layer.process_weights_after_loading()


def test_expert_parallel_with_fewer_experts_than_ranks_is_an_error_naming_both():
    with override_tensor_parallel(0, 4, expert_parallel=True):
        with pytest.raises(ValueError, match="4 tensor-parallel ranks, but the model has only 3 experts"):
            FusedMoEWeights(3, 16, 8)


def test_a_checkpoint_expert_tensor_of_the_wrong_shape_is_an_error_naming_it():
    layer = FusedMoEWeights(2, 16, 8)
    with pytest.raises(ValueError, match=r"expert 1 w1 has shape \(8, 12\), the model expects \(8, 16\)"):
        layer.w13_weight.weight_loader(layer.w13_weight, torch.zeros(8, 12), (1, "w1"))


def test_the_fused_moe_benchmark_times_every_path_this_machine_has(capsys):
    from raylm.cluster.benchmarks import bench_fused_moe

    bench_fused_moe.main(["--tokens", "3", "--dtypes", "float32", "--rounds", "1", "--sample-s", "0.001"])
    rows = [line.split() for line in capsys.readouterr().out.splitlines() if line.startswith("float32")]
    assert [row[1:6] for row in rows] == [[str(v) for v in (*shape, 3)] for shape in bench_fused_moe.SHAPES]
    expected_paths = 1 + cpu_fused_moe.library_loaded() + avx512_runs(torch.float32)
    assert all(sum(cell != "-" for cell in row[6:]) == expected_paths for row in rows)
