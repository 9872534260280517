"""Paged decode attention benchmark: achieved KV bandwidth against the device's copy bandwidth.

Decode attention reads every cached key and value of every sequence once per step and does
little arithmetic on them, so its speed limit is memory bandwidth. For each (context length,
batch) this times one decode step of one layer (`paged_attention` after the KV write, as the
engine calls it) and reports

    KV bandwidth = bytes of K and V read / time

next to the copy bandwidth the same device reaches in a plain `torch` copy of a large tensor
(bytes read + bytes written / time). The issue's goal is KV bandwidth >= 70% of copy
bandwidth for long-context decode on a GPU.

    python -m raylm.cluster.benchmarks.bench_attention                  # CUDA: triton backend, 1k..32k x 1..256
    python -m raylm.cluster.benchmarks.bench_attention --quick          # CPU smoke test: default backend, small sizes
    python -m raylm.cluster.benchmarks.bench_attention --backend cpu --contexts 192 1024 --batches 1 64 --num-heads 8 --num-kv-heads 4 --head-size 32

Block tables are shuffled permutations of the cache, as after a while of serving. Cases whose
KV cache would not fit in ``--max-kv-gib`` are skipped and listed. The last line printed is
``RESULT {json}``.

``--prefill CASE ...`` times prefill steps instead, each CASE ``SEQSxNEW`` (prompts of NEW
tokens) or ``SEQSxNEW+CACHED`` (NEW tokens after CACHED ones already in the cache, as a chunk
of a chunked prefill or a prompt with a cached prefix), on the backend and on the PyTorch
reference, with the speedup and the backend's causal-attention GFLOP/s:

    python -m raylm.cluster.benchmarks.bench_attention --backend cpu --prefill 4x512 1x128+1900 --num-heads 8 --num-kv-heads 4 --head-size 32

``--sliding-window W`` times a sliding-window layer (Mistral's, Gemma 2's local layers): each
query reads its last W positions only, so past W a decode step's time should stay flat in the
context length. KV bytes then count the keys and values a window reads:

    python -m raylm.cluster.benchmarks.bench_attention --backend cpu --sliding-window 256 --contexts 256 1024 4096 16384 --batches 1 16
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from dataclasses import asdict, dataclass

import torch

from raylm.kernels.attention_metadata import AttentionMetadata
from raylm.kernels import torch_attention
from raylm.kernels.backend import default_backend_name, get_attention_backend

DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}


@dataclass
class DecodeResult:
    context_len: int
    batch: int
    keys_read: int  # per sequence: the context, or the window
    time_us: float
    kv_bytes: int
    kv_gbps: float
    fraction_of_copy: float


@dataclass
class PrefillResult:
    seqs: int
    query_len: int
    cached: int
    time_ms: float
    reference_ms: float
    speedup: float
    gflops: float  # 4 * head_size flops per query head per causal (query, key) pair, per second


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_call(fn, device: torch.device, warmup: int, iters: int) -> float:
    """Median seconds per call: the median shrugs off neighbours on a shared machine."""
    for _ in range(warmup):
        fn()
    _sync(device)
    times = []
    if device.type == "cuda":
        for _ in range(iters):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
    else:
        for _ in range(iters):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def copy_bandwidth(device: torch.device, num_bytes: int, warmup: int, iters: int) -> float:
    """Bytes moved (read + written) per second by `dst.copy_(src)` of a large tensor."""
    src = torch.empty(num_bytes // 2, dtype=torch.float16, device=device).fill_(1.0)
    dst = torch.empty_like(src)
    seconds = time_call(lambda: dst.copy_(src), device, warmup, iters)
    del src, dst
    return 2 * num_bytes / seconds


def build_decode_step(batch: int, context_len: int, num_heads: int, num_kv_heads: int, head_size: int,
                      block_size: int, dtype: torch.dtype, device: torch.device, seed: int = 0):
    """A decode step: every sequence at `context_len`, its blocks scattered over the cache."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    blocks_per_seq = -(-context_len // block_size)
    num_blocks = batch * blocks_per_seq
    k_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_size, dtype=dtype, device=device)
    v_cache = torch.randn_like(k_cache)
    block_tables = torch.randperm(num_blocks, generator=gen).view(batch, blocks_per_seq).to(torch.int32)
    # Each sequence's newest token, the one this step writes.
    last = block_tables[:, (context_len - 1) // block_size].long() * block_size + (context_len - 1) % block_size
    metadata = AttentionMetadata(
        slot_mapping=last.to(device),
        query_start_loc=torch.arange(batch + 1, dtype=torch.int32, device=device),
        seq_lens=torch.full((batch,), context_len, dtype=torch.int32, device=device),
        block_tables=block_tables.to(device),
        max_query_len=1,
        max_seq_len=context_len,
        query_lens_list=[1] * batch,
        seq_lens_list=[context_len] * batch,
    )
    query = torch.randn(batch, num_heads, head_size, dtype=dtype, device=device)
    key = torch.randn(batch, num_kv_heads, head_size, dtype=dtype, device=device)
    value = torch.randn_like(key)
    return query, key, value, k_cache, v_cache, metadata


def parse_prefill_case(text: str) -> tuple[int, int, int]:
    """'4x512' -> (4, 512, 0); '1x128+1900' -> (1, 128, 1900): sequences, new tokens, cached tokens."""
    try:
        seqs, rest = text.split("x")
        new, _, cached = rest.partition("+")
        case = int(seqs), int(new), int(cached or 0)
    except ValueError:
        case = None
    if case is None or case[0] < 1 or case[1] < 1 or case[2] < 0:
        raise argparse.ArgumentTypeError(f"a prefill case is SEQSxNEW or SEQSxNEW+CACHED (e.g. 4x512, 1x128+1900), "
                                         f"got {text!r}")
    return case


def build_prefill_step(seqs: int, query_len: int, cached: int, num_heads: int, num_kv_heads: int, head_size: int,
                       block_size: int, dtype: torch.dtype, device: torch.device, seed: int = 0):
    """A prefill step after its KV write: `seqs` sequences of `query_len` new tokens after
    `cached` ones, their blocks scattered over the cache."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    context_len = cached + query_len
    blocks_per_seq = -(-context_len // block_size)
    num_blocks = seqs * blocks_per_seq
    k_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_size, dtype=dtype, device=device)
    v_cache = torch.randn_like(k_cache)
    block_tables = torch.randperm(num_blocks, generator=gen).view(seqs, blocks_per_seq).to(torch.int32)
    metadata = AttentionMetadata(
        slot_mapping=torch.zeros(seqs * query_len, dtype=torch.int64, device=device),  # unused: already written
        query_start_loc=torch.arange(0, seqs * query_len + 1, query_len, dtype=torch.int32, device=device),
        seq_lens=torch.full((seqs,), context_len, dtype=torch.int32, device=device),
        block_tables=block_tables.to(device),
        max_query_len=query_len,
        max_seq_len=context_len,
        query_lens_list=[query_len] * seqs,
        seq_lens_list=[context_len] * seqs,
    )
    query = torch.randn(seqs * query_len, num_heads, head_size, dtype=dtype, device=device)
    return query, k_cache, v_cache, metadata


def run_prefill(args: argparse.Namespace, backend, dtype: torch.dtype, device: torch.device) -> list[PrefillResult]:
    """Times `paged_attention` on each prefill case, on the backend and on the reference."""
    scale = args.head_size ** -0.5
    window = args.sliding_window
    results = []
    for seqs, query_len, cached in args.prefill:
        query, k_cache, v_cache, md = build_prefill_step(seqs, query_len, cached, args.num_heads, args.num_kv_heads,
                                                         args.head_size, args.block_size, dtype, device)
        seconds = time_call(lambda: backend.paged_attention(query, k_cache, v_cache, md, scale, sliding_window=window),
                            device, args.warmup, args.iters)
        reference = time_call(lambda: torch_attention.paged_attention(query, k_cache, v_cache, md, scale,
                                                                      sliding_window=window),
                              device, args.warmup, args.iters)
        # (query, key) pairs attended: each query at p sees p + 1 keys, or at most the window.
        pairs = seqs * sum(min(p + 1, window or p + 1) for p in range(cached, cached + query_len))
        flops = 4 * args.head_size * args.num_heads * pairs
        results.append(PrefillResult(seqs, query_len, cached, seconds * 1e3, reference * 1e3, reference / seconds,
                                     flops / seconds / 1e9))
    return results


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backend", choices=("triton", "cpu", "torch"), default=None,
                        help="Attention backend; default triton on CUDA, the native cpu kernel on CPU (torch if "
                             "it cannot be built).")
    parser.add_argument("--contexts", type=int, nargs="+", default=[1024, 2048, 4096, 8192, 16384, 32768])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 4, 16, 64, 256])
    parser.add_argument("--num-heads", type=int, default=32)
    parser.add_argument("--num-kv-heads", type=int, default=8)
    parser.add_argument("--head-size", type=int, default=128)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--dtype", choices=tuple(DTYPES), default=None,
                        help="KV cache dtype; default bfloat16 on CUDA, float32 on CPU.")
    parser.add_argument("--max-kv-gib", type=float, default=None,
                        help="Skip cases whose K+V cache exceeds this; default 40%% of GPU memory, 1 GiB on CPU.")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--quick", action="store_true",
                        help="Small sizes for a smoke test on CPU: contexts 256 1024, batches 1 8, 8/2 heads of 64.")
    parser.add_argument("--prefill", type=parse_prefill_case, nargs="+", default=None, metavar="CASE",
                        help="Time prefill steps instead of decode: each CASE SEQSxNEW or SEQSxNEW+CACHED "
                             "(e.g. 4x512 1x128+1900), against the PyTorch reference.")
    parser.add_argument("--sliding-window", type=int, default=None, metavar="W",
                        help="Time a sliding-window layer: each query reads its last W positions only.")
    parser.add_argument("--output-json", default=None, help="Also write the report to this file.")
    # --quick changes the defaults only: sizes given explicitly still win.
    if "--quick" in (sys.argv[1:] if argv is None else argv):
        parser.set_defaults(contexts=[256, 1024], batches=[1, 8], num_heads=8, num_kv_heads=2, head_size=64,
                            warmup=1, iters=3)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    backend_name = args.backend or default_backend_name()
    if backend_name == "triton" and device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError("--backend triton needs a CUDA device (or TRITON_INTERPRET=1, far too slow to "
                         "benchmark); use --backend cpu or torch on CPU.")
    backend = get_attention_backend(backend_name)
    dtype = DTYPES[args.dtype] if args.dtype else (torch.bfloat16 if device.type == "cuda" else torch.float32)
    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu"
    header = (f"device: {device_name} | backend: {backend.name} | dtype: {str(dtype).removeprefix('torch.')} | "
              f"heads {args.num_heads}/{args.num_kv_heads} x {args.head_size} | block size {args.block_size}"
              + (f" | sliding window {args.sliding_window}" if args.sliding_window else ""))
    report = {
        "device": device_name, "backend": backend.name, "dtype": str(dtype).removeprefix("torch."),
        "num_heads": args.num_heads, "num_kv_heads": args.num_kv_heads, "head_size": args.head_size,
        "block_size": args.block_size, "sliding_window": args.sliding_window,
    }
    if args.prefill:
        prefill_results = run_prefill(args, backend, dtype, device)
        print(header + f" | threads {torch.get_num_threads()}")
        print(f"{'seqs':>5} {'new':>6} {'cached':>7} {'time ms':>9} {'torch ms':>9} {'speedup':>8} {'GFLOP/s':>8}")
        for r in prefill_results:
            print(f"{r.seqs:>5} {r.query_len:>6} {r.cached:>7} {r.time_ms:>9.2f} {r.reference_ms:>9.2f} "
                  f"{r.speedup:>7.2f}x {r.gflops:>8.1f}")
        report.update(threads=torch.get_num_threads(), prefill=[asdict(r) for r in prefill_results])
        _write_report(report, args.output_json)
        return report

    if args.max_kv_gib is not None:
        max_kv_bytes = int(args.max_kv_gib * 2**30)
    elif device.type == "cuda":
        max_kv_bytes = int(0.4 * torch.cuda.get_device_properties(device).total_memory)
    else:
        max_kv_bytes = 2**30
    copy_bytes = 2**30 if device.type == "cuda" else 2**26
    copy_bps = copy_bandwidth(device, copy_bytes, args.warmup, args.iters)
    scale = args.head_size ** -0.5
    element = torch.tensor([], dtype=dtype).element_size()

    results: list[DecodeResult] = []
    skipped: list[tuple[int, int]] = []
    window = args.sliding_window
    for context_len in args.contexts:
        for batch in args.batches:
            keys_read = min(context_len, window or context_len)
            kv_bytes = 2 * batch * keys_read * args.num_kv_heads * args.head_size * element
            cache_bytes = 2 * batch * context_len * args.num_kv_heads * args.head_size * element
            if cache_bytes > max_kv_bytes:
                skipped.append((context_len, batch))
                continue
            query, key, value, k_cache, v_cache, md = build_decode_step(
                batch, context_len, args.num_heads, args.num_kv_heads, args.head_size, args.block_size, dtype,
                device)

            def step():
                backend.write_kv_cache(key, value, k_cache, v_cache, md.slot_mapping)
                return backend.paged_attention(query, k_cache, v_cache, md, scale, sliding_window=window)

            seconds = time_call(step, device, args.warmup, args.iters)
            kv_bps = kv_bytes / seconds
            results.append(DecodeResult(context_len, batch, keys_read, seconds * 1e6, kv_bytes, kv_bps / 1e9,
                                        kv_bps / copy_bps))
            del query, key, value, k_cache, v_cache, md
            if device.type == "cuda":
                torch.cuda.empty_cache()

    print(header)
    print(f"copy bandwidth (read + write): {copy_bps / 1e9:.1f} GB/s")
    print(f"{'context':>8} {'batch':>6} {'keys':>7} {'time us':>10} {'KV MB':>9} {'KV GB/s':>9} {'of copy':>8}")
    for r in results:
        print(f"{r.context_len:>8} {r.batch:>6} {r.keys_read:>7} {r.time_us:>10.1f} {r.kv_bytes / 1e6:>9.1f} "
              f"{r.kv_gbps:>9.1f} {r.fraction_of_copy:>8.1%}")
    if skipped:
        print(f"skipped (KV cache over {max_kv_bytes / 2**30:.1f} GiB): "
              + ", ".join(f"{c}x{b}" for c, b in skipped))
    report.update(copy_gbps=copy_bps / 1e9, results=[asdict(r) for r in results],
                  skipped=[list(s) for s in skipped])
    _write_report(report, args.output_json)
    return report


def _write_report(report: dict, output_json: str | None) -> None:
    if output_json:
        with open(output_json, "w") as f:
            json.dump(report, f, indent=2)
    print("RESULT " + json.dumps(report))


if __name__ == "__main__":
    main()
