"""Fuzzing `raylm serve` from its own OpenAPI spec with schemathesis: every route, valid and
invalid requests alike, gets an answer that is not a server error, and the server stays
healthy and does not grow."""

from __future__ import annotations

import base64
import collections
import json
import os
import subprocess
import sys
from pathlib import Path

import httpx
from server_process import rss_kib, start_server, stop_server

SEED = 13
# Random examples per route in schemathesis's fuzzing phase, after its coverage phase (~2,800
# requests: every field's boundary and wrong-typed values). Measured on this seed against 100
# a route (the fuzzing phase was ~2/3 of the test's time): 30 get 400s naming the same (route,
# field) pairs and send every field; the unknown-model 404 (one shared check_model) shows on 3
# routes instead of 8.
EXAMPLES_PER_ROUTE = 30


def start_tiny_server(llama_dir: Path, log: Path, *extra: str) -> tuple[subprocess.Popen, str]:
    """`raylm serve` of the tiny llama with a 256-token context, once it answers /health."""
    return start_server([str(llama_dir), "--max-model-len", "256", *extra], log)


def interactions(ndjson: Path):
    """(request, response) of every call schemathesis made, from its NDJSON report."""
    for line in ndjson.read_text().splitlines():
        finished = json.loads(line).get("ScenarioFinished")
        if finished:
            for interaction in finished["recorder"].get("interactions", {}).values():
                yield interaction["request"], interaction["response"]


def describe(request: dict, response: dict | None) -> str:
    body = request.get("body")
    if isinstance(body, dict) and "$base64" in body:
        body = base64.b64decode(body["$base64"]).decode("utf-8", "replace")
    answer = None
    if response is not None:
        content = response.get("content") or {}
        answer = base64.b64decode(content["$base64"]).decode("utf-8", "replace") if "$base64" in content else content
    return f"{request['method']} {request['uri']} body={body!r} -> {response and response['status_code']} {answer!r}"


def test_no_request_from_the_openapi_spec_gets_a_server_error(llama_dir, tmp_path):
    process, base_url = start_tiny_server(llama_dir, tmp_path / "server.log")
    try:
        start_rss = rss_kib(process.pid)
        report = tmp_path / "schemathesis.ndjson"
        run = subprocess.run(
            [sys.executable, "-m", "schemathesis.cli", "run", f"{base_url}/openapi.json",
             "--max-examples", str(EXAMPLES_PER_ROUTE), "--seed", str(SEED), "--no-shrink",
             "--generation-database", "none", "--checks", "not_a_server_error", "--request-timeout", "60",
             "--report", "ndjson", "--report-ndjson-path", str(report)],
            capture_output=True, text=True, timeout=300, cwd=tmp_path, env={**os.environ, "NO_COLOR": "1"})
        calls = list(interactions(report))
        counts = collections.Counter((r["method"], r["uri"].removeprefix(base_url), s and s["status_code"])
                                     for r, s in calls)
        print(f"schemathesis sent {len(calls)} requests (seed {SEED}):")
        for (method, path, status), count in sorted(counts.items(), key=str):
            print(f"  {method} {path} {status}: {count}")
        server_errors = [describe(r, s) for r, s in calls if s is None or s["status_code"] >= 500]
        assert not server_errors, "\n".join(server_errors[:20])
        assert run.returncode == 0, run.stdout[-5000:] + run.stderr[-5000:]
        # Every route of the spec was called, mostly through its one method.
        spec = httpx.get(f"{base_url}/openapi.json", timeout=10).json()
        called = {(method, path) for method, path, _ in counts}
        for path, methods in spec["paths"].items():
            for method in methods:
                assert (method.upper(), path) in called, (method, path)
        assert len(calls) >= 1000
        assert httpx.get(f"{base_url}/health", timeout=5).status_code == 200
        assert process.poll() is None
        end_rss = rss_kib(process.pid)
        print(f"server RSS: {start_rss / 1024:.0f} MiB after start, {end_rss / 1024:.0f} MiB after fuzzing")
        assert end_rss <= 2 * start_rss
    finally:
        stop_server(process)
