"""Prefix-aware routing against Serve's power-of-two-choices: prefix-cache hit rate and TTFT.

Deploys the raylm Serve app with `--replicas` engine replicas (2) under each router in
turn, alternating (`--repeats` rounds, the first router swapped each round, so that load
from elsewhere on the machine falls on both), and sends each the same workload:
bench_serving's shared-prefix prompts, `--num-prefixes` (8) prefixes of `--prefix-len`
(1000) token ids with `--suffix-len` (32) token suffixes, interleaved (prompt i has prefix
i mod 8). A warm-up round sends each prefix once; the measured run then sends
`--num-prompts` streaming requests, `--max-concurrency` in flight. Reported per router:

- the prefix-cache hit rate of the measured run, vLLM's definition (prompt tokens found in
  the cache / prompt tokens looked up), summed over the replicas from their own counters
  (`record_routing_stats`, read from the replica actors);
- TTFT (median, mean, p99) as the client sees it, through Serve's proxy and the ingress;
- the router's decisions (prefix_match, no_match, ...) from the ingress's /metrics.

By default each replica's KV cache (`--num-gpu-blocks`) holds about 5 of the 8 prefixes:
together the replicas can hold them all, one alone cannot, which is what a prefix-aware
router is for. `--num-gpu-blocks 0` gives each replica the engine's default cache instead.

Last, what keying a request costs the ingress (deploy/prefix_key.py: JSON, tokenizing,
block hashes) against hashing the prompt's characters in chunks as character-tree
routers do, per request of the same prompt length, as text completions and as chat.

    python -m raylm.cluster.benchmarks.bench_prefix_routing            # the demo model, 2 replicas
    python -m raylm.cluster.benchmarks.bench_prefix_routing --model /models/llama --replica-cpus 4

Prints a table, then ``RESULT {json}``.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from raylm.cluster.benchmarks.bench_serving import RequestResult, _request, sample_shared_prefix_prompts

APP = "raylm-routing-bench"
ENGINE = "RaylmDeployment"
ROUTERS = ("prefix_aware", "power_of_two")


def add_cli_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument("--model", default=None,
                        help="Model folder; default: the bundled demo model (5M), its context raised to fit.")
    parser.add_argument("--dtype", default="auto", help="Engine dtype.")
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--replica-cpus", type=float, default=1.0, help="Ray CPUs of each engine replica.")
    parser.add_argument("--num-gpu-blocks", type=int, default=320,
                        help="KV-cache blocks per replica (0: the engine's default). The default holds ~5 of 8 "
                             "prefixes of 1000 tokens.")
    parser.add_argument("--num-prefixes", type=int, default=8)
    parser.add_argument("--prefix-len", type=int, default=1000)
    parser.add_argument("--suffix-len", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=16)
    parser.add_argument("--num-prompts", type=int, default=64, help="Measured requests per run.")
    parser.add_argument("--max-concurrency", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=2, help="Rounds of (prefix_aware, power_of_two).")
    parser.add_argument("--stats-period", type=float, default=0.5, help="router_stats_period_s.")
    parser.add_argument("--address", default="local", help="Ray address; default: a private local Ray.")
    parser.add_argument("--num-cpus", type=int, default=4, help="Logical CPUs of the private Ray.")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output-json", default=None)
    return parser


# ----------------------------------------------------------------- serving
def prepare_model(args: argparse.Namespace, workdir: Path) -> str:
    """The model folder: --model, or the demo model with max_position_embeddings raised to
    the workload's length (RoPE: no weights depend on it)."""
    if args.model:
        return args.model
    from raylm.models.bundled import default_model_path

    folder = workdir / "demo-long"
    shutil.copytree(default_model_path(), folder)
    config = json.loads((folder / "config.json").read_text())
    config["max_position_embeddings"] = max(config["max_position_embeddings"],
                                            2 ** (args.prefix_len + args.suffix_len + args.output_len).bit_length())
    (folder / "config.json").write_text(json.dumps(config))
    return str(folder)


def deploy(model: str, router: str, args: argparse.Namespace, port: int) -> str:
    from ray import serve

    from raylm.deploy.serve_app import build_serve_app

    engine = {"model": model, "device": "cpu", "dtype": args.dtype}
    if args.num_gpu_blocks:
        engine["num_gpu_blocks_override"] = args.num_gpu_blocks
    app = build_serve_app(engine, {"served_model_name": ["bench"]}, num_replicas=args.replicas,
                          replica_cpus=args.replica_cpus, ingress_cpus=0.25, request_router=router,
                          router_stats_period_s=args.stats_period)
    serve.run(app, name=APP, route_prefix="/")
    return f"http://127.0.0.1:{port}"


def replica_reports() -> dict[str, dict[str, Any]]:
    """Each engine replica's prefix-cache counters, from its actor."""
    import ray

    reports = {}
    for entry in ray.util.list_named_actors(all_namespaces=True):
        name = entry["name"] if isinstance(entry, dict) else entry
        if name.startswith(f"SERVE_REPLICA::{APP}#{ENGINE}#"):
            actor = ray.get_actor(name, namespace="serve")
            reports[name.rsplit("#", 1)[1]] = ray.get(actor.record_routing_stats.remote(), timeout=60)
    return reports


def decisions(url: str) -> dict[str, float]:
    import re
    import urllib.request

    text = urllib.request.urlopen(url + "/metrics", timeout=60).read().decode()
    return {kind: float(value) for kind, value in re.findall(r'raylm:router_requests_total\{decision="(\w+)"\} (\S+)',
                                                             text)}


async def send_all(url: str, prompts: list[list[int]], args: argparse.Namespace, concurrency: int
                   ) -> list[RequestResult]:
    import aiohttp

    semaphore = asyncio.Semaphore(concurrency)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        async def one(prompt: list[int]) -> RequestResult:
            payload = {"model": "bench", "prompt": prompt, "max_tokens": args.output_len, "temperature": 0.0,
                       "stream": True, "ignore_eos": True}
            async with semaphore:
                return await _request(session, url + "/v1/completions", payload, {}, 600.0)

        return list(await asyncio.gather(*(one(p) for p in prompts)))


def run_router(model: str, router: str, args: argparse.Namespace, prompts: list[list[int]], port: int
               ) -> dict[str, Any]:
    from ray import serve

    url = deploy(model, router, args, port)
    try:
        warmup = asyncio.run(send_all(url, prompts[:args.num_prefixes], args, 1))
        failed = [r.error for r in warmup if not r.success]
        if failed:
            raise SystemExit(f"warm-up failed: {failed[:2]}")
        time.sleep(3 * args.stats_period)
        before, decided_before = replica_reports(), decisions(url)
        start = time.perf_counter()
        results = asyncio.run(send_all(url, prompts[args.num_prefixes:], args, args.max_concurrency))
        duration = time.perf_counter() - start
        time.sleep(3 * args.stats_period)
        after, decided_after = replica_reports(), decisions(url)
    finally:
        serve.delete(APP)
    ok = [r for r in results if r.success]
    if len(ok) != len(results):
        raise SystemExit(f"{len(results) - len(ok)} requests failed: {[r.error for r in results if r.error][:2]}")
    hits = sum(after[r]["prefix_cache_hits"] - before.get(r, {}).get("prefix_cache_hits", 0) for r in after)
    queries = sum(after[r]["prefix_cache_queries"] - before.get(r, {}).get("prefix_cache_queries", 0) for r in after)
    ttft = np.asarray([r.ttft for r in ok]) * 1000.0
    return {"router": router, "hit_rate": hits / max(1, queries), "median_ttft_ms": float(np.median(ttft)),
            "mean_ttft_ms": float(ttft.mean()), "p99_ttft_ms": float(np.percentile(ttft, 99)),
            "duration_s": duration,
            "decisions": {k: decided_after.get(k, 0.0) - decided_before.get(k, 0.0) for k in decided_after},
            "per_replica_hits": {r: after[r]["prefix_cache_hits"] - before.get(r, {}).get("prefix_cache_hits", 0)
                                 for r in after}}


# ------------------------------------------------------------------ keying
# English prose for the keying measurement (random token ids decode to text no tokenizer
# sees in practice).
_PROSE = ("The committee met on Tuesday to review the quarterly figures, and after a long discussion "
          "of shipping delays, currency moves and the new warehouse in the north, it agreed to revisit "
          "the forecast in March. ")


def keying_costs(model: str, args: argparse.Namespace, prompt_ids: list[int], repeats: int = 200) -> dict[str, float]:
    """Microseconds per request: the ingress's key (JSON, tokenize, block hashes) for a text
    completion and a chat request of English prose as long as the workload's prompts (in
    the model's tokens), and for the token-id prompts themselves, against JSON plus chained
    SHA-256 over 64-character chunks of the same text (what a character-tree router hashes)."""
    from raylm.deploy.prefix_key import PrefixKeyer
    from raylm.engine.tokenizer import get_tokenizer

    tokenizer = get_tokenizer(model)
    text = _PROSE
    while len(tokenizer.encode(text)) < len(prompt_ids):
        text += _PROSE
    keyer = PrefixKeyer(tokenizer, 16, max_blocks=256)
    completion = json.dumps({"model": "bench", "prompt": text, "max_tokens": 16}).encode()
    chat = json.dumps({"model": "bench", "messages": [{"role": "system", "content": text},
                                                      {"role": "user", "content": "Summarise."}]}).encode()
    ids = json.dumps({"model": "bench", "prompt": prompt_ids, "max_tokens": 16}).encode()

    def char_chunks(body: bytes) -> list[bytes]:
        prompt = json.loads(body)["prompt"]
        digests, parent = [], b""
        for i in range(0, len(prompt), 64):
            parent = hashlib.sha256(parent + prompt[i:i + 64].encode()).digest()
            digests.append(parent[:8])
        return digests

    cases = {"key_text_completion": lambda: keyer.key("/v1/completions", completion),
             "key_chat": lambda: keyer.key("/v1/chat/completions", chat),
             "key_token_ids": lambda: keyer.key("/v1/completions", ids),
             "char_chunks_text_completion": lambda: char_chunks(completion)}
    costs = {}
    for name, case in cases.items():
        case()
        samples = []
        for _ in range(5):
            start = time.perf_counter()
            for _ in range(repeats // 5):
                case()
            samples.append((time.perf_counter() - start) / (repeats // 5) * 1e6)
        costs[name + "_us"] = statistics.median(samples)
    costs["prompt_chars"] = len(text)
    costs["prompt_tokens"] = len(tokenizer.encode(text, add_special_tokens=True))
    return costs


# -------------------------------------------------------------------- main
def format_table(runs: list[dict[str, Any]]) -> str:
    lines = [f"{'router':<14} {'hit rate':>9} {'median TTFT ms':>15} {'mean TTFT ms':>13} {'p99 TTFT ms':>12}  "
             f"decisions"]
    for run in runs:
        decided = ", ".join(f"{k} {v:.0f}" for k, v in sorted(run["decisions"].items()) if v)
        lines.append(f"{run['router']:<14} {run['hit_rate']:>9.1%} {run['median_ttft_ms']:>15.1f} "
                     f"{run['mean_ttft_ms']:>13.1f} {run['p99_ttft_ms']:>12.1f}  {decided}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    import ray
    from ray import serve

    from raylm.deploy.api_server import bind_socket

    args = add_cli_args(argparse.ArgumentParser(description=__doc__.split("\n\n")[0])).parse_args(argv)
    prompts = sample_shared_prefix_prompts(args.num_prefixes + args.num_prompts, args.prefix_len, args.suffix_len,
                                           args.num_prefixes, 4000, args.seed)
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory() as tmp:
        model = prepare_model(args, Path(tmp))
        sock = bind_socket("127.0.0.1", 0)
        port = sock.getsockname()[1]
        sock.close()
        ray.init(address=args.address, include_dashboard=False,
                 **({"num_cpus": args.num_cpus} if args.address == "local" else {}))
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        runs = []
        try:
            for repeat in range(args.repeats):
                order = ROUTERS if repeat % 2 == 0 else ROUTERS[::-1]
                for router in order:
                    run = run_router(model, router, args, prompts, port)
                    run["repeat"] = repeat
                    runs.append(run)
                    print(format_table([run]).splitlines()[1], flush=True)
        finally:
            serve.shutdown()
            ray.shutdown()
        keying = keying_costs(model, args, prompts[0])
    summary = {}
    for router in ROUTERS:
        mine = [r for r in runs if r["router"] == router]
        summary[router] = {"hit_rate": statistics.median(r["hit_rate"] for r in mine),
                           "median_ttft_ms": statistics.median(r["median_ttft_ms"] for r in mine)}
    summary["ttft_ratio"] = summary["power_of_two"]["median_ttft_ms"] / summary["prefix_aware"]["median_ttft_ms"]
    result = {"settings": {k: v for k, v in vars(args).items() if k != "output_json"}, "runs": runs,
              "summary": summary, "keying_cost": keying, "cpu_count": os.cpu_count(),
              "load_average_before": load_before, "load_average_after": os.getloadavg()}
    print(format_table(runs))
    print(f"median over rounds: prefix_aware hit rate {summary['prefix_aware']['hit_rate']:.1%}, median TTFT "
          f"{summary['prefix_aware']['median_ttft_ms']:.1f} ms; power_of_two {summary['power_of_two']['hit_rate']:.1%},"
          f" {summary['power_of_two']['median_ttft_ms']:.1f} ms; TTFT ratio {summary['ttft_ratio']:.2f}x")
    print("keying cost per request (us):", json.dumps({k: round(v, 1) for k, v in keying.items()}))
    if args.output_json:
        Path(args.output_json).write_text(json.dumps(result, indent=2))
    print("RESULT " + json.dumps(result))
    return result


if __name__ == "__main__":
    main()
