"""Per-step decode latency: in process, Ray with one worker, Ray with N workers, each Ray
configuration three ways: through the Ray compiled graph with async scheduling (the
defaults: step k+1 is sent before step k is collected), through the compiled graph one step
at a time, and as one actor call per worker, one step at a time.

What the Ray control path costs: every configuration runs the same batch of sequences
(greedy, EOS ignored) through `LLMEngine.step()`; after the prefill and a few warm-up
steps, each decode step is timed, whole (scheduler, executor, output processing) and
the executor's share alone (`execute_model`: sending the step, the workers' forward and
sampling, the answer coming back), and inside it rank 0's `Worker.execute_model` (the
forward, its collectives and sampling). The executor's time less rank 0's is the control
path: what it costs to get the step to the workers and the answer back. With async
scheduling steps overlap, so a step's time is the period between outputs, the executor's
time is not reported, and the control column is the step less rank 0's time: what the
workers spend per step outside their forward.

    python -m raylm.cluster.benchmarks.bench_step_latency                  # a tiny random Llama
    python -m raylm.cluster.benchmarks.bench_step_latency MODEL_DIR --batch-size 64 --tp-sizes 2,4

Without a model folder it builds a tiny random Llama (hidden 64, 2 layers, vocab 512,
the shape of the test models) in a temporary folder. Ray is joined if RAY_ADDRESS is set,
else started locally. The last line printed is ``RESULT {json}``.
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import ray
import torch


@dataclass
class StepLatency:
    name: str
    backend: str
    # How steps reached the workers: "in process", "compiled graph" or "actor calls".
    step_path: str
    # Whether step k+1 was scheduled and sent before step k was collected.
    async_scheduling: bool
    tensor_parallel_size: int
    batch_size: int
    num_steps: int
    step_ms_median: float
    step_ms_p90: float
    executor_ms_median: float
    # Rank 0's time inside Worker.execute_model, and the executor's time less it (per step).
    worker_ms_median: float
    control_ms_median: float
    startup_s: float


# The three ways a Ray configuration runs its steps: (row label, compiled graph, async scheduling).
RAY_STEP_PATHS = {"graph-async": ("graph, async scheduling", True, True),
                  "graph": ("graph, step at a time", True, False),
                  "actor-calls": ("actor calls", False, False)}


def build_tiny_llama(path: Path, seed: int = 0) -> Path:
    """A random Llama with the test models' shape; no tokenizer (token-id prompts)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).to(torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" not in name:
                param.normal_(0.0, 0.08)
    model.save_pretrained(str(path), safe_serialization=True)
    return path


def _time_steps(worker) -> None:
    """Records the duration of each `Worker.execute_model` in `worker.step_s`."""
    run = worker.execute_model
    worker.step_s = []

    def timed(req):
        t0 = time.perf_counter()
        out = run(req)
        worker.step_s.append(time.perf_counter() - t0)
        return out

    worker.execute_model = timed


def _time_worker_steps(wrapper) -> None:
    """Runs in a Ray worker actor (`__ray_call__`): times its Worker's steps."""
    _time_steps(wrapper.worker)


def _worker_step_times(wrapper, count: int) -> list[float]:
    return wrapper.worker.step_s[-count:]


def measure(name: str, model_dir: str, args: argparse.Namespace, tensor_parallel_size: int,
            backend: str | None, compiled: bool = True, async_scheduling: bool = False) -> StepLatency:
    from raylm.engine.arg_utils import EngineArgs
    from raylm.engine.llm_engine import LLMEngine
    from raylm.engine.sampling_params import SamplingParams

    engine_args = EngineArgs(model=model_dir, dtype=args.dtype, skip_tokenizer_init=True,
                             tensor_parallel_size=tensor_parallel_size, distributed_executor_backend=backend,
                             ray_compiled_graph=compiled, async_scheduling=async_scheduling,
                             max_num_seqs=args.batch_size, max_model_len=args.max_model_len,
                             num_gpu_blocks_override=args.num_blocks, disable_log_stats=True, device=args.device)
    # Without async scheduling, one step at a time, so that the executor's time is the
    # step's round trip alone.
    engine_args.disable_async_output_proc = not async_scheduling
    start = time.perf_counter()
    engine = LLMEngine.from_engine_args(engine_args)
    startup_s = time.perf_counter() - start

    executor = engine.executor
    if backend is None:
        step_path = "in process"
    else:
        step_path = "compiled graph" if executor.uses_compiled_graph else "actor calls"
        if compiled and not executor.uses_compiled_graph:
            raise RuntimeError(f"{name}: the compiled graph could not be built (see the warning above).")
        if engine.engine_core.async_scheduling != async_scheduling:
            raise RuntimeError(f"{name}: async scheduling is {'off' if async_scheduling else 'on'}.")
    rank0 = executor.driver_worker if backend is None else executor.workers[0]
    if backend is None:
        _time_steps(rank0)
    else:
        ray.get(rank0.__ray_call__.remote(_time_worker_steps), timeout=60)
    # From handing the step over to its output coming back, whichever call the engine uses.
    hook = "execute_model_async" if hasattr(executor, "execute_model_async") else "execute_model"
    run_step = getattr(executor, hook)
    executor_s: list[float] = []

    def timed_execute_model(req):
        t0 = time.perf_counter()
        out = run_step(req)
        executor_s.append(time.perf_counter() - t0)
        return out

    def timed_execute_model_async(req):
        t0 = time.perf_counter()
        wait = run_step(req)

        def timed_wait():
            out = wait()
            executor_s.append(time.perf_counter() - t0)
            return out

        return timed_wait

    setattr(executor, hook, timed_execute_model if hook == "execute_model" else timed_execute_model_async)
    rng = random.Random(args.seed)
    vocab = engine.model_config.vocab_size
    max_tokens = 2 + args.warmup_steps + args.num_steps
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    for i in range(args.batch_size):
        engine.add_request(str(i), [rng.randrange(4, vocab) for _ in range(args.prompt_len)], params)
    step_s: list[float] = []
    try:
        engine.step()  # the prefill of every prompt
        for _ in range(args.warmup_steps):
            engine.step()
        running = len(engine.scheduler.running)
        if running != args.batch_size:
            raise RuntimeError(f"{name}: {running} sequences run at once, not the batch of {args.batch_size}: "
                               f"give the KV cache more blocks (--num-blocks).")
        executor_s.clear()
        for _ in range(args.num_steps):
            t0 = time.perf_counter()
            engine.step()
            step_s.append(time.perf_counter() - t0)
        worker_s = (rank0.step_s[-args.num_steps:] if backend is None else
                    ray.get(rank0.__ray_call__.remote(_worker_step_times, args.num_steps), timeout=60))
    finally:
        setattr(executor, hook, run_step)
        engine.shutdown()
        del engine, executor, rank0
        gc.collect()
    step_ms = sorted(1000 * s for s in step_s)
    worker_ms = 1000 * statistics.median(worker_s)
    if async_scheduling:
        executor_ms = float("nan")  # steps overlap: a send-to-answer time spans two of them
        control_ms = statistics.median(step_ms) - worker_ms
    else:
        executor_ms = 1000 * statistics.median(executor_s)
        control_ms = 1000 * statistics.median(e - w for e, w in zip(executor_s, worker_s))
    return StepLatency(name, backend or "in process", step_path, async_scheduling, tensor_parallel_size,
                       args.batch_size, args.num_steps, statistics.median(step_ms), step_ms[int(0.9 * (len(step_ms) - 1))],
                       executor_ms, worker_ms, control_ms, startup_s)


def print_table(results: list[StepLatency]) -> None:
    base = results[0]
    print(f"\nDecode step latency, batch {base.batch_size}, {base.num_steps} timed steps "
          f"(median; ratio to {base.name}):")
    header = (f"{'configuration':<34}{'step ms':>9}{'p90 ms':>9}{'ratio':>7}{'executor ms':>13}{'rank 0 ms':>11}"
              f"{'control ms':>12}{'startup s':>11}")
    print(header)
    print("-" * len(header))
    for r in results:
        print(f"{r.name:<34}{r.step_ms_median:>9.2f}{r.step_ms_p90:>9.2f}{r.step_ms_median / base.step_ms_median:>7.2f}"
              f"{r.executor_ms_median:>13.2f}{r.worker_ms_median:>11.2f}{r.control_ms_median:>12.2f}"
              f"{r.startup_s:>11.1f}")
    for path, pipelined in (("compiled graph", True), ("compiled graph", False), ("actor calls", False)):
        ray_runs = {r.tensor_parallel_size: r for r in results
                    if r.step_path == path and r.async_scheduling == pipelined}
        if 1 not in ray_runs:
            continue
        one = ray_runs[1]
        label = path + (", async scheduling" if pipelined else ", one step at a time")
        line = (f"{label}: Ray N=1 step minus in process {one.step_ms_median - base.step_ms_median:+.2f} ms "
                f"({one.step_ms_median / base.step_ms_median:.2f}x)")
        for n, r in sorted(ray_runs.items()):
            if n > 1:
                line += (f"; each worker beyond one at N={n}: step {(r.step_ms_median - one.step_ms_median) / (n - 1):+.2f}"
                         f" ms, control path {(r.control_ms_median - one.control_ms_median) / (n - 1):+.2f} ms")
        print(line)


def main(argv: list[str] | None = None) -> list[StepLatency]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model", nargs="?", default=None, help="Model folder; default: a tiny random Llama.")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=16)
    parser.add_argument("--num-steps", type=int, default=50, help="Timed decode steps per configuration.")
    parser.add_argument("--warmup-steps", type=int, default=5)
    parser.add_argument("--tp-sizes", default="2", help="Ray tensor-parallel sizes beyond 1, comma-separated.")
    parser.add_argument("--tp-paths", default=",".join(RAY_STEP_PATHS),
                        help="Which ways to run the --tp-sizes configurations, comma-separated (N=1 runs all).")
    parser.add_argument("--max-model-len", type=int, default=128)
    parser.add_argument("--num-blocks", type=int, default=1024, help="KV-cache blocks (enough for the batch).")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output-json", default=None)
    args = parser.parse_args(argv)
    tp_paths = [path for path in args.tp_paths.split(",") if path]
    if set(tp_paths) - set(RAY_STEP_PATHS):
        parser.error(f"--tp-paths takes a comma-separated subset of {','.join(RAY_STEP_PATHS)}, got {args.tp_paths!r}")

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = args.model or str(build_tiny_llama(Path(tmp) / "tiny-llama"))
        configs = [("in process", 1, None, True, False)]
        for n in [1] + [int(x) for x in args.tp_sizes.split(",") if x]:
            # N=1 runs every path: the reference of each larger size's "each worker beyond one".
            configs += [(f"ray N={n} {label}", n, "ray", compiled, pipelined)
                        for path, (label, compiled, pipelined) in RAY_STEP_PATHS.items()
                        if n == 1 or path in tp_paths]
        results = [measure(name, model_dir, args, n, backend, compiled, pipelined)
                   for name, n, backend, compiled, pipelined in configs]
    print_table(results)
    payload = {"model": args.model or "tiny random llama", "device": args.device,
               "results": [asdict(r) for r in results]}
    if args.output_json:
        Path(args.output_json).write_text(json.dumps(payload, indent=2))
    print("RESULT " + json.dumps(payload))
    return results


if __name__ == "__main__":
    main()
