"""Request limits: every size a request can ask for is bounded and refused before anything
is allocated, with a 400 naming the field; hostile requests leave the server's memory
flat and the server serving; tokenizing and chat templates run off the event loop."""

from __future__ import annotations

import json
import re
import threading
import time
from pathlib import Path

import httpx
import pytest
from raylm.deploy.cli import build_parser
from raylm.deploy.limits import PROMPT_CHARS_PER_TOKEN, RequestLimits
from raylm.deploy.server_args import ServerArgs
from raylm.engine import LLM, BeamSearchParams, SamplingParams
from raylm.engine.sampling_params import MAX_N_SEQUENCES
from raylm.engine.structured_output.params import StructuredOutputsParams
from process_tree import descendants
from server_process import rss_kib, running_server

MODEL = "tiny-llama"
MAX_MODEL_LEN = 256  # the tiny model's context
CHAT = [{"role": "user", "content": "Hi"}]
# The server's --max-chat-template-render-seconds.
RENDER_SECONDS = 3.0


@pytest.fixture(scope="module")
def server(llama_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    """`raylm serve` with its default limits; yields (base_url, pid)."""
    log = tmp_path_factory.mktemp("limits_server") / "server.log"
    with running_server([str(llama_dir), "--served-model-name", MODEL, "--num-gpu-blocks-override", "256",
                         "--trust-request-chat-template", "--max-chat-template-render-seconds", str(RENDER_SECONDS)],
                        log) as (process, base_url):
        yield base_url, process.pid


def rss_mb(pid: int) -> float:
    return rss_kib(pid) / 1024


def post(base_url: str, path: str, body: dict, timeout: float = 60) -> httpx.Response:
    return httpx.post(base_url + path, json={"model": MODEL, **body}, timeout=timeout)


def assert_served(base_url: str) -> None:
    response = post(base_url, "/v1/completions", {"prompt": "Hi", "max_tokens": 2})
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["finish_reason"] in ("length", "stop")


# case: (route, body, the error's "param")
HOSTILE = {
    "n of a million": ("/v1/completions", {"prompt": "x", "n": 1_000_000, "temperature": 1}, "n"),
    "best_of of a million": ("/v1/completions", {"prompt": "x", "best_of": 1_000_000, "temperature": 1}, "best_of"),
    "chat n of a million": ("/v1/chat/completions", {"messages": CHAT, "n": 1_000_000, "temperature": 1}, "n"),
    "20,000 prompts": ("/v1/completions", {"prompt": ["Hi"] * 20_000, "max_tokens": 1}, "prompt"),
    "20,000 token-id prompts": ("/v1/completions", {"prompt": [[5, 6]] * 20_000, "max_tokens": 1}, "prompt"),
    "prompts x n over the sequence limit": ("/v1/completions", {"prompt": ["Hi"] * 20, "n": 1000,
                                                                "temperature": 1, "max_tokens": 1}, "n"),
    "logprobs of a million": ("/v1/completions", {"prompt": "Hi", "logprobs": 1_000_000}, "logprobs"),
    "prompt_logprobs of a million": ("/v1/completions", {"prompt": "Hi", "prompt_logprobs": 1_000_000},
                                     "prompt_logprobs"),
    "chat top_logprobs of a million": ("/v1/chat/completions", {"messages": CHAT, "logprobs": True,
                                                                "top_logprobs": 1_000_000}, "top_logprobs"),
    "beam width of a thousand": ("/v1/completions", {"prompt": "Hi", "best_of": 1000, "use_beam_search": True,
                                                     "temperature": 0}, "best_of"),
    "10,000 stop strings": ("/v1/completions", {"prompt": "Hi", "stop": [f"s{i}" for i in range(10_000)]}, "stop"),
    "a 100,000-character stop string": ("/v1/completions", {"prompt": "Hi", "stop": "s" * 100_000}, "stop"),
    "100,000 stop_token_ids": ("/v1/completions", {"prompt": "Hi", "stop_token_ids": [5] * 100_000},
                               "stop_token_ids"),
    "100,000-entry logit_bias": ("/v1/completions", {"prompt": "Hi", "logit_bias": {str(i): 1 for i in
                                                                                   range(100_000)}}, "logit_bias"),
    "10,000 chat messages": ("/v1/chat/completions", {"messages": CHAT * 10_000}, "messages"),
    "a 2,000,000-character chat message": ("/v1/chat/completions", {"messages": [
        {"role": "user", "content": "Hi " * 700_000}]}, "messages"),
    "a 2,000,000-character prompt": ("/v1/completions", {"prompt": "Hi " * 700_000}, "prompt"),
    "a 2,000,000-character /tokenize prompt": ("/tokenize", {"prompt": "Hi " * 700_000}, "prompt"),
    # 8,192 characters of content, the limit, rendered with the template's role tags: 77,838.
    "/tokenize messages rendered past the character limit": ("/tokenize", {"messages": [
        {"role": "user", "content": "xx"}] * 4096}, "messages"),
    # The decode ran on the tokenizer thread every request shares: 7.5 million ids held the
    # others up 1.7 s.
    "/detokenize of a million token ids": ("/detokenize", {"tokens": [5] * 1_000_000}, "tokens"),
    "/detokenize of one token id past the context": ("/detokenize", {"tokens": [5] * (MAX_MODEL_LEN + 1)},
                                                      "tokens"),
    # Each size within its own limit, their product not: this one grew the server by 3 GB in two
    # minutes until the engine died for want of memory.
    "16,384 samples x 254 tokens x 20 logprobs": ("/v1/completions", {"prompt": "Hi", "n": 16384, "temperature": 1,
                                                                       "max_tokens": 254, "logprobs": 20},
                                                  "max_tokens"),
    "chat: 16,384 samples to the end of the context x 20 logprobs": ("/v1/chat/completions", {
        "messages": CHAT, "n": 16384, "temperature": 1, "logprobs": True, "top_logprobs": 20}, "max_tokens"),
    "1,024 prompts of 250 tokens x 20 prompt_logprobs": ("/v1/completions", {"prompt": [[5] * 250] * 1024,
                                                                             "max_tokens": 1, "prompt_logprobs": 20},
                                                         "prompt_logprobs"),
    "echo of 1,024 prompts of 250 tokens x 20 logprobs": ("/v1/completions", {"prompt": [[5] * 250] * 1024,
                                                                              "max_tokens": 1, "echo": True,
                                                                              "logprobs": 20}, "logprobs"),
    # 1e39 is finite in JSON and in Python, inf in the sampler's fp32.
    "temperature of 1e39": ("/v1/completions", {"prompt": "Hi", "temperature": 1e39}, "temperature"),
    "chat temperature of 1e39": ("/v1/chat/completions", {"messages": CHAT, "temperature": 1e39}, "temperature"),
    "repetition_penalty of 1e39": ("/v1/completions", {"prompt": "Hi", "repetition_penalty": 1e39},
                                   "repetition_penalty"),
    # Positive logits are divided by it: 1e-45 made them inf, and the request a 500.
    "repetition_penalty of 1e-45": ("/v1/completions", {"prompt": "Hi", "repetition_penalty": 1e-45},
                                    "repetition_penalty"),
    # A finished beam's score divides by length ** length_penalty: these overflowed, a 500.
    "beam search length_penalty of 1e308": ("/v1/completions", {"prompt": "Hi", "use_beam_search": True, "best_of": 2,
                                                                "temperature": 0, "length_penalty": 1e308},
                                            "length_penalty"),
    "beam search length_penalty of -1e308": ("/v1/completions", {"prompt": "Hi", "use_beam_search": True,
                                                                 "best_of": 2, "temperature": 0,
                                                                 "length_penalty": -1e308}, "length_penalty"),
    "max_tokens of 10**18": ("/v1/completions", {"prompt": "Hi", "max_tokens": 10**18}, "max_tokens"),
    "chat max_tokens of 10**18": ("/v1/chat/completions", {"messages": CHAT, "max_tokens": 10**18}, "max_tokens"),
}


def test_hostile_requests_are_4xx_naming_their_field_and_leave_memory_flat(server):
    base_url, pid = server
    assert_served(base_url)
    start = rss_mb(pid)
    wrong = {}
    for case, (path, body, param) in HOSTILE.items():
        response = post(base_url, path, body)
        error = response.json().get("error") if response.headers.get("content-type") == "application/json" else None
        if not (400 <= response.status_code < 500 and error and error.get("param") == param):
            wrong[case] = (response.status_code, response.text[:300])
    grown = rss_mb(pid) - start
    assert not wrong, wrong
    assert grown < 200, f"RSS grew {grown:.0f} MB over the hostile requests (from {start:.0f} MB)"
    assert_served(base_url)
    print(f"RSS {start:.0f} MB before the {len(HOSTILE)} hostile requests, +{grown:.1f} MB after")


@pytest.mark.parametrize("field", ["temperature", "repetition_penalty", "length_penalty"])
def test_a_number_json_reads_as_infinite_is_a_400_naming_its_field(server, field):
    # 1e999 is valid JSON that parses to inf (httpx's json= cannot write it): raw bytes.
    base_url, _ = server
    extra = ', "use_beam_search": true, "n": 2' if field == "length_penalty" else ""
    body = f'{{"model": "{MODEL}", "prompt": "Hi", "max_tokens": 2, "{field}": 1e999{extra}}}'
    response = httpx.post(base_url + "/v1/completions", content=body,
                          headers={"content-type": "application/json"}, timeout=60)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == field
    assert_served(base_url)


# case: (route, body, the error's "param"); each body holds a lone surrogate, which
# json.dumps writes as a \\udfff escape (valid JSON that no UTF-8 can encode).
LONE_SURROGATES = {
    "prompt": ("/v1/completions", {"prompt": "Hi \udfff"}, "prompt"),
    "one of several prompts": ("/v1/completions", {"prompt": ["Hi", "\ud800 there"]}, "prompt"),
    "stop string": ("/v1/completions", {"prompt": "Hi", "stop": ["\udfff"]}, "stop"),
    "chat message": ("/v1/chat/completions", {"messages": [{"role": "user", "content": "\udfff"}]}, "messages"),
    "chat content part": ("/v1/chat/completions", {"messages": [{"role": "user", "content": [
        {"type": "text", "text": "\udfff"}]}]}, "messages"),
    "chat role": ("/v1/chat/completions", {"messages": [{"role": "\udfff", "content": "Hi"}]}, "messages"),
    "chat_template_kwargs": ("/v1/chat/completions", {"messages": CHAT, "chat_template_kwargs": {"x": "\udfff"}},
                             "chat_template_kwargs"),
    "model": ("/v1/completions", {"prompt": "Hi", "model": "\udfff"}, "model"),
    "/tokenize prompt": ("/tokenize", {"prompt": "\udfff"}, "prompt"),
    "/tokenize messages": ("/tokenize", {"messages": [{"role": "user", "content": "\udfff"}]}, "messages"),
    "guided_regex": ("/v1/completions", {"prompt": "Hi", "guided_regex": "\udfff"}, "guided_regex"),
    "a JSON schema's key": ("/v1/chat/completions", {"messages": CHAT, "response_format": {
        "type": "json_schema", "json_schema": {"name": "x", "schema": {"properties": {"\udfff": {}}}}}},
        "response_format"),
}


@pytest.mark.parametrize("case", list(LONE_SURROGATES))
def test_a_lone_surrogate_anywhere_is_a_400_naming_its_field(server, case):
    # The tokenizer raised on these (a 500), and one in a constraint made the grammar compile
    # worker refuse every constrained request (a 503) for a growing pause.
    base_url, _ = server
    path, body, param = LONE_SURROGATES[case]
    response = httpx.post(base_url + path, content=json.dumps({"model": MODEL, "max_tokens": 2, **body}),
                          headers={"content-type": "application/json"}, timeout=60)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and "lone UTF-16 surrogate" in error["message"], error
    constrained = post(base_url, "/v1/completions", {"prompt": "Hi", "max_tokens": 3, "guided_regex": "[ab]+"})
    assert constrained.status_code == 200, constrained.text
    assert_served(base_url)


def test_limit_errors_name_the_limit(server):
    base_url, _ = server
    checks = {
        "/v1/completions": [({"prompt": "Hi", "logprobs": 21}, "20"), ({"prompt": ["Hi"] * 1025}, "1024"),
                            ({"prompt": "Hi", "stop": ["s"] * 65}, "64"),
                            ({"prompt": "Hi", "logit_bias": {str(i): 1 for i in range(1025)}}, "1024")],
        "/v1/chat/completions": [({"messages": CHAT * 4097}, "4096"),
                                 ({"messages": CHAT, "n": 16384, "temperature": 1, "max_tokens": 230,
                                   "logprobs": True, "top_logprobs": 1},
                                  "4,194,304 are allowed (--max-response-tokens)")],
    }
    for path, cases in checks.items():
        for body, limit in cases:
            response = post(base_url, path, body)
            assert response.status_code == 400, response.text
            assert limit in response.json()["error"]["message"], response.text


def test_logprobs_up_to_vllms_max_logprobs_of_20_are_served(server):
    base_url, _ = server
    response = post(base_url, "/v1/completions", {"prompt": "Hi", "max_tokens": 2, "logprobs": 20,
                                                  "prompt_logprobs": 20})
    assert response.status_code == 200, response.text
    assert len(response.json()["choices"][0]["logprobs"]["top_logprobs"]) == 2
    chat = post(base_url, "/v1/chat/completions", {"messages": CHAT, "max_tokens": 2, "logprobs": True,
                                                   "top_logprobs": 20})
    assert chat.status_code == 200, chat.text
    assert len(chat.json()["choices"][0]["logprobs"]["content"][0]["top_logprobs"]) == 20


def test_sizes_just_under_the_limits_are_served(server):
    base_url, _ = server
    body = {"prompt": ["Hi"] * 64, "max_tokens": 1, "stop": [f"s{i}" for i in range(64)],
            "stop_token_ids": list(range(3, 503)), "logit_bias": {str(i): 0.5 for i in range(512)}}
    response = post(base_url, "/v1/completions", body)
    assert response.status_code == 200, response.text
    assert len(response.json()["choices"]) == 64
    detokenized = post(base_url, "/detokenize", {"tokens": [5] * MAX_MODEL_LEN})
    assert detokenized.status_code == 200, detokenized.text


@pytest.mark.parametrize("seed", [2**100, -5, 2**64 - 1])
def test_any_integer_seed_is_served(server, seed):
    base_url, _ = server
    body = {"prompt": "Hi", "max_tokens": 4, "temperature": 1.0, "seed": seed}
    first, second = post(base_url, "/v1/completions", body), post(base_url, "/v1/completions", body)
    assert first.status_code == 200, first.text
    assert first.json()["choices"][0]["text"] == second.json()["choices"][0]["text"]  # the seed still seeds
    assert httpx.get(base_url + "/health").status_code == 200
    assert_served(base_url)


def test_health_answers_while_a_chat_template_renders(server):
    """A request's template renders in a process of its own, waited for off the event loop: one
    that runs until its deadline (RENDER_SECONDS) leaves /health answering meanwhile, at once.
    Were /health queued behind the render, a call would wait for the rest of it; the bound is
    half of that, so that a loaded machine, which slows both alike, cannot fail the test."""
    base_url, _ = server
    result = {}

    def chat() -> None:
        started = time.monotonic()
        result["response"] = post(base_url, "/v1/chat/completions", {"messages": CHAT, "max_tokens": 2,
                                                                     "chat_template": PAST_THE_DEADLINE})
        result["seconds"] = time.monotonic() - started

    thread = threading.Thread(target=chat)
    thread.start()
    time.sleep(0.3)
    latencies = []
    while thread.is_alive():
        started = time.monotonic()
        assert httpx.get(base_url + "/health", timeout=5).status_code == 200
        latencies.append(time.monotonic() - started)
        time.sleep(0.1)
    thread.join()
    assert result["response"].status_code == 400, result["response"].text
    assert f"did not render within {RENDER_SECONDS:g} s" in result["response"].json()["error"]["message"]
    assert result["seconds"] >= RENDER_SECONDS
    assert latencies and max(latencies) < (result["seconds"] - 0.3) / 2, (result["seconds"], latencies)


# A request's template that stays within every bound (8,000 characters, 600,000 steps) but
# sorts 8,000 characters at each of its 300,000 iterations: minutes of work, stopped at the deadline.
PAST_THE_DEADLINE = ("{% set big = 'ab' * 4000 %}{% for i in range(300000) %}{% set x = big|list|sort|join %}"
                     "{% endfor %}")
# case: (request fields, the error's "param", what its message says: one of several where the
# steps (1,000,000 macro calls: some 4 s on a loaded machine) and the deadline race)
HOSTILE_TEMPLATES = {
    "nested ranges of 10**5 x 10**5": ({"chat_template": "{% for i in range(100000) %}{% for j in range(100000) %}"
                                                         "{% endfor %}{% endfor %}"}, "chat_template",
                                       "too many steps"),
    "'x' * 10**10": ({"chat_template": "{{ 'x' * 10**10 }}"}, "chat_template", "repeated string"),
    "a string doubled 60 times": ({"chat_template": "{% set ns = namespace(s='x') %}{% for i in range(60) %}"
                                                    "{% set ns.s = ns.s ~ ns.s %}{% endfor %}{{ ns.s }}"},
                                  "chat_template", "characters or items"),
    "a macro calling itself": ({"chat_template": "{% macro f(n) %}{{ f(n) }}{% endmacro %}{{ f(1) }}"},
                               "chat_template", "recursed too deeply"),
    "a macro calling itself twice, 60 deep": ({"chat_template": "{% macro f(n) %}{% if n > 0 %}{{ f(n - 1) }}"
                                                                "{{ f(n - 1) }}{% endif %}{% endmacro %}{{ f(60) }}"},
                                              "chat_template", ("too many steps", "did not render within")),
    "a str.format padded to 3 GB": ({"chat_template": "{{ '{:>3000000000}'.format('x') }}"}, "chat_template",
                                    "ran out of memory"),
    "minutes of sorting": ({"chat_template": PAST_THE_DEADLINE}, "chat_template", "did not render within"),
    "kwargs the template repeats 10**9 times": ({"chat_template": "{{ pad * count }}",
                                                 "chat_template_kwargs": {"pad": "x", "count": 10**9}},
                                                "chat_template", "repeated string"),
    "a template of 100,000 characters": ({"chat_template": "{{ 1 }}" * 15_000}, "chat_template",
                                         "at most 65536 are allowed (--max-chat-template-chars)"),
    "chat_template_kwargs of 100,000 characters": ({"chat_template_kwargs": {"x": "y" * 100_000}},
                                                   "chat_template_kwargs",
                                                   "at most 65536 are allowed (--max-chat-template-kwargs-chars)"),
    "chat_template_kwargs nested 100 deep": ({"chat_template_kwargs": {"x": json.loads("[" * 99 + "]" * 99)}},
                                             "chat_template_kwargs", "at most 64 are allowed"),
    "a chat_template inside chat_template_kwargs": ({"chat_template_kwargs": {"chat_template": "{{ 'x' * 9 }}"}},
                                                    "chat_template_kwargs", "may not set chat_template"),
}


def server_threads(pid: int) -> int:
    status = Path(f"/proc/{pid}/status").read_text()
    return int(re.search(r"^Threads:\s+(\d+)", status, re.MULTILINE).group(1))


def test_hostile_chat_templates_are_400s_within_seconds_and_the_server_serves_on(server, llama_dir):
    from transformers import AutoTokenizer

    base_url, pid = server
    template = "{% for m in messages %}[{{ m.role }}] {{ m.content }}{{ eos_token }}{% endfor %}[assistant]"
    tokenizer = AutoTokenizer.from_pretrained(str(llama_dir))
    prompt_ids = tokenizer.encode(tokenizer.apply_chat_template(CHAT, chat_template=template, tokenize=False),
                                  add_special_tokens=False)

    def served_as_transformers_renders() -> None:
        # The request's template renders as transformers does: the engine answers as it
        # answers those token ids.
        chat = post(base_url, "/v1/chat/completions", {"messages": CHAT, "max_tokens": 6, "temperature": 0,
                                                       "chat_template": template, "ignore_eos": True})
        assert chat.status_code == 200, chat.text
        completion = post(base_url, "/v1/completions", {"prompt": prompt_ids, "max_tokens": 6, "temperature": 0,
                                                        "ignore_eos": True})
        assert chat.json()["usage"]["prompt_tokens"] == len(prompt_ids)
        assert chat.json()["choices"][0]["message"]["content"] == completion.json()["choices"][0]["text"]

    served_as_transformers_renders()
    threads = server_threads(pid)
    wrong = {}
    for case, (fields, param, messages) in HOSTILE_TEMPLATES.items():
        started = time.monotonic()
        response = post(base_url, "/v1/chat/completions", {"messages": CHAT, "max_tokens": 2, **fields})
        seconds = time.monotonic() - started
        error = response.json().get("error", {})
        said = any(message in error.get("message", "") for message in
                   ((messages,) if isinstance(messages, str) else messages))
        if not (response.status_code == 400 and error.get("param") == param and said and seconds < RENDER_SECONDS + 5):
            wrong[case] = (response.status_code, f"{seconds:.1f} s", response.text[:300])
    assert not wrong, wrong
    served_as_transformers_renders()
    assert_served(base_url)
    wait_for_no_kv_blocks(base_url)
    assert server_threads(pid) <= threads
    sandboxes = [command for command in descendants(pid).values() if "chat_template_sandbox" in command]
    assert len(sandboxes) <= 2, sandboxes  # DEFAULT_MAX_PROCESSES: the killed ones are gone


def wait_for_no_kv_blocks(base_url: str, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while True:
        metrics = httpx.get(base_url + "/metrics").text
        used = float(re.search(r"^raylm:num_kv_cache_blocks_used(?:{[^}]*})? ([0-9.e+-]+)$", metrics,
                               re.MULTILINE).group(1))
        if used == 0:
            return
        assert time.monotonic() < deadline, f"{used} KV blocks still held"
        time.sleep(0.2)


def test_a_template_error_without_a_message_is_named_by_its_type(server):
    # A trusted template that asks for gigabytes fails with a MemoryError whose message is
    # empty: the 400 read "The chat template failed on these messages: " and stopped there.
    base_url, _ = server
    response = post(base_url, "/v1/chat/completions", {"messages": CHAT, "max_tokens": 2,
                                                       "chat_template": "{{ raise_exception('') }}"})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["message"].endswith("messages: TemplateError"), response.text


# ------------------------------------------------------------- unit level
def test_limits_are_serve_flags_with_documented_defaults():
    args = build_parser().parse_args(["serve", "--max-stop-strings", "3", "--max-logprobs", "5"])
    limits = ServerArgs.from_cli_args(args).limits
    assert limits.max_stop_strings == 3 and args.max_logprobs == 5
    assert RequestLimits() == ServerArgs.from_cli_args(build_parser().parse_args(["serve"])).limits
    defaults = RequestLimits()
    assert (defaults.max_prompts_per_request, defaults.max_stop_strings, defaults.max_stop_string_chars,
            defaults.max_stop_token_ids, defaults.max_logit_bias, defaults.max_chat_messages,
            defaults.max_response_tokens) == (1024, 64, 256, 1024, 1024, 4096, 2**22)
    assert defaults.prompt_chars(MAX_MODEL_LEN) == PROMPT_CHARS_PER_TOKEN * MAX_MODEL_LEN
    assert RequestLimits(max_prompt_chars=10).prompt_chars(MAX_MODEL_LEN) == 10
    assert MAX_N_SEQUENCES == 16384


def test_a_limit_must_be_positive():
    with pytest.raises(ValueError, match="max_logit_bias must be a positive integer"):
        RequestLimits(max_logit_bias=0)


@pytest.fixture(scope="module")
def llm(llama_dir):
    with LLM(model=str(llama_dir), dtype="float32", max_logprobs=4) as llm:
        yield llm


def test_llm_generate_refuses_logprobs_above_max_logprobs(llm):
    assert len(llm.generate(["Hi"], SamplingParams(max_tokens=1, logprobs=4), use_tqdm=False)
               [0].outputs[0].logprobs[0]) >= 4
    for name in ("logprobs", "prompt_logprobs"):
        with pytest.raises(ValueError, match=f"{name} must be at most max_logprobs = 4") as error:
            llm.generate(["Hi"], SamplingParams(max_tokens=1, **{name: 5}), use_tqdm=False)
        assert error.value.param == name
    assert llm.llm_engine.get_num_unfinished_requests() == 0


def test_max_logprobs_bounds_the_beam_width_at_half(llm):
    (output,) = llm.beam_search([{"prompt_token_ids": [5, 6, 7]}], BeamSearchParams(beam_width=2, max_tokens=2))
    assert len(output.sequences) == 2
    with pytest.raises(ValueError, match="beam search asks for 2 x beam_width"):
        llm.beam_search([{"prompt_token_ids": [5, 6, 7]}], BeamSearchParams(beam_width=3, max_tokens=2))
    assert llm.llm_engine.get_num_unfinished_requests() == 0


def test_llm_refuses_text_that_is_not_unicode_naming_its_field_and_keeps_compiling_grammars(llm):
    # Lone surrogates (what JSON's \\udXXX escapes can spell) were a TypeError from the
    # tokenizer, went unseen in a short cache_salt, and in a constraint stopped the grammar
    # compile worker for a growing pause (a GrammarCompilerUnavailableError for everything).
    params = SamplingParams(max_tokens=3)
    cases = {
        "prompt": lambda: llm.generate(["Hi \udfff"], params, use_tqdm=False),
        "messages": lambda: llm.chat([{"role": "user", "content": "\udfff"}], params, use_tqdm=False),
        "cache_salt": lambda: llm.generate([{"prompt": "Hi", "cache_salt": "\udfff"}], params, use_tqdm=False),
        "structured_outputs": lambda: llm.generate(["Hi"], SamplingParams(
            max_tokens=3, structured_outputs=StructuredOutputsParams(regex="\udfff")), use_tqdm=False),
    }
    for param, run in cases.items():
        with pytest.raises(ValueError, match="lone UTF-16 surrogate") as error:
            run()
        assert error.value.param == param
    constrained = SamplingParams(max_tokens=4, structured_outputs=StructuredOutputsParams(regex="[ab]+"))
    assert re.fullmatch("[ab]+", llm.generate(["Hi"], constrained, use_tqdm=False)[0].outputs[0].text)
    assert llm.llm_engine.get_num_unfinished_requests() == 0
