"""The Triton kernels against the PyTorch reference (raylm.kernels.torch_attention) under
Triton's interpreter, on the CPU. Not collected by the suite: `tests/test_triton_kernels.py`
runs this file in a pytest subprocess with TRITON_INTERPRET=1, which must be set before the
kernels (and triton.language's own @triton.jit helpers) are decorated and would otherwise
make every later test in the process interpret its kernels.

Every case builds fresh random keys and values, scatters them over shuffled physical blocks
of a NaN-poisoned cache, and poisons the output buffer with NaN before the kernel runs, so a
slot read that should not be, or an output element never written, fails the comparison.
Shapes stay small: the interpreter runs every program instance in Python.
"""

from __future__ import annotations

import importlib
import os

import pytest
import torch

from paged_steps import build_cached_step as build_step
from raylm.kernels import torch_attention as reference

if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("runs under TRITON_INTERPRET=1 only (tests/test_triton_kernels.py starts it)", allow_module_level=True)

KERNEL_MODULES = ("raylm.kernels.triton_kv_cache", "raylm.kernels.triton_decode_attention",
                  "raylm.kernels.triton_prefill_attention")
# max |kernel - reference| / max |reference|
TOLERANCE = {torch.float32: 1e-3, torch.float16: 5e-3, torch.bfloat16: 3e-2}


@pytest.fixture(scope="module")
def kernels():
    """The Triton kernel modules, decorated under the interpreter."""
    pytest.importorskip("triton")
    return {name.rsplit(".", 1)[1]: importlib.import_module(name) for name in KERNEL_MODULES}


def relative_error(out: torch.Tensor, expected: torch.Tensor) -> float:
    return ((out.float() - expected.float()).abs().max() / expected.float().abs().max()).item()


def poisoned_like(query: torch.Tensor) -> torch.Tensor:
    return torch.full_like(query, float("nan"))


# ---- KV-cache write ------------------------------------------------------------------------

@pytest.mark.parametrize("block_size,dtype", [(1, torch.float32), (8, torch.float16), (16, torch.bfloat16),
                                              (32, torch.float32)])
def test_write_kv_cache_scatters_like_the_reference_and_skips_padding_slots(kernels, block_size, dtype):
    gen = torch.Generator().manual_seed(block_size)
    num_blocks, num_kv_heads, head_size, num_tokens = 16, 2, 64, 13
    # Keys and values as the attention layer passes them: strided views of a fused QKV output.
    # In the model dtype, as in the engine (the interpreter truncates fp32 -> bf16 casts
    # where a GPU rounds to nearest, so a cast inside the kernel would not compare exactly).
    qkv = torch.randn(num_tokens, 3, num_kv_heads, head_size, generator=gen).to(dtype)
    key, value = qkv[:, 1], qkv[:, 2]
    slot_mapping = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    slot_mapping[[2, 7]] = -1
    k_cache = torch.full((num_blocks, block_size, num_kv_heads, head_size), float("nan"), dtype=dtype)
    v_cache = torch.full_like(k_cache, float("nan"))
    k_expected, v_expected = k_cache.clone(), v_cache.clone()

    kernels["triton_kv_cache"].write_kv_cache(key, value, k_cache, v_cache, slot_mapping)
    reference.write_kv_cache(key, value, k_expected, v_expected, slot_mapping)

    torch.testing.assert_close(k_cache, k_expected, rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(v_cache, v_expected, rtol=0, atol=0, equal_nan=True)


# ---- decode ---------------------------------------------------------------------------------

# (dtype, head_size, num_heads, num_kv_heads, block_size, seq_lens): GQA 1, 2, 4; lengths 1
# to several blocks, mostly not block multiples.
DECODE_CASES = [
    (torch.float32, 64, 4, 4, 16, [1, 17, 64, 150]),
    (torch.float32, 128, 8, 4, 8, [5, 33, 97]),
    (torch.float32, 64, 8, 2, 32, [1, 100, 200]),
    (torch.float16, 128, 4, 1, 16, [3, 48, 129]),
    (torch.float16, 64, 4, 2, 4, [2, 70]),
    (torch.bfloat16, 64, 8, 2, 16, [9, 80]),
    (torch.float32, 80, 6, 2, 16, [20, 75]),  # head size that is not a power of two
]


@pytest.mark.parametrize("dtype,head_size,num_heads,num_kv_heads,block_size,seq_lens", DECODE_CASES)
def test_decode_matches_reference(kernels, dtype, head_size, num_heads, num_kv_heads, block_size, seq_lens):
    query, k_cache, v_cache, md = build_step([1] * len(seq_lens), seq_lens, num_heads=num_heads,
                                             num_kv_heads=num_kv_heads, head_size=head_size,
                                             block_size=block_size, dtype=dtype, seed=len(seq_lens) + head_size)
    scale = head_size ** -0.5
    out = kernels["triton_decode_attention"].paged_decode_attention(
        query, k_cache, v_cache, md, scale, out=poisoned_like(query), num_splits=1)
    expected = reference.paged_attention(query, k_cache, v_cache, md, scale)
    assert out.dtype == dtype
    assert relative_error(out, expected) < TOLERANCE[dtype]


@pytest.mark.parametrize("dtype,num_heads,num_kv_heads,num_splits", [
    (torch.float32, 4, 4, 2), (torch.float32, 8, 2, 4), (torch.float16, 8, 2, 3), (torch.bfloat16, 4, 1, 5)])
def test_split_k_decode_matches_reference_including_sequences_shorter_than_a_partition(
        kernels, dtype, num_heads, num_kv_heads, num_splits):
    # Partitions are 64-token multiples: the 1- and 40-token sequences fill only the first.
    seq_lens = [300, 1, 40, 257]
    query, k_cache, v_cache, md = build_step([1] * 4, seq_lens, num_heads=num_heads, num_kv_heads=num_kv_heads,
                                             head_size=64, block_size=16, dtype=dtype, seed=num_splits)
    out = kernels["triton_decode_attention"].paged_decode_attention(
        query, k_cache, v_cache, md, 0.125, out=poisoned_like(query), num_splits=num_splits)
    expected = reference.paged_attention(query, k_cache, v_cache, md, 0.125)
    assert relative_error(out, expected) < TOLERANCE[dtype]


# Tile and partition boundaries: contexts that end on a whole tile, one past it and one short
# of it, at every BLOCK_N the launcher or the speed check's sweep can pick, single-pass and
# split into 64-token-multiple partitions (a tile never straddles two); window edges mid-tile.
@pytest.mark.parametrize("block_n,num_warps,num_stages", [(16, 4, 5), (32, 4, 7), (64, 8, 3)])
@pytest.mark.parametrize("num_splits", [1, 2, 3])
def test_decode_tiles_end_whole_or_partial_at_every_tile_width_and_split(kernels, block_n, num_warps, num_stages,
                                                                         num_splits):
    seq_lens = [block_n, block_n + 1, 2 * block_n - 1, 64, 65, 128, 129, 191]
    query, k_cache, v_cache, md = build_step([1] * len(seq_lens), seq_lens, num_heads=4, num_kv_heads=2,
                                             head_size=32, block_size=16, dtype=torch.float32,
                                             seed=block_n + num_splits)
    tiles = dict(BLOCK_N=block_n, num_warps=num_warps, num_stages=num_stages)
    out = kernels["triton_decode_attention"].paged_decode_attention(
        query, k_cache, v_cache, md, 0.2, out=poisoned_like(query), num_splits=num_splits, tiles=tiles)
    expected = reference.paged_attention(query, k_cache, v_cache, md, 0.2)
    assert relative_error(out, expected) < 1e-3


def test_decode_tiles_fill_16_kib_a_stage_and_divide_the_partitions(kernels):
    decode = kernels["triton_decode_attention"]
    for dtype, head_size, block_n in ((torch.bfloat16, 64, 64), (torch.bfloat16, 128, 32), (torch.float16, 256, 16),
                                      (torch.float32, 64, 32), (torch.float32, 128, 16), (torch.float32, 256, 16),
                                      (torch.float32, 80, 16)):
        tiles = decode.decode_tiles(dtype, 4, head_size)
        assert tiles["BLOCK_N"] == block_n and decode.PARTITION_ALIGN % block_n == 0
        assert (tiles["num_warps"], tiles["num_stages"]) == (4, 5)
        assert "maxnreg" not in tiles  # slower on an H100 (decode_tiles)
    with pytest.raises(AssertionError):
        decode.complete_decode_tiles(torch.bfloat16, 4, 128, dict(BLOCK_N=48, num_warps=4, num_stages=5))


def test_decode_zeroes_padding_rows_past_the_last_sequence(kernels):
    query, k_cache, v_cache, md = build_step([1, 1], [7, 30], num_heads=4, num_kv_heads=2, head_size=64,
                                             block_size=16, dtype=torch.float32, seed=3, padding_tokens=3)
    out = kernels["triton_decode_attention"].paged_decode_attention(query, k_cache, v_cache, md, 0.125,
                                                                    out=poisoned_like(query))
    expected = reference.paged_attention(query, k_cache, v_cache, md, 0.125)
    assert torch.equal(out[2:], torch.zeros_like(out[2:]))
    assert relative_error(out, expected) < 1e-3


# ---- prefill / extend -----------------------------------------------------------------------

# (dtype, head_size, num_heads, num_kv_heads, block_size, query_lens, seq_lens)
PREFILL_CASES = [
    # Whole prompts.
    (torch.float32, 64, 4, 4, 16, [1, 23, 40], [1, 23, 40]),
    # Chunked prefill / prefix-cache hits: chunks behind cached context.
    (torch.float32, 128, 8, 2, 8, [12, 30], [50, 37]),
    # Mixed batch: decode rows beside prefill chunks.
    (torch.float32, 64, 8, 2, 16, [1, 17, 1, 9], [70, 17, 5, 90]),
    (torch.float16, 64, 4, 1, 16, [33, 1, 5], [33, 100, 77]),
    (torch.float16, 128, 4, 2, 32, [20, 6], [45, 6]),
    (torch.bfloat16, 64, 8, 2, 16, [19, 1], [60, 33]),
]


@pytest.mark.parametrize("dtype,head_size,num_heads,num_kv_heads,block_size,query_lens,seq_lens", PREFILL_CASES)
def test_prefill_matches_reference(kernels, dtype, head_size, num_heads, num_kv_heads, block_size, query_lens,
                                   seq_lens):
    query, k_cache, v_cache, md = build_step(query_lens, seq_lens, num_heads=num_heads, num_kv_heads=num_kv_heads,
                                             head_size=head_size, block_size=block_size, dtype=dtype,
                                             seed=sum(seq_lens))
    scale = head_size ** -0.5
    out = kernels["triton_prefill_attention"].paged_prefill_attention(query, k_cache, v_cache, md, scale,
                                                                      out=poisoned_like(query))
    expected = reference.paged_attention(query, k_cache, v_cache, md, scale)
    assert out.dtype == dtype
    assert relative_error(out, expected) < TOLERANCE[dtype]


# The keys before a program's first query are visible to all its rows: whole tiles of them
# run without any mask; the tiles from there to its last query's key (the diagonal) are
# masked. Tiles forced small so that each program has several of both: chunks behind cached
# context (prefix-cache hits) whose lengths are and are not tile multiples, windows whose
# edge falls inside the unmasked tiles, a soft cap, GQA 1, 3 and 4, decode rows.
# (dtype, BLOCK_M, BLOCK_N, num_heads, num_kv_heads, query_lens, seq_lens, window, soft cap)
UNMASKED_TILE_CASES = [
    (torch.float32, 16, 16, 4, 4, [64, 37, 1], [128, 90, 40], None, None),
    (torch.bfloat16, 32, 16, 8, 2, [48, 21, 1], [112, 21, 64], None, None),
    (torch.float16, 16, 32, 4, 1, [40, 1, 17], [72, 50, 17], 24, None),
    (torch.float32, 64, 16, 8, 2, [33, 5], [97, 5], 40, 3.0),
    (torch.float32, 16, 16, 6, 2, [30, 2], [77, 34], None, 2.0),
]


@pytest.mark.parametrize("dtype,block_m,block_n,num_heads,num_kv_heads,query_lens,seq_lens,window,soft_cap",
                         UNMASKED_TILE_CASES)
def test_prefill_unmasked_and_diagonal_tiles_match_reference(kernels, dtype, block_m, block_n, num_heads,
                                                             num_kv_heads, query_lens, seq_lens, window, soft_cap):
    query, k_cache, v_cache, md = build_step(query_lens, seq_lens, num_heads=num_heads, num_kv_heads=num_kv_heads,
                                             head_size=64, block_size=16, dtype=dtype, seed=sum(seq_lens),
                                             padding_tokens=2, sliding_window=window)
    options = dict(sliding_window=window, logits_soft_cap=soft_cap)
    tiles = dict(BLOCK_M=block_m, BLOCK_N=block_n, num_warps=4, num_stages=3)
    out = kernels["triton_prefill_attention"].paged_prefill_attention(
        query, k_cache, v_cache, md, 0.125, out=poisoned_like(query), tiles=tiles, **options)
    expected = reference.paged_attention(query, k_cache, v_cache, md, 0.125, **options)
    packed = sum(query_lens)
    assert torch.equal(out[packed:], torch.zeros_like(out[packed:]))
    assert relative_error(out[:packed], expected[:packed]) < TOLERANCE[dtype]


def test_prefill_long_chunk_tiles_match_reference_behind_a_prefix_hit(kernels):
    """The tiles a long 16-bit chunk gets (LONG_CHUNK_TILES: 128 rows at head size 128), over
    80 cached tokens (five blocks, not a whole tile) and beside a decode row."""
    prefill = kernels["triton_prefill_attention"]
    assert prefill.prefill_tiles(torch.bfloat16, 4, 128, 70)["BLOCK_M"] == 128
    query, k_cache, v_cache, md = build_step([70, 1], [150, 9], num_heads=8, num_kv_heads=2, head_size=128,
                                             block_size=16, dtype=torch.bfloat16, seed=11)
    out = prefill.paged_prefill_attention(query, k_cache, v_cache, md, 128 ** -0.5, out=poisoned_like(query))
    expected = reference.paged_attention(query, k_cache, v_cache, md, 128 ** -0.5)
    assert relative_error(out, expected) < TOLERANCE[torch.bfloat16]


def test_prefill_zeroes_padding_rows_past_the_last_sequence(kernels):
    query, k_cache, v_cache, md = build_step([5, 1], [12, 20], num_heads=4, num_kv_heads=2, head_size=64,
                                             block_size=16, dtype=torch.float32, seed=4, padding_tokens=2)
    out = kernels["triton_prefill_attention"].paged_prefill_attention(query, k_cache, v_cache, md, 0.125,
                                                                      out=poisoned_like(query))
    expected = reference.paged_attention(query, k_cache, v_cache, md, 0.125)
    assert torch.equal(out[6:], torch.zeros_like(out[6:]))
    assert relative_error(out, expected) < 1e-3


# ---- sliding windows and soft caps ----------------------------------------------------------
# The blocks before each sequence's window point at the NaN block (build_step), as the
# engine's freed blocks point at someone else's: a kernel that loaded one would return NaN.

@pytest.mark.parametrize("dtype,window,soft_cap,num_splits", [
    (torch.float32, 5, None, 1), (torch.float32, 70, None, 1), (torch.float16, 33, 4.0, 1),
    (torch.float32, 130, None, 3), (torch.bfloat16, 100, 2.0, 2)])
def test_windowed_decode_matches_reference_without_loading_blocks_before_the_window(kernels, dtype, window, soft_cap,
                                                                                     num_splits):
    # Windows shorter than a tile, mid-tile, and split over partitions (split-K); sequences
    # shorter than the window too.
    seq_lens = [300, 1, 40, 257]
    query, k_cache, v_cache, md = build_step([1] * 4, seq_lens, num_heads=8, num_kv_heads=2, head_size=64,
                                             block_size=16, dtype=dtype, seed=window, sliding_window=window)
    options = dict(sliding_window=window, logits_soft_cap=soft_cap)
    out = kernels["triton_decode_attention"].paged_decode_attention(
        query, k_cache, v_cache, md, 0.3, out=poisoned_like(query), num_splits=num_splits, **options)
    expected = reference.paged_attention(query, k_cache, v_cache, md, 0.3, **options)
    assert relative_error(out, expected) < TOLERANCE[dtype]


@pytest.mark.parametrize("dtype,window,soft_cap", [
    (torch.float32, 3, None), (torch.float32, 40, None), (torch.float16, 17, 3.0), (torch.float32, None, 2.0)])
def test_windowed_prefill_matches_reference_without_loading_blocks_before_the_window(kernels, dtype, window,
                                                                                      soft_cap):
    # A prompt longer than a tile of queries, a chunk after cached tokens, decode rows.
    query_lens, seq_lens = [90, 12, 1, 1], [90, 75, 50, 3]
    query, k_cache, v_cache, md = build_step(query_lens, seq_lens, num_heads=4, num_kv_heads=2, head_size=64,
                                             block_size=8, dtype=dtype, seed=7, sliding_window=window)
    options = dict(sliding_window=window, logits_soft_cap=soft_cap)
    out = kernels["triton_prefill_attention"].paged_prefill_attention(query, k_cache, v_cache, md, 0.3,
                                                                      out=poisoned_like(query), **options)
    expected = reference.paged_attention(query, k_cache, v_cache, md, 0.3, **options)
    assert relative_error(out, expected) < TOLERANCE[dtype]


def test_triton_backend_runs_a_write_then_attend_step_like_the_torch_backend(kernels):
    from raylm.kernels.backend import get_attention_backend

    triton_backend, torch_backend = get_attention_backend("triton"), get_attention_backend("torch")
    assert (triton_backend.name, torch_backend.name) == ("triton", "torch")
    # A mixed step: write the new tokens through the backend, then attend.
    query, k_cache, v_cache, md = build_step([4, 1], [4, 9], num_heads=4, num_kv_heads=2, head_size=64,
                                             block_size=8, dtype=torch.float32, seed=5)
    block_tables = md.block_tables
    slots = [block_tables[0, t // 8].item() * 8 + t % 8 for t in range(4)] + [block_tables[1, 1].item() * 8]
    md.slot_mapping = torch.tensor(slots)
    key = torch.randn(5, 2, 64)
    value = torch.randn(5, 2, 64)
    results = []
    for backend in (triton_backend, torch_backend):
        k, v = k_cache.clone(), v_cache.clone()
        backend.write_kv_cache(key, value, k, v, md.slot_mapping)
        results.append(backend.paged_attention(query, k, v, md, 0.125))
    assert relative_error(results[0], results[1]) < 1e-3


# ---- end to end -----------------------------------------------------------------------------

def test_llm_with_triton_backend_matches_hf_greedy_tokens(kernels, llama_dir):
    from hf_reference import hf_greedy
    from raylm.engine import LLM, SamplingParams

    prompts = [[5, 17, 300, 42], [9] * 19, list(range(4, 30))]
    # A small budget: the warm-up's full-budget prefill step runs interpreted too.
    llm = LLM(model=str(llama_dir), dtype="float32", max_num_seqs=4, max_model_len=32, max_num_batched_tokens=32,
              attention_backend="triton")
    try:
        layers = llm.llm_engine.executor.driver_worker.model_runner._attention_layers()
        backends = {getattr(getattr(layer, "attn_backend", None), "name", None) for layer in layers}
        if backends != {"triton"}:
            pytest.skip(f"Attention layers do not run the Triton backend yet (found {backends}); "
                        "see kernels/backend.py for the wiring")
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                               SamplingParams(temperature=0.0, max_tokens=4), use_tqdm=False)
    finally:
        llm.shutdown()
    for prompt, output in zip(prompts, outputs):
        assert output.outputs[0].token_ids == hf_greedy(llama_dir, prompt, 4)


# (cache dtype, head size, query heads): at bf16 head size 256 GQA 8 the 64-row tile comes only
# with chunks of 16 queries or more, not BLOCK_M // group = 8.
@pytest.mark.parametrize("dtype,head_size,num_heads", [(torch.float32, 64, 8), (torch.bfloat16, 256, 16)])
def test_warm_up_launches_every_variant_and_writes_nothing(kernels, monkeypatch, dtype, head_size, num_heads):
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
                    launched.append((self.name, kwargs.get("SPLIT_K"), kwargs.get("BLOCK_S"), kwargs.get("BLOCK_M")))
                    return self.kernel[grid](*args, **kwargs)
                return launch

        monkeypatch.setattr(module, name, Recording(kernel, name))
    gen = torch.Generator().manual_seed(0)
    k_cache = torch.randn(4, 16, 2, head_size, generator=gen).to(dtype)
    v_cache = torch.randn(4, 16, 2, head_size, generator=gen).to(dtype)
    before = (k_cache.clone(), v_cache.clone())
    # max_model_len 2048: split counts 2..4 (merges with BLOCK_S 2 and 4).
    backend.launch_every_variant(num_heads, 2, head_size, 0.125, k_cache, v_cache, 2048)
    assert torch.equal(k_cache, before[0]) and torch.equal(v_cache, before[1])
    decodes = {split for name, split, _, _ in launched if name == "_paged_decode_kernel"}
    merges = {block_s for name, _, block_s, _ in launched if name == "_merge_partitions_kernel"}
    prefills = {block_m for name, _, _, block_m in launched if name == "_paged_prefill_kernel"}
    assert decodes == {False, True}
    assert merges == {2, 4}
    assert prefills == set(prefill.block_m_variants(dtype, num_heads // 2, head_size))


def test_speed_checks_prefill_tile_sweep_runs_every_tile_shape_to_the_same_output(kernels):
    """cluster/benchmarks/gpu_speed_check.py's prefill sweep (the device run's choice among
    tile shapes), interpreted on a small shape: every configuration runs, with tiles passed
    through paged_prefill_attention(tiles=), and agrees with the chosen one."""
    from raylm.cluster.benchmarks.gpu_speed_check import PREFILL_TILE_ALTERNATIVES, Shape, prefill_attention_sweep

    shape = Shape(num_heads=4, num_kv_heads=1, head_size=64)  # GQA 4 as the 8B's, one program a query tile
    sweep = prefill_attention_sweep(shape, 80, torch.device("cpu"), PREFILL_TILE_ALTERNATIVES, use_triton=True,
                                    repeats=1, warmup=0)
    assert [case["case"] for case in sweep["cases"]] == ["fresh prompt", "prefix hit"]
    for case in sweep["cases"]:
        assert len(case["configs"]) == 1 + len(PREFILL_TILE_ALTERNATIVES)
        assert all("error" not in row and row["rel_diff_from_chosen"] < TOLERANCE[torch.bfloat16]
                   for row in case["configs"]), case["configs"]
        assert case["chosen"]["tiles"]["BLOCK_M"] == 128


def test_speed_checks_decode_tile_sweep_runs_every_configuration_to_the_same_output(kernels):
    """cluster/benchmarks/gpu_speed_check.py's decode sweep (the device run's choice among
    tile shapes and split counts), interpreted on a small shape: every configuration runs,
    through paged_decode_attention(tiles=, num_splits=), and agrees with the chosen one."""
    from raylm.cluster.benchmarks.gpu_speed_check import DECODE_TILE_ALTERNATIVES, Shape, decode_attention_sweep

    # GQA 4 as the 8B's with one KV head and small batches: each configuration's launch is a
    # few programs (the interpreter runs each in Python), partial tiles at every BLOCK_N.
    shape = Shape(num_heads=4, num_kv_heads=1, head_size=64)
    sweep = decode_attention_sweep(shape, ((2, 100), (1, 130)), torch.device("cpu"), DECODE_TILE_ALTERNATIVES,
                                   copy_bytes_s=1e9, use_triton=True, repeats=1, warmup=0)
    assert [case["case"] for case in sweep["cases"]] == ["batch 2, context 100", "batch 1, context 130"]
    for case in sweep["cases"]:
        assert len(case["configs"]) == 1 + len(DECODE_TILE_ALTERNATIVES)
        assert all("error" not in row and row["rel_diff_from_chosen"] < TOLERANCE[torch.bfloat16]
                   and row["fraction_of_copy"] > 0 for row in case["configs"]), case["configs"]
        assert case["chosen"]["tiles"] == dict(BLOCK_N=64, num_warps=4, num_stages=5)  # head size 64: uncapped
        assert [row["num_splits"] for row in case["configs"]][-1] == 2
        assert case["best"] in case["configs"]
