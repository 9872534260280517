"""The fused-experts layer's CPU paths against each other, at MoE shapes: the native op on the
AVX-512 panels (what `FusedMoE` runs where it builds), the native op on ATen's GEMM per
expert group (CPUs without AVX-512), and the PyTorch reference (a Python loop over experts,
one `F.linear` pair per expert; roughly what Hugging Face's MoE blocks do).

Paths are timed in interleaved rounds (median per path), so a noisy neighbour slows them
alike and the ratios stay comparable; the weights are warm (a model whose MoE weights are
more than the last-level cache reads them cold in the engine). Run with
`python -m raylm.cluster.benchmarks.bench_fused_moe [--tokens 1 16 64 512] [--dtypes float32 bfloat16]`.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

from raylm.kernels import cpu_fused_moe, torch_moe

# (hidden, expert intermediate, experts, top_k): the MoE benchmark model (tests/bench_models.py),
# and a Qwen3-MoE-like layer scaled down (many small experts, top-8).
SHAPES = ((256, 688, 8, 2), (512, 192, 64, 8))


def paths(x, w13, w2, topk_weights, topk_ids) -> dict[str, Callable[[], torch.Tensor]]:
    found: dict[str, Callable[[], torch.Tensor]] = {}
    packed = cpu_fused_moe.pack_experts(w13, w2)
    if packed is not None:
        found["avx512 op"] = lambda: cpu_fused_moe.fused_experts(x, w13, w2, topk_weights, topk_ids, packed=packed)
    if cpu_fused_moe.library_loaded():
        found["aten op"] = lambda: torch.ops.raylm.dense_fused_moe(x, w13, w2, topk_weights, topk_ids, None)
    found["torch loop"] = lambda: torch_moe.fused_experts(x, w13, w2, topk_weights, topk_ids)
    return found


def time_paths(found: dict[str, Callable[[], torch.Tensor]], rounds: int, sample_s: float) -> dict[str, float]:
    """Median seconds per call of each path over `rounds` interleaved samples."""
    iters = {}
    for name, fn in found.items():
        fn()  # warm-up
        start = time.perf_counter()
        fn()
        iters[name] = max(1, int(sample_s / max(time.perf_counter() - start, 1e-7)))
    samples: dict[str, list[float]] = {name: [] for name in found}
    for _ in range(rounds):
        for name, fn in found.items():
            start = time.perf_counter()
            for _ in range(iters[name]):
                fn()
            samples[name].append((time.perf_counter() - start) / iters[name])
    return {name: statistics.median(times) for name, times in samples.items()}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 16, 64, 512])
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--sample-s", type=float, default=0.05)
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"torch threads: {torch.get_num_threads()}")
    print(f"{'dtype':9} {'H':>5} {'I':>5} {'E':>3} {'k':>2} {'T':>5}  " + "  ".join(
        f"{name:>12}" for name in ("avx512 op", "aten op", "torch loop")) + "  (ms per call)")
    gen = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        for dtype in (getattr(torch, name) for name in args.dtypes):
            for hidden, intermediate, experts, top_k in SHAPES:
                w13 = (torch.randn(experts, 2 * intermediate, hidden, generator=gen) * 0.05).to(dtype)
                w2 = (torch.randn(experts, hidden, intermediate, generator=gen) * 0.05).to(dtype)
                for tokens in args.tokens:
                    x = torch.randn(tokens, hidden, generator=gen).to(dtype)
                    topk_weights, topk_ids = torch_moe.fused_topk(torch.randn(tokens, experts, generator=gen),
                                                                  top_k, True)
                    timed = time_paths(paths(x, w13, w2, topk_weights, topk_ids), args.rounds, args.sample_s)
                    cells = "  ".join(f"{timed[name] * 1e3:12.3f}" if name in timed else f"{'-':>12}"
                                      for name in ("avx512 op", "aten op", "torch loop"))
                    print(f"{str(dtype).removeprefix('torch.'):9} {hidden:5} {intermediate:5} {experts:3} {top_k:2} "
                          f"{tokens:5}  {cells}", flush=True)


if __name__ == "__main__":
    main()
