"""Floors of a throughput workload: times no engine can beat on this machine, each from a
limit measured here, so that an engine's time over each says how far it is from it.

The matmuls counted are those the outputs need: per layer the q/k/v, output, gate/up and
down projections of every prompt token (prefill) and of every generated token (decode),
except that the last layer's query projection, output projection and MLP feed nothing but
the logits, so they count only for the rows whose logits are read (one per prompt, or one
per chunk that samples; its keys and values count for every token); and the LM head once per
sequence per step. raylm runs exactly these (`ForwardContext.output_rows`); an engine that
runs the last layer on every prompt token (vLLM, Hugging Face) does about 1 / num_layers more
prefill GEMM work than the floor counts. The floors:

- GEMMs: those matmuls alone, each shape timed (random tensors, warm caches, nothing else
  running) as `F.linear`, as raylm's oneDNN GEMM on a weight packed once and, for
  decode-sized batches, as raylm's streaming decode kernel (AMX or AVX-512) where it runs
  (`raylm.kernels.cpu_gemm`); the fastest per shape.
- KV reads: decode attention must read every cached key and value of every sequence at
  every step; those bytes at the measured copy bandwidth. On a CPU the same cores do
  both, so `total_s` = GEMMs + KV reads: `baseline seconds / total_s` bounds the speed-up
  over a baseline that any engine can reach here, however little else it does.
- Peak FLOP/s: the same matmuls' FLOPs at the best rate a large square GEMM reaches on
  all threads (the rate the workload's small, skinny GEMMs would reach if they were
  perfect), and at the FMA peak: a register-only loop of the dtype's multiply-add on every
  thread, the machine's limit at the clock it runs (a nominal cores x FLOP/cycle x clock
  needs a clock, and /proc/cpuinfo gives the base one: on a Zen 5 EPYC 2.6 GHz, 35% under
  what the loop ran at; on a Zen 4 the same 2.6 GHz and the assumed two 512-bit FMA ports
  gave 44% over it).
- Memory: every step reads every weight (and decode its KV); those bytes at the copy
  bandwidth (a streaming copy of a buffer far larger than the caches). Weights that fit
  in the last-level cache can be read faster; the printout says when they do.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

# The FMA peak's loop: iterations of 16 instructions per thread (~40-80 ms on a 2-core
# Zen 4/5 EPYC), best of FMA_PEAK_RUNS.
FMA_PEAK_ITERATIONS = 10_000_000
FMA_PEAK_RUNS = 3
# Square GEMM sizes tried for the peak; a larger one only while a call stays short.
PEAK_GEMM_SIZES = (1024, 2048, 4096)
PEAK_GEMM_MAX_CALL_S = 0.25
COPY_BYTES = 2**30


# ---------------------------------------------------------------------------- counts

def linear_shapes(model_config: dict) -> list[tuple[int, int]]:
    """(in_features, out_features) of one decoder layer's projections, Llama layout."""
    hidden = model_config["hidden_size"]
    num_heads = model_config["num_attention_heads"]
    num_kv_heads = model_config.get("num_key_value_heads") or num_heads
    head_dim = model_config.get("head_dim") or hidden // num_heads
    intermediate = model_config["intermediate_size"]
    return [(hidden, (num_heads + 2 * num_kv_heads) * head_dim), (num_heads * head_dim, hidden),
            (hidden, 2 * intermediate), (intermediate, hidden)]


def prefill_batches(prompt_lens: list[int], max_num_batched_tokens: int) -> list[list[int]]:
    """The prompts of each prefill step when whole prompts are packed first come, first
    served into steps of at most max_num_batched_tokens tokens (as raylm's scheduler does)."""
    batches: list[list[int]] = [[]]
    for length in prompt_lens:
        if batches[-1] and sum(batches[-1]) + length > max_num_batched_tokens:
            batches.append([])
        batches[-1].append(length)
    return [b for b in batches if b]


def workload_matmuls(model_config: dict, prompt_lens: list[int], output_len: int,
                     max_num_batched_tokens: int) -> tuple[Counter, Counter]:
    """How many times each (rows, in, out) matmul runs in the workload's prefill steps and
    in its decode steps: every layer's projections on every token, but in the last layer the
    query projection, the output projection and the MLP only on the rows whose logits are
    read (its keys and values still on every token), as raylm runs them."""
    layers = model_config["num_hidden_layers"]
    hidden = model_config["hidden_size"]
    lm_head = (hidden, model_config["vocab_size"])
    num_heads = model_config["num_attention_heads"]
    q_size = num_heads * (model_config.get("head_dim") or hidden // num_heads)

    def step(counts: Counter, num_tokens: int, num_logit_rows: int) -> None:
        qkv, *after_attention = linear_shapes(model_config)
        if num_logit_rows < num_tokens:  # the last layer's q and k/v projections apart
            counts[(num_tokens, *qkv)] += layers - 1
            counts[(num_tokens, hidden, qkv[1] - q_size)] += 1
            counts[(num_logit_rows, hidden, q_size)] += 1
        else:
            counts[(num_tokens, *qkv)] += layers
        for in_features, out_features in after_attention:
            counts[(num_tokens, in_features, out_features)] += layers - 1
            counts[(num_logit_rows, in_features, out_features)] += 1
        counts[(num_logit_rows, *lm_head)] += 1

    prefill: Counter = Counter()
    for batch in prefill_batches(prompt_lens, max_num_batched_tokens):
        step(prefill, sum(batch), len(batch))
    decode: Counter = Counter()
    for _ in range(output_len - 1):  # the prefill step draws each request's first token
        step(decode, len(prompt_lens), len(prompt_lens))
    return prefill, decode


def matmul_flops(counts: Counter) -> int:
    """FLOPs of the matmuls `workload_matmuls` counted: a multiply and an add per weight
    element per row."""
    return sum(2 * rows * in_features * out_features * n for (rows, in_features, out_features), n in counts.items())


def weight_bytes_per_step(model_config: dict, element_size: int) -> int:
    """Bytes of linear weights, every layer's projections and the LM head, that one step
    reads (each once)."""
    per_layer = sum(in_features * out_features for in_features, out_features in linear_shapes(model_config))
    lm_head = model_config["hidden_size"] * model_config["vocab_size"]
    return (per_layer * model_config["num_hidden_layers"] + lm_head) * element_size


def weight_bytes_read(model_config: dict, prompt_lens: list[int], output_len: int, max_num_batched_tokens: int,
                      element_size: int) -> int:
    """Bytes of linear weights that the workload's steps read: one step per prefill batch
    and output_len - 1 decode steps."""
    steps = len(prefill_batches(prompt_lens, max_num_batched_tokens)) + output_len - 1
    return steps * weight_bytes_per_step(model_config, element_size)


def kv_bytes_read(model_config: dict, prompt_lens: list[int], output_len: int, element_size: int) -> int:
    """Bytes of K and V that decode attention reads over the workload: decode step i
    (1 .. output_len - 1) feeds a sequence's i-th generated token, which attends to the
    prompt and the i generated tokens, in every layer."""
    num_heads = model_config["num_attention_heads"]
    num_kv_heads = model_config.get("num_key_value_heads") or num_heads
    head_dim = model_config.get("head_dim") or model_config["hidden_size"] // num_heads
    per_token = 2 * num_kv_heads * head_dim * element_size * model_config["num_hidden_layers"]
    tokens = sum(length + step for length in prompt_lens for step in range(1, output_len))
    return tokens * per_token


# ---------------------------------------------------------------------------- timings

def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _best_seconds(call: Callable[[], object], device: str, min_seconds: float) -> float:
    """Seconds per call, warm, at its fastest. On a CPU the fastest single call of at least
    five over about min_seconds: a floor is what the machine can do, and on a shared one a
    call that another process preempts one OpenMP thread of (every thread then waits for it)
    can take a thousand times longer. On a GPU the best of five synchronized batches."""
    call()
    _sync(device)
    if device == "cpu":
        best, calls, deadline = float("inf"), 0, time.perf_counter() + min_seconds
        while calls < 5 or time.perf_counter() < deadline:
            start = time.perf_counter()
            call()
            best = min(best, time.perf_counter() - start)
            calls += 1
        return best
    start, calls = time.perf_counter(), 0
    while time.perf_counter() - start < min_seconds / 5:
        call()
        calls += 1
    _sync(device)
    calls = max(1, calls)
    best = float("inf")
    for _ in range(5):
        _sync(device)
        start = time.perf_counter()
        for _ in range(calls):
            call()
        _sync(device)
        best = min(best, (time.perf_counter() - start) / calls)
    return best


def packed_gemm_available(dtype: torch.dtype, device: str) -> bool:
    """Whether raylm's packed oneDNN GEMM can run this dtype here (it may be emulated: bf16
    on a CPU without bf16 instructions)."""
    return device == "cpu" and dtype in (torch.float32, torch.bfloat16) and torch.backends.mkldnn.is_available()


def time_matmul(rows: int, in_features: int, out_features: int, dtype: torch.dtype, device: str,
                min_seconds: float = 0.05, packed: bool = False, decode: bool = False) -> float:
    """Seconds per [rows, in] by [out, in] matmul, warm: `F.linear`, or with packed=True
    raylm's oneDNN GEMM on the weight packed once (`raylm.kernels.cpu_gemm.cpu_linear`), or
    with decode=True raylm's streaming decode kernel (`cpu_gemm.pack_streaming_weight`):
    infinite where that kernel does not run here or takes fewer rows."""
    x = torch.randn(rows, in_features, dtype=dtype, device=device)
    weight = torch.randn(out_features, in_features, dtype=dtype, device=device)
    with torch.inference_mode():
        if decode:
            from raylm.kernels.cpu_gemm import pack_streaming_weight

            streaming = pack_streaming_weight(weight)
            if streaming is None or not streaming.takes(rows):
                return float("inf")
            return _best_seconds(lambda: streaming.op(x, streaming.packed, out_features, None), device, min_seconds)
        if packed:
            from raylm.kernels.cpu_gemm import cpu_linear, pack_linear_weight

            packed_weight = pack_linear_weight(weight)
            return _best_seconds(lambda: cpu_linear(x, packed_weight, None), device, min_seconds)
        return _best_seconds(lambda: F.linear(x, weight), device, min_seconds)


def matmul_floor_seconds(model_config: dict, prompt_lens: list[int], output_len: int,
                         max_num_batched_tokens: int, dtype: torch.dtype, device: str) -> dict:
    """The workload's matmul time in seconds, prefill and decode, each shape at the fastest
    of `F.linear`, the packed GEMM and (decode-sized) the streaming decode kernel; and the
    whole workload with `F.linear` and the packed GEMM alone."""
    prefill, decode = workload_matmuls(model_config, prompt_lens, output_len, max_num_batched_tokens)
    shapes = prefill | decode
    f_linear = {shape: time_matmul(*shape, dtype=dtype, device=device) for shape in shapes}
    packed = ({shape: time_matmul(*shape, dtype=dtype, device=device, packed=True) for shape in shapes}
              if packed_gemm_available(dtype, device) else None)
    streamed = {shape: time_matmul(*shape, dtype=dtype, device=device, decode=True) for shape in shapes}
    best = {shape: min([f_linear[shape], streamed[shape]] + ([packed[shape]] if packed else [])) for shape in shapes}

    def total(per_call: dict, counts: Counter) -> float:
        return sum(per_call[shape] * n for shape, n in counts.items())

    return dict(total_s=total(best, prefill) + total(best, decode), prefill_s=total(best, prefill),
                decode_s=total(best, decode), f_linear_s=total(f_linear, prefill + decode),
                packed_s=total(packed, prefill + decode) if packed else None)


def peak_gemm(dtype: torch.dtype, device: str) -> dict:
    """The best FLOP/s of a large square GEMM on all threads, `F.linear` or the packed GEMM
    (oneDNN: AMX or AVX512-BF16 for bf16 where the CPU has them), over PEAK_GEMM_SIZES."""
    kernels = ["F.linear"] + (["oneDNN packed"] if packed_gemm_available(dtype, device) else [])
    best = dict(flops_per_s=0.0, n=None, kernel=None)
    for n in PEAK_GEMM_SIZES:
        slowest = 0.0
        for kernel in kernels:
            seconds = time_matmul(n, n, n, dtype, device, min_seconds=0.0, packed=kernel != "F.linear")
            slowest = max(slowest, seconds)
            if 2 * n**3 / seconds > best["flops_per_s"]:
                best = dict(flops_per_s=2 * n**3 / seconds, n=n, kernel=kernel)
        if slowest > PEAK_GEMM_MAX_CALL_S:
            break
    return best


def fma_peak_flops(dtype: torch.dtype, device: str) -> tuple[float, str] | None:
    """The CPU's measured peak FLOP/s for dtype on the threads torch uses, and its basis: the
    best of FMA_PEAK_RUNS runs of a register-only loop of the dtype's widest multiply-add on
    every thread (`torch.ops.raylm.cpu_peak_flops`, `kernels/csrc/cpu_peak_flops.cpp`), at
    the clock the cores run it at. None off the CPU, where the kernel cannot be built, or
    where this build has no such instruction for dtype."""
    from raylm.kernels.native_build import load_native_library

    if device != "cpu" or load_native_library("cpu_peak_flops") is None:
        return None
    instruction = torch.ops.raylm.cpu_peak_flops_instruction(dtype)
    if not instruction:
        return None
    flops = max(torch.ops.raylm.cpu_peak_flops(dtype, FMA_PEAK_ITERATIONS) for _ in range(FMA_PEAK_RUNS))
    threads = torch.get_num_threads()
    return flops, f"{threads} thread{'s' if threads > 1 else ''} x a register-only loop of {instruction}"


def last_level_cache_bytes() -> int | None:
    """Size of the CPU's last-level cache as Linux reports it (a VM may report its host's),
    or None where unknown."""
    caches = {}
    for index in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*"):
        try:
            level, size = int((index / "level").read_text()), (index / "size").read_text().strip()
        except (OSError, ValueError):
            continue
        scale = {"K": 2**10, "M": 2**20, "G": 2**30}.get(size[-1:], 1)
        if size.rstrip("KMG").isdigit():
            caches[level] = int(size.rstrip("KMG")) * scale
    return caches[max(caches)] if caches else None


def copy_bandwidth(device: str, num_bytes: int | None = None) -> float:
    """Bytes per second a streaming copy moves (read plus written, as STREAM counts them),
    from a buffer far larger than the caches (COPY_BYTES), on all threads."""
    num_bytes = num_bytes or COPY_BYTES
    src = torch.ones(num_bytes // 4, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    return 2 * num_bytes / _best_seconds(lambda: dst.copy_(src), device, min_seconds=0.0)


# ---------------------------------------------------------------------------- floors

def workload_floors(model_config: dict, prompt_lens: list[int], output_len: int, max_num_batched_tokens: int,
                    dtype: torch.dtype, device: str) -> dict:
    """Every floor of the workload in seconds, with the counts and measured rates behind
    them; `total_s` is the GEMM floor plus the KV-read floor."""
    element_size = torch.tensor([], dtype=dtype).element_size()
    matmuls = matmul_floor_seconds(model_config, prompt_lens, output_len, max_num_batched_tokens, dtype, device)
    prefill, decode = workload_matmuls(model_config, prompt_lens, output_len, max_num_batched_tokens)
    flops = matmul_flops(prefill + decode)
    peak = peak_gemm(dtype, device)
    fma_peak = fma_peak_flops(dtype, device)
    kv_bytes = kv_bytes_read(model_config, prompt_lens, output_len, element_size)
    weight_bytes = weight_bytes_read(model_config, prompt_lens, output_len, max_num_batched_tokens, element_size)
    bandwidth = copy_bandwidth(device)
    return dict(
        dtype=str(dtype).removeprefix("torch."), threads=torch.get_num_threads() if device == "cpu" else None,
        matmul_s=matmuls["total_s"], matmul_prefill_s=matmuls["prefill_s"], matmul_decode_s=matmuls["decode_s"],
        matmul_f_linear_s=matmuls["f_linear_s"], matmul_packed_s=matmuls["packed_s"],
        matmul_flops=flops, matmul_gflops_per_s=flops / matmuls["total_s"] / 1e9,
        kv_read_s=kv_bytes / bandwidth, kv_bytes=kv_bytes, copy_gbps=bandwidth / 1e9,
        total_s=matmuls["total_s"] + kv_bytes / bandwidth,
        peak_flops_s=flops / peak["flops_per_s"], peak_gflops_per_s=peak["flops_per_s"] / 1e9,
        peak_gemm_n=peak["n"], peak_gemm_kernel=peak["kernel"],
        fma_peak_gflops_per_s=fma_peak[0] / 1e9 if fma_peak else None,
        fma_peak_basis=fma_peak[1] if fma_peak else None,
        fma_peak_flops_s=flops / fma_peak[0] if fma_peak else None,
        weight_bytes=weight_bytes, memory_s=(weight_bytes + kv_bytes) / bandwidth,
        weight_bytes_per_step=weight_bytes_per_step(model_config, element_size),
        last_level_cache_bytes=last_level_cache_bytes() if device == "cpu" else None,
    )


def floor_lines(floors: dict, seconds: float | None, name: str = "raylm") -> list[str]:
    """The floors as printed lines, each with `seconds / floor` where an engine's time is
    given."""
    def over(floor_s: float | None) -> str:
        return f"   {name} {seconds / floor_s:.1f}x" if seconds is not None and floor_s else ""

    f = floors
    kernels = f"F.linear {f['matmul_f_linear_s']:.3f} s" + (
        f", oneDNN packed {f['matmul_packed_s']:.3f} s" if f["matmul_packed_s"] is not None else "")
    threads = f", {f['threads']} thread{'s' if f['threads'] > 1 else ''}" if f["threads"] else ""
    lines = [
        f"floors ({f['dtype']}{threads})" + (f", and {name}'s time over each:" if seconds is not None else ":"),
        f"  GEMMs, best kernel per shape   {f['matmul_s']:.3f} s (prefill {f['matmul_prefill_s']:.3f}, decode "
        f"{f['matmul_decode_s']:.3f}; {kernels}; {f['matmul_gflops_per_s']:.1f} GFLOP/s){over(f['matmul_s'])}",
        f"  + KV reads at copy bandwidth   {f['kv_read_s']:.3f} s ({f['kv_bytes'] / 1e9:.2f} GB at "
        f"{f['copy_gbps']:.1f} GB/s)",
        f"  = GEMMs + KV reads             {f['total_s']:.3f} s{over(f['total_s'])}",
        f"  GEMM FLOPs at measured peak    {f['peak_flops_s']:.3f} s ({f['matmul_flops'] / 1e9:.1f} GFLOP at "
        f"{f['peak_gflops_per_s']:.0f} GFLOP/s, {f['peak_gemm_n']}^2 {f['peak_gemm_kernel']}){over(f['peak_flops_s'])}",
    ]
    if f["fma_peak_flops_s"] is not None:
        lines.append(f"  GEMM FLOPs at the FMA peak     {f['fma_peak_flops_s']:.3f} s "
                     f"({f['fma_peak_gflops_per_s']:.0f} GFLOP/s: {f['fma_peak_basis']})"
                     f"{over(f['fma_peak_flops_s'])}")
    lines.append(f"  weight + KV bytes at copy bw   {f['memory_s']:.3f} s ({f['weight_bytes'] / 1e9:.2f} GB weights + "
                 f"{f['kv_bytes'] / 1e9:.2f} GB KV at {f['copy_gbps']:.1f} GB/s){over(f['memory_s'])}")
    cache = f["last_level_cache_bytes"]
    if cache and f["weight_bytes_per_step"] <= cache:
        lines.append(f"    (a step's {f['weight_bytes_per_step'] / 2**20:.0f} MiB of weights fit in the "
                     f"{cache / 2**20:.0f} MiB last-level cache: steps may read them faster than that)")
    return lines
