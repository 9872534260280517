"""The Ray Serve app's keys as `serve run raylm.deploy.serve_app:app_builder key=value`
passes them (strings): each typed by its setting ("false" is False, "8" is 8), an unknown
key named with its near misses, and applied by the replica:
`trust_request_chat_template=false` keeps request templates off."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from test_api_server import free_port

ray = pytest.importorskip("ray")
serve = pytest.importorskip("ray.serve")

APP_NAME = "raylm-keys-test"


def test_string_keys_are_typed_by_their_settings(llama_dir):
    from raylm.deploy.serve_app import app_arguments

    parsed = app_arguments({
        "model": str(llama_dir), "enable_prefix_caching": "false", "kv_cache_space": "0.5", "max_num_seqs": "8",
        "tokenizer": "none", "trust_request_chat_template": "false", "max_concurrent_requests": "8",
        "served_model_name": "a,b", "max_prompt_chars": "none", "max_stop_strings": "2", "shutdown_timeout": "7",
        "num_replicas": "2", "use_gpu": "false", "replica_cpus": "0.25", "enable_auto_tool_choice": "true",
        "tool_call_parser": "mistral", "max_tools": "4", "max_grammar_compile_seconds": "2.5"})
    assert parsed.engine_kwargs == {"model": str(llama_dir), "enable_prefix_caching": False, "kv_cache_space": 0.5,
                                    "max_num_seqs": 8, "tokenizer": None}
    server = parsed.server_args
    assert server.trust_request_chat_template is False and server.max_concurrent_requests == 8
    assert server.served_model_name == ["a", "b"] and server.shutdown_timeout == 7.0
    assert server.limits.max_prompt_chars is None and server.limits.max_stop_strings == 2
    assert server.enable_auto_tool_choice is True and server.tool_call_parser == "mistral"
    assert server.limits.max_tools == 4 and server.limits.max_grammar_compile_seconds == 2.5
    deployment = parsed.deployment
    assert deployment.num_replicas == 2 and deployment.use_gpu is False and deployment.replica_cpus == 0.25


def test_yaml_values_keep_their_types(llama_dir):
    from raylm.deploy.serve_app import app_arguments

    parsed = app_arguments({"model": str(llama_dir), "trust_request_chat_template": True, "max_stop_strings": 3,
                            "served_model_name": ["x"], "target_ongoing_requests": 16})
    assert parsed.server_args.trust_request_chat_template is True and parsed.server_args.limits.max_stop_strings == 3
    assert parsed.server_args.served_model_name == ["x"] and parsed.deployment.target_ongoing_requests == 16.0


@pytest.mark.parametrize("args,message", [
    ({"trust_request_chat_templat": "false"},
     "Unknown app argument: 'trust_request_chat_templat' (did you mean 'trust_request_chat_template'"),
    ({"max_num_seq": "8"}, "'max_num_seq' (did you mean 'max_num_seqs'"),
    ({"trust_request_chat_template": "flase"}, "trust_request_chat_template must be true or false, got 'flase'"),
    ({"max_concurrent_requests": "eight"}, "max_concurrent_requests must be an integer, got 'eight'"),
    ({"max_concurrent_requests": "0"}, "max_concurrent_requests must be a positive integer, got 0"),
    ({"enable_prefix_caching": "maybe"}, "enable_prefix_caching must be true or false"),
    ({"port": "9000"}, "'port' is not a server setting: Ray Serve's http_options set it"),
    ({"uvicorn_log_level": "info"}, "uvicorn's own"),
    ({"tool_call_parser": "hermes2"},
     "tool_call_parser must be one of hermes, llama3_json, mistral, openai, qwen3_coder, qwen3_xml, got 'hermes2'"),
    ({"enable_auto_tool_choice": "true"}, "enable_auto_tool_choice (--enable-auto-tool-choice) needs tool_call_parser"),
    ({"max_grammar_compile_seconds": "0"}, "max_grammar_compile_seconds must be a positive number, got 0.0"),
])
def test_a_bad_key_or_value_is_an_error_naming_it(llama_dir, args, message):
    from raylm.deploy.serve_app import app_arguments

    with pytest.raises(ValueError) as error:
        app_arguments({"model": str(llama_dir), **args})
    assert message in str(error.value)


def test_engine_server_and_deployment_settings_have_distinct_names():
    from raylm.deploy.server_args import DeploymentArgs, ServerArgs
    from raylm.engine.arg_fields import settings_of
    from raylm.engine.arg_utils import EngineArgs

    names = [s.name for cls in (EngineArgs, ServerArgs, DeploymentArgs) for s in settings_of(cls)]
    assert len(names) == len(set(names))


def test_the_shutdown_timeout_is_serves_grace_period_for_a_stopping_replica():
    from raylm.deploy.serve_app import deployment_options
    from raylm.deploy.server_args import DeploymentArgs

    options = deployment_options(2, DeploymentArgs(min_replicas=1, max_replicas=3), shutdown_timeout=7.0)
    assert options["graceful_shutdown_timeout_s"] == 7.0
    assert options["autoscaling_config"]["max_replicas"] == 3
    assert len(options["placement_group_bundles"]) == 3


# --------------------------------------------------------------- a real app
@pytest.fixture(scope="module")
def serve_url(ray_cluster, llama_dir: Path):
    from raylm.deploy.serve_app import app_builder

    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    # As `serve run ... key=value` passes them: every value a string.
    app = app_builder({"model": str(llama_dir), "num_gpu_blocks_override": "64", "device": "cpu",
                       "served_model_name": "keys-model,alias", "trust_request_chat_template": "false",
                       "max_stop_strings": "2", "num_replicas": "1", "replica_cpus": "0.25",
                       "health_check_period_s": "2"})
    serve.run(app, name=APP_NAME, route_prefix="/")
    yield f"http://127.0.0.1:{port}"
    serve.delete(APP_NAME)
    serve.shutdown()


def test_trust_request_chat_template_false_keeps_request_templates_off(serve_url):
    chat = {"model": "keys-model", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
    assert httpx.post(serve_url + "/v1/chat/completions", json=chat, timeout=60).status_code == 200
    response = httpx.post(serve_url + "/v1/chat/completions", json={**chat, "chat_template": "{{ 7 * 6 }}"},
                          timeout=60)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == "chat_template"


def test_the_other_string_keys_reach_the_replica_typed(serve_url):
    models = httpx.get(serve_url + "/v1/models", timeout=30).json()
    assert [card["id"] for card in models["data"]] == ["keys-model", "alias"]
    body = {"model": "alias", "prompt": "Hi", "max_tokens": 2, "stop": ["a", "b", "c"]}
    response = httpx.post(serve_url + "/v1/completions", json=body, timeout=60)
    assert response.status_code == 400 and response.json()["error"]["param"] == "stop", response.text
