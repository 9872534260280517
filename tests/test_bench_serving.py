"""The serving benchmark's client: its shared-prefix workload and its latency figures.

References are arithmetic (lengths, counts, percentiles) and what a stub OpenAI-style
server received. No speed is asserted: timings on a shared CI machine mean nothing.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import threading

import pytest

from raylm.cluster.benchmarks.bench_serving import (RequestResult, add_cli_args, load_prompts, run,
                                         sample_shared_prefix_prompts, summarize)

NUM_PROMPTS = 12
PREFIX_LEN = 40
SUFFIX_LEN = 5
NUM_PREFIXES = 3
VOCAB_SIZE = 1000


def parse(*argv: str) -> argparse.Namespace:
    return add_cli_args(argparse.ArgumentParser()).parse_args(["--base-url", "http://unused", *argv])


def shared_prefix_prompts(seed: int = 0) -> list[list[int]]:
    return sample_shared_prefix_prompts(NUM_PROMPTS, PREFIX_LEN, SUFFIX_LEN, NUM_PREFIXES, VOCAB_SIZE, seed)


def test_shared_prefix_prompts_are_exactly_prefix_len_plus_suffix_len_tokens():
    prompts = shared_prefix_prompts()
    assert len(prompts) == NUM_PROMPTS
    assert {len(p) for p in prompts} == {PREFIX_LEN + SUFFIX_LEN}
    assert all(0 <= t < VOCAB_SIZE for p in prompts for t in p)


def test_shared_prefix_prompt_i_starts_with_prefix_i_mod_num_prefixes():
    prompts = shared_prefix_prompts()
    for i, prompt in enumerate(prompts):
        assert prompt[:PREFIX_LEN] == prompts[i % NUM_PREFIXES][:PREFIX_LEN]
    assert len({tuple(p[:PREFIX_LEN]) for p in prompts[:NUM_PREFIXES]}) == NUM_PREFIXES


def test_shared_prefix_prompts_have_pairwise_distinct_suffixes():
    suffixes = [tuple(p[PREFIX_LEN:]) for p in shared_prefix_prompts()]
    assert len(set(suffixes)) == NUM_PROMPTS


def test_shared_prefix_suffixes_stay_distinct_when_the_vocabulary_barely_allows_it():
    # 2 ids, 3 positions: exactly 8 suffixes exist, and 8 prompts must use each once.
    prompts = sample_shared_prefix_prompts(8, 4, 3, 1, vocab_size=2, seed=0)
    assert sorted(tuple(p[4:]) for p in prompts) == sorted({(a, b, c) for a in (0, 1) for b in (0, 1)
                                                            for c in (0, 1)})


def test_shared_prefix_rejects_more_prompts_than_distinct_suffixes():
    with pytest.raises(SystemExit, match="--suffix-len 3 over --random-vocab-size 2 allows only 8"):
        sample_shared_prefix_prompts(9, 4, 3, 1, vocab_size=2, seed=0)


def test_shared_prefix_prompts_are_reproducible_for_a_seed():
    assert shared_prefix_prompts(seed=7) == shared_prefix_prompts(seed=7)
    assert shared_prefix_prompts(seed=7) != shared_prefix_prompts(seed=8)


def test_vllm_prefix_repetition_flags_give_the_same_prompts_as_the_short_ones():
    short = parse("--dataset", "shared-prefix", "--prefix-len", "40", "--suffix-len", "5",
                  "--num-prefixes", "3", "--output-len", "7", "--num-prompts", "12")
    vllm = parse("--dataset", "prefix_repetition", "--prefix-repetition-prefix-len", "40",
                 "--prefix-repetition-suffix-len", "5", "--prefix-repetition-num-prefixes", "3",
                 "--prefix-repetition-output-len", "7", "--num-prompts", "12")
    assert vllm.output_len == short.output_len == 7
    assert load_prompts(vllm) == load_prompts(short) == shared_prefix_prompts()


def test_p99_itl_is_the_99th_percentile_of_every_gap_of_every_request():
    # Gaps of 1..101 ms over two requests: the 99th percentile of 101 values is the 100th smallest.
    gaps = [ms / 1000.0 for ms in range(1, 102)]
    results = [RequestResult(success=True, prompt_len=3, output_tokens=len(part) + 1, ttft=0.01, latency=1.0,
                             itl=part) for part in (gaps[:50], gaps[50:])]
    report = summarize(parse(), "m", results, duration=1.0)
    assert report.p99_itl_ms == pytest.approx(100.0)
    assert report.median_itl_ms == pytest.approx(51.0)
    assert "P99 ITL (ms):" in report.table()


class StubCompletionsServer:
    """An OpenAI-style /v1/completions that streams `max_tokens` one-token chunks and
    records every prompt it was sent, on a thread of its own."""

    def __init__(self) -> None:
        self.prompts: list = []
        self.port = 0
        self._ready = threading.Event()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._serve, daemon=True)

    async def _completions(self, request):
        from aiohttp import web

        body = await request.json()
        self.prompts.append(body["prompt"])
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for _ in range(body["max_tokens"]):
            chunk = {"choices": [{"index": 0, "text": "x"}]}
            await response.write(f"data: {json.dumps(chunk)}\n\n".encode())
        usage = {"choices": [], "usage": {"prompt_tokens": len(body["prompt"]),
                                          "completion_tokens": body["max_tokens"]}}
        await response.write(f"data: {json.dumps(usage)}\n\ndata: [DONE]\n\n".encode())
        return response

    async def _models(self, request):
        from aiohttp import web

        return web.json_response({"data": [{"id": "stub"}]})

    def _serve(self) -> None:
        from aiohttp import web

        asyncio.set_event_loop(self._loop)
        app = web.Application()
        app.router.add_post("/v1/completions", self._completions)
        app.router.add_get("/v1/models", self._models)
        self._runner = web.AppRunner(app)
        self._loop.run_until_complete(self._runner.setup())
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        self._loop.run_until_complete(site.start())
        self.port = site._server.sockets[0].getsockname()[1]
        self._ready.set()
        self._loop.run_forever()

    def __enter__(self) -> "StubCompletionsServer":
        self._thread.start()
        assert self._ready.wait(30), "the stub server did not start"
        return self

    def __exit__(self, *exc) -> None:
        asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(30)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(30)


def test_shared_prefix_run_sends_the_prompts_as_token_ids_and_counts_their_tokens(tmp_path):
    output_json = tmp_path / "result.json"
    with StubCompletionsServer() as server:
        args = add_cli_args(argparse.ArgumentParser()).parse_args([
            "--base-url", f"http://127.0.0.1:{server.port}", "--dataset", "shared-prefix",
            "--prefix-len", str(PREFIX_LEN), "--suffix-len", str(SUFFIX_LEN), "--num-prefixes", str(NUM_PREFIXES),
            "--num-prompts", str(NUM_PROMPTS), "--output-len", "4", "--num-warmups", "1",
            "--output-json", str(output_json)])
        result = run(args)
    expected = shared_prefix_prompts()
    assert server.prompts[0] == expected[0]  # the warm-up
    assert sorted(server.prompts[1:]) == sorted(expected)  # arrival order is the server's
    assert result.completed == NUM_PROMPTS and result.failed == 0
    assert result.total_input_tokens == NUM_PROMPTS * (PREFIX_LEN + SUFFIX_LEN)
    assert result.total_output_tokens == NUM_PROMPTS * 4
    assert json.loads(output_json.read_text())["p99_itl_ms"] == pytest.approx(result.p99_itl_ms)
