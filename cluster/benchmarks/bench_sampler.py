"""The sampler's step on the CPU: raylm's native passes against the PyTorch path (sort and
dense masks, the way vLLM's CPU build samples), in one process, alternating.

    python -m raylm.cluster.benchmarks.bench_sampler --vocab-sizes 32000 128256 --rows 64

Each case samples --rows rows of random logits with the parameters a user or a model's
generation config sends: temperature alone, top-p, top-k + top-p, min-p, and Qwen2.5's
defaults (temperature 0.7, top-p 0.8, top-k 20, repetition penalty 1.05, over
--prompt-len prompt and --output-len output tokens of history). The two paths alternate call
by call (so drift of a shared machine hits both) and the fastest of --repeats calls counts.
Prints one row per case and the ratio, then ``RESULT {json}``.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from collections.abc import Callable

import torch

from raylm.engine.sampling_params import SamplingParams
from raylm.executors.sampler import Sampler
from raylm.executors.sampling_metadata import SamplingMetadata
from raylm.kernels import cpu_ops

CASES: dict[str, dict] = {
    "temperature": dict(temperature=1.0),
    "top_p=0.9": dict(temperature=1.0, top_p=0.9),
    "top_k=50,top_p=0.9": dict(temperature=1.0, top_k=50, top_p=0.9),
    "min_p=0.05": dict(temperature=1.0, min_p=0.05),
    "qwen2.5 defaults": dict(temperature=0.7, top_p=0.8, top_k=20, repetition_penalty=1.05),
}


def case_metadata(params: dict, rows: int, vocab_size: int, prompt_len: int, output_len: int,
                  rng: random.Random) -> SamplingMetadata:
    histories = "repetition_penalty" in params
    prompts = [[rng.randrange(vocab_size) for _ in range(prompt_len)] if histories else [] for _ in range(rows)]
    outputs = [[rng.randrange(vocab_size) for _ in range(output_len)] if histories else [] for _ in range(rows)]
    return SamplingMetadata(list(range(rows)), [SamplingParams(**params) for _ in range(rows)], prompts, outputs,
                            [None] * rows)


def fastest_alternating(native: Callable[[], object], pytorch: Callable[[], object], repeats: int) -> tuple[float, float]:
    """The fastest of `repeats` calls of each, the two alternating (order swapped each round)."""
    times: dict[str, list[float]] = {"native": [], "pytorch": []}
    calls = {"native": native, "pytorch": pytorch}
    for round_index in range(repeats):
        for name in (("native", "pytorch") if round_index % 2 else ("pytorch", "native")):
            start = time.perf_counter()
            calls[name]()
            times[name].append(time.perf_counter() - start)
    return min(times["native"]), min(times["pytorch"])


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--vocab-sizes", type=int, nargs="+", default=[32000, 128256])
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if not cpu_ops.usable(torch.zeros(1)):
        raise SystemExit("the native CPU library cannot be built here: nothing to compare")
    sampler = Sampler()
    native_usable = cpu_ops.usable
    results = []
    print(f"{'vocab':>7}  {'case':22s} {'native ms':>10} {'pytorch ms':>11} {'ratio':>7}")
    for vocab_size in args.vocab_sizes:
        rng = random.Random(args.seed)
        logits = torch.randn(args.rows, vocab_size, generator=torch.Generator().manual_seed(args.seed)) * 3
        for name, params in CASES.items():
            metadata = case_metadata(params, args.rows, vocab_size, args.prompt_len, args.output_len, rng)

            def run(native: bool) -> None:
                # The PyTorch path is what the sampler takes where the native library is unusable.
                cpu_ops.usable = native_usable if native else (lambda *tensors: False)
                try:
                    sampler(logits, metadata)
                finally:
                    cpu_ops.usable = native_usable

            run(True), run(False)  # warm
            native_s, pytorch_s = fastest_alternating(lambda: run(True), lambda: run(False), args.repeats)
            results.append(dict(vocab_size=vocab_size, case=name, native_ms=native_s * 1e3, pytorch_ms=pytorch_s * 1e3,
                                pytorch_over_native=pytorch_s / native_s))
            print(f"{vocab_size:>7}  {name:22s} {native_s * 1e3:10.2f} {pytorch_s * 1e3:11.2f} "
                  f"{pytorch_s / native_s:6.1f}x", flush=True)
    result = dict(rows=args.rows, prompt_len=args.prompt_len, output_len=args.output_len, cases=results)
    print("RESULT " + json.dumps(result))
    return result


if __name__ == "__main__":
    main()
