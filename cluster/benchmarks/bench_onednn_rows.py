"""What padding oneDNN's GEMM rows to a few counts costs a prefill (`kernels/cpu_gemm.onednn_rows`).

oneDNN keeps a compiled primitive per GEMM shape; padding a call's rows to one of a few
counts bounds how many it keeps (and the memory they hold) at the price of computing the
padded rows. Two measurements, each in one process, padded and exact alternating call by
call (so that drift of a shared machine hits both), the fastest of a few calls per row count,
each warm (its primitive already built, which leaves only the padding's cost):

- `gemm`: `cpu_gemm.cpu_linear` on the ~100M Llama's projection shapes at random row counts;
- `prefill`: one-prompt prefill steps (`LLM.generate`, max_tokens=1) of random lengths
  through a random Llama of the ~100M model's layer shapes (4 layers).

    python -m raylm.cluster.benchmarks.bench_onednn_rows --level gemm --dtype float32
    python -m raylm.cluster.benchmarks.bench_onednn_rows --level prefill --dtype bfloat16

Row counts are drawn log-uniformly from --min-rows to --max-rows (the step's token budget).
Prints one row per measurement and the ratio padded / exact, then ``RESULT {json}``.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import tempfile
import time
from collections.abc import Callable
from contextlib import nullcontext
from pathlib import Path

import torch

from raylm.kernels import cpu_gemm

# (in_features, out_features) of the ~100M Llama's qkv, o, gate_up and down projections.
SHAPES = ((1024, 1536), (1024, 1024), (1024, 5632), (2816, 1024))


def draw_rows(rng: random.Random, count: int, low: int, high: int) -> list[int]:
    return [int(math.exp(rng.uniform(math.log(low), math.log(high + 1)))) for _ in range(count)]


def alternate(run: Callable[[int], None], rows: list[int], repeats: int) -> tuple[float, float]:
    """Seconds of `run(r)` summed over `rows`, padded and exact: per row count the fastest
    of `repeats` timed calls (the others carry a shared machine's interruptions), after an
    untimed one (its primitive built); the modes alternate call by call."""
    totals = {"padded": 0.0, "exact": 0.0}
    for r in rows:
        best = {"padded": math.inf, "exact": math.inf}
        for repeat in range(repeats + 1):
            for mode in (("padded", "exact") if repeat % 2 == 0 else ("exact", "padded")):
                with cpu_gemm.exact_onednn_rows() if mode == "exact" else nullcontext():
                    start = time.perf_counter()
                    run(r)
                    if repeat:
                        best[mode] = min(best[mode], time.perf_counter() - start)
        for mode in totals:
            totals[mode] += best[mode]
    return totals["padded"], totals["exact"]


def gemm_level(args: argparse.Namespace, rows: list[int]) -> tuple[float, float]:
    dtype = getattr(torch, args.dtype)
    packed = [(cpu_gemm.pack_linear_weight(torch.randn(n, k).to(dtype)), k) for k, n in SHAPES]
    inputs = {k: torch.randn(args.max_rows, k).to(dtype) for k, _ in SHAPES}

    def run(r: int) -> None:
        with torch.inference_mode():
            for weight, k in packed:
                cpu_gemm.cpu_linear(inputs[k][:r], weight, None)

    return alternate(run, rows, args.repeats)


def build_llama(path: Path, seed: int = 0) -> Path:
    """A random Llama with the ~100M model's layer shapes, 4 layers, vocab 4096; no tokenizer."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=4096, hidden_size=1024, intermediate_size=2816, num_hidden_layers=4,
                         num_attention_heads=16, num_key_value_heads=4, max_position_embeddings=4096,
                         bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
    torch.manual_seed(seed)
    LlamaForCausalLM(config).to(torch.float32).save_pretrained(str(path), safe_serialization=True)
    return path


def prefill_level(args: argparse.Namespace, rows: list[int]) -> tuple[float, float]:
    from raylm.engine import LLM, SamplingParams

    with tempfile.TemporaryDirectory() as tmp:
        model = args.model or str(build_llama(Path(tmp) / "llama"))
        llm = LLM(model=model, dtype=args.dtype, skip_tokenizer_init=True, enable_prefix_caching=False,
                  max_num_batched_tokens=args.max_rows, max_model_len=max(args.max_rows, 2048), max_num_seqs=8)
        rng = random.Random(args.seed + 1)
        params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)

        def run(r: int) -> None:
            prompt = [rng.randrange(3, 4096) for _ in range(r)]
            llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)

        try:
            return alternate(run, rows, args.repeats)
        finally:
            llm.shutdown()


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--level", choices=("gemm", "prefill"), default="gemm")
    parser.add_argument("--model", default=None, help="prefill: a model folder; default a random ~100M-shaped Llama.")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--count", type=int, default=40, help="Row counts drawn.")
    parser.add_argument("--repeats", type=int, default=5, help="Timed calls per row count and mode.")
    parser.add_argument("--min-rows", type=int, default=cpu_gemm.ONEDNN_EXACT_ROWS + 1)
    parser.add_argument("--max-rows", type=int, default=2048)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    rows = draw_rows(random.Random(args.seed), args.count, args.min_rows, args.max_rows)
    padded_s, exact_s = (gemm_level if args.level == "gemm" else prefill_level)(args, rows)
    added = sum(cpu_gemm.onednn_rows(r) - r for r in rows) / sum(rows)
    result = {"level": args.level, "dtype": args.dtype, "threads": torch.get_num_threads(), "row_counts": len(rows),
              "rows_added": added, "padded_s": padded_s, "exact_s": exact_s, "ratio": padded_s / exact_s}
    print(f"{args.level} {args.dtype}, {len(rows)} row counts in [{args.min_rows}, {args.max_rows}] "
          f"(padding adds {added:.1%} rows): padded {padded_s:.3f} s, exact {exact_s:.3f} s, "
          f"ratio {padded_s / exact_s:.3f}")
    print("RESULT " + json.dumps(result))
    return result


if __name__ == "__main__":
    main()
