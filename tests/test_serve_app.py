"""The Ray Serve application as `raylm serve --ray-serve` builds it from its flags: every
server flag reaches the replica (key, root path, limits, template trust, shutdown
timeout), a replica owning two tensor-parallel CPU workers, stepped through a Ray
compiled graph, serves the same greedy results as `LLM.generate`, and a replica whose
worker dies fails its health check and is replaced by a working one."""

from __future__ import annotations

import http.client
import json
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from test_api_server import free_port, stream_text

ray = pytest.importorskip("ray")
serve = pytest.importorskip("ray.serve")

APP_NAME = "raylm-test"
MODEL = "tiny-llama-tp2"
PROMPTS = ["The quick brown fox", "Hello, world!"]


@pytest.fixture(scope="module")
def session_ray(request: pytest.FixtureRequest):
    """The test session's Ray (conftest's `ray_cluster`); a local one if it has none."""
    try:
        return request.getfixturevalue("ray_cluster")
    except pytest.FixtureLookupError:
        if not ray.is_initialized():
            ray.init(address="local", include_dashboard=False, num_cpus=4)
        return None


API_KEY = "serve-key"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
ROOT = "/raylm"
BODY_TIMEOUT_S = 3
# Every server setting away from its default (uvicorn's own, host and port aside).
SERVER_FLAGS = ["--served-model-name", MODEL, "--api-key", API_KEY, "--root-path", ROOT,
                "--max-concurrent-requests", "64", "--max-request-body-bytes", "200000", "--shutdown-timeout", "7",
                "--request-body-timeout", str(BODY_TIMEOUT_S), "--max-response-tokens-in-flight", "5000000",
                "--max-served-loras", "7",
                "--trust-request-chat-template", "--chat-template", "{% for m in messages %}{{ m.content }}{% endfor %}",
                "--max-prompts-per-request", "8", "--max-stop-strings", "2", "--max-stop-string-chars", "50",
                "--max-stop-token-ids", "9", "--max-logit-bias", "10", "--max-chat-messages", "11",
                "--max-prompt-chars", "5000", "--enable-auto-tool-choice", "--tool-call-parser", "hermes",
                "--max-structured-output-chars", "4000", "--max-json-schema-depth", "12", "--max-tools", "1",
                "--max-grammar-compile-seconds", "4.5"]


@pytest.fixture(scope="module")
def cli_args(llama_dir: Path):
    from raylm.deploy.cli import build_parser

    return build_parser().parse_args(["serve", str(llama_dir), "--ray-serve", "--tensor-parallel-size", "2",
                                      "--num-gpu-blocks-override", "256", "--device", "cpu", *SERVER_FLAGS])


def run_cli_serve_app(cli_args, app_name: str) -> Iterator[str]:
    """Runs what `raylm serve --ray-serve` runs for these flags, with test-sized deployment
    settings that have no flag, on a free local port; yields its URL, then deletes the app
    and stops Serve."""
    from raylm.deploy.serve_app import cli_serve_app

    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    app, _ = cli_serve_app(cli_args, num_replicas=1, replica_cpus=0.25, health_check_period_s=1.0,
                           health_check_timeout_s=20.0)
    serve.run(app, name=app_name, route_prefix="/")
    yield f"http://127.0.0.1:{port}"
    serve.delete(app_name)
    serve.shutdown()


@pytest.fixture(scope="module")
def serve_url(session_ray, cli_args):
    yield from run_cli_serve_app(cli_args, APP_NAME)


@pytest.fixture(scope="module")
def expected(llama_dir: Path) -> list[str]:
    from raylm.engine.llm import LLM
    from raylm.engine.sampling_params import SamplingParams

    llm = LLM(str(llama_dir), num_gpu_blocks_override=64)
    outputs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)
    llm.shutdown()
    return [o.outputs[0].text for o in outputs]


def _client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + ROOT + "/v1", api_key=API_KEY, max_retries=0, timeout=60)


def test_serve_app_with_tp2_matches_llm_generate(serve_url, expected):
    handle = serve.get_deployment_handle("RaylmDeployment", app_name=APP_NAME)
    assert handle.uses_compiled_graph.remote().result(timeout_s=30)
    client = _client(serve_url)
    assert [m.id for m in client.models.list().data] == [MODEL]
    response = client.completions.create(model=MODEL, prompt=PROMPTS, max_tokens=12, temperature=0)
    assert [c.text for c in sorted(response.choices, key=lambda c: c.index)] == expected
    stream = client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=12, temperature=0, stream=True,
                                       stream_options={"include_usage": True})
    texts, reasons, usage = stream_text(stream)
    assert texts == {0: expected[1]} and usage.completion_tokens == 12
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=4,
                                          temperature=0)
    assert chat.choices[0].finish_reason in ("stop", "length")
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL, prompt=[5] * 300)
    assert httpx.get(serve_url + "/health").status_code == 200


def test_every_server_flag_reaches_the_replica(serve_url, cli_args):
    from raylm.deploy.server_args import ServerArgs

    handle = serve.get_deployment_handle("RaylmDeployment", app_name=APP_NAME)
    served = handle.served_server_args.remote().result(timeout_s=30)
    assert served == ServerArgs.from_cli_args(cli_args)


def test_serve_app_applies_the_server_flags(serve_url):
    completions = serve_url + ROOT + "/v1/completions"
    body = {"model": MODEL, "prompt": "Hi", "max_tokens": 2, "stop": ["a", "b", "c"]}
    assert httpx.post(completions, json=body, timeout=60).status_code == 401  # the key
    response = httpx.post(completions, json=body, headers=AUTH, timeout=60)
    assert response.status_code == 400 and response.json()["error"]["param"] == "stop", response.text
    body["stop"] = ["a", "b"]
    assert httpx.post(completions, json=body, headers=AUTH, timeout=60).status_code == 200
    too_large = {**body, "prompt": "a" * 300_000}
    assert httpx.post(completions, json=too_large, headers=AUTH, timeout=60).status_code == 413
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2,
            "chat_template": "{{ messages[0].content }}"}
    response = httpx.post(serve_url + ROOT + "/v1/chat/completions", json=chat, headers=AUTH, timeout=60)
    assert response.status_code == 200, response.text  # --trust-request-chat-template
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    response = httpx.post(serve_url + ROOT + "/v1/chat/completions", headers=AUTH, timeout=60,
                          json={**chat, "tools": [tool], "tool_choice": "auto"})
    assert response.status_code == 200, response.text  # --enable-auto-tool-choice --tool-call-parser hermes
    response = httpx.post(serve_url + ROOT + "/v1/chat/completions", headers=AUTH, timeout=60,
                          json={**chat, "tools": [tool, {**tool, "function": {**tool["function"], "name": "g"}}]})
    assert response.status_code == 400 and "--max-tools" in response.json()["error"]["message"], response.text


def test_a_body_that_stops_arriving_gets_408_from_the_ingress(serve_url):
    # The ingress read the body with no deadline (Serve's proxy sets none): a client that
    # sent part of one and waited held one of its max_ongoing_requests for as long as it
    # liked, and with all of them held every other request waited in Serve's queue.
    payload = json.dumps({"model": MODEL, "prompt": "Hi", "max_tokens": 2}).encode()
    url = httpx.URL(serve_url)
    conn = http.client.HTTPConnection(url.host, url.port, timeout=60)
    conn.putrequest("POST", ROOT + "/v1/completions")
    for name, value in {**AUTH, "Content-Type": "application/json", "Content-Length": str(len(payload))}.items():
        conn.putheader(name, value)
    conn.endheaders()
    conn.send(payload[:8])  # the rest never comes
    start = time.monotonic()
    response = conn.getresponse()
    waited = time.monotonic() - start
    error = json.loads(response.read())["error"]
    conn.close()
    assert response.status == 408 and "--request-body-timeout" in error["message"], error
    assert waited < BODY_TIMEOUT_S + 10
    body = {"model": MODEL, "prompt": "Hi", "max_tokens": 2}
    assert httpx.post(serve_url + ROOT + "/v1/completions", json=body, headers=AUTH, timeout=60).status_code == 200


def test_killed_worker_fails_health_and_serve_replaces_the_replica(serve_url, expected):
    handle = serve.get_deployment_handle("RaylmDeployment", app_name=APP_NAME)
    workers = handle.worker_actors.remote().result(timeout_s=30)
    assert len(workers) == 2
    kill_worker_mid_stream_and_await_a_new_replica(serve_url, handle, workers, 1, "its worker")
    response = _client(serve_url).completions.create(model=MODEL, prompt=PROMPTS, max_tokens=12, temperature=0)
    assert [c.text for c in sorted(response.choices, key=lambda c: c.index)] == expected
    assert handle.uses_compiled_graph.remote().result(timeout_s=30)


def kill_worker_mid_stream_and_await_a_new_replica(serve_url: str, handle, workers: list, index: int,
                                                   what: str) -> None:
    """Kills workers[index] of the replica (`what` names it in failures) while a long stream
    is in flight. The stream must end with an error within 30 s, not hang; the dying replica
    must report unhealthy (or be taken out already); and Serve must bring up a healthy
    replica on as many new workers."""
    old_ids = {w._actor_id for w in workers}
    in_flight = _InFlightStream(serve_url)
    assert in_flight.started.wait(timeout=60), "the stream never started"
    killed_at = time.monotonic()
    ray.kill(workers[index], no_restart=True)
    in_flight.thread.join(timeout=35)
    assert not in_flight.thread.is_alive(), f"the in-flight stream hung after {what} died"
    assert in_flight.ended_at - killed_at < 30
    assert not in_flight.done, f"the in-flight stream finished normally although {what} died mid-way"

    deadline = time.monotonic() + 30
    while httpx.get(serve_url + "/health", timeout=30).status_code == 200:
        assert time.monotonic() < deadline, f"/health kept answering 200 after {what} died"
        time.sleep(0.2)

    deadline = time.monotonic() + 150
    while True:
        try:
            if httpx.get(serve_url + "/health", timeout=30).status_code == 200:
                new_workers = handle.worker_actors.remote().result(timeout_s=30)
                if len(new_workers) == len(workers) and not {w._actor_id for w in new_workers} & old_ids:
                    break
        except Exception:  # noqa: BLE001 - the replica is being replaced
            pass
        assert time.monotonic() < deadline, "Serve did not bring up a healthy replica"
        time.sleep(1.0)


class _InFlightStream:
    """A streaming completion of 16 prompts x 240 tokens read in a thread: `started` is set
    at its first token; `done` says whether it ended normally ([DONE] and no error event)."""

    def __init__(self, url: str) -> None:
        import threading

        self.started = threading.Event()
        self.done = False
        self.ended_at = float("inf")
        self._url = url
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self) -> None:
        body = {"model": MODEL, "prompt": [[5, 6, 7]] * 16, "max_tokens": 240, "temperature": 0,
                "ignore_eos": True, "stream": True}
        saw_done = saw_error = False
        try:
            with httpx.stream("POST", self._url + ROOT + "/v1/completions", json=body, headers=AUTH,
                              timeout=60) as response:
                for line in response.iter_lines():
                    if line.startswith("data: {") and '"text"' in line:
                        self.started.set()
                    saw_error = saw_error or '"error"' in line
                    saw_done = saw_done or line == "data: [DONE]"
        except httpx.HTTPError:
            pass
        finally:
            self.done = saw_done and not saw_error
            self.started.set()
            self.ended_at = time.monotonic()
