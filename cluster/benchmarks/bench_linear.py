"""Which CPU GEMM runs a linear layer fastest on this machine: `F.linear` against torch's
packed-weight paths, at the linear shapes of the benchmark models.

Methods (each only where this torch build offers it):
- `F.linear`: the baseline, what the parallel linear layers call.
- `mkldnn`: oneDNN with the weight reordered once into its blocked layout
  (`torch.ops.mkldnn._reorder_linear_weight` + `_linear_pointwise`), what inductor's
  freezing uses for bf16 and the path `kernels/cpu_gemm.py` takes.
- `mkl` (fp32): MKL's packed GEMM (`_mkl_reorder_linear_weight` + `_mkl_linear`), packed
  for exactly M rows; any other M falls back to `F.linear`, so it only suits a fixed M.
- `to_mkldnn`: `torch.utils.mkldnn`'s module path, input converted to and from an
  MKLDNN tensor on every call.

Methods are timed in interleaved rounds (median per method), so a noisy neighbour slows
them alike and the ratio to `F.linear` stays comparable. Run with
`python -m raylm.cluster.benchmarks.bench_linear [--threads 1 2] [--dtypes float32 bfloat16]`.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

TOKENS = (16, 64, 256, 1024)
# (in_features, out_features) of the 5M and ~100M Llama benchmark models' projections.
SHAPES = ((256, 768), (768, 256), (1024, 2816), (2816, 1024), (1024, 1536))


def methods(weight: torch.Tensor, num_tokens: int) -> dict[str, Callable[[torch.Tensor], torch.Tensor]]:
    """Each available method as a function of the input, its weight packed here, once."""
    found: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {"F.linear": lambda x: F.linear(x, weight)}
    if torch.backends.mkldnn.is_available():
        packed = torch.ops.mkldnn._reorder_linear_weight(weight, None)
        found["mkldnn"] = lambda x: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
        as_mkldnn = weight.to_mkldnn()
        found["to_mkldnn"] = lambda x: torch._C._nn.mkldnn_linear(x.to_mkldnn(), as_mkldnn, None).to_dense()
    if weight.dtype == torch.float32 and torch.backends.mkl.is_available():
        mkl_packed = torch.ops.mkl._mkl_reorder_linear_weight(weight, num_tokens)
        found["mkl"] = lambda x: torch.ops.mkl._mkl_linear(x, mkl_packed, weight, None, num_tokens)
    return found


def _time_once(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, iters: int) -> float:
    start = time.perf_counter()
    for _ in range(iters):
        fn(x)
    return (time.perf_counter() - start) / iters


def time_methods(found: dict[str, Callable], x: torch.Tensor, rounds: int, sample_s: float) -> dict[str, float]:
    """Median seconds per call of each method over `rounds` interleaved samples."""
    iters = {}
    for name, fn in found.items():
        fn(x)  # warm-up (and oneDNN primitive creation)
        iters[name] = max(1, int(sample_s / max(_time_once(fn, x, 2), 1e-7)))
    samples: dict[str, list[float]] = {name: [] for name in found}
    for _ in range(rounds):
        for name, fn in found.items():
            samples[name].append(_time_once(fn, x, iters[name]))
    return {name: statistics.median(s) for name, s in samples.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--tokens", type=int, nargs="+", default=list(TOKENS))
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--sample-ms", type=float, default=20.0)
    args = parser.parse_args()
    torch.manual_seed(0)
    print(f"torch {torch.__version__}, mkldnn bf16: {torch.ops.mkldnn._is_mkldnn_bf16_supported()}")
    print(f"{'dtype':8} {'thr':>3} {'M':>5} {'K':>5} {'N':>5}  method     GFLOP/s  vs F.linear")
    for threads in args.threads:
        torch.set_num_threads(threads)
        for dtype_name in args.dtypes:
            dtype = getattr(torch, dtype_name)
            for num_tokens in args.tokens:
                for k, n in SHAPES:
                    weight = torch.randn(n, k, dtype=dtype) / k ** 0.5
                    x = torch.randn(num_tokens, k, dtype=dtype)
                    found = methods(weight, num_tokens)
                    seconds = time_methods(found, x, args.rounds, args.sample_ms / 1000)
                    flops = 2 * num_tokens * k * n
                    for name, s in seconds.items():
                        print(f"{dtype_name:8} {threads:>3} {num_tokens:>5} {k:>5} {n:>5}  {name:9} "
                              f"{flops / s / 1e9:8.1f}  {seconds['F.linear'] / s:6.2f}x", flush=True)


if __name__ == "__main__":
    main()
