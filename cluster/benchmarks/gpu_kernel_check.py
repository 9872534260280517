"""Stage a of `scripts/gpu_check.sh`: the Triton attention kernels, compiled natively,
against the PyTorch reference computed in fp32; and the fused pointwise kernels (RMSNorm
with the residual add, SiLU-and-mul, rotary embedding: `gpu_elementwise_check.py`).

Every case draws fresh random keys and values into shuffled physical blocks of a
NaN-poisoned cache (block tables padded with a poisoned block) and poisons the output
buffer, so a stray read or an unwritten output shows. The configurations cover bf16, fp16
and fp32, head sizes 64, 128 and 256 and GQA ratios 1, 4 and 8 as an orthogonal array
(each pair of values appears once: 9 configurations, not 27, to fit the device's
minutes); each runs decode with and without split-K, prefill/extend (whole prompts,
chunks behind cached context, decode rows mixed in) and the KV write, at contexts of 1 to
32k tokens and batches of 1 to 256 (smaller with --dry-run, under the interpreter).

It also reports the registers, spills and shared memory of every compiled variant
(`launched_resources`, from the kernels Triton compiled in this process), and, without a
GPU, compiles a variant for sm_90a and reads the same from the cubin
(`compile_resources`, used by the tests).

    python -m raylm.cluster.benchmarks.gpu_kernel_check --out a.json [--part 0/3] [--dry-run]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

# (dtype, head size, GQA ratio): an orthogonal array of strength 2 over the three factors.
CONFIGS = [
    (torch.bfloat16, 64, 1), (torch.bfloat16, 128, 4), (torch.bfloat16, 256, 8),
    (torch.float16, 64, 4), (torch.float16, 128, 8), (torch.float16, 256, 1),
    (torch.float32, 64, 8), (torch.float32, 128, 1), (torch.float32, 256, 4),
]
# One per dtype, GQA 1, 4 and 8 (head size 64: the interpreter's cost grows with it).
DRY_CONFIGS = [CONFIGS[0], CONFIGS[3], CONFIGS[6]]
NUM_KV_HEADS = 2
BLOCK_SIZE = 16
# max |kernel - reference| / max |reference|, the reference in fp32 on the same inputs.
TOLERANCE = {torch.float32: 1e-3, torch.float16: 5e-3, torch.bfloat16: 3e-2}
DTYPE_NAMES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}
# Triton's names of the fp8 cache dtypes (kv_cache_dtype fp8_e4m3 and fp8_e5m2).
FP8_POINTERS = {torch.float8_e4m3fn: "fp8e4nv", torch.float8_e5m2: "fp8e5"}
# The KV writes (the KV write kernel, the rotary kernel's fused write) store an fp8 cache's
# bytes through a uint8 view of it (`triton_paged_kv.fp8_encode`).
FP8_WRITE_POINTER = "u8"

# (name, [(query_len, seq_len)] per sequence or a generator spec, forced split count)
# Decode: (batch, longest context, num_splits or None for the dispatcher's choice).
GPU_DECODE = [(1, 32768, None), (1, 32768, 1), (4, 8192, None), (64, 4096, 8), (64, 4096, 1), (256, 512, None)]
DRY_DECODE = [(1, 200, None), (1, 200, 1), (3, 130, 3)]
# Prefill/extend: (name, query lengths, context lengths); "random:B:Q:C" draws B sequences
# of 1..Q new tokens behind 0..C cached ones.
GPU_PREFILL = [("whole prompts", [1, 100, 1000, 2048], [1, 100, 1000, 2048]),
               ("chunks behind context", [64, 300, 17], [32768, 4396, 8000]),
               ("decode rows mixed in", [1, 200, 1, 37, 1], [5000, 200, 1, 2000, 31]),
               ("batch 256", "random:256:8:1024", None)]
# Sliding-window, soft-capped layers (Mistral's 4k window, Gemma 2's window and cap):
# (window, soft cap, decode contexts, prefill query lengths, prefill contexts).
GPU_WINDOWED = [(4096, None, [1, 3000, 8192, 32768], [1, 2048, 300], [5000, 2048, 9000]),
                (4096, 50.0, [1, 3000, 8192], [2048, 1], [2048, 8000])]
DRY_WINDOWED = [(37, None, [1, 30, 130], [20, 1], [40, 90]), (37, 5.0, [1, 130], [12, 1], [60, 90])]
# Layers with attention sinks (gpt-oss: alternating 128-token windows and full attention):
# (window, decode contexts, decode split count, prefill query lengths, prefill contexts).
GPU_SINKS = [(128, [1, 100, 3000], 1, [1, 500, 64], [1, 500, 4000]),
             (None, [1, 3000, 8192], 1, [2048, 1], [2048, 7000]), (None, [8192], 8, [], [])]
DRY_SINKS = [(37, [1, 30, 130], 1, [20, 1], [40, 90]), (None, [200], 3, [12, 1], [60, 90])]
# The dry run's query lengths are short: an interpreted prefill costs per query tile, and
# tests/test_triton_kernels.py checks the kernels' numbers under the interpreter already.
DRY_PREFILL = [("whole prompts", [1, 9, 20], [1, 9, 20]),
               ("chunks behind context", [5, 12], [50, 37]),
               ("decode rows mixed in", [1, 7, 1, 4], [70, 7, 5, 90])]


@dataclass
class PagedStep:
    query: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    metadata: object  # AttentionMetadata


def build_step(query_lens: list[int], seq_lens: list[int], num_heads: int, head_size: int, dtype: torch.dtype,
               device: torch.device, generator: torch.Generator, padding_tokens: int = 0) -> PagedStep:
    """A step whose context is already in the cache: every sequence's tokens at shuffled
    blocks of a NaN cache; block tables padded with a block nothing was written to."""
    from raylm.kernels.attention_metadata import AttentionMetadata

    blocks_needed = [-(-s // BLOCK_SIZE) for s in seq_lens]
    num_blocks = sum(blocks_needed) + 2
    shape = (num_blocks, BLOCK_SIZE, NUM_KV_HEADS, head_size)
    k_cache = torch.full(shape, float("nan"), dtype=dtype, device=device)
    v_cache = torch.full(shape, float("nan"), dtype=dtype, device=device)
    order = torch.randperm(num_blocks, generator=generator).to(device)
    poisoned = order[-1].item()
    width = max(blocks_needed) + 1
    block_tables = torch.full((len(seq_lens), width), poisoned, dtype=torch.int32, device=device)
    start = 0
    for i, (seq_len, n) in enumerate(zip(seq_lens, blocks_needed)):
        blocks = order[start:start + n]
        start += n
        block_tables[i, :n] = blocks.to(torch.int32)
        positions = torch.arange(seq_len, device=device)
        slots = blocks[positions // BLOCK_SIZE] * BLOCK_SIZE + positions % BLOCK_SIZE
        for cache in (k_cache, v_cache):
            values = torch.randn(seq_len, NUM_KV_HEADS, head_size, generator=generator).to(device, dtype)
            cache.view(-1, NUM_KV_HEADS, head_size)[slots] = values
    num_tokens = sum(query_lens) + padding_tokens
    query = torch.randn(num_tokens, num_heads, head_size, generator=generator).to(device, dtype)
    starts = [0]
    for n in query_lens:
        starts.append(starts[-1] + n)
    metadata = AttentionMetadata(
        slot_mapping=torch.zeros(num_tokens, dtype=torch.long, device=device),
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        block_tables=block_tables, max_query_len=max(query_lens), max_seq_len=max(seq_lens),
        query_lens_list=list(query_lens), seq_lens_list=list(seq_lens))
    return PagedStep(query, k_cache, v_cache, metadata)


def reference_attention(step: PagedStep, scale: float, **layer) -> torch.Tensor:
    """The PyTorch reference on fp32 copies of the same inputs (`layer`: a sliding window,
    a soft cap and sinks, as the kernels take them)."""
    from raylm.kernels import torch_attention

    return torch_attention.paged_attention(step.query.float(), step.k_cache.float(), step.v_cache.float(),
                                           step.metadata, scale, **layer)


def relative_error(out: torch.Tensor, expected: torch.Tensor) -> float:
    """max |out - expected| / max |expected|; inf if out holds a NaN where expected does not."""
    difference = (out.float() - expected.float()).abs()
    if torch.isnan(difference).any():
        return float("inf")
    return (difference.max() / expected.float().abs().max()).item()


def _lengths(spec, generator: torch.Generator) -> tuple[list[int], list[int]]:
    _, batch, max_query, max_context = spec.split(":")
    query = torch.randint(1, int(max_query) + 1, (int(batch),), generator=generator).tolist()
    context = torch.randint(0, int(max_context) + 1, (int(batch),), generator=generator).tolist()
    return query, [q + c for q, c in zip(query, context)]


def check_config(dtype: torch.dtype, head_size: int, group: int, device: torch.device, dry_run: bool,
                 seed: int) -> list[dict]:
    """Every case of one configuration; one record per case."""
    from raylm.kernels import torch_attention, triton_decode_attention, triton_kv_cache, triton_prefill_attention

    generator = torch.Generator().manual_seed(seed)
    num_heads = NUM_KV_HEADS * group
    scale = head_size ** -0.5
    config = dict(dtype=DTYPE_NAMES[dtype], head_size=head_size, gqa=group)
    records = []

    def record(kernel: str, case: str, error: float, extra: dict | None = None) -> None:
        records.append(dict(config, kernel=kernel, case=case, rel_error=error, tolerance=TOLERANCE[dtype],
                            passed=error <= TOLERANCE[dtype], **(extra or {})))

    # KV write: strided views of a fused QKV output, two padding slots; exact.
    num_tokens = 13 if dry_run else 3000
    qkv = torch.randn(num_tokens, 3, NUM_KV_HEADS, head_size, generator=generator).to(device, dtype)
    num_slots = 64 * BLOCK_SIZE if dry_run else 4096 * BLOCK_SIZE
    slots = torch.randperm(num_slots, generator=generator)[:num_tokens].to(device)
    slots[[2, 7]] = -1
    caches = [torch.full((num_slots // BLOCK_SIZE, BLOCK_SIZE, NUM_KV_HEADS, head_size), float("nan"), dtype=dtype,
                         device=device) for _ in range(4)]
    triton_kv_cache.write_kv_cache(qkv[:, 1], qkv[:, 2], caches[0], caches[1], slots)
    torch_attention.write_kv_cache(qkv[:, 1], qkv[:, 2], caches[2], caches[3], slots)
    exact = all(torch.equal(a.nan_to_num(7.0), b.nan_to_num(7.0)) for a, b in ((caches[0], caches[2]),
                                                                              (caches[1], caches[3])))
    record("kv_write", f"{num_tokens} tokens", 0.0 if exact else float("inf"))
    del caches, qkv

    for batch, max_context, num_splits in (DRY_DECODE if dry_run else GPU_DECODE):
        # The shortest and the longest context, the rest drawn between.
        seq_lens = ([max_context] if batch == 1 else
                    [1] + torch.randint(1, max_context + 1, (batch - 2,), generator=generator).tolist() + [max_context])
        step = build_step([1] * batch, seq_lens, num_heads, head_size, dtype, device, generator, padding_tokens=2)
        out = torch.full_like(step.query, float("nan"))
        triton_decode_attention.paged_decode_attention(step.query, step.k_cache, step.v_cache, step.metadata, scale,
                                                       out=out, num_splits=num_splits)
        expected = reference_attention(step, scale)
        padding_zero = bool((out[batch:] == 0).all())
        chosen = num_splits or triton_decode_attention.choose_num_splits(
            batch, NUM_KV_HEADS, max(seq_lens), triton_decode_attention._num_sms(device))
        splits = triton_decode_attention.partition(max(seq_lens), chosen)[1]
        label = f"{splits} split(s)" + (" (the dispatcher's choice)" if num_splits is None else "")
        record("decode" if splits == 1 else "decode_split_k", f"batch {batch}, contexts up to {max_context}, {label}",
               relative_error(out[:batch], expected[:batch]) if padding_zero else float("inf"))
        del step, out, expected

    for window, soft_cap, decode_lens, query_lens, seq_lens in (DRY_WINDOWED if dry_run else GPU_WINDOWED):
        layer = dict(sliding_window=window, logits_soft_cap=soft_cap)
        what = f"window {window}" + (f", soft cap {soft_cap}" if soft_cap else "")
        for kernel, q_lens, s_lens in (("decode", [1] * len(decode_lens), decode_lens),
                                       ("prefill", query_lens, seq_lens)):
            step = build_step(q_lens, s_lens, num_heads, head_size, dtype, device, generator, padding_tokens=2)
            out = torch.full_like(step.query, float("nan"))
            launch = (triton_decode_attention.paged_decode_attention if kernel == "decode"
                      else triton_prefill_attention.paged_prefill_attention)
            launch(step.query, step.k_cache, step.v_cache, step.metadata, scale, out=out, **layer)
            expected = reference_attention(step, scale, **layer)
            packed = sum(q_lens)
            padding_zero = bool((out[packed:] == 0).all())
            record(kernel, f"{what}: contexts up to {max(s_lens)}",
                   relative_error(out[:packed], expected[:packed]) if padding_zero else float("inf"))
            del step, out, expected

    for name, query_lens, seq_lens in (DRY_PREFILL if dry_run else GPU_PREFILL):
        if isinstance(query_lens, str):
            query_lens, seq_lens = _lengths(query_lens, generator)
        step = build_step(query_lens, seq_lens, num_heads, head_size, dtype, device, generator, padding_tokens=2)
        out = torch.full_like(step.query, float("nan"))
        triton_prefill_attention.paged_prefill_attention(step.query, step.k_cache, step.v_cache, step.metadata,
                                                         scale, out=out)
        expected = reference_attention(step, scale)
        packed = sum(query_lens)
        padding_zero = bool((out[packed:] == 0).all())
        record("prefill", f"{name}: {len(query_lens)} sequences, chunks up to {max(query_lens)}, contexts up to "
               f"{max(seq_lens)}", relative_error(out[:packed], expected[:packed]) if padding_zero else float("inf"))
        del step, out, expected

    # Attention sinks: each head's sink a logit of its own in the softmax (split-K: added once,
    # by the merge).
    for window, decode_lens, num_splits, query_lens, seq_lens in (DRY_SINKS if dry_run else GPU_SINKS):
        layer = dict(sliding_window=window, sinks=(torch.randn(num_heads, generator=generator) * 2).to(device))
        what = "sinks" + (f", window {window}" if window else "")
        cases = [("decode", [1] * len(decode_lens), decode_lens, num_splits)]
        if query_lens:
            cases.append(("prefill", query_lens, seq_lens, None))
        for kernel, q_lens, s_lens, splits in cases:
            step = build_step(q_lens, s_lens, num_heads, head_size, dtype, device, generator, padding_tokens=2)
            out = torch.full_like(step.query, float("nan"))
            if kernel == "decode":
                triton_decode_attention.paged_decode_attention(step.query, step.k_cache, step.v_cache, step.metadata,
                                                               scale, out=out, num_splits=splits, **layer)
                kernel = "decode" if splits == 1 else "decode_split_k"
            else:
                triton_prefill_attention.paged_prefill_attention(step.query, step.k_cache, step.v_cache,
                                                                 step.metadata, scale, out=out, **layer)
            expected = reference_attention(step, scale, **layer)
            packed = sum(q_lens)
            padding_zero = bool((out[packed:] == 0).all())
            record(kernel, f"{what}: contexts up to {max(s_lens)}" + (f", {splits} splits" if splits else ""),
                   relative_error(out[:packed], expected[:packed]) if padding_zero else float("inf"))
            del step, out, expected
    try:
        records += check_fp8_cache(dtype, head_size, group, device, dry_run, generator)
    except Exception as error:  # recorded as a failed check; the stage's other records stand
        record("kv_write", f"fp8 cache ({FP8_FORMATS[dtype]}): {type(error).__name__}: {error}", float("inf"))
    return records


# The fp8 cache format checked beside each model dtype (kv_cache_dtype "fp8_e4m3" / "fp8_e5m2").
FP8_FORMATS = {torch.bfloat16: "fp8_e4m3", torch.float16: "fp8_e5m2", torch.float32: "fp8_e4m3"}


def fp8_write_mismatches(qkv: torch.Tensor, slots: torch.Tensor, caches: tuple[torch.Tensor, torch.Tensor],
                         expected: list[torch.Tensor], scales: tuple[float, float], shown: int = 8) -> dict:
    """Where an fp8 KV write differs from the reference: how many bytes, and the first few as
    (input value, input / scale in fp32, written and expected values), to tell a rounding
    boundary from a subnormal or a saturation case on the device."""
    mismatches, examples = 0, []
    for which, (cache, reference, scale) in enumerate(zip(caches, expected, scales)):
        written = cache.view(torch.uint8).view(-1, *qkv.shape[2:])
        wanted = reference.view(-1, *qkv.shape[2:])
        differs = written != wanted
        mismatches += int(differs.sum())
        for slot, head, column in differs.nonzero().tolist()[:shown - len(examples)]:
            token = int((slots == slot).nonzero()[0, 0]) if (slots == slot).any() else None
            value = float(qkv[token, 1 + which, head, column]) if token is not None else None
            examples.append(dict(cache="kv"[which], input=value, scaled=None if value is None else value / scale,
                                 written=float(cache.view(-1, *qkv.shape[2:])[slot, head, column].float()),
                                 expected=float(reference.view(cache.dtype).view(-1, *qkv.shape[2:])[
                                     slot, head, column].float())))
    return dict(mismatched_bytes=mismatches, mismatch_examples=examples)


def check_fp8_cache(dtype: torch.dtype, head_size: int, group: int, device: torch.device, dry_run: bool,
                    generator: torch.Generator) -> list[dict]:
    """The KV write, decode (one pass and split-K) and prefill/extend over an fp8 cache of
    FP8_FORMATS[dtype] with scales that saturate a few per cent of the values: the write
    bit-exact against PyTorch's saturated cast (`kv_cache_dtype.quantize`), attention
    against the fp32 reference over the cache's values times the scales. Records carry
    `kv_cache_dtype`."""
    from raylm.kernels import torch_attention, triton_decode_attention, triton_kv_cache, triton_prefill_attention
    from raylm.kernels.kv_cache_dtype import dequantize, kv_cache_torch_dtype, quantize

    name = FP8_FORMATS[dtype]
    fp8 = kv_cache_torch_dtype(name, dtype)
    limit = torch.finfo(fp8).max
    k_scale, v_scale = 2.0 / limit, 3.0 / limit  # |x| > 2 (keys), > 3 (values) saturates
    num_heads, scale = NUM_KV_HEADS * group, head_size ** -0.5
    config = dict(dtype=DTYPE_NAMES[dtype], head_size=head_size, gqa=group, kv_cache_dtype=name)
    records = []

    def record(kernel: str, case: str, error: float, **details) -> None:
        records.append(dict(config, kernel=kernel, case=f"{name} cache: {case}", rel_error=error,
                            tolerance=TOLERANCE[dtype], passed=error <= TOLERANCE[dtype], **details))

    num_tokens = 13 if dry_run else 3000
    num_slots = 64 * BLOCK_SIZE if dry_run else 4096 * BLOCK_SIZE
    qkv = torch.randn(num_tokens, 3, NUM_KV_HEADS, head_size, generator=generator).to(device, dtype)
    slots = torch.randperm(num_slots, generator=generator)[:num_tokens].to(device)
    slots[[2, 7]] = -1
    shape = (num_slots // BLOCK_SIZE, BLOCK_SIZE, NUM_KV_HEADS, head_size)
    k_cache = torch.full(shape, float("nan"), device=device).to(fp8)
    v_cache = torch.full(shape, float("nan"), device=device).to(fp8)
    expected = [k_cache.view(torch.uint8).clone(), v_cache.view(torch.uint8).clone()]
    triton_kv_cache.write_kv_cache(qkv[:, 1], qkv[:, 2], k_cache, v_cache, slots, k_scale=k_scale, v_scale=v_scale)
    stored = slots >= 0
    for cache, index, cache_scale in ((expected[0], 1, k_scale), (expected[1], 2, v_scale)):
        cache.view(-1, NUM_KV_HEADS, head_size)[slots[stored]] = quantize(qkv[stored, index], fp8,
                                                                         cache_scale).view(torch.uint8)
    exact = torch.equal(k_cache.view(torch.uint8), expected[0]) and torch.equal(v_cache.view(torch.uint8), expected[1])
    record("kv_write", f"{num_tokens} tokens", 0.0 if exact else float("inf"),
           **({} if exact else fp8_write_mismatches(qkv, slots, (k_cache, v_cache), expected, (k_scale, v_scale))))
    del qkv, k_cache, v_cache, expected

    decode = DRY_DECODE if dry_run else GPU_DECODE
    prefill = DRY_PREFILL if dry_run else GPU_PREFILL
    cases = [("decode", batch, [1] * batch, None, splits) for batch, _, splits in (decode[0], decode[-1])]
    cases += [("prefill", None, query_lens, seq_lens, None) for _, query_lens, seq_lens in prefill[1:3]]
    for index, (kernel, batch, query_lens, seq_lens, num_splits) in enumerate(cases):
        if kernel == "decode":
            max_context = (decode[0] if index == 0 else decode[-1])[1]
            seq_lens = ([max_context] if batch == 1 else
                        [1] + torch.randint(1, max_context + 1, (batch - 2,), generator=generator).tolist()
                        + [max_context])
        step = build_step(query_lens, seq_lens, num_heads, head_size, torch.float32, device, generator,
                          padding_tokens=2)
        query = step.query.to(dtype)
        k_cache, v_cache = quantize(step.k_cache, fp8, k_scale), quantize(step.v_cache, fp8, v_scale)
        out = torch.full_like(query, float("nan"))
        if kernel == "decode":
            triton_decode_attention.paged_decode_attention(query, k_cache, v_cache, step.metadata, scale, out=out,
                                                           num_splits=num_splits, k_scale=k_scale, v_scale=v_scale)
            splits = triton_decode_attention.partition(max(seq_lens), num_splits or triton_decode_attention
                                                       .choose_num_splits(batch, NUM_KV_HEADS, max(seq_lens),
                                                                          triton_decode_attention._num_sms(device)))[1]
            kernel = "decode" if splits == 1 else "decode_split_k"
        else:
            triton_prefill_attention.paged_prefill_attention(query, k_cache, v_cache, step.metadata, scale, out=out,
                                                             k_scale=k_scale, v_scale=v_scale)
        reference = torch_attention.paged_attention(query.float(), dequantize(k_cache, k_scale),
                                                    dequantize(v_cache, v_scale), step.metadata, scale)
        packed = sum(query_lens)
        padding_zero = bool((out[packed:] == 0).all())
        record(kernel, f"{len(query_lens)} sequences, chunks up to {max(query_lens)}, contexts up to {max(seq_lens)}",
               relative_error(out[:packed], reference[:packed]) if padding_zero else float("inf"))
        del step, query, k_cache, v_cache, out, reference
    return records


# ---- resources ------------------------------------------------------------------------

def kernel_functions() -> dict[str, object]:
    from raylm.kernels import triton_decode_attention as decode
    from raylm.kernels import triton_elementwise as elementwise
    from raylm.kernels import triton_kv_cache as kv
    from raylm.kernels import triton_prefill_attention as prefill

    return {"decode": decode._paged_decode_kernel, "merge": decode._merge_partitions_kernel,
            "prefill": prefill._paged_prefill_kernel, "kv_write": kv._write_kv_cache_kernel,
            "rms_norm": elementwise._rms_norm_kernel, "silu_and_mul": elementwise._silu_and_mul_kernel,
            "rotary_embedding": elementwise._rotary_embedding_kernel}


def compiled_kernels(function) -> list:
    """The variants Triton has compiled of a @triton.jit function in this process (none
    under the interpreter)."""
    kernels = []
    for entry in getattr(function, "device_caches", {}).values():
        cache = entry[0] if isinstance(entry, tuple) else entry
        kernels.extend(kernel for kernel in cache.values() if hasattr(kernel, "metadata"))
    return kernels


def count_compiled_variants() -> int:
    """How many variants of raylm's Triton kernels (attention and the fused pointwise ops)
    Triton has compiled in this process."""
    return sum(len(compiled_kernels(function)) for function in kernel_functions().values())


def launched_resources() -> list[dict]:
    """Registers, spilled bytes and shared memory of every compiled variant; for the KV
    writes (the KV write kernel, the rotary kernel with its fused write) also the PTX's
    divisions and fp8 conversions (`ptx_arithmetic`), which decide whether an fp8 cache's
    bytes equal PyTorch's."""
    rows = []
    for name, function in kernel_functions().items():
        for kernel in compiled_kernels(function):
            metadata = kernel.metadata
            row = dict(kernel=name, num_warps=getattr(metadata, "num_warps", None),
                       num_stages=getattr(metadata, "num_stages", None),
                       registers=getattr(kernel, "n_regs", None), spills=getattr(kernel, "n_spills", None),
                       shared_bytes=getattr(metadata, "shared", None))
            if name in ("kv_write", "rotary_embedding") and "ptx" in getattr(kernel, "asm", {}):
                row.update(ptx_arithmetic(kernel.asm["ptx"]))
            rows.append(row)
    return rows


@dataclass
class Variant:
    """One compiled form of a kernel: what its launcher passes as constexprs."""

    name: str
    kernel: object
    constexprs: dict
    num_warps: int
    pointer_dtype: str
    num_stages: int = 3  # Triton's default on CUDA
    fp_fusion: bool = True  # Triton's enable_fp_fusion (FMA contraction)
    max_registers: int | None = None  # Triton's maxnreg
    cache_pointer_dtype: str | None = None  # the KV cache's, where not pointer_dtype (fp8)


def launch_variants(dtype: torch.dtype, group: int, head_size: int, max_model_len: int = 8192,
                    sliding_window: int = 0, soft_cap: float = 0.0,
                    kv_cache_dtype: torch.dtype | None = None, sinks: bool = False) -> list[Variant]:
    """The variants a run with this model dtype, GQA ratio and head size launches (the
    launchers' own tile choices): decode with and without split-K, each merge, each prefill
    BLOCK_M, the KV write; for a layer with this sliding window and soft cap (0: none), over
    a cache of kv_cache_dtype (an fp8 dtype; None: the model's), with attention sinks or not."""
    from raylm.kernels import triton_decode_attention as decode
    from raylm.kernels import triton_prefill_attention as prefill
    from raylm.kernels.kv_cache_dtype import triton_fp8_format

    functions = kernel_functions()
    pointer = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}[dtype]
    cache_pointer = FP8_POINTERS.get(kv_cache_dtype)
    fp8 = triton_fp8_format(kv_cache_dtype or dtype)
    shape = dict(NUM_QUERIES_PER_KV=group, HEAD_SIZE=head_size, BLOCK_SIZE=BLOCK_SIZE,
                 SLIDING_WINDOW=sliding_window, SOFT_CAP=float(soft_cap), KV_FP8=fp8["KV_FP8"], HAS_SINKS=sinks)
    variants = []
    tiles = decode.decode_tiles(dtype, group, head_size)
    warps, stages, max_registers = tiles.pop("num_warps"), tiles.pop("num_stages"), tiles.pop("maxnreg", None)
    for split in (False, True):
        variants.append(Variant("decode_split_k" if split else "decode", functions["decode"],
                                dict(shape, **tiles, SPLIT_K=split), warps, pointer, stages,
                                max_registers=max_registers, cache_pointer_dtype=cache_pointer))
    block_d = max(16, 1 << (head_size - 1).bit_length())
    for block_s in sorted({decode.merge_block_s(n) for n in decode.possible_split_counts(max_model_len)}):
        variants.append(Variant(f"merge BLOCK_S={block_s}", functions["merge"],
                                dict(HEAD_SIZE=head_size, BLOCK_D=block_d, BLOCK_S=block_s,
                                     SLIDING_WINDOW=sliding_window, HAS_SINKS=sinks), 4, pointer))
    for query_len in prefill.variant_query_lens(dtype, group, head_size).values():
        tiles = prefill.prefill_tiles(dtype, group, head_size, query_len)
        variants.append(prefill_variant(tiles, shape, pointer, cache_pointer))
    variants.append(Variant("kv_write", functions["kv_write"],
                            dict(HEAD_SIZE=head_size, BLOCK_SIZE=BLOCK_SIZE, BLOCK_D=block_d, **fp8), 4, pointer,
                            cache_pointer_dtype=FP8_WRITE_POINTER if cache_pointer else None))
    return variants


def prefill_variant(tiles: dict, shape: dict, pointer_dtype: str, cache_pointer_dtype: str | None = None) -> Variant:
    """The prefill kernel compiled with these launch options (prefill_tiles' or
    complete_tiles' dict) for a layer's shape constexprs."""
    tiles = dict(tiles)
    warps, stages = tiles.pop("num_warps"), tiles.pop("num_stages")
    name = f"prefill BLOCK_M={tiles['BLOCK_M']} BLOCK_N={tiles['BLOCK_N']} warps={warps} stages={stages}"
    return Variant(name, kernel_functions()["prefill"], dict(shape, **tiles), warps, pointer_dtype, stages,
                   cache_pointer_dtype=cache_pointer_dtype)


def elementwise_variants(dtype: torch.dtype, hidden_size: int, intermediate_size: int, head_size: int,
                         rotary_dim: int) -> list[Variant]:
    """The variants of the fused pointwise kernels a model of these sizes launches: the
    norm with and without the residual add (Llama's weight; Gemma's 1 + weight is one more
    of each), SiLU-and-mul, the rotary embedding (launch choices of kernels/triton_elementwise.py)."""
    from raylm.kernels import triton_elementwise as elementwise
    from raylm.kernels.kv_cache_dtype import triton_fp8_format

    functions = kernel_functions()
    pointer = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}[dtype]
    norm = elementwise.norm_tiles(hidden_size)
    norm_warps = norm.pop("num_warps")
    variants = [Variant(f"rms_norm{' + residual' if residual else ''} H={hidden_size}", functions["rms_norm"],
                        dict(norm, HAS_RESIDUAL=residual, WEIGHT_OFFSET=False), norm_warps, pointer)
                for residual in (False, True)]
    variants.append(Variant(f"silu_and_mul d={intermediate_size}", functions["silu_and_mul"],
                            dict(BLOCK=elementwise.SILU_BLOCK), 4, pointer))
    rotary = elementwise.rotary_tiles(rotary_dim)
    rotary_warps, fp_fusion = rotary.pop("num_warps"), rotary.pop("enable_fp_fusion")
    rest = head_size - rotary_dim
    block_d = 1 << (head_size - 1).bit_length()
    # Plain (queries and keys alone), with the KV-cache write (the attention layers' call on
    # CUDA), and with Qwen3's q/k norms too.
    for qk_norm, cache in ((False, False), (False, True), (True, True)):
        reads_rest = rest > 0 and (qk_norm or cache)
        name = (f"rotary_embedding D={head_size} rotary={rotary_dim}" + (" + q/k norm" if qk_norm else "")
                + (" + kv cache" if cache else ""))
        variants.append(Variant(name, functions["rotary_embedding"],
                                dict(rotary, HEAD_SIZE=head_size, QK_NORM=qk_norm,
                                     BLOCK_REST=(1 << (rest - 1).bit_length()) if reads_rest else 0,
                                     CACHE_BLOCK_SIZE=BLOCK_SIZE if cache else 0, BLOCK_D=block_d,
                                     **triton_fp8_format(dtype)),
                                rotary_warps, pointer, fp_fusion=fp_fusion))
    return variants


# Arguments the launchers pass that are not 16-aligned pointers or multiples of 16 in the
# engine's layouts (a layer's KV head count; the block-table stride, never specialised).
UNALIGNED_ARGS = {"qk_scale", "k_scale", "v_scale", "stride_bt", "num_kv_heads", "partition_size", "stride_pl_seq",
                  "stride_pl_head"}


def compile_resources(variant: Variant, capability: int = 90, aligned: bool = True) -> dict:
    """Compiles a variant ahead of time for a GPU of this compute capability (no GPU
    needed) with the ptxas Triton ships, and reads registers, stack frame (spills) and
    shared memory: from cuobjdump's resource report and Triton's metadata (`compile_variant`)."""
    import triton

    compiled = compile_variant(variant, capability, aligned)
    cuobjdump = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
        cubin.write(compiled.asm["cubin"])
        cubin.flush()
        report = subprocess.run([str(cuobjdump), "--dump-resource-usage", cubin.name], capture_output=True,
                                text=True, check=True).stdout
    fields = dict(item.split(":", 1) for item in next(line for line in report.splitlines() if "REG:" in line).split())
    return dict(kernel=variant.name, num_warps=variant.num_warps, num_stages=variant.num_stages,
                registers=int(fields["REG"]),
                stack_bytes=int(fields["STACK"]), local_bytes=int(fields["LOCAL"]),
                shared_bytes=compiled.metadata.shared)


def compile_variant(variant: Variant, capability: int = 90, aligned: bool = True):
    """The variant compiled ahead of time for a GPU of this compute capability, no GPU
    needed (Triton's CompiledKernel: asm["ptx"], asm["cubin"], metadata).

    aligned: as a launch on the engine's tensors compiles it. Triton specialises every
    pointer argument that is 16-byte aligned and every integer divisible by 16 (torch's
    allocations; the strides of [tokens, heads, head size] layouts whose head size is a
    multiple of 16): only then can it prove a K/V row contiguous and aligned, load it in
    16-byte vectors and pipeline it through shared memory (cp.async). Compiled without
    that knowledge the prefill kernel loads 2-byte scalars and needs twice the registers."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    ptr = "*" + variant.pointer_dtype
    cache_ptr = "*" + (variant.cache_pointer_dtype or variant.pointer_dtype)
    types = dict(query_ptr=ptr, k_cache_ptr=cache_ptr, v_cache_ptr=cache_ptr, out_ptr=ptr, key_ptr=ptr, value_ptr=ptr,
                 block_tables_ptr="*i32", seq_lens_ptr="*i32", query_start_loc_ptr="*i32", partial_out_ptr="*fp32",
                 partial_lse_ptr="*fp32", sinks_ptr="*fp32", slot_mapping_ptr="*i64", qk_scale="fp32", k_scale="fp32", v_scale="fp32",
                 x_ptr=ptr, residual_ptr=ptr,
                 weight_ptr=ptr, cos_sin_cache_ptr=ptr, positions_ptr="*i64", eps="fp32", q_norm_ptr=ptr,
                 k_norm_ptr=ptr)
    kernel = variant.kernel
    signature = {name: "constexpr" if name in variant.constexprs else types.get(name, "i32")
                 for name in kernel.arg_names}
    attrs = {(index,): [["tt.divisibility", 16]] for index, name in enumerate(kernel.arg_names)
             if aligned and signature[name] != "constexpr" and name not in UNALIGNED_ARGS}
    compiled = triton.compile(ASTSource(fn=kernel, signature=signature, constexprs=variant.constexprs, attrs=attrs),
                              target=GPUTarget("cuda", capability, 32),
                              options={"num_warps": variant.num_warps, "num_stages": variant.num_stages,
                                       "enable_fp_fusion": variant.fp_fusion,
                                       **({"maxnreg": variant.max_registers} if variant.max_registers else {})})
    return compiled


def ptx_arithmetic(ptx: str) -> dict:
    """What a kernel's PTX divides and converts to fp8 with: its fp32 division instructions
    (div.rn.f32 is IEEE's; div.full.f32 and div.approx.f32 are not) and its conversions to
    an fp8 type (cvt.*.e4m3x2 / e5m2x2), each instruction once. The fp8 KV writes must show
    div.rn.f32 and no fp8 conversion (`triton_paged_kv.fp8_encode`)."""
    return dict(divisions=sorted(set(re.findall(r"\bdiv\.[a-z0-9.]*f32\b", ptx))),
                fp8_conversions=sorted(set(re.findall(r"\bcvt\.[a-z0-9.]*\.e[45]m[23]x2\.[a-z0-9]+\b", ptx))))


# ---- command line ----------------------------------------------------------------------

def interpreter_problem(triton_version: str, numpy_version: str) -> str | None:
    """Why Triton's interpreter cannot run the kernels with these versions, or None.

    Before Triton 3.7 the interpreter turns a scalar into a Python int with int() on a
    one-element NumPy array, which NumPy 2.4 made an error, so every kernel whose loop
    bounds are loaded values (all of ours) fails with "only 0-dimensional arrays can be
    converted to Python scalars" (triton-lang/triton#9171). The device image pairs Triton
    3.6 with NumPy 2.5: its native run never meets this, only a dry run there would."""
    def release(version: str) -> tuple[int, ...]:
        return tuple(int(part) for part in re.findall(r"\d+", version)[:2])

    if release(triton_version) < (3, 7) and release(numpy_version) >= (2, 4):
        return (f"--dry-run runs the kernels under Triton's interpreter, which triton {triton_version} cannot do "
                f"with numpy {numpy_version}: it needs numpy < 2.4 or triton >= 3.7")
    return None


def run(out: Path, dry_run: bool, part: tuple[int, int]) -> dict:
    """Runs this part's configurations, rewriting `out` after each one (a stage cut off
    by its timeout keeps what it finished)."""
    index, parts = part
    device = torch.device("cpu" if dry_run else "cuda")
    # The dry run: one configuration per dtype, as the interpreter runs every program in Python.
    configs = (DRY_CONFIGS if dry_run else CONFIGS)[index::parts]
    result: dict = {"records": [], "resources": [], "seconds": {}}
    for config_index, (dtype, head_size, group) in enumerate(configs):
        start = time.perf_counter()
        result["records"] += check_config(dtype, head_size, group, device, dry_run, seed=index * 100 + config_index)
        result["seconds"][f"{DTYPE_NAMES[dtype]} d{head_size} gqa{group}"] = round(time.perf_counter() - start, 1)
        result["resources"] = launched_resources()
        out.write_text(json.dumps(result, indent=1))
    # The fused pointwise kernels: one dtype a part (bf16, fp16, fp32 for parts 0, 1, 2 of 3).
    from raylm.cluster.benchmarks.gpu_elementwise_check import check_elementwise

    for dtype in list(DTYPE_NAMES)[::-1][index::parts]:
        start = time.perf_counter()
        result["records"] += check_elementwise(dtype, device, dry_run)
        result["seconds"][f"{DTYPE_NAMES[dtype]} pointwise ops"] = round(time.perf_counter() - start, 1)
        result["resources"] = launched_resources()
        out.write_text(json.dumps(result, indent=1))
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--dry-run", action="store_true", help="CPU, Triton's interpreter, tiny shapes")
    parser.add_argument("--part", default="0/1", help="i/n: run every n-th configuration from the i-th")
    args = parser.parse_args(argv)
    if args.dry_run and os.environ.get("TRITON_INTERPRET") != "1":
        parser.error("--dry-run needs TRITON_INTERPRET=1 in the environment (set before the kernels are imported)")
    if args.dry_run:
        import numpy
        import triton

        problem = interpreter_problem(triton.__version__, numpy.__version__)
        if problem:
            parser.error(problem)
    index, parts = (int(x) for x in args.part.split("/"))
    run(args.out, args.dry_run, (index, parts))
    return 0


if __name__ == "__main__":
    sys.exit(main())
