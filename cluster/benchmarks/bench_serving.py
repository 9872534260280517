"""`raylm bench serving`: an HTTP load generator for any OpenAI-compatible server.

Sends `--num-prompts` streaming completion requests, arriving as a Poisson process at
`--request-rate` per second (default: all at once) and/or capped at `--max-concurrency`
in flight, and measures per request the time to first token (TTFT), the time per
output token after the first (TPOT) and the gaps between streamed chunks (ITL).
Generated prompts are sent as token ids (so no tokenizer is needed on either side):
- `random`: random token ids, exactly `--input-len` of them;
- `shared-prefix` (vLLM's `prefix_repetition`): one of `--num-prefixes` random prefixes of
  exactly `--prefix-len` token ids followed by a random suffix of exactly `--suffix-len`,
  no two suffixes alike: the workload of many requests behind one system prompt, for
  prefix caching. The warm-up request (`--num-warmups`, default 1) is the first prompt, so,
  as with vLLM's test run, its prefix is cached before the measured run starts; pass
  `--num-warmups 0` to measure from a cold cache;
or come from a file:
- `file`: lines of a text/JSONL file, sent as they are.

    raylm bench serving --base-url http://127.0.0.1:8000 --num-prompts 64 --input-len 128 --output-len 128
    raylm bench serving --base-url http://127.0.0.1:8000 --dataset shared-prefix --prefix-len 1000 \
        --suffix-len 32 --num-prefixes 1 --num-prompts 64 --output-len 64

Prints a table, then ``RESULT {json}``; `--output-json` writes the same JSON to a file.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np


@dataclass
class RequestResult:
    """What one request saw: success, token counts and timings (seconds)."""

    success: bool = False
    prompt_len: int = 0
    output_tokens: int = 0
    ttft: float = 0.0
    latency: float = 0.0
    itl: list[float] = field(default_factory=list)
    error: str = ""


@dataclass
class BenchmarkResult:
    base_url: str
    model: str
    num_prompts: int
    completed: int
    failed: int
    duration_s: float
    total_input_tokens: int
    total_output_tokens: int
    request_throughput: float
    output_throughput: float
    total_token_throughput: float
    mean_ttft_ms: float
    median_ttft_ms: float
    p99_ttft_ms: float
    mean_tpot_ms: float
    median_tpot_ms: float
    p99_tpot_ms: float
    mean_itl_ms: float
    median_itl_ms: float
    p99_itl_ms: float
    request_rate: float
    max_concurrency: int | None
    errors: list[str] = field(default_factory=list)

    def table(self) -> str:
        rows = [
            ("Successful requests:", self.completed),
            ("Failed requests:", self.failed),
            ("Benchmark duration (s):", f"{self.duration_s:.2f}"),
            ("Total input tokens:", self.total_input_tokens),
            ("Total generated tokens:", self.total_output_tokens),
            ("Request throughput (req/s):", f"{self.request_throughput:.2f}"),
            ("Output token throughput (tok/s):", f"{self.output_throughput:.2f}"),
            ("Total token throughput (tok/s):", f"{self.total_token_throughput:.2f}"),
        ]
        lines = ["{s:{c}^{n}}".format(s=" Serving Benchmark Result ", n=50, c="=")]
        lines += [f"{k:<40}{v:<10}" for k, v in rows]
        for title, key in (("Time to First Token", "ttft"), ("Time per Output Token (excl. 1st token)", "tpot"),
                           ("Inter-token Latency", "itl")):
            lines.append("{s:{c}^{n}}".format(s=title, n=50, c="-"))
            for stat in ("mean", "median", "p99"):
                value = getattr(self, f"{stat}_{key}_ms")
                label = f"{stat.capitalize() if stat != 'p99' else 'P99'} {key.upper()} (ms):"
                lines.append(f"{label:<40}{value:<10.2f}")
        lines.append("=" * 50)
        return "\n".join(lines)


def add_cli_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument("--base-url", required=True, help="Server root, e.g. http://127.0.0.1:8000.")
    parser.add_argument("--endpoint", default="/v1/completions", help="Completions route to call.")
    parser.add_argument("--model", default=None, help="Model name to send; default: the first of /v1/models.")
    parser.add_argument("--api-key", default=None, help="Bearer token, if the server wants one.")
    parser.add_argument("--dataset", choices=("random", "shared-prefix", "prefix_repetition", "file"),
                        default="random",
                        help="'random': random token ids; 'shared-prefix' (or vLLM's name, "
                             "'prefix_repetition'): random shared prefixes plus random suffixes; "
                             "'file': prompts from --dataset-path.")
    parser.add_argument("--dataset-path", default=None,
                        help="Text file (one prompt per line) or JSONL with a 'prompt' field.")
    parser.add_argument("--num-prompts", type=int, default=64, help="Requests to send.")
    parser.add_argument("--input-len", type=int, default=128, help="Random prompts: tokens per prompt.")
    parser.add_argument("--output-len", "--prefix-repetition-output-len", type=int, default=128,
                        help="max_tokens of every request.")
    parser.add_argument("--prefix-len", "--prefix-repetition-prefix-len", type=int, default=256,
                        help="Shared-prefix prompts: tokens in each shared prefix.")
    parser.add_argument("--suffix-len", "--prefix-repetition-suffix-len", type=int, default=256,
                        help="Shared-prefix prompts: tokens in each prompt's own suffix.")
    parser.add_argument("--num-prefixes", "--prefix-repetition-num-prefixes", type=int, default=10,
                        help="Shared-prefix prompts: distinct prefixes; prompt i gets prefix i mod this.")
    parser.add_argument("--random-vocab-size", type=int, default=1000,
                        help="Random and shared-prefix prompts: token ids are drawn from [0, this).")
    parser.add_argument("--request-rate", type=float, default=float("inf"),
                        help="Poisson arrival rate in requests/s; inf sends all at once.")
    parser.add_argument("--max-concurrency", type=int, default=None, help="Most requests in flight at once.")
    parser.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=True,
                        help="Ask for exactly --output-len tokens (vLLM's ignore_eos).")
    parser.add_argument("--num-warmups", type=int, default=1,
                        help="Requests sent (one at a time, untimed) before the measured run.")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=600.0, help="Seconds before one request is given up.")
    parser.add_argument("--output-json", default=None, help="Write the result as JSON here.")
    return parser


def sample_shared_prefix_prompts(num_prompts: int, prefix_len: int, suffix_len: int, num_prefixes: int,
                                 vocab_size: int, seed: int) -> list[list[int]]:
    """Prompts of exactly ``prefix_len + suffix_len`` token ids: prompt i starts with random
    prefix ``i % num_prefixes`` (so requests for different prefixes interleave) and ends
    with a random suffix no other prompt has."""
    for name, value, least in (("--num-prompts", num_prompts, 1), ("--prefix-len", prefix_len, 0),
                               ("--suffix-len", suffix_len, 0), ("--num-prefixes", num_prefixes, 1),
                               ("--random-vocab-size", vocab_size, 1)):
        if value < least:
            raise SystemExit(f"{name} is {value}; it must be at least {least}.")
    if vocab_size ** suffix_len < num_prompts:
        raise SystemExit(f"--suffix-len {suffix_len} over --random-vocab-size {vocab_size} allows only "
                         f"{vocab_size ** suffix_len} distinct suffixes, fewer than --num-prompts {num_prompts}.")
    rng = random.Random(seed)
    prefixes = [[rng.randrange(vocab_size) for _ in range(prefix_len)] for _ in range(num_prefixes)]
    suffixes: set[tuple[int, ...]] = set()
    prompts = []
    for i in range(num_prompts):
        suffix = tuple(rng.randrange(vocab_size) for _ in range(suffix_len))
        while suffix in suffixes:  # a repeated suffix would be a whole-prompt cache hit
            suffix = tuple(rng.randrange(vocab_size) for _ in range(suffix_len))
        suffixes.add(suffix)
        prompts.append(prefixes[i % num_prefixes] + list(suffix))
    return prompts


def load_prompts(args: argparse.Namespace) -> list[str | list[int]]:
    rng = random.Random(args.seed)
    if args.dataset == "random":
        return [[rng.randrange(args.random_vocab_size) for _ in range(args.input_len)]
                for _ in range(args.num_prompts)]
    if args.dataset in ("shared-prefix", "prefix_repetition"):
        return sample_shared_prefix_prompts(args.num_prompts, args.prefix_len, args.suffix_len, args.num_prefixes,
                                            args.random_vocab_size, args.seed)
    if not args.dataset_path:
        raise SystemExit("--dataset file needs --dataset-path.")
    prompts: list[str | list[int]] = []
    for line in Path(args.dataset_path).read_text().splitlines():
        if not line.strip():
            continue
        if line.lstrip().startswith("{"):
            prompts.append(json.loads(line)["prompt"])
        else:
            prompts.append(line)
    if not prompts:
        raise SystemExit(f"{args.dataset_path} holds no prompts.")
    return [prompts[i % len(prompts)] for i in range(args.num_prompts)]


async def _request(session: Any, url: str, payload: dict, headers: dict, timeout: float) -> RequestResult:
    import aiohttp

    result = RequestResult(prompt_len=len(payload["prompt"]) if isinstance(payload["prompt"], list) else 0)
    start = time.perf_counter()
    last = start
    chunks = 0
    try:
        async with session.post(url, json=payload, headers=headers,
                                timeout=aiohttp.ClientTimeout(total=timeout)) as response:
            if response.status != 200:
                result.error = f"HTTP {response.status}: {(await response.text())[:200]}"
                return result
            buffer = b""
            async for data in response.content.iter_any():
                buffer += data
                while b"\n\n" in buffer:
                    event, buffer = buffer.split(b"\n\n", 1)
                    line = event.strip()
                    if not line.startswith(b"data:"):
                        continue
                    body = line[5:].strip()
                    if body == b"[DONE]":
                        continue
                    message = json.loads(body)
                    if "error" in message:
                        result.error = str(message["error"])[:200]
                        return result
                    if message.get("usage"):
                        result.output_tokens = message["usage"].get("completion_tokens") or 0
                        result.prompt_len = message["usage"].get("prompt_tokens") or result.prompt_len
                    # Every chunk with a choice carries a new token (its text may be empty: a
                    # byte of an unfinished character), as vLLM's benchmark counts them.
                    if not message.get("choices"):
                        continue
                    now = time.perf_counter()
                    if chunks == 0:
                        result.ttft = now - start
                    else:
                        result.itl.append(now - last)
                    last = now
                    chunks += 1
        result.latency = time.perf_counter() - start
        if not result.output_tokens:
            result.output_tokens = chunks
        result.success = chunks > 0
        if not result.success:
            result.error = "no tokens streamed"
    except Exception as exc:  # noqa: BLE001 - a failed request is a result, not a crash
        result.error = repr(exc)[:200]
    return result


async def _first_model(session: Any, base_url: str, headers: dict) -> str:
    async with session.get(base_url + "/v1/models", headers=headers) as response:
        response.raise_for_status()
        return (await response.json())["data"][0]["id"]


async def run_benchmark(args: argparse.Namespace) -> BenchmarkResult:
    import aiohttp

    base_url = args.base_url.rstrip("/")
    prompts = load_prompts(args)
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    connector = aiohttp.TCPConnector(limit=0, force_close=False)
    rng = np.random.default_rng(args.seed)
    async with aiohttp.ClientSession(connector=connector) as session:
        model = args.model or await _first_model(session, base_url, headers)
        semaphore = asyncio.Semaphore(args.max_concurrency) if args.max_concurrency else None

        async def one(prompt: str | list[int]) -> RequestResult:
            payload = {"model": model, "prompt": prompt, "max_tokens": args.output_len, "temperature": 0.0,
                       "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": args.ignore_eos}
            if semaphore is None:
                return await _request(session, base_url + args.endpoint, payload, headers, args.timeout)
            async with semaphore:
                return await _request(session, base_url + args.endpoint, payload, headers, args.timeout)

        for prompt in prompts[:args.num_warmups]:
            warmup = await one(prompt)
            if not warmup.success:
                raise SystemExit(f"The warm-up request failed: {warmup.error}")
        tasks = []
        start = time.perf_counter()
        for prompt in prompts:
            tasks.append(asyncio.create_task(one(prompt)))
            if args.request_rate != float("inf"):
                await asyncio.sleep(float(rng.exponential(1.0 / args.request_rate)))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
    return summarize(args, model, results, duration)


def summarize(args: argparse.Namespace, model: str, results: list[RequestResult], duration: float
              ) -> BenchmarkResult:
    ok = [r for r in results if r.success]
    ttfts = [r.ttft for r in ok]
    tpots = [(r.latency - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    itls = [gap for r in ok for gap in r.itl]
    input_tokens = sum(r.prompt_len for r in ok)
    output_tokens = sum(r.output_tokens for r in ok)

    def stats(values: list[float]) -> tuple[float, float, float]:
        if not values:
            return 0.0, 0.0, 0.0
        array = np.asarray(values) * 1000.0
        return float(array.mean()), float(np.median(array)), float(np.percentile(array, 99))

    ttft, tpot, itl = stats(ttfts), stats(tpots), stats(itls)
    return BenchmarkResult(
        base_url=args.base_url, model=model, num_prompts=len(results), completed=len(ok),
        failed=len(results) - len(ok), duration_s=duration, total_input_tokens=input_tokens,
        total_output_tokens=output_tokens, request_throughput=len(ok) / duration,
        output_throughput=output_tokens / duration, total_token_throughput=(input_tokens + output_tokens) / duration,
        mean_ttft_ms=ttft[0], median_ttft_ms=ttft[1], p99_ttft_ms=ttft[2],
        mean_tpot_ms=tpot[0], median_tpot_ms=tpot[1], p99_tpot_ms=tpot[2],
        mean_itl_ms=itl[0], median_itl_ms=itl[1], p99_itl_ms=itl[2],
        request_rate=args.request_rate, max_concurrency=args.max_concurrency,
        errors=sorted({r.error for r in results if r.error})[:5])


def run(args: argparse.Namespace) -> BenchmarkResult:
    result = asyncio.run(run_benchmark(args))
    print(result.table())
    if result.errors:
        print("Errors:", *result.errors, sep="\n  ")
    report = asdict(result)
    report["request_rate"] = str(result.request_rate)
    if args.output_json:
        Path(args.output_json).write_text(json.dumps(report, indent=2))
    print("RESULT " + json.dumps(report))
    return result


def main(argv: list[str] | None = None) -> int:
    args = add_cli_args(argparse.ArgumentParser(description=__doc__.splitlines()[0])).parse_args(argv)
    result = run(args)
    return 0 if result.failed == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
