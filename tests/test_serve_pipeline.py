"""A Ray Serve replica of two pipeline stages (`raylm serve --ray-serve
--pipeline-parallel-size 2`): its workers are stage 0 and stage 1, it serves `LLM.generate`'s
greedy text; a killed stage ends the stream in flight with an error within seconds, the
replica fails its health check, and Serve replaces it with a working one on new workers.
(The Serve plumbing shared with tensor parallel is tested in test_serve_app.py; this module
runs after it, on its own app.)"""

from __future__ import annotations

from pathlib import Path

import pytest

from test_serve_app import (MODEL, PROMPTS, SERVER_FLAGS, _client, kill_worker_mid_stream_and_await_a_new_replica,
                            run_cli_serve_app)
from test_serve_app import expected, session_ray  # noqa: F401 - fixtures

ray = pytest.importorskip("ray")
serve = pytest.importorskip("ray.serve")

APP_NAME = "raylm-test-pp"


@pytest.fixture(scope="module")
def serve_url(session_ray, llama_dir: Path):  # noqa: F811 - the imported fixture
    from raylm.deploy.cli import build_parser

    cli_args = build_parser().parse_args(["serve", str(llama_dir), "--ray-serve", "--pipeline-parallel-size", "2",
                                          "--num-gpu-blocks-override", "256", "--device", "cpu", *SERVER_FLAGS])
    yield from run_cli_serve_app(cli_args, APP_NAME)


def _stages(handle) -> list[tuple[int, int]]:
    """(pipeline rank, tensor-parallel rank) of each of the replica's workers, in rank order."""
    workers = handle.worker_actors.remote().result(timeout_s=30)

    def ranks(wrapper) -> tuple[int, int]:
        return wrapper.worker.pp_rank, wrapper.worker.tp_rank

    return [tuple(r) for r in ray.get([w.__ray_call__.remote(ranks) for w in workers], timeout=60)]


def test_a_two_stage_replica_serves_llm_generate_text_and_is_replaced_when_a_stage_dies(
        serve_url, expected):  # noqa: F811 - the imported fixture
    handle = serve.get_deployment_handle("RaylmDeployment", app_name=APP_NAME)
    assert _stages(handle) == [(0, 0), (1, 0)]
    client = _client(serve_url)
    response = client.completions.create(model=MODEL, prompt=PROMPTS, max_tokens=12, temperature=0)
    assert [c.text for c in sorted(response.choices, key=lambda c: c.index)] == expected

    workers = handle.worker_actors.remote().result(timeout_s=30)
    assert len(workers) == 2
    kill_worker_mid_stream_and_await_a_new_replica(serve_url, handle, workers, 1, "the last stage")
    assert _stages(handle) == [(0, 0), (1, 0)]
    response = _client(serve_url).completions.create(model=MODEL, prompt=PROMPTS, max_tokens=12, temperature=0)
    assert [c.text for c in sorted(response.choices, key=lambda c: c.index)] == expected
