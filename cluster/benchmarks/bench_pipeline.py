"""Pipeline parallel on one machine: what splitting the model into stages costs, and what
keeping several micro-batches in flight buys.

Four engines on the same cores, greedy, the same prompts:

- ``pp1``: one Ray worker holding every layer, computing with all the machine's cores;
- ``pp2``: two pipeline stages, one Ray worker each, the cores split between them, with
  async scheduling: up to P + 1 = 3 micro-batches of different requests in flight;
- ``pp2-one-at-a-time``: the same two stages without async scheduling: one batch in flight,
  so each stage idles while the other works;
- ``pp2-actor-calls``: ``pp2`` with its steps sent as actor calls instead of through the
  compiled graph, whose idle readers poll their channels (two workers and the driver then
  want three cores of a two-core machine).

Each round builds each engine in turn (never two at once: an idle engine's compiled-graph
readers poll their channels and would take cores from the one being timed), warms it up
with one generate call, then times one generate call of ``--num-prompts`` requests of
``--input-len`` random tokens and ``--output-len`` output tokens (EOS ignored). Rounds
alternate the engines, so that a shared machine's drift hits all of them; the table reports
each engine's output tokens/s in its fastest run (on a shared machine a neighbour only ever
slows a run down), the median and every round, and the ratios that matter, of the fastest
runs and round by round: pp2 over pp1 (the overhead of the split on the same cores), pp2
over pp2-one-at-a-time (what micro-batches in flight buy), pp2-actor-calls over pp1. Every
engine must give pp1's tokens.

    python -m raylm.cluster.benchmarks.bench_pipeline /tmp/llama-100m --rounds 6 --num-prompts 64

The last line printed is ``RESULT {json}``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import subprocess
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

# name -> engine arguments beside the common ones.
CONFIGS: dict[str, dict[str, Any]] = {
    "pp1": dict(pipeline_parallel_size=1),
    "pp2": dict(pipeline_parallel_size=2, async_scheduling=True),
    "pp2-one-at-a-time": dict(pipeline_parallel_size=2, async_scheduling=False),
    # The compiled graph's readers poll their channels: 2 workers + the driver want 3 cores.
    "pp2-actor-calls": dict(pipeline_parallel_size=2, async_scheduling=True, ray_compiled_graph=False),
}


@dataclass
class Row:
    name: str
    output_tokens: int
    best_tokens_per_s: float  # the fastest run: what the machine allows when no neighbour intrudes
    median_tokens_per_s: float
    runs_tokens_per_s: list[float] = field(default_factory=list)
    same_tokens_as_pp1: bool = True


# (numerator, denominator) of the ratios reported, by key.
RATIOS = {"pp2_over_pp1": ("pp2", "pp1"), "pp2_over_one_at_a_time": ("pp2", "pp2-one-at-a-time"),
          "pp2_actor_calls_over_pp1": ("pp2-actor-calls", "pp1")}


def prompts(num_prompts: int, input_len: int, vocab_size: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    return [{"prompt_token_ids": [rng.randrange(4, vocab_size) for _ in range(input_len)]} for _ in range(num_prompts)]


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """What every engine shares: Ray workers (even pp1's one), the pool sized for the run."""
    blocks_per_request = -(-(args.input_len + args.output_len) // 16)
    return dict(model=args.model, distributed_executor_backend="ray", dtype=args.dtype,
                max_model_len=args.input_len + args.output_len, max_num_seqs=args.num_prompts,
                num_gpu_blocks_override=args.num_prompts * blocks_per_request + 16, enable_prefix_caching=False)


def timed_run(name: str, args: argparse.Namespace, requests: list[dict]) -> tuple[float, list[list[int]]]:
    """Builds `name`'s engine, warms it up, times one generate call; (seconds, tokens)."""
    from raylm.engine import LLM, SamplingParams

    llm = LLM(**engine_kwargs(args), **CONFIGS[name])
    try:
        params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
        llm.generate(requests[:4], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True), use_tqdm=False)
        start = time.perf_counter()
        outputs = llm.generate(requests, params, use_tqdm=False)
        elapsed = time.perf_counter() - start
    finally:
        llm.shutdown()
    return elapsed, [list(o.outputs[0].token_ids) for o in outputs]


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def git_commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              cwd=Path(__file__).parent, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def run(args: argparse.Namespace) -> dict:
    import ray
    from transformers import AutoConfig

    ray.init(address="local", include_dashboard=False, num_cpus=4)

    vocab_size = AutoConfig.from_pretrained(args.model).vocab_size
    requests = prompts(args.num_prompts, args.input_len, vocab_size, args.seed)
    names = list(CONFIGS)
    times: dict[str, list[float]] = {name: [] for name in names}
    load_averages: list[float] = []  # the 1-minute load average after each run: how shared the machine was
    reference: list[list[int]] | None = None  # pp1's tokens, which every run must give
    same = {name: True for name in names}
    for round_index in range(args.rounds):
        order = names if round_index % 2 == 0 else names[::-1]  # alternate which goes first
        for name in order:
            elapsed, out = timed_run(name, args, requests)
            times[name].append(elapsed)
            load_averages.append(os.getloadavg()[0])
            if name == "pp1" and reference is None:
                reference = out
            same[name] = same[name] and (reference is None or out == reference)
            print(f"round {round_index + 1} {name}: {elapsed:.2f} s (load average {load_averages[-1]:.1f})",
                  flush=True)
    ray.shutdown()
    output_tokens = args.num_prompts * args.output_len
    rows = {name: Row(name, output_tokens, max(output_tokens / t for t in times[name]),
                      statistics.median(output_tokens / t for t in times[name]),
                      [round(output_tokens / t, 1) for t in times[name]], same[name]) for name in names}

    def round_ratios(numerator: str, denominator: str) -> list[float]:
        """numerator's tokens/s over denominator's (its time over numerator's), round by round:
        a round's runs are adjacent in time, so a shared machine's drift partly cancels."""
        return [round(t_den / t_num, 3) for t_num, t_den in zip(times[numerator], times[denominator])]

    return dict(
        date=time.strftime("%Y-%m-%d", time.gmtime()), commit=git_commit(), cpu=cpu_name(),
        settings=dict(model=args.model, num_prompts=args.num_prompts, input_len=args.input_len,
                      output_len=args.output_len, rounds=args.rounds, dtype=args.dtype),
        cpu_count=os.cpu_count(), load_average_range=[min(load_averages), max(load_averages)],
        rows=[asdict(row) for row in rows.values()],
        # Fastest run over fastest run (the project's convention on shared machines), the
        # median of the rounds' ratios, and those ratios.
        ratios={key: dict(best=rows[num].best_tokens_per_s / rows[den].best_tokens_per_s,
                          median_of_rounds=statistics.median(round_ratios(num, den)),
                          rounds=round_ratios(num, den))
                for key, (num, den) in RATIOS.items()},
    )


def print_table(report: dict) -> None:
    print("| engine | output tokens/s, fastest run | median | every round | same tokens as pp1 |")
    print("|---|---:|---:|---|---|")
    for row in report["rows"]:
        runs = ", ".join(f"{x:.0f}" for x in row["runs_tokens_per_s"])
        same = "yes" if row["same_tokens_as_pp1"] else "NO"
        print(f"| {row['name']} | {row['best_tokens_per_s']:.0f} | {row['median_tokens_per_s']:.0f} | {runs} "
              f"| {same} |")
    for key, ratio in report["ratios"].items():
        print(f"{key}: fastest runs {ratio['best']:.2f}, median of the rounds {ratio['median_of_rounds']:.2f} "
              f"(rounds: {', '.join(f'{r:.2f}' for r in ratio['rounds'])})")
    low, high = report["load_average_range"]
    print(f"{report['cpu_count']} cores, 1-minute load average {low:.1f}-{high:.1f} after the runs")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", help="Hugging Face model folder (a Llama-family model of 2 layers or more)")
    parser.add_argument("--num-prompts", type=int, default=32, help="requests per timed run (default 32)")
    parser.add_argument("--input-len", type=int, default=32, help="prompt tokens per request (default 32)")
    parser.add_argument("--output-len", type=int, default=64, help="output tokens per request (default 64)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds, each timing every engine once (default 3)")
    parser.add_argument("--dtype", default="float32", help="model dtype (default float32)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random prompts")
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    report = run(args)
    print_table(report)
    print("RESULT " + json.dumps(report), flush=True)


if __name__ == "__main__":
    main()
