"""Resident memory of `raylm serve` under a mixed load: does it settle, or grow with the requests?

Starts `raylm serve MODEL_DIR` (default settings; extra server flags after `--`), then
1. a first round: 256 concurrent streams of 16 tokens, then waits until the server is idle;
   its resident set (RSS, the server and its child processes) is then the reference;
2. `--rounds` rounds of `--requests` mixed requests (64 in flight): chat or completions,
   streamed or not, n of 1 to 3, 1 to 48 tokens, prompts of 1 to 12 phrases, a third of
   the clients hanging up mid-way; after each round, once idle, the RSS again.
Prints the RSS after each round and its growth over the reference, then ``RESULT {json}``.

    python -m raylm.cluster.benchmarks.bench_memory_under_load MODEL_DIR -- --max-model-len 256

What grew before oneDNN's GEMM rows were padded to a few counts (`kernels/cpu_gemm.onednn_rows`):
every new prefill row count left a compiled primitive behind, and the tiny test model's
server went from ~440 to ~730 MiB over 1,000 mixed requests.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

PHRASES = ["The quick brown fox", "Paged attention stores keys and values", "Hello, world!", "for i in range(10):",
           "Ray places one worker actor on each GPU", "Once upon a time there was a tiny language model"]
IN_FLIGHT = 64
SERVER_START_TIMEOUT_S = 300


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def tree_rss_mib(pid: int) -> float:
    """RSS of the process and its descendants, in MiB."""
    import psutil

    process = psutil.Process(pid)
    return sum(p.memory_info().rss for p in [process, *process.children(recursive=True)]) / 2**20


def start_server(model: str | None, extra: list[str], log: Path) -> tuple[subprocess.Popen, str]:
    port = free_port()
    command = [sys.executable, "-m", "raylm.deploy.cli", "serve", *([model] if model else []), "--port", str(port),
               *extra]
    with open(log, "w") as output:
        process = subprocess.Popen(command, stdout=output, stderr=subprocess.STDOUT)
    base_url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + SERVER_START_TIMEOUT_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"the server exited with {process.returncode}:\n{log.read_text()[-3000:]}")
        try:
            with urllib.request.urlopen(base_url + "/health", timeout=2) as response:
                if response.status == 200:
                    return process, base_url
        except OSError:
            time.sleep(0.3)
    process.kill()
    raise TimeoutError(f"the server did not answer /health in {SERVER_START_TIMEOUT_S} s")


def request_body(model: str, chat: bool, prompt: str, max_tokens: int, n: int, stream: bool) -> dict:
    body = dict(model=model, max_tokens=max_tokens, n=n, temperature=1.0, ignore_eos=True, stream=stream)
    if chat:
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    return body


async def send(session, base_url: str, chat: bool, body: dict, hang_up_after_s: float | None) -> None:
    """One request, read to its end, or dropped after `hang_up_after_s`."""
    url = base_url + ("/v1/chat/completions" if chat else "/v1/completions")

    async def read() -> None:
        async with session.post(url, json=body) as response:
            if response.status != 200:
                raise RuntimeError(f"{response.status}: {await response.text()}")
            await response.read()

    if hang_up_after_s is None:
        await read()
        return
    try:  # cancelling the read closes its connection, as a client that hangs up
        await asyncio.wait_for(read(), hang_up_after_s)
    except asyncio.TimeoutError:
        pass


async def wait_idle(session, base_url: str, timeout_s: float = 60.0) -> None:
    """Until no request runs or waits and no KV block is held (the server's gauges)."""
    deadline = time.monotonic() + timeout_s
    names = ("raylm:num_requests_running", "raylm:num_requests_waiting", "raylm:num_kv_cache_blocks_used")
    while time.monotonic() < deadline:
        async with session.get(base_url + "/metrics") as response:
            text = await response.text()
        values = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                  if line.startswith(names) and not line.startswith("#")]
        if values and not any(values):
            return
        await asyncio.sleep(0.2)
    raise TimeoutError("the server did not become idle")


async def run_load(base_url: str, pid: int, args: argparse.Namespace) -> dict:
    import aiohttp

    rng = random.Random(args.seed)
    gate = asyncio.Semaphore(IN_FLIGHT)
    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=256), timeout=timeout) as session:
        async with session.get(base_url + "/v1/models") as response:
            model = (await response.json())["data"][0]["id"]
        start = tree_rss_mib(pid)
        await asyncio.gather(*(send(session, base_url, chat, request_body(model, chat, rng.choice(PHRASES), 16, 1,
                                                                          True), None)
                               for chat in [rng.random() < 0.5 for _ in range(256)]))
        await wait_idle(session, base_url)
        reference = tree_rss_mib(pid)
        print(f"RSS at start {start:.0f} MiB; after 256 streams (the reference) {reference:.0f} MiB", flush=True)

        async def one() -> None:
            chat, stream = rng.random() < 0.5, rng.random() < 0.6
            n, max_tokens = rng.randint(1, 3), rng.randint(1, 48)
            prompt = " ".join(rng.choice(PHRASES) for _ in range(rng.randint(1, 12)))
            hang_up = rng.uniform(0.001, 0.5) if rng.random() < 1 / 3 else None
            async with gate:
                await send(session, base_url, chat, request_body(model, chat, prompt, max_tokens, n, stream), hang_up)

        rounds = []
        for index in range(args.rounds):
            started = time.monotonic()
            await asyncio.gather(*(one() for _ in range(args.requests)))
            seconds = time.monotonic() - started
            await wait_idle(session, base_url)
            rss = tree_rss_mib(pid)
            rounds.append({"requests": args.requests, "seconds": seconds, "rss_mib": rss,
                           "growth": rss / reference - 1})
            print(f"round {index + 1}: {args.requests} mixed requests in {seconds:.1f} s; RSS {rss:.0f} MiB "
                  f"({rss / reference - 1:+.1%} over the reference)", flush=True)
    return {"start_rss_mib": start, "reference_rss_mib": reference, "rounds": rounds}


def main(argv: list[str] | None = None) -> dict:
    argv = sys.argv[1:] if argv is None else argv
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model", nargs="?", default=None, help="Model folder; default the bundled demo model.")
    parser.add_argument("--requests", type=int, default=1000, help="Mixed requests per round.")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--log", default="bench_memory_server.log", help="The server's output.")
    args = parser.parse_args(argv[:argv.index("--")] if "--" in argv else argv)
    process, base_url = start_server(args.model, extra, Path(args.log))
    try:
        result = asyncio.run(run_load(base_url, process.pid, args))
    finally:
        process.terminate()
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
    result |= {"model": args.model or "demo", "server_args": extra}
    print("RESULT " + json.dumps(result))
    return result


if __name__ == "__main__":
    main()
