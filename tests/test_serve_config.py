"""The shipped `deploy/serve_config.yaml`, as `serve run deploy/serve_config.yaml` runs it:
validated by Serve's own schema, its application built from its import path and args, and
answering a completion with the bundled demo model. It runs on the test session's Ray
with a free HTTP port instead of the config's 8000."""

from __future__ import annotations

import dataclasses
import importlib
from pathlib import Path

import openai
import pytest
import yaml

from test_api_server import free_port

ray = pytest.importorskip("ray")
serve = pytest.importorskip("ray.serve")

CONFIG = Path(__file__).resolve().parent.parent / "deploy" / "serve_config.yaml"
PROMPT = "def"
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def config():
    from ray.serve.schema import ServeDeploySchema

    return ServeDeploySchema.model_validate(yaml.safe_load(CONFIG.read_text()))


@pytest.fixture(scope="module")
def served(ray_cluster, config):
    """(base URL, served model name) of the config's application."""
    (app_config,) = config.applications
    module_name, attr = app_config.import_path.split(":")
    app = getattr(importlib.import_module(module_name), attr)(app_config.args)
    port = free_port()
    serve.start(proxy_location=config.proxy_location, http_options={"host": config.http_options.host, "port": port})
    serve.run(app, name=app_config.name, route_prefix=app_config.route_prefix)
    yield f"http://{config.http_options.host}:{port}", app_config.args["served_model_name"]
    serve.delete(app_config.name)
    serve.shutdown()


def test_shipped_config_serves_the_bundled_demo_model(config):
    from raylm.models.bundled import DEMO_MODEL_NAME

    assert config.applications[0].args["model"] == DEMO_MODEL_NAME


def test_shipped_config_answers_a_completion_as_llm_generate_does(served):
    from raylm.engine import LLM

    url, model = served
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)
    assert [m.id for m in client.models.list().data] == [model]
    response = client.completions.create(model=model, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0)

    llm = LLM()
    # The server fills the fields a request leaves unset from the model's generation_config.
    params = dataclasses.replace(llm.get_default_sampling_params(), temperature=0.0, max_tokens=MAX_TOKENS)
    expected = llm.generate([PROMPT], params, use_tqdm=False)[0]
    llm.shutdown()
    assert response.choices[0].text == expected.outputs[0].text
    assert response.choices[0].text and response.usage.completion_tokens == len(expected.outputs[0].token_ids)
