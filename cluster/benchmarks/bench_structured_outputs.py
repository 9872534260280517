"""What structured outputs cost: tokens/s with a JSON schema on every request against the
same load without one, and the grammars' compile times; with ``--peer-env``, the same
ratio on vLLM's CPU build (its own xgrammar backend) in the same run.

Both loads generate exactly ``--output-len`` tokens per request, greedy: the free one
ignores EOS, the constrained one's schema (an array of at least `MIN_ITEMS` objects) cannot
end sooner. The two alternate ``--repeats`` times in one process (one engine) and the
fastest run of each counts, so a busy neighbour slows both alike. The last line printed is
``RESULT {json}``.

    python -m raylm.cluster.benchmarks.bench_structured_outputs MODEL_DIR --num-prompts 64
    python -m raylm.cluster.benchmarks.bench_structured_outputs MODEL_DIR --peer-env $PEER_DIR/env.sh
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

# Minimal JSON for this schema is far longer than any --output-len here: every request runs
# to max_tokens, as the free load does with ignore_eos.
MIN_ITEMS = 200
SCHEMA = {"type": "array", "minItems": MIN_ITEMS,
          "items": {"type": "object",
                    "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 9999},
                                   "name": {"type": "string", "maxLength": 12},
                                   "kind": {"enum": ["a", "b", "c"]},
                                   "ok": {"type": "boolean"}},
                    "required": ["id", "name", "kind"]}}


def _nested(depth: int) -> dict:
    schema: dict = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"child": schema, "n": {"type": "integer"}}, "required": ["child"]}
    return schema


# Grammars whose compile times are reported (on the model's vocabulary).
COMPILE_CASES: dict[str, dict[str, Any]] = {
    "benchmark schema": {"json": SCHEMA},
    "object, 3 typed fields": {"json": {"type": "object", "properties": {
        "name": {"type": "string", "pattern": "^[a-z]{1,8}$"}, "age": {"type": "integer", "minimum": 0,
                                                                      "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["x", "y"]}, "maxItems": 3}}, "required": ["name", "age"]}},
    "object, 50 optional fields": {"json": {"type": "object", "properties": {
        f"field_{i}": {"type": ["integer", "string", "null"]} for i in range(50)}}},
    "nested 20 deep": {"json": _nested(20)},
    "json_object": {"json_object": True},
    "regex": {"regex": r"\d{3}-\d{4}-[A-Z]{2,5}"},
    "choice of 100": {"choice": [f"option {i}" for i in range(100)]},
}


def best_of_alternating(runs: dict[str, Callable[[], int]], repeats: int) -> dict[str, dict[str, float]]:
    """Runs each callable (returning the tokens it generated) `repeats` times, alternating;
    per name: the fastest run's wall seconds and tokens/s, the least CPU time the process
    spent on a run (on a machine shared with other work, CPU time moves far less than wall
    time) and tokens per CPU second, and every run's wall and CPU seconds."""
    times: dict[str, list[float]] = {name: [] for name in runs}
    cpu_times: dict[str, list[float]] = {name: [] for name in runs}
    tokens: dict[str, int] = {}
    for _ in range(repeats):
        for name, run in runs.items():
            start, cpu_start = time.perf_counter(), time.process_time()
            tokens[name] = run()
            times[name].append(time.perf_counter() - start)
            cpu_times[name].append(time.process_time() - cpu_start)
    return {name: {"best_s": min(times[name]), "tokens": tokens[name], "tokens_per_s": tokens[name] / min(times[name]),
                   "best_cpu_s": min(cpu_times[name]), "tokens_per_cpu_s": tokens[name] / min(cpu_times[name]),
                   "all_s": times[name], "all_cpu_s": cpu_times[name]} for name in runs}


def overhead(result: dict[str, dict[str, float]], key: str = "tokens_per_s") -> float:
    """How much slower the constrained load ran than the free one (0.05 = 5%)."""
    return result["free"][key] / result["json_schema"][key] - 1.0


def bench_raylm(args: argparse.Namespace, prompts: list[list[int]]) -> dict[str, Any]:
    from raylm.engine import LLM, SamplingParams, StructuredOutputsParams

    llm = LLM(args.model, dtype=args.dtype, max_model_len=args.max_model_len, max_num_seqs=args.num_prompts,
              seed=args.seed, disable_log_stats=True)
    try:
        manager = llm.llm_engine.structured_output_manager
        start = time.perf_counter()
        manager.start_warm_up().result()
        started_ms = round((time.perf_counter() - start) * 1e3, 2)
        compile_ms = {"compile worker start (xgrammar import, vocabulary index)": started_ms}
        for name, fields in COMPILE_CASES.items():
            start = time.perf_counter()
            manager.compile(StructuredOutputsParams(**fields)).result()
            compile_ms[name] = round((time.perf_counter() - start) * 1e3, 2)
        free = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
        constrained = SamplingParams(temperature=0.0, max_tokens=args.output_len,
                                     structured_outputs=StructuredOutputsParams(json=SCHEMA))
        batch = [{"prompt_token_ids": p} for p in prompts]

        def run(params: SamplingParams) -> Callable[[], int]:
            def generate() -> int:
                outputs = llm.generate(batch, params, use_tqdm=False)
                return sum(len(o.outputs[0].token_ids) for o in outputs)
            return generate

        run(free)()  # warm-up
        run(constrained)()
        result = best_of_alternating({"free": run(free), "json_schema": run(constrained)}, args.repeats)
        return {"runs": result, "overhead": overhead(result), "cpu_overhead": overhead(result, "tokens_per_cpu_s"),
                "compile_ms": compile_ms}
    finally:
        llm.shutdown()


# The same measurement inside vLLM's environment (its LLM and StructuredOutputsParams).
_VLLM_SCRIPT = """
import json, sys, time


def main():
    from vllm import LLM, SamplingParams
    from vllm.sampling_params import StructuredOutputsParams

    config = json.loads(open(sys.argv[1]).read())
    llm = LLM(model=config["model"], dtype=config["dtype"], max_model_len=config["max_model_len"],
              max_num_seqs=config["num_prompts"], seed=config["seed"])
    batch = [{"prompt_token_ids": p} for p in config["prompts"]]
    free = SamplingParams(temperature=0.0, max_tokens=config["output_len"], ignore_eos=True)
    constrained = SamplingParams(temperature=0.0, max_tokens=config["output_len"],
                                 structured_outputs=StructuredOutputsParams(json=config["schema"]))

    import psutil

    def cpu_seconds():
        # vLLM's engine core runs in a child process: the whole tree's CPU time.
        me = psutil.Process()
        return sum(sum(p.cpu_times()[:2]) for p in [me] + me.children(recursive=True))

    def generate(params):
        return sum(len(o.outputs[0].token_ids) for o in llm.generate(batch, params, use_tqdm=False))

    generate(free)
    generate(constrained)
    times = {"free": [], "json_schema": []}
    cpu = {"free": [], "json_schema": []}
    tokens = {}
    for _ in range(config["repeats"]):
        for name, params in (("free", free), ("json_schema", constrained)):
            start, cpu_start = time.perf_counter(), cpu_seconds()
            tokens[name] = generate(params)
            times[name].append(time.perf_counter() - start)
            cpu[name].append(cpu_seconds() - cpu_start)
    print("VLLM_RESULT " + json.dumps({n: {"best_s": min(t), "tokens": tokens[n], "tokens_per_s": tokens[n] / min(t),
                                           "best_cpu_s": min(cpu[n]), "tokens_per_cpu_s": tokens[n] / min(cpu[n]),
                                           "all_s": t, "all_cpu_s": cpu[n]} for n, t in times.items()}), flush=True)


if __name__ == "__main__":  # vLLM starts its engine core in a spawned process
    main()
"""


def bench_vllm(args: argparse.Namespace, prompts: list[list[int]]) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="raylm-vllm-structured-") as tmp:
        config = Path(tmp) / "config.json"
        config.write_text(json.dumps({"model": str(Path(args.model).resolve()), "dtype": args.dtype,
                                      "max_model_len": args.max_model_len, "num_prompts": args.num_prompts,
                                      "seed": args.seed, "prompts": prompts, "output_len": args.output_len,
                                      "schema": SCHEMA, "repeats": args.repeats}))
        script = Path(tmp) / "vllm_structured.py"
        script.write_text(_VLLM_SCRIPT)
        command = ["bash", "-c", 'source "$0" && exec python "$@"', str(Path(args.peer_env).resolve()), str(script),
                   str(config)]
        # From the temporary folder: raylm's checkout on sys.path would shadow vLLM's imports.
        proc = subprocess.run(command, capture_output=True, text=True, timeout=3600, check=False, cwd=tmp)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("VLLM_RESULT ")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"vLLM's run failed (exit status {proc.returncode}):\n" + (proc.stdout + proc.stderr)[-3000:])
    result = json.loads(lines[-1][len("VLLM_RESULT "):])
    return {"runs": result, "overhead": overhead(result), "cpu_overhead": overhead(result, "tokens_per_cpu_s")}


def run(args: argparse.Namespace) -> dict[str, Any]:
    from raylm.cluster.benchmarks.bench_throughput import read_model_config, sample_random_prompts, \
        special_token_ids

    model_config = read_model_config(args.model)
    prompts = sample_random_prompts(args.num_prompts, args.input_len, model_config["vocab_size"],
                                    special_token_ids(args.model, model_config), args.seed)
    report: dict[str, Any] = {"num_prompts": args.num_prompts, "input_len": args.input_len,
                              "output_len": args.output_len, "repeats": args.repeats,
                              "raylm": bench_raylm(args, prompts)}
    if args.peer_env:
        report["vllm"] = bench_vllm(args, prompts)
    for name in ("raylm", "vllm"):
        if name in report:
            runs = report[name]["runs"]
            print(f"{name}: free {runs['free']['tokens_per_s']:.0f} tok/s, JSON schema "
                  f"{runs['json_schema']['tokens_per_s']:.0f} tok/s, overhead {report[name]['overhead']:+.1%}")
    for name in ("raylm", "vllm"):
        if name in report:
            runs = report[name]["runs"]
            print(f"{name} per CPU second: free {runs['free']['tokens_per_cpu_s']:.0f}, JSON schema "
                  f"{runs['json_schema']['tokens_per_cpu_s']:.0f} tokens, overhead {report[name]['cpu_overhead']:+.1%}")
    print("compile times (ms): " + ", ".join(f"{k} {v}" for k, v in report["raylm"]["compile_ms"].items()))
    print("RESULT " + json.dumps(report))
    return report


def add_cli_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument("model", help="Hugging Face model folder (tests/bench_models.py builds the 5M Llama).")
    parser.add_argument("--num-prompts", type=int, default=64, help="Requests in the batch (default: %(default)s).")
    parser.add_argument("--input-len", type=int, default=128, help="Prompt tokens, ±10%% (default: %(default)s).")
    parser.add_argument("--output-len", type=int, default=128, help="Tokens per request (default: %(default)s).")
    parser.add_argument("--max-model-len", type=int, default=512, help="(default: %(default)s)")
    parser.add_argument("--repeats", type=int, default=5, help="Timed runs of each load (default: %(default)s).")
    parser.add_argument("--dtype", default="float32", help="(default: %(default)s)")
    parser.add_argument("--seed", type=int, default=0, help="(default: %(default)s)")
    parser.add_argument("--peer-env", default=None,
                        help="The shell file that activates vLLM's CPU build ($PEER_DIR/env.sh): also measure vLLM.")
    return parser


def main(argv: list[str] | None = None) -> dict[str, Any]:
    return run(add_cli_args(argparse.ArgumentParser(description=__doc__.splitlines()[0])).parse_args(argv))


if __name__ == "__main__":
    main(sys.argv[1:])
