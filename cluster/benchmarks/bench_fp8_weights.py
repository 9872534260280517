"""Decode speed of FP8 weights (`quantization="fp8"`) against the same model unquantized.

Both engines live in one process and generate the same greedy batch in alternating rounds
(unquantized, fp8, unquantized, ...), so a noisy neighbour slows them alike; the median
output tokens/s of each and their ratio are printed. Prompts are short and outputs long,
so the time is decode steps. On the CPU the FP8 engine dequantizes each layer's weight in
row chunks as it multiplies (W8A16, `kernels/fp8_linear.py`).

    python -m raylm.cluster.benchmarks.bench_fp8_weights MODEL_DIR [--dtype bfloat16] [--rounds 3]

MODEL_DIR: a Llama folder, e.g. the 5M or ~100M bench Llama (docs/performance.md says how
to write them), or a MoE model (Mixtral, Qwen2/3-MoE: FP8 experts, `kernels/fp8_fused_moe.py`);
prompts draw token ids below 4000, so its vocabulary must be larger.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from collections.abc import Callable


def alternating_generate_times(llms: dict, prompts: list, params, rounds: int,
                               before: Callable[[str], None] | None = None) -> dict[str, list[float]]:
    """Seconds of `generate(prompts, params)` per engine, the engines taking turns for
    rounds + 1 rounds (the first warms up, kernels built and caches touched, and is dropped),
    so a shared machine's slow spells fall on all of them alike. before(name) runs ahead of
    each engine's turn (a switch the comparison flips)."""
    times: dict[str, list[float]] = {name: [] for name in llms}
    for round_index in range(rounds + 1):
        for name, llm in llms.items():
            if before is not None:
                before(name)
            start = time.perf_counter()
            llm.generate(prompts, params, use_tqdm=False)
            if round_index:
                times[name].append(time.perf_counter() - start)
    return times


def main(argv: list[str] | None = None) -> dict[str, float]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--batch", type=int, default=16, help="requests decoded together")
    parser.add_argument("--input-len", type=int, default=8)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3, help="timed rounds per engine, alternating")
    parser.add_argument("--chunks", action="store_true",
                        help="also time the fp8 engine with decode batches through dequantized chunks and oneDNN "
                             "instead of the native FP8 kernel ('fp8-chunks')")
    args = parser.parse_args(argv)

    from raylm.engine import LLM, SamplingParams
    from raylm.kernels import fp8_linear

    engine = dict(model=args.model, dtype=args.dtype, skip_tokenizer_init=True, max_model_len=512,
                  max_num_seqs=args.batch, num_gpu_blocks_override=args.batch * 32 + 8)
    llms = {"unquantized": LLM(**engine), "fp8": LLM(quantization="fp8", **engine)}
    if args.chunks:
        llms["fp8-chunks"] = llms["fp8"]
    native_max_rows = fp8_linear.NATIVE_MAX_ROWS
    rng = random.Random(0)
    prompts = [{"prompt_token_ids": [rng.randrange(3, 4000) for _ in range(args.input_len)]}
               for _ in range(args.batch)]
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    def before(name: str) -> None:
        fp8_linear.NATIVE_MAX_ROWS = 0 if name == "fp8-chunks" else native_max_rows

    times = alternating_generate_times(llms, prompts, params, args.rounds, before)
    fp8_linear.NATIVE_MAX_ROWS = native_max_rows
    tokens = args.batch * args.output_len
    result = {name: tokens / statistics.median(seconds) for name, seconds in times.items()}
    for name, seconds in times.items():
        print(f"{name:12s} {result[name]:9.1f} output tok/s (median of {', '.join(f'{s:.2f}' for s in seconds)} s)")
    for name in llms:
        if name != "unquantized":
            print(f"{name} / unquantized: {result[name] / result['unquantized']:.2f}x")
    result["ratio"] = result["fp8"] / result["unquantized"]
    for llm in {id(llm): llm for llm in llms.values()}.values():
        llm.shutdown()
    return result


if __name__ == "__main__":
    main()
