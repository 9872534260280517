"""`raylm serve` as a process a supervisor can trust, against real server processes: the API
key guards every route but /health and /metrics (a root path included), overload is a 429
at once, an oversized body a 413 before it is read, SIGTERM drains and exits 0, and a dead
engine exits 1 after failing its requests with a body that names no file."""

from __future__ import annotations

import http.client
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest
from raylm.deploy.errors import INTERNAL_ERROR_MESSAGE
from process_tree import descendants, wait_gone
from server_process import free_port, server_env, start_server
from server_process import stop_server as stop

API_KEY = "lifecycle-key"
MODEL = "tiny-llama"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
COMPLETION = {"model": MODEL, "prompt": "Hi", "max_tokens": 4}
BODY_TIMEOUT_S = 4


def start(llama_dir: Path, log: Path, *flags: str) -> tuple[subprocess.Popen, str]:
    return start_server([str(llama_dir), "--served-model-name", MODEL, "--num-gpu-blocks-override", "512", *flags],
                        log)


@pytest.fixture
def log(tmp_path: Path) -> Path:
    return tmp_path / "server.log"


@pytest.fixture(scope="module")
def guarded(llama_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    """A server behind a proxy's root path, with a key, 2 requests in flight at most, a
    1 MB body limit and 4 s for a body to arrive."""
    log = tmp_path_factory.mktemp("guarded") / "server.log"
    process, base_url = start(llama_dir, log, "--api-key", API_KEY, "--root-path", "/raylm",
                                     "--max-concurrent-requests", "2", "--max-request-body-bytes", "1000000",
                                     "--request-body-timeout", str(BODY_TIMEOUT_S))
    yield base_url
    stop(process)


def assert_error(response: httpx.Response, status: int, error_type: str) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["code"] == status and error["type"] == error_type
    return error


# ---------------------------------------------------------------------- API key
def test_a_root_path_does_not_bypass_the_api_key(guarded):
    # uvicorn's root_path stays in scope["path"]: /v1/models arrives as /raylm/v1/models.
    assert_error(httpx.get(guarded + "/v1/models"), 401, "AuthenticationError")
    response = httpx.get(guarded + "/v1/models", headers=AUTH)
    assert response.status_code == 200 and [m["id"] for m in response.json()["data"]] == [MODEL]


ROUTES = [
    ("GET", "/v1/models", None),
    ("POST", "/v1/completions", COMPLETION),
    ("POST", "/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}],
                                      "max_tokens": 4}),
    ("GET", "/version", None),
    ("POST", "/tokenize", {"prompt": "Hi"}),
    ("POST", "/detokenize", {"tokens": [5, 6]}),
    ("GET", "/openapi.json", None),
    ("GET", "/docs", None),
]


@pytest.mark.parametrize("method,path,body", ROUTES, ids=[path for _, path, _ in ROUTES])
def test_every_other_route_needs_the_key(guarded, method, path, body):
    for headers in ({}, {"Authorization": "Bearer wrong-key"}, {"Authorization": API_KEY}):
        assert_error(httpx.request(method, guarded + path, json=body, headers=headers), 401, "AuthenticationError")
    assert httpx.request(method, guarded + path, json=body, headers=AUTH).status_code == 200


def test_health_and_metrics_answer_without_the_key(guarded):
    assert httpx.get(guarded + "/health").status_code == 200
    assert "raylm" in httpx.get(guarded + "/metrics").text


# --------------------------------------------------------------------- overload
def held_request(base_url: str, body: dict) -> tuple[http.client.HTTPConnection, bytes]:
    """A completion request whose headers and first bytes are sent and the rest held back:
    in flight until `finish_request`."""
    payload = json.dumps(body).encode()
    conn = http.client.HTTPConnection(httpx.URL(base_url).host, httpx.URL(base_url).port, timeout=60)
    conn.putrequest("POST", "/v1/completions")
    for name, value in {**AUTH, "Content-Type": "application/json", "Content-Length": str(len(payload))}.items():
        conn.putheader(name, value)
    conn.endheaders()
    conn.send(payload[:8])
    return conn, payload[8:]


def finish_request(held: tuple[http.client.HTTPConnection, bytes]) -> tuple[int, bytes]:
    conn, rest = held
    conn.send(rest)
    response = conn.getresponse()
    return response.status, response.read()


def wait_until_both_are_in_flight(base_url: str) -> None:
    """Returns once the server refuses a cheap request (GET /v1/models counts as one in
    flight): the held requests count from when the server has read their headers, which on
    a loaded machine can take longer than a fixed wait. Within 3 s: their bodies have 4."""
    deadline = time.monotonic() + 3.0
    while httpx.get(base_url + "/v1/models", headers=AUTH, timeout=30).status_code != 429:
        assert time.monotonic() < deadline, "the two held requests were not both in flight within 3 s"
        time.sleep(0.05)


@pytest.mark.serial  # wall-clock deadline: alone, after the parallel part (scripts/test.sh)
def test_past_max_concurrent_requests_a_request_gets_429_at_once_and_later_ones_succeed(guarded):
    held = [held_request(guarded, COMPLETION) for _ in range(2)]
    wait_until_both_are_in_flight(guarded)  # the server waits for their bodies
    start = time.monotonic()
    refused = httpx.post(guarded + "/v1/completions", json=COMPLETION, headers=AUTH, timeout=30)
    assert time.monotonic() - start < 1.0
    error = assert_error(refused, 429, "RateLimitError")
    assert "--max-concurrent-requests" in error["message"] and refused.headers["retry-after"] == "1"
    assert httpx.get(guarded + "/health").status_code == 200  # probes are never refused

    for request in held:
        status, body = finish_request(request)
        assert status == 200 and json.loads(body)["usage"]["completion_tokens"] == 4
    response = httpx.post(guarded + "/v1/completions", json=COMPLETION, headers=AUTH, timeout=30)
    assert response.status_code == 200 and response.json()["usage"]["completion_tokens"] == 4


def test_a_body_that_stops_arriving_gets_408_and_frees_its_place(guarded):
    # With no deadline, clients that sent part of a body and waited held every place in
    # flight for as long as they liked: all other requests were 429s (90 s in the red-team
    # run, until the clients let go).
    held = [held_request(guarded, COMPLETION) for _ in range(2)]
    wait_until_both_are_in_flight(guarded)
    assert_error(httpx.post(guarded + "/v1/completions", json=COMPLETION, headers=AUTH, timeout=30), 429,
                 "RateLimitError")
    start = time.monotonic()
    for conn, _ in held:  # the rest of the body never comes: the server answers on its own
        response = conn.getresponse()
        error = json.loads(response.read())["error"]
        assert response.status == 408 and "--request-body-timeout" in error["message"], error
    assert time.monotonic() - start < BODY_TIMEOUT_S
    response = httpx.post(guarded + "/v1/completions", json=COMPLETION, headers=AUTH, timeout=30)
    assert response.status_code == 200 and response.json()["usage"]["completion_tokens"] == 4


# -------------------------------------------------------------------- body size
def test_a_body_over_the_limit_gets_413(guarded):
    prompt = "a" * 10_500_000
    response = httpx.post(guarded + "/v1/completions", json={**COMPLETION, "prompt": prompt}, headers=AUTH,
                          timeout=60)
    assert "--max-request-body-bytes" in assert_error(response, 413, "RequestTooLargeError")["message"]


def test_a_declared_oversized_body_gets_413_before_any_of_it_is_sent(guarded):
    conn = http.client.HTTPConnection(httpx.URL(guarded).host, httpx.URL(guarded).port, timeout=10)
    conn.putrequest("POST", "/v1/completions")
    for name, value in {**AUTH, "Content-Type": "application/json", "Content-Length": "10500000"}.items():
        conn.putheader(name, value)
    conn.endheaders()
    response = conn.getresponse()
    assert response.status == 413 and json.loads(response.read())["error"]["type"] == "RequestTooLargeError"


def test_a_chunked_body_gets_413_once_the_bytes_read_pass_the_limit(guarded):
    """No Content-Length: the limit is found while reading, and the answer comes although
    the body never ends."""
    conn = http.client.HTTPConnection(httpx.URL(guarded).host, httpx.URL(guarded).port, timeout=10)
    conn.putrequest("POST", "/v1/completions")
    for name, value in {**AUTH, "Content-Type": "application/json", "Transfer-Encoding": "chunked"}.items():
        conn.putheader(name, value)
    conn.endheaders()
    chunk = b"a" * 65536
    for _ in range(20):  # 1.3 MB, then nothing more, not even the last chunk
        conn.send(b"%x\r\n%s\r\n" % (len(chunk), chunk))
    response = conn.getresponse()
    assert response.status == 413 and json.loads(response.read())["error"]["type"] == "RequestTooLargeError"


def test_the_default_body_limit_refuses_20_mb_and_takes_1_mb(llama_dir, log):
    process, base_url = start(llama_dir, log)
    try:
        response = httpx.post(base_url + "/v1/completions", json={**COMPLETION, "prompt": "a" * 20_000_000},
                              timeout=60)
        assert "16777216 bytes" in assert_error(response, 413, "RequestTooLargeError")["message"]
        # Under the limit, the prompt's own limits answer.
        response = httpx.post(base_url + "/v1/completions", json={**COMPLETION, "prompt": "a" * 1_000_000},
                              timeout=60)
        assert response.status_code == 400 and response.json()["error"]["param"] == "prompt"
    finally:
        stop(process)


# ------------------------------------------------------------- graceful shutdown
class Stream(threading.Thread):
    """One streamed completion of `n` x `max_tokens` tokens, read to its end or its failure."""

    def __init__(self, base_url: str, max_tokens: int = 250, n: int = 1) -> None:
        super().__init__(daemon=True)
        self.client = openai.OpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0, timeout=60)
        self.max_tokens = max_tokens
        self.n = n
        self.started = threading.Event()
        self.tokens: int | None = None  # completion_tokens of a stream that finished
        self.error: Exception | None = None
        self.start()

    def run(self) -> None:
        try:
            stream = self.client.completions.create(model=MODEL, prompt="Hi", max_tokens=self.max_tokens, n=self.n,
                                                    stream=True, temperature=0, stream_options={"include_usage": True},
                                                    extra_body={"ignore_eos": True})
            self.started.set()
            for chunk in stream:
                if chunk.usage is not None:
                    self.tokens = chunk.usage.completion_tokens
        except Exception as exc:  # noqa: BLE001 - what the test looks at
            self.error = exc
        finally:
            self.started.set()


def start_streams(base_url: str, count: int, n: int = 1) -> list[Stream]:
    """`count` streams in flight: with --max-num-seqs 1 they run one after another."""
    streams = [Stream(base_url, n=n) for _ in range(count)]
    for stream in streams:
        assert stream.started.wait(30)
    return streams


def refuses_connections(base_url: str, timeout: float) -> bool:
    url = httpx.URL(base_url)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            socket.create_connection((url.host, url.port), timeout=1).close()
        except ConnectionRefusedError:
            return True
        time.sleep(0.05)
    return False


def _compile_worker_tree(server_pid: int) -> list[int]:
    """The server's grammar compile worker and the processes below it, once it runs."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        found = descendants(server_pid)
        workers = [pid for pid, command in found.items() if "compile_worker_process" in command]
        if workers:
            return [pid for pid in found if pid in workers or pid in descendants(workers[0])]
        time.sleep(0.1)
    raise AssertionError("the server started no grammar compile worker")


def test_sigterm_stops_accepting_lets_streams_finish_and_exits_0(llama_dir, log):
    process, base_url = start(llama_dir, log, "--max-num-seqs", "1", "--shutdown-timeout", "30")
    try:
        streams = start_streams(base_url, 16)
        # The grammar compile worker (started with the server) and its processes.
        helpers = _compile_worker_tree(process.pid)
        process.send_signal(signal.SIGTERM)
        assert refuses_connections(base_url, timeout=5)
        assert any(stream.is_alive() for stream in streams), "all streams ended before the listener closed"
        assert process.wait(timeout=40) == 0
        assert not wait_gone(helpers, timeout=5), "processes outlived the server"
        for stream in streams:
            stream.join(10)
            assert stream.error is None and stream.tokens == 250
    finally:
        stop(process)
    # The log says that shutdown started, what it waits for, and that it finished.
    text = log.read_text()
    assert re.search(r"Shutting down on SIGTERM: no new connections; waiting up to 30 s for \d+ request", text), text
    assert text.index("Shutting down on SIGTERM") < text.index("Shutdown complete.")
    assert "already shutting down" not in text


def test_sigterm_aborts_what_still_runs_after_the_shutdown_timeout_and_exits_0(llama_dir, log):
    process, base_url = start(llama_dir, log, "--max-num-seqs", "1", "--shutdown-timeout", "1")
    try:
        # 48 x 4 x 250 tokens one after another: ~10 s of steps on a 2-core machine where the
        # server steps 4,600 tokens/s. With 48 x 250 the engine kept up with the streams'
        # arrival, and all of them could finish within the second the shutdown waits.
        streams = start_streams(base_url, 48, n=4)
        signalled = time.monotonic()
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=20) == 0
        assert time.monotonic() - signalled < 15
        for stream in streams:
            stream.join(10)
            assert not stream.is_alive()
        # The last ones were cut off.
        aborted = [s for s in streams if s.tokens is None]
        assert aborted and all(isinstance(s.error, (openai.APIError, httpx.HTTPError)) for s in aborted)
        assert all(s.tokens == 4 * 250 for s in streams if s.tokens is not None)
    finally:
        stop(process)


# ------------------------------------------------------------------ engine death
def test_a_killed_worker_fails_its_stream_without_internals_and_the_server_exits_1(llama_dir, log):
    """A fault of the engine itself (a tensor-parallel worker killed mid-stream): the
    stream ends in an error within 30 s, /health fails, the process exits 1."""
    process, base_url = start(llama_dir, log, "--tensor-parallel-size", "2")
    try:
        workers = [pid for pid, command in descendants(process.pid).items()
                   if command.startswith("ray::RayWorkerWrapper")]
        assert len(workers) == 2
        body = {**COMPLETION, "max_tokens": 250, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", base_url + "/v1/completions", json=body, timeout=60) as response:
            lines = response.iter_lines()
            assert next(lines).startswith("data: ")  # generating
            os.kill(workers[1], signal.SIGKILL)
            killed = time.monotonic()
            events = [json.loads(line[len("data: "):]) for line in lines
                      if line.startswith("data: ") and line != "data: [DONE]"]
        assert time.monotonic() - killed < 30
        errors = [event["error"] for event in events if "error" in event]
        assert errors and errors[0]["code"] == 500 and errors[0]["message"] == INTERNAL_ERROR_MESSAGE
        try:
            assert httpx.get(base_url + "/health", timeout=10).status_code == 500
        except httpx.TransportError:
            pass  # already gone
        assert process.wait(timeout=30) == 1
        assert "The engine loop has died" in log.read_text()
    finally:
        stop(process)


# ------------------------------------------------------------------ the port
def test_a_busy_port_ends_serve_before_the_model_loads_with_one_line_and_exit_2(llama_dir):
    port = free_port()
    with socket.create_server(("127.0.0.1", port)):
        result = subprocess.run([sys.executable, "-m", "raylm.deploy.cli", "serve", str(llama_dir), "--port",
                                 str(port)], capture_output=True, text=True, timeout=120, env=server_env())
    assert result.returncode == 2, result.stderr[-3000:]
    lines = [line for line in result.stderr.splitlines() if line.strip() and " INFO " not in line]
    assert lines == [f"raylm: error: Cannot listen on 127.0.0.1:{port}: Address already in use (is another server "
                     f"running there? --port picks another port)."], result.stderr[-3000:]
    assert "model loaded" not in result.stderr and "Serving" not in result.stderr
