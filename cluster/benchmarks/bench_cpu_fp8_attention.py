"""CPU decode attention over an fp8 KV cache against a bf16 one: time per layer.

One decode step of `--batch` sequences of `--context` tokens (bf16 queries, shuffled block
tables), one layer after another over `--layers` separate caches as the engine's layers
read theirs (so a layer's blocks are not warm from the layer before), through the CPU
backend's `paged_attention`:

- ``bf16``: a bf16 cache (the reference for speed);
- ``fp8_e4m3`` / ``fp8_e5m2``: fp8 caches read by the native kernels directly.

``--prefill N`` times, instead, one prompt of N tokens per layer (`--batch` is then 1), the
prefill kernel's path.

The modes take turns within each repeat, in one process, so that a loaded machine slows
them alike; the table gives each mode's median and best per-layer time over the repeats
and its ratio to bf16's median. The last line printed is ``RESULT {json}``.

    python -m raylm.cluster.benchmarks.bench_cpu_fp8_attention
    python -m raylm.cluster.benchmarks.bench_cpu_fp8_attention --batch 64 --context 1024 --head-size 128
    python -m raylm.cluster.benchmarks.bench_cpu_fp8_attention --prefill 512
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from collections.abc import Callable

import torch

from raylm.kernels import cpu_attention
from raylm.kernels.attention_metadata import AttentionMetadata
from raylm.kernels.kv_cache_dtype import quantize

FP8_MODES = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}


def attention_step(batch: int, context: int, query_len: int, block_size: int, num_blocks: int,
                   gen: torch.Generator) -> AttentionMetadata:
    """A step of `batch` sequences of `context` tokens, the last query_len of them queries
    (1: decode), at shuffled blocks of a cache of num_blocks."""
    per_seq = -(-context // block_size)
    tables = torch.randperm(num_blocks, generator=gen)[:batch * per_seq].view(batch, per_seq).to(torch.int32)
    return AttentionMetadata(
        slot_mapping=torch.zeros(batch * query_len, dtype=torch.int64),
        query_start_loc=torch.arange(batch + 1, dtype=torch.int32) * query_len,
        seq_lens=torch.full((batch,), context, dtype=torch.int32),
        block_tables=tables, max_query_len=query_len, max_seq_len=context,
        query_lens_list=[query_len] * batch, seq_lens_list=[context] * batch)


def layer_calls(args: argparse.Namespace) -> dict[str, Callable[[], None]]:
    """mode -> a function running one decode step's attention over every layer's cache."""
    gen = torch.Generator().manual_seed(0)
    per_seq = -(-args.context // args.block_size)
    num_blocks = args.batch * per_seq + 8
    shape = (num_blocks, args.block_size, args.num_kv_heads, args.head_size)
    query_len = args.context if args.prefill else 1
    md = attention_step(args.batch, args.context, query_len, args.block_size, num_blocks, gen)
    query = torch.randn(args.batch * query_len, args.num_heads, args.head_size, generator=gen).to(torch.bfloat16)
    scale = 1.0 / math.sqrt(args.head_size)
    k_scale, v_scale = 0.05, 0.02  # not powers of two: fp8 * scale is not exact in bf16
    bf16_layers = [(torch.randn(shape, generator=gen).to(torch.bfloat16),
                    torch.randn(shape, generator=gen).to(torch.bfloat16)) for _ in range(args.layers)]

    def run(layers: list[tuple[torch.Tensor, torch.Tensor]], **scales: float) -> Callable[[], None]:
        def step() -> None:
            for k_cache, v_cache in layers:
                cpu_attention.paged_attention(query, k_cache, v_cache, md, scale, **scales)
        return step

    calls = {"bf16": run(bf16_layers)}
    for mode in args.fp8_modes:
        fp8 = FP8_MODES[mode]
        fp8_layers = [(quantize(k.float(), fp8, k_scale), quantize(v.float(), fp8, v_scale)) for k, v in bf16_layers]
        calls[mode] = run(fp8_layers, k_scale=k_scale, v_scale=v_scale)
    return calls


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--num-heads", type=int, default=8)
    parser.add_argument("--num-kv-heads", type=int, default=2)
    parser.add_argument("--head-size", type=int, default=64)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--layers", type=int, default=8, help="separate caches a step reads, one per layer")
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--prefill", type=int, default=None, metavar="N", help="time a prompt of N tokens instead")
    parser.add_argument("--fp8-modes", nargs="+", choices=tuple(FP8_MODES), default=list(FP8_MODES))
    args = parser.parse_args(argv)
    if args.prefill:
        args.batch, args.context = 1, args.prefill
    if not cpu_attention.is_available():
        raise SystemExit("the native CPU attention kernel cannot be built here")

    calls = layer_calls(args)
    for call in calls.values():  # warm-up: builds, first touches
        call()
    per_layer_us: dict[str, list[float]] = {mode: [] for mode in calls}
    for _ in range(args.repeats):
        for mode, call in calls.items():  # in turns, so that the machine's load falls on all alike
            start = time.perf_counter()
            call()
            per_layer_us[mode].append((time.perf_counter() - start) / args.layers * 1e6)

    base = statistics.median(per_layer_us["bf16"])
    what = f"prefill attention per layer: a prompt of {args.context}" if args.prefill else \
        f"decode attention per layer: {args.batch} sequences x {args.context}"
    print(f"{what} tokens, heads "
          f"{args.num_heads}/{args.num_kv_heads} x {args.head_size}, bf16 queries, {args.layers} layers' caches, "
          f"{torch.get_num_threads()} threads, {args.repeats} alternated repeats")
    print(f"{'cache':<10} {'median us':>10} {'best us':>10} {'x bf16':>8}")
    rows = {}
    for mode, times in per_layer_us.items():
        median = statistics.median(times)
        rows[mode] = {"median_us": round(median, 1), "best_us": round(min(times), 1), "ratio": round(median / base, 2)}
        print(f"{mode:<10} {median:>10.1f} {min(times):>10.1f} {median / base:>8.2f}")
    report = {"config": vars(args), "threads": torch.get_num_threads(), "per_layer": rows}
    print("RESULT " + json.dumps(report))
    return report


if __name__ == "__main__":
    main()
