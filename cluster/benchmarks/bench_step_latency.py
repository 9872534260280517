"""Per-step decode latency: in process, Ray with one worker, Ray with N workers.

What the Ray control path costs: every configuration runs the same batch of sequences
(greedy, EOS ignored) through `LLMEngine.step()`; after the prefill and a few warm-up
steps, each decode step is timed, whole (scheduler, executor, output processing) and
the executor's share alone (`execute_model`: sending the step, the workers' forward and
sampling, the answer coming back).

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

import torch


@dataclass
class StepLatency:
    name: str
    backend: str
    tensor_parallel_size: int
    batch_size: int
    num_steps: int
    step_ms_median: float
    step_ms_p90: float
    executor_ms_median: float
    startup_s: float


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


def measure(name: str, model_dir: str, args: argparse.Namespace, tensor_parallel_size: int,
            backend: str | None) -> StepLatency:
    from raylm.engine.arg_utils import EngineArgs
    from raylm.engine.llm_engine import LLMEngine
    from raylm.engine.sampling_params import SamplingParams

    engine_args = EngineArgs(model=model_dir, dtype=args.dtype, skip_tokenizer_init=True,
                             tensor_parallel_size=tensor_parallel_size, distributed_executor_backend=backend,
                             max_num_seqs=args.batch_size, max_model_len=args.max_model_len,
                             num_gpu_blocks_override=args.num_blocks, disable_log_stats=True, device=args.device)
    start = time.perf_counter()
    engine = LLMEngine.from_engine_args(engine_args)
    startup_s = time.perf_counter() - start

    executor = engine.executor
    run_step = executor.execute_model
    executor_s: list[float] = []

    def timed_execute_model(req):
        t0 = time.perf_counter()
        out = run_step(req)
        executor_s.append(time.perf_counter() - t0)
        return out

    executor.execute_model = timed_execute_model
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
    finally:
        executor.execute_model = run_step
        engine.shutdown()
        del engine, executor
        gc.collect()
    step_ms = sorted(1000 * s for s in step_s)
    return StepLatency(name, backend or "in process", tensor_parallel_size, args.batch_size, args.num_steps,
                       statistics.median(step_ms), step_ms[int(0.9 * (len(step_ms) - 1))],
                       1000 * statistics.median(executor_s), startup_s)


def print_table(results: list[StepLatency]) -> None:
    base = results[0]
    print(f"\nDecode step latency, batch {base.batch_size}, {base.num_steps} timed steps "
          f"(median; ratio to {base.name}):")
    header = f"{'configuration':<16}{'step ms':>10}{'p90 ms':>10}{'executor ms':>13}{'ratio':>8}{'startup s':>11}"
    print(header)
    print("-" * len(header))
    for r in results:
        print(f"{r.name:<16}{r.step_ms_median:>10.2f}{r.step_ms_p90:>10.2f}{r.executor_ms_median:>13.2f}"
              f"{r.step_ms_median / base.step_ms_median:>8.2f}{r.startup_s:>11.1f}")
    print("Control path cost (Ray N=1 minus in process, per step): "
          f"{results[1].step_ms_median - base.step_ms_median:.2f} ms" if len(results) > 1 else "")


def main(argv: list[str] | None = None) -> list[StepLatency]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model", nargs="?", default=None, help="Model folder; default: a tiny random Llama.")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=16)
    parser.add_argument("--num-steps", type=int, default=50, help="Timed decode steps per configuration.")
    parser.add_argument("--warmup-steps", type=int, default=5)
    parser.add_argument("--tp-sizes", default="2", help="Ray tensor-parallel sizes beyond 1, comma-separated.")
    parser.add_argument("--max-model-len", type=int, default=128)
    parser.add_argument("--num-blocks", type=int, default=1024, help="KV-cache blocks (enough for the batch).")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output-json", default=None)
    args = parser.parse_args(argv)

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = args.model or str(build_tiny_llama(Path(tmp) / "tiny-llama"))
        configs = [("in process", 1, None), ("ray N=1", 1, "ray")]
        configs += [(f"ray N={n}", n, "ray") for n in (int(x) for x in args.tp_sizes.split(",") if x)]
        results = [measure(name, model_dir, args, n, backend) for name, n, backend in configs]
    print_table(results)
    payload = {"model": args.model or "tiny random llama", "device": args.device,
               "results": [asdict(r) for r in results]}
    if args.output_json:
        Path(args.output_json).write_text(json.dumps(payload, indent=2))
    print("RESULT " + json.dumps(payload))
    return results


if __name__ == "__main__":
    main()
