"""raylm's server against vLLM's CPU build's, loaded by one client: `vllm bench serve`.

    python -m raylm.cluster.benchmarks.serve_vs_vllm MODEL_DIR --dtype bfloat16 \
        --peer-env $PEER_DIR/env.sh --runs 2

Starts `raylm serve MODEL_DIR` and `vllm serve MODEL_DIR` in turn on one port (alternating,
`--runs` times each, so drift of a shared machine hits both), and against each runs
`vllm bench serve` with vLLM's random dataset: `--num-prompts` prompts of `--input-len`
tokens, `--output-len` tokens each, all sent at once, EOS ignored, greedy unless
`--temperature` (with `--top-p`, `--top-k`) says otherwise. Each server is
stopped before the next starts. Prints one row per run and the ratio of the medians of
output tokens/s, then ``RESULT {json}``.

vLLM lives in its own environment (`../shared/peers/vllm-cpu/`): its commands run through
``--peer-env``, from a temporary folder (from raylm's checkout vLLM would import raylm's
top-level `kernels/` as Hugging Face's).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import asdict, dataclass
from pathlib import Path

# vLLM's CPU build compiles its model at start (~45 s here); raylm starts in seconds.
SERVER_START_TIMEOUT_S = 600
CLIENT_TIMEOUT_S = 1800


@dataclass
class ServedRun:
    server: str
    output_tokens_per_s: float
    median_ttft_ms: float
    median_tpot_ms: float
    completed: int


def _in_peer_env(peer_env: str, command: list[str]) -> list[str]:
    return ["bash", "-c", 'source "$0" && exec "$@"', str(Path(peer_env).resolve()), *command]


def server_command(server: str, args: argparse.Namespace) -> list[str]:
    model = str(Path(args.model).resolve())
    if server == "raylm":
        return [sys.executable, "-m", "raylm.deploy.cli", "serve", model, "--dtype", args.dtype, "--port",
                str(args.port), "--max-model-len", str(args.max_model_len)]
    return _in_peer_env(args.peer_env, ["vllm", "serve", model, "--dtype", args.dtype, "--port", str(args.port),
                                        "--max-model-len", str(args.max_model_len)])


def client_command(args: argparse.Namespace, result_dir: Path, name: str) -> list[str]:
    return _in_peer_env(args.peer_env, [
        "vllm", "bench", "serve", "--backend", "vllm", "--model", str(Path(args.model).resolve()),
        "--dataset-name", "random", "--random-input-len", str(args.input_len),
        "--random-output-len", str(args.output_len), "--num-prompts", str(args.num_prompts),
        "--port", str(args.port), "--ignore-eos", "--temperature", str(args.temperature), "--seed", str(args.seed),
        "--save-result", "--result-dir", str(result_dir), "--result-filename", name]
        + (["--top-p", str(args.top_p)] if args.top_p is not None else [])
        + (["--top-k", str(args.top_k)] if args.top_k is not None else []))


def wait_until_healthy(port: int, server: subprocess.Popen, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise RuntimeError(f"the server exited with status {server.returncode} before it was healthy")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as response:
                if response.status == 200:
                    return
        except OSError:
            pass
        time.sleep(1)
    raise TimeoutError(f"no healthy server on port {port} after {timeout_s:.0f} s")


def stop(server: subprocess.Popen) -> None:
    """SIGTERM to the server's process group (vLLM's engine runs in a child), then SIGKILL."""
    if server.poll() is not None:
        return
    os.killpg(server.pid, signal.SIGTERM)
    try:
        server.wait(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(server.pid, signal.SIGKILL)
        server.wait()


def run_once(server_name: str, args: argparse.Namespace, workdir: Path, index: int) -> ServedRun:
    log_path = workdir / f"{server_name}-{index}.log"
    with open(log_path, "w") as log:
        server = subprocess.Popen(server_command(server_name, args), stdout=log, stderr=subprocess.STDOUT,
                                  cwd=workdir, start_new_session=True)
        try:
            wait_until_healthy(args.port, server, SERVER_START_TIMEOUT_S)
            name = f"{server_name}-{index}.json"
            client = subprocess.run(client_command(args, workdir, name), capture_output=True, text=True,
                                    cwd=workdir, timeout=CLIENT_TIMEOUT_S, check=False)
            if client.returncode != 0:
                raise RuntimeError(f"vllm bench serve against {server_name} failed:\n"
                                   + (client.stdout + client.stderr)[-3000:])
        except Exception:
            print((log_path.read_text())[-3000:], file=sys.stderr)
            raise
        finally:
            stop(server)
    report = json.loads((workdir / name).read_text())
    return ServedRun(server=server_name, output_tokens_per_s=float(report["output_throughput"]),
                     median_ttft_ms=float(report["median_ttft_ms"]), median_tpot_ms=float(report["median_tpot_ms"]),
                     completed=int(report["completed"]))


def summarize(runs: list[ServedRun]) -> dict:
    def median(server: str, key: str) -> float:
        return statistics.median(getattr(r, key) for r in runs if r.server == server)

    summary = {f"{server}_{key}": round(median(server, key), 2) for server in ("raylm", "vllm")
               for key in ("output_tokens_per_s", "median_ttft_ms", "median_tpot_ms")}
    summary["raylm_over_vllm_output_tokens_per_s"] = round(
        summary["raylm_output_tokens_per_s"] / summary["vllm_output_tokens_per_s"], 3)
    return summary


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--peer-env", required=True, help="the shell file that activates vLLM's environment")
    parser.add_argument("--runs", type=int, default=2, help="runs per server, alternating (default 2)")
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--max-model-len", type=int, default=1024)
    parser.add_argument("--port", type=int, default=8011)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--temperature", type=float, default=0.0, help="sampling temperature (default 0: greedy)")
    parser.add_argument("--top-p", type=float, default=None, help="top-p of every request (default: none)")
    parser.add_argument("--top-k", type=int, default=None, help="top-k of every request (default: none)")
    parser.add_argument("--output-json", default=None)
    args = parser.parse_args(argv)
    if not Path(args.peer_env).is_file():
        parser.error(f"--peer-env {args.peer_env!r} is not a file")

    runs: list[ServedRun] = []
    with tempfile.TemporaryDirectory(prefix="raylm-serve-vs-vllm-") as tmp:
        print(f"{'server':8} {'out tok/s':>10} {'TTFT med ms':>12} {'TPOT med ms':>12} {'done':>5}", flush=True)
        for index in range(args.runs):
            for server_name in ("raylm", "vllm"):
                run = run_once(server_name, args, Path(tmp), index)
                runs.append(run)
                print(f"{run.server:8} {run.output_tokens_per_s:10.1f} {run.median_ttft_ms:12.1f} "
                      f"{run.median_tpot_ms:12.2f} {run.completed:5d}", flush=True)
    summary = summarize(runs)
    report = {"model": args.model, "dtype": args.dtype, "runs": [asdict(r) for r in runs], **summary}
    if args.output_json:
        Path(args.output_json).write_text(json.dumps(report, indent=2))
    print(f"raylm / vLLM output tokens/s (medians): {summary['raylm_over_vllm_output_tokens_per_s']:.2f}x")
    print("RESULT " + json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
