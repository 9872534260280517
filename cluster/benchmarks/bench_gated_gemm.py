"""The gated gate_up GEMM (SiLU-and-mul in the streaming kernel's epilogue:
`cpu_gemm.maybe_pack_silu_and_mul_weight`) against the pair it replaces, the same kernel's
plain GEMM then `silu_and_mul`, on this machine's streaming kernel (AVX-512, else AVX2).

`--per-call`: the ~100M Llama's gate_up shape ([2 x 2816, 1024]) at 1/4/16/64 rows, fp32 and
bf16, on one thread, each call after a write over twice the last-level cache (a decode step
finds its weights cold), timed in thread CPU time (a shared machine's other work does not
count), the two alternating; fastest and median of `--repeats` calls each.

`--decode`: decode tokens/s of the ~100M Llama (random weights, its shape) with the gated
copies against without them (RAYLM_TEST_DISABLE_KERNELS=silu_and_mul_linear, the layers
repacked), alternating run by run in one engine, as bench_fused_decode does: the fastest of
`--repeats` runs of each mode, a run's prefill (a max_tokens=1 run beside it) taken off, in
wall time and in the process's CPU time (all its threads: what a shared machine's other work
does not inflate). fp32 takes the gated copy only at the probe sizes where it timed faster at
load; `--force-gated` seeds that timing as faster everywhere, to compare the kernels as such.

    python -m raylm.cluster.benchmarks.bench_gated_gemm --per-call --decode --force-gated

The last line printed is ``RESULT {json}``.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

HIDDEN, INTERMEDIATE = 1024, 2816  # the ~100M Llama's
ROWS = (1, 4, 16, 64)


def _thread_seconds(call: Callable[[], object], evict: torch.Tensor) -> float:
    evict.add_(1)
    start = time.thread_time()
    call()
    return time.thread_time() - start


def per_call(dtype: torch.dtype, repeats: int) -> dict[str, dict[str, float]]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _per_call(dtype, repeats)
    finally:
        torch.set_num_threads(threads)


def _per_call(dtype: torch.dtype, repeats: int) -> dict[str, dict[str, float]]:
    from raylm.kernels import cpu_gemm, native_build

    if native_build.load_native_library("cpu_ops") is None:  # silu_and_mul
        raise SystemExit("the fused CPU ops cannot be built here")

    gen = torch.Generator().manual_seed(0)
    weight = (torch.randn(2 * INTERMEDIATE, HIDDEN, generator=gen) / HIDDEN ** 0.5).to(dtype)
    kernel = cpu_gemm.gated_kernel(dtype)
    plain = cpu_gemm.pack_streaming_weight(weight)
    if kernel is None or plain is None:
        raise SystemExit(f"no streaming kernel for {dtype} here")
    pack, op, _, _ = kernel
    gated = pack(weight)
    evict = torch.empty(2 * cpu_gemm.last_level_cache_bytes(), dtype=torch.uint8)
    results = {}
    with torch.inference_mode():
        for rows in ROWS:
            x = torch.randn(rows, HIDDEN, generator=gen).to(dtype)
            calls = {"fused": lambda: op(x, gated, INTERMEDIATE),
                     "pair": lambda: torch.ops.raylm.silu_and_mul(plain.op(x, plain.packed, 2 * INTERMEDIATE, None))}
            assert torch.equal(calls["fused"](), calls["pair"]())  # d = 2816 is whole vectors
            times: dict[str, list[float]] = {name: [] for name in calls}
            for repeat in range(repeats):
                for name in (("fused", "pair") if repeat % 2 == 0 else ("pair", "fused")):
                    times[name].append(_thread_seconds(calls[name], evict))
            results[str(rows)] = {
                **{f"{name}_fastest_us": round(min(t) * 1e6, 1) for name, t in times.items()},
                **{f"{name}_median_us": round(statistics.median(t) * 1e6, 1) for name, t in times.items()},
                "speedup_fastest": round(min(times["pair"]) / min(times["fused"]), 3),
                "speedup_median": round(statistics.median(times["pair"]) / statistics.median(times["fused"]), 3)}
            print(f"{dtype} {rows} rows: {results[str(rows)]}", flush=True)
    return results


def decode(dtype: str, batch_size: int, input_len: int, output_len: int, repeats: int,
           force_gated: bool) -> dict[str, float]:
    from raylm.cluster.benchmarks.bench_fused_decode import build_model
    from raylm.engine import LLM, SamplingParams, envs
    from raylm.kernels import cpu_gemm
    from raylm.parallel.linear import MergedColumnParallelLinear

    if force_gated:
        cpu_gemm._fp32_silu_and_mul_slower_at[(2 * INTERMEDIATE, HIDDEN)] = frozenset()

    rng = random.Random(0)
    prompts = [{"prompt_token_ids": [rng.randrange(3, 4096) for _ in range(input_len)]} for _ in range(batch_size)]
    with tempfile.TemporaryDirectory() as tmp:
        llm = LLM(model=str(build_model(Path(tmp) / "llama", "llama")), dtype=dtype, skip_tokenizer_init=True,
                  enable_prefix_caching=False, max_model_len=512, max_num_seqs=batch_size)
        model = llm.llm_engine.executor.driver_worker.model_runner.model
        gate_ups = [m for m in model.modules() if isinstance(m, MergedColumnParallelLinear) and m.silu_and_mul_follows]

        def use_gated(on: bool) -> None:
            envs.switch_off_kernels(set() if on else {"silu_and_mul_linear"})
            for module in gate_ups:
                module.process_weights_after_loading()  # fp32 timings are cached per shape: no new probe
            assert all((m.silu_and_mul_weight is not None) == on for m in gate_ups) or dtype == "float32"
            model.model.fused_decode.reset()

        def timed(max_tokens: int) -> tuple[float, float]:
            params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
            start, start_cpu = time.perf_counter(), time.process_time()
            llm.generate(prompts, params, use_tqdm=False)
            return time.perf_counter() - start, time.process_time() - start_cpu

        best = {"fused": float("inf"), "pair": float("inf")}
        best_cpu = dict(best)
        gated_layers = 0
        for repeat in range(repeats + 1):  # the first round warms up, untimed
            for mode in (("fused", "pair") if repeat % 2 == 0 else ("pair", "fused")):
                use_gated(mode == "fused")
                if mode == "fused":
                    gated_layers = sum(m.silu_and_mul_weight is not None for m in gate_ups)
                (run, run_cpu), (prefill, prefill_cpu) = timed(output_len), timed(1)
                if repeat:
                    best[mode] = min(best[mode], run - prefill)
                    best_cpu[mode] = min(best_cpu[mode], run_cpu - prefill_cpu)
        use_gated(True)
        llm.shutdown()
    tokens = batch_size * (output_len - 1)
    return {**{f"{mode}_decode_tok_s": round(tokens / s, 1) for mode, s in best.items()},
            "speedup": round(best["pair"] / best["fused"], 3),
            **{f"{mode}_decode_tok_per_cpu_s": round(tokens / s, 1) for mode, s in best_cpu.items()},
            "speedup_cpu": round(best_cpu["pair"] / best_cpu["fused"], 3), "gated_layers": gated_layers}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--per-call", action="store_true")
    parser.add_argument("--decode", action="store_true")
    parser.add_argument("--dtype", nargs="+", choices=("float32", "bfloat16"), default=["float32", "bfloat16"])
    parser.add_argument("--repeats", type=int, default=15, help="per-call timings of each (decode: runs, 4)")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--input-len", type=int, default=16)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--force-gated", action="store_true", help="fp32: the gated copy at every batch size")
    args = parser.parse_args()
    result: dict[str, object] = {}
    for dtype in args.dtype:
        if args.per_call:
            result[f"per_call_{dtype}"] = per_call(getattr(torch, dtype), args.repeats)
        if args.decode:
            result[f"decode_{dtype}"] = decode(dtype, args.batch_size, args.input_len, args.output_len,
                                               min(args.repeats, 4), args.force_gated)
            print(f"decode {dtype}: {result[f'decode_{dtype}']}", flush=True)
    print("RESULT " + json.dumps(result))


if __name__ == "__main__":
    main()
