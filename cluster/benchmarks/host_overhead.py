"""Host time of one decode step, by phase, where the model costs almost nothing.

Issue 31: on an H100 a batch-256 decode step of the Llama-3-8B shape spends ~1.2 ms outside
GPU kernels. The host side of a step is the same Python on any machine, so it is measured
here on the 5M bench Llama (`tests/bench_models.py`), whose forward is small: 256 prompts of
64 tokens, 128 out each, EOS ignored, through `LLM.generate` with the defaults a user gets
(async scheduling on), greedy and with temperature and top-p sampling.

Each phase is timed by wrapping the method that does it (a wrapper costs about a
microsecond; the detokenizer's is paid once a token, the others once a step). The clock is
the main thread's CPU time by default (`--clock cpu`): on a machine shared with other work
it leaves out the time the process waits for a core, so runs compare; the forward's other
threads are left out too, so its figure is the main thread's part (use `--clock wall` for
elapsed time).

- scheduler: `Scheduler.schedule`
- input preparation: `ModelRunner.execute_model` less the phases below inside it
  (the requests' states, the packed inputs and their tensors, the attention metadata)
- forward: the model's forward (`model(...)`; on the CPU the fused decode layers)
- logits: `compute_logits` (the LM head)
- sampling metadata: `ModelRunner._sampling_metadata`
- sampler: the sampler (`Sampler.forward` / `launch`) and reading the tokens back
- update: `EngineCore._update_from_output` (appending tokens, stops, freeing blocks)
- detokenization: the incremental detokenizers' `step`
- output processing: `OutputProcessor.process_outputs` less detokenization
- other: `LLMEngine.step` less all of the above, plus the generate loop around it

Only the steady decode steps count: those whose batch is the full 256 decode rows and whose
collected output has 256 requests. The medians per step are printed, one table per
sampling mode, with the mean time in garbage collection (already inside the phases), then
tokens/s of each generate call (`--runs` calls each, the modes alternating; wall time).

    python -m raylm.cluster.benchmarks.host_overhead                 # builds the 5M Llama
    python -m raylm.cluster.benchmarks.host_overhead MODEL_DIR --runs 3 --profile

`--profile` adds cProfile's top functions of one greedy run (slower: for finding costs,
not for the figures). The last line printed is ``RESULT {json}``.
"""

from __future__ import annotations

import argparse
import cProfile
import functools
import gc
import io
import json
import pstats
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Any, Callable

PHASES = ["scheduler", "input preparation", "forward", "logits", "sampling metadata", "sampler", "update",
          "output processing", "detokenization", "other"]
HOST_PHASES = [p for p in PHASES if p not in ("forward", "logits")]


class PhaseTimer:
    """Accumulates the time spent in wrapped callables, per phase, for the current step."""

    def __init__(self, clock: Callable[[], float] = time.perf_counter) -> None:
        self.clock = clock
        self.current: dict[str, float] = defaultdict(float)
        self.counts: dict[str, int] = defaultdict(int)
        # Per phase, the length of what its last call returned (how many requests it handled).
        self.sizes: dict[str, int] = {}

    def wrap(self, owner: Any, name: str, phase: str) -> None:
        """Replaces owner.name (a class or an instance attribute) by a timed call."""
        function = getattr(owner, name)
        current, counts, sizes, clock = self.current, self.counts, self.sizes, self.clock

        @functools.wraps(function)
        def timed(*args: Any, **kwargs: Any) -> Any:
            start = clock()
            result = function(*args, **kwargs)
            current[phase] += clock() - start
            counts[phase] += 1
            if isinstance(result, list):
                sizes[phase] = len(result)
            return result

        setattr(owner, name, timed)

    def watch_gc(self) -> None:
        """Also times Python's garbage collections ("gc", inside whichever phase ran them)."""
        started: list[float] = []

        def callback(phase: str, info: dict) -> None:
            if phase == "start":
                started.append(self.clock())
            elif started:
                self.current["gc"] += self.clock() - started.pop()

        gc.callbacks.append(callback)

    def take(self) -> tuple[dict[str, float], dict[str, int]]:
        times, counts = dict(self.current), dict(self.counts)
        self.current.clear()
        self.counts.clear()
        self.sizes.clear()
        return times, counts


def instrument(llm: Any, timer: PhaseTimer) -> None:
    """Wraps the phases of `llm`'s in-process engine (instances where one exists, else classes)."""
    from raylm.engine.detokenizer import IncrementalDetokenizer
    from raylm.executors import sampler as sampler_module

    engine = llm.llm_engine
    core = engine.engine_core
    runner = core.executor.driver_worker.model_runner
    timer.wrap(core.scheduler, "schedule", "scheduler")
    timer.wrap(core, "_update_from_output", "update")
    timer.wrap(runner, "execute_model", "model runner")
    timer.wrap(runner.model, "forward", "forward")
    timer.wrap(runner.model, "compute_logits", "logits")
    timer.wrap(runner, "_sampling_metadata", "sampling metadata")
    timer.wrap(runner.sampler, "forward", "sampler")
    timer.wrap(runner.sampler, "launch", "sampler")
    timer.wrap(sampler_module.PendingSample, "result", "sampler")
    timer.wrap(engine, "_process_outputs", "output processor")
    timer.wrap(IncrementalDetokenizer, "step", "detokenization")
    timer.wrap(engine, "step", "engine step")


def exclusive(times: dict[str, float]) -> dict[str, float]:
    """Per phase, ms, with nested phases taken out of the ones around them."""
    t = defaultdict(float, times)
    inside_runner = t["forward"] + t["logits"] + t["sampling metadata"] + t["sampler"]
    phases = {
        "scheduler": t["scheduler"],
        "input preparation": t["model runner"] - inside_runner,
        "forward": t["forward"],
        "logits": t["logits"],
        "sampling metadata": t["sampling metadata"],
        "sampler": t["sampler"],
        "update": t["update"],
        "output processing": t["output processor"] - t["detokenization"],
        "detokenization": t["detokenization"],
    }
    phases["other"] = t["loop"] - sum(phases.values())
    phases["gc"] = t["gc"]
    return {name: value * 1e3 for name, value in phases.items()}


def run_workload(llm: Any, timer: PhaseTimer, prompts: list[dict], params: Any, batch_size: int
                 ) -> tuple[list[dict[str, float]], float, list[Any]]:
    """One generate call; returns the steady decode steps' phases, tokens/s and the outputs."""
    engine = llm.llm_engine
    scheduler = engine.engine_core.scheduler
    steps: list[dict[str, float]] = []
    original_step = engine.step
    last_end = [None]

    def step() -> list[Any]:
        # The loop's time between steps (the generate loop's own work) counts as "other".
        start = timer.clock()
        gap = start - last_end[0] if last_end[0] is not None else 0.0
        outputs = original_step()
        end = last_end[0] = timer.clock()
        num_collected = timer.sizes.get("update", 0)
        times, _ = timer.take()
        times["loop"] = end - start + gap
        running = scheduler.running
        decode_only = len(running) == batch_size and all(r.num_computed_tokens >= r.num_prompt_tokens for r in running)
        if decode_only and num_collected == batch_size:
            steps.append(exclusive(times))
        return outputs

    engine.step = step
    try:
        timer.take()
        start = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        elapsed = time.perf_counter() - start
    finally:
        del engine.step
    num_tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    return steps, num_tokens / elapsed, outputs


def build_model(path: Path) -> Path:
    tests = Path(__file__).resolve().parents[2] / "tests"
    subprocess.run([sys.executable, str(tests / "bench_models.py"), str(path)], check=True, cwd=tests,
                   stdout=subprocess.DEVNULL)
    return path


def table(per_step: list[dict[str, float]]) -> dict[str, float]:
    return {phase: statistics.median(step[phase] for step in per_step) for phase in PHASES}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model", nargs="?", help="model folder (default: build the 5M bench Llama)")
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--input-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--runs", type=int, default=3, help="generate calls per sampling mode, alternating")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--clock", choices=["cpu", "wall"], default="cpu",
                        help="cpu: the main thread's CPU time (time.thread_time: what other processes on a "
                             "shared machine take is left out; the forward's other threads too); wall: "
                             "time.perf_counter")
    parser.add_argument("--profile", action="store_true", help="also print cProfile's top functions (greedy)")
    args = parser.parse_args(argv)

    from raylm.engine import LLM, SamplingParams

    with tempfile.TemporaryDirectory() as tmp:
        model = args.model or str(build_model(Path(tmp) / "llama-5m"))
        llm = LLM(model, dtype=args.dtype, seed=0, max_num_seqs=args.batch_size)
        vocab = llm.llm_engine.model_config.hf_config.vocab_size
        rng = random.Random(0)
        prompts = [{"prompt_token_ids": [rng.randrange(3, vocab) for _ in range(args.input_len)]}
                   for _ in range(args.batch_size)]
        modes = {
            "greedy": SamplingParams(max_tokens=args.output_len, ignore_eos=True, temperature=0.0),
            "temperature 0.8, top-p 0.95": SamplingParams(max_tokens=args.output_len, ignore_eos=True,
                                                          temperature=0.8, top_p=0.95),
        }
        llm.generate(prompts[:8], SamplingParams(max_tokens=4), use_tqdm=False)  # warm-up
        timer = PhaseTimer(time.thread_time if args.clock == "cpu" else time.perf_counter)
        instrument(llm, timer)
        timer.watch_gc()
        steps: dict[str, list[dict[str, float]]] = {mode: [] for mode in modes}
        rates: dict[str, list[float]] = {mode: [] for mode in modes}
        for _ in range(args.runs):
            for mode, params in modes.items():
                run_steps, rate, _ = run_workload(llm, timer, prompts, params, args.batch_size)
                steps[mode].extend(run_steps)
                rates[mode].append(rate)
        profile_text = None
        if args.profile:
            profiler = cProfile.Profile()
            profiler.enable()
            run_workload(llm, timer, prompts, modes["greedy"], args.batch_size)
            profiler.disable()
            stream = io.StringIO()
            pstats.Stats(profiler, stream=stream).sort_stats("tottime").print_stats(30)
            profile_text = stream.getvalue()
        llm.shutdown()

    result: dict[str, Any] = {"clock": args.clock, "batch_size": args.batch_size, "input_len": args.input_len,
                              "output_len": args.output_len, "modes": {}}
    for mode in modes:
        medians = table(steps[mode])
        host = sum(medians[p] for p in HOST_PHASES)
        result["modes"][mode] = {"steps": len(steps[mode]), "ms_per_step": medians, "host_ms": host,
                                 "tokens_per_s": rates[mode]}
        print(f"\n{mode}: {len(steps[mode])} steady decode steps of batch {args.batch_size}, "
              f"median ms a step ({args.clock} time)")
        for phase in PHASES:
            print(f"  {phase:<20} {medians[phase]:8.3f}")
        print(f"  {'host (all but forward, logits)':<20} {host:8.3f}")
        gc_ms = statistics.mean(step["gc"] for step in steps[mode])
        print(f"  of which garbage collection (mean) {gc_ms:8.3f}")
        print(f"  tokens/s per run: {', '.join(f'{r:,.0f}' for r in rates[mode])}")
    if profile_text:
        print(profile_text)
    print("RESULT " + json.dumps(result))
    return result


if __name__ == "__main__":
    main()
