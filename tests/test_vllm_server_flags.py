"""vLLM's server flags on a real in-process server (the engine and the FastAPI app in this
process, driven over ASGI by httpx): --enable-log-requests / --max-log-len log each
request's id, prompt and parameters, and never the API key; --response-role names the
reply's role, streamed or not, unless the request continues its last message;
--chat-template-content-format gives a template its messages' content as one string or as
OpenAI's list of parts ("auto": the form the template reads), checked against transformers'
apply_chat_template given the content in that form."""

from __future__ import annotations

import asyncio
import json
import logging
from pathlib import Path

import httpx
import pytest

from tiny_models import CHAT_TEMPLATE

from raylm.deploy.api_server import build_app
from raylm.deploy.protocol import ChatMessage
from raylm.deploy.server_args import ServerArgs
from raylm.engine.arg_utils import EngineArgs
from raylm.engine.async_llm_engine import AsyncLLMEngine

API_KEY = "sk-request-log-secret"
ENGINE_KWARGS = dict(num_gpu_blocks_override=128, disable_log_stats=True, dtype="float32")
LOGGER = "raylm.deploy.request_logger"


@pytest.fixture(scope="module")
def engine(llama_dir: Path):
    engine = AsyncLLMEngine.from_engine_args(EngineArgs(model=str(llama_dir), **ENGINE_KWARGS))
    yield engine
    engine.shutdown()


# The engine's output loop belongs to the event loop it first ran on: every request of the
# module runs on this one, as a server's requests all run on uvicorn's.
_RUNNER = asyncio.Runner()


@pytest.fixture(scope="module", autouse=True)
def _close_runner():
    yield
    _RUNNER.close()


def post(app, path: str, body: dict, api_key: str | None = None) -> httpx.Response:
    """One request to the app over ASGI, on the module's event loop."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}

    async def send() -> httpx.Response:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test", timeout=60) as client:
            return await client.post(path, json=body, headers=headers)

    return _RUNNER.run(send())


def stream_events(response: httpx.Response) -> list[dict]:
    return [json.loads(line[len("data: "):]) for line in response.text.splitlines()
            if line.startswith("data: ") and line != "data: [DONE]"]


# ------------------------------------------------------------ request logs
def test_enable_log_requests_logs_id_cut_prompt_and_params_never_the_key(engine, caplog):
    app = build_app(engine, ServerArgs(enable_log_requests=True, max_log_len=3, api_key=API_KEY))
    prompt = "The quick brown fox jumps"
    token_ids = engine.engine.tokenizer.encode(prompt)
    with caplog.at_level(logging.INFO, logger=LOGGER):
        response = post(app, "/v1/completions", {"prompt": prompt, "max_tokens": 2, "temperature": 0,
                                                        "seed": 1234}, API_KEY)
    assert response.status_code == 200, response.text
    lines = [r.getMessage() for r in caplog.records if r.name == LOGGER]
    assert len(lines) == 1
    line = lines[0]
    assert line.startswith(f"Received request {response.json()['id']}-0: ")
    assert len(token_ids) > 3
    assert line.split(", params: ")[0].endswith(f"prompt: {prompt[:3]!r}")
    assert line.split("prompt_token_ids: ")[1].split(", lora_request")[0] == str(token_ids[:3])
    assert "seed=1234" in line and "max_tokens=2" in line
    assert API_KEY not in caplog.text


def test_requests_are_not_logged_by_default(engine, caplog):
    app = build_app(engine, ServerArgs())
    with caplog.at_level(logging.INFO, logger=LOGGER):
        response = post(app, "/v1/completions", {"prompt": "Hello", "max_tokens": 1})
    assert response.status_code == 200, response.text
    assert not [r for r in caplog.records if r.name == LOGGER]
    assert app.state.chat.request_logger is None  # the hot path pays one `is None` test


def test_chat_requests_log_the_rendered_prompt_whole_without_max_log_len(engine, caplog):
    app = build_app(engine, ServerArgs(enable_log_requests=True))
    messages = [{"role": "user", "content": "Tell me about paged attention, at length."}]
    rendered = engine.engine.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    with caplog.at_level(logging.INFO, logger=LOGGER):
        response = post(app, "/v1/chat/completions", {"messages": messages, "max_tokens": 1})
    assert response.status_code == 200, response.text
    (line,) = [r.getMessage() for r in caplog.records if r.name == LOGGER]
    assert f"prompt: {rendered!r}," in line


def output_lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == LOGGER and r.getMessage().startswith("Generated")]


def test_enable_log_outputs_logs_each_choice_as_the_response_gives_it(engine, caplog):
    """Each of n choices: one line with its text and token ids (as the response returns
    them, cut to --max-log-len) and finish reason."""
    app = build_app(engine, ServerArgs(enable_log_requests=True, enable_log_outputs=True, max_log_len=4))
    with caplog.at_level(logging.INFO, logger=LOGGER):
        response = post(app, "/v1/completions", {"prompt": "The quick brown", "max_tokens": 6, "n": 2,
                                                 "temperature": 1.0, "seed": 7, "return_token_ids": True})
    assert response.status_code == 200, response.text
    body = response.json()
    lines = sorted(output_lines(caplog))
    assert len(lines) == 2
    for choice, line in zip(sorted(body["choices"], key=lambda c: c["index"]), lines):
        assert line == (f"Generated response {body['id']}-0, choice {choice['index']}: output: "
                        f"{choice['text'][:4]!r}, output_token_ids: {choice['token_ids'][:4]}, "
                        f"finish_reason: {choice['finish_reason']}.")


def test_streamed_chat_choices_are_logged_once_whole_when_they_finish(engine, caplog):
    app = build_app(engine, ServerArgs(enable_log_requests=True, enable_log_outputs=True))
    with caplog.at_level(logging.INFO, logger=LOGGER):
        response = post(app, "/v1/chat/completions", {
            "messages": [{"role": "user", "content": "Hello there"}], "max_tokens": 5, "stream": True,
            "return_token_ids": True, "temperature": 0})
    assert response.status_code == 200, response.text
    events = stream_events(response)
    text = "".join(event["choices"][0]["delta"].get("content") or "" for event in events if event["choices"])
    token_ids = [i for event in events if event["choices"] for i in event["choices"][0].get("token_ids") or []]
    finish = [event["choices"][0]["finish_reason"] for event in events if event["choices"]][-1]
    assert output_lines(caplog) == [f"Generated response {events[0]['id']}-0, choice 0 (streaming complete): output: "
                                    f"{text!r}, output_token_ids: {token_ids}, finish_reason: {finish}."]
    assert len(token_ids) == 5


def test_enable_log_outputs_alone_logs_nothing_and_says_so(engine, caplog):
    with caplog.at_level(logging.INFO):
        app = build_app(engine, ServerArgs(enable_log_outputs=True))
        response = post(app, "/v1/completions", {"prompt": "Hello", "max_tokens": 2})
    assert response.status_code == 200, response.text
    assert not output_lines(caplog)
    assert "--enable-log-outputs logs nothing without --enable-log-requests" in caplog.text


# ------------------------------------------------------- prompt tokens details
def test_enable_prompt_tokens_details_reports_the_prefix_cache_hits(engine):
    """A 40-token prompt sent twice: the second finds its first two 16-token blocks cached
    (32 tokens; the third block is not full), streamed or not, completions or chat; without
    the flag usage has no prompt_tokens_details, as vLLM's."""
    app = build_app(engine, ServerArgs(enable_prompt_tokens_details=True))
    prompt = list(range(100, 140))
    body = {"prompt": prompt, "max_tokens": 2, "temperature": 0}
    cached = [post(app, "/v1/completions", body).json()["usage"]["prompt_tokens_details"]["cached_tokens"]
              for _ in range(2)]
    assert cached == [0, 32]
    streamed = stream_events(post(app, "/v1/completions", dict(body, stream=True,
                                                               stream_options={"include_usage": True})))
    assert streamed[-1]["usage"]["prompt_tokens_details"] == {"cached_tokens": 32}
    # Two prompts of a request count together.
    both = post(app, "/v1/completions", dict(body, prompt=[prompt, prompt[:20] + list(range(200, 220))])).json()
    assert both["usage"]["prompt_tokens_details"]["cached_tokens"] == 32 + 16
    messages = [{"role": "user", "content": "Tell me about paged attention and prefix caching, at great length."}]
    chat = [post(app, "/v1/chat/completions", {"messages": messages, "max_tokens": 1}).json()["usage"]
            for _ in range(2)]
    prompt_len = chat[0]["prompt_tokens"]  # the rendered prompt's (checked by the chat tests)
    assert prompt_len > 32 and prompt_len % 16
    assert chat[1]["prompt_tokens_details"]["cached_tokens"] == prompt_len // 16 * 16
    plain = post(build_app(engine, ServerArgs()), "/v1/completions", body).json()["usage"]
    assert plain["prompt_tokens_details"] is None


def test_max_log_len_must_be_a_non_negative_integer():
    with pytest.raises(ValueError, match="max_log_len"):
        ServerArgs(max_log_len=-1)
    assert ServerArgs.from_values({"enable_log_requests": "true", "max_log_len": "12"}).max_log_len == 12


def test_vllms_older_disable_log_requests_flag_is_taken_and_contradicting_flags_are_refused(engine, caplog):
    """Scripts written for vLLM before request logging was off by default pass
    --disable-log-requests: it parses and nothing is logged; with --enable-log-requests too it
    is an error naming both."""
    from raylm.deploy import cli

    def server_args(*flags: str) -> ServerArgs:
        return ServerArgs.from_cli_args(cli.build_parser().parse_args(["serve", *flags]))

    args = server_args("--disable-log-requests")
    assert args.disable_log_requests and not args.enable_log_requests
    app = build_app(engine, args)
    with caplog.at_level(logging.INFO, logger=LOGGER):
        response = post(app, "/v1/completions", {"prompt": "Hello", "max_tokens": 1})
    assert response.status_code == 200, response.text
    assert not [r for r in caplog.records if r.name == LOGGER]
    with pytest.raises(ValueError, match="--enable-log-requests and --disable-log-requests"):
        server_args("--disable-log-requests", "--enable-log-requests")


# ------------------------------------------------------------ response role
CHAT = [{"role": "user", "content": "Hello there"}]


@pytest.mark.parametrize("stream", [False, True])
def test_response_role_names_the_reply_of_a_new_turn(engine, stream):
    app = build_app(engine, ServerArgs(response_role="bot"))
    response = post(app, "/v1/chat/completions", {"messages": CHAT, "max_tokens": 2, "stream": stream})
    assert response.status_code == 200, response.text
    if stream:
        roles = [c["choices"][0]["delta"].get("role") for c in stream_events(response) if c["choices"]]
        assert roles[0] == "bot" and not any(roles[1:])
    else:
        assert response.json()["choices"][0]["message"]["role"] == "bot"


@pytest.mark.parametrize("stream", [False, True])
def test_a_continued_message_keeps_its_own_role(engine, stream):
    """vLLM: without add_generation_prompt the reply continues the last message, in its role."""
    app = build_app(engine, ServerArgs(response_role="bot"))
    messages = CHAT + [{"role": "assistant", "content": "Hi, I am"}]
    response = post(app, "/v1/chat/completions", {"messages": messages, "max_tokens": 2, "stream": stream,
                                                        "add_generation_prompt": False,
                                                        "continue_final_message": True})
    assert response.status_code == 200, response.text
    if stream:
        assert stream_events(response)[0]["choices"][0]["delta"]["role"] == "assistant"
    else:
        assert response.json()["choices"][0]["message"]["role"] == "assistant"


def test_response_role_defaults_to_assistant(engine):
    response = post(build_app(engine, ServerArgs()), "/v1/chat/completions", {"messages": CHAT,
                                                                                    "max_tokens": 1})
    assert response.json()["choices"][0]["message"]["role"] == "assistant"


# ------------------------------------------------------ chat template content format
STRING_TEMPLATE = CHAT_TEMPLATE  # reads message['content'] as a string
OPENAI_TEMPLATE = (
    "{% for message in messages %}<|{{ message['role'] }}|>\n"
    "{% for part in message['content'] %}{% if part['type'] == 'text' %}[{{ part['text'] }}]{% endif %}{% endfor %}"
    "<|end|>\n{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
PARTS = [{"type": "text", "text": "First part."}, {"type": "text", "text": "Second part."}]
CONTENTS = {"string": "One string.", "parts": PARTS}


def as_form(content, form: str):
    """The content as a template of that form is given it (vLLM's two formats)."""
    if form == "string":
        return content if isinstance(content, str) else "\n".join(part["text"] for part in content)
    return [{"type": "text", "text": content}] if isinstance(content, str) else content


def rendered(engine, template: str, content_format: str, messages: list[dict], **kwargs) -> str:
    app = build_app(engine, ServerArgs(chat_template=template, chat_template_content_format=content_format))
    return app.state.chat.render([ChatMessage.model_validate(m) for m in messages], **kwargs)


@pytest.mark.parametrize("content", CONTENTS)
@pytest.mark.parametrize("template, form", [(STRING_TEMPLATE, "string"), (OPENAI_TEMPLATE, "openai")],
                         ids=["string_template", "openai_template"])
def test_auto_gives_each_template_the_content_form_it_reads(engine, template, form, content):
    messages = [{"role": "system", "content": CONTENTS[content]}, {"role": "user", "content": PARTS}]
    expected = engine.engine.tokenizer.apply_chat_template(
        [{**m, "content": as_form(m["content"], form)} for m in messages], chat_template=template, tokenize=False,
        add_generation_prompt=True)
    assert "First part." in expected
    assert rendered(engine, template, "auto", messages, add_generation_prompt=True) == expected
    assert rendered(engine, template, form, messages, add_generation_prompt=True) == expected


@pytest.mark.parametrize("form", ["string", "openai"])
def test_an_explicit_content_format_is_what_the_template_gets(engine, form):
    """Forced, the format holds even where the template reads the other (vLLM's flag)."""
    messages = [{"role": "user", "content": PARTS}]
    for template in (STRING_TEMPLATE, OPENAI_TEMPLATE):
        expected = engine.engine.tokenizer.apply_chat_template(
            [{"role": "user", "content": as_form(PARTS, form)}], chat_template=template, tokenize=False,
            add_generation_prompt=True)
        assert rendered(engine, template, form, messages, add_generation_prompt=True) == expected


def test_continue_final_message_with_content_parts(engine):
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": PARTS}]
    expected = engine.engine.tokenizer.apply_chat_template(
        [{**m, "content": as_form(m["content"], "openai")} for m in messages], chat_template=OPENAI_TEMPLATE,
        tokenize=False, continue_final_message=True)
    assert rendered(engine, OPENAI_TEMPLATE, "auto", messages, add_generation_prompt=False,
                    continue_final_message=True) == expected


def test_chat_through_a_parts_template_over_http(engine):
    app = build_app(engine, ServerArgs(chat_template=OPENAI_TEMPLATE))
    response = post(app, "/v1/chat/completions", {"messages": [{"role": "user", "content": "Hello"}],
                                                  "max_tokens": 1, "return_token_ids": True})
    expected = engine.engine.tokenizer.apply_chat_template(
        [{"role": "user", "content": [{"type": "text", "text": "Hello"}]}], chat_template=OPENAI_TEMPLATE,
        tokenize=True, add_generation_prompt=True, return_dict=True)["input_ids"]
    assert response.json()["prompt_token_ids"] == list(expected)


def test_the_content_format_flag_offers_what_the_renderer_takes():
    """server_args spells the choices itself (importing the renderer would bring Jinja into
    the command line's start): they must stay the renderer's."""
    from raylm.deploy.chat_template import CONTENT_FORMATS
    from raylm.deploy.server_args import CHAT_TEMPLATE_CONTENT_FORMATS

    assert CHAT_TEMPLATE_CONTENT_FORMATS == CONTENT_FORMATS
