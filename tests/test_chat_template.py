"""Bounded chat-template rendering (deploy/chat_template.py, deploy/chat_template_sandbox.py):
templates render exactly as transformers' apply_chat_template renders them, and hostile ones
stop at a bound within a fraction of a second with a message; a request's template that runs
past its deadline, or asks for more memory than its process may have, is stopped there, and
the sandbox goes on rendering."""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time
from pathlib import Path

import pytest
from raylm.deploy.chat_template import (ChatTemplateBusyError, ChatTemplateError, ChatTemplateLimitError,
                                       ChatTemplateRenderer, ChatTemplateTimeoutError, ChatTemplateUnavailableError)
from raylm.deploy.chat_template_sandbox import ChatTemplateSandbox
from process_tree import descendants, wait_gone
from tiny_models import CHAT_TEMPLATE

MAX_CHARS = 32 * 4096
MAX_STEPS = 100_000

# Written for these tests: what real templates use (macros, namespace, loop.last, tojson with
# an indent, slices, `{% generation %}`, `is defined`, special tokens, keyword arguments).
TOOLS_TEMPLATE = """\
{%- macro render_args(args) -%}
{%- for key, value in args.items() -%}{{ key }}={{ value | tojson }}{% if not loop.last %}, {% endif %}{%- endfor -%}
{%- endmacro -%}
{{ bos_token }}
{%- if tools %}<|system|>
You may call:{% for tool in tools %}
{{ tool | tojson(indent=2) }}{% endfor %}
{% endif %}
{%- set ns = namespace(last_user=-1) %}
{%- for message in messages %}{% if message.role == 'user' %}{% set ns.last_user = loop.index0 %}{% endif %}{% endfor %}
{%- for message in messages %}
<|{{ message['role'] }}|>{% if message.role == 'assistant' %}{% generation %}{{ message['content'] | trim }}\
{% endgeneration %}{% else %}{{ message['content'] | trim }}{% endif %}
{%- if message.tool_calls is defined %}{% for call in message.tool_calls %}
call {{ call.function.name }}({{ render_args(call.function.arguments) }}){% endfor %}{% endif %}
{%- if loop.index0 == ns.last_user %} [last of {{ messages[::-1] | length }}]{% endif %}{{ eos_token }}
{%- endfor %}
{%- if add_generation_prompt %}<|assistant|>{% if enable_thinking is defined and not enable_thinking %}\
<think></think>{% endif %}{% endif %}"""

MESSAGES = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "What is 6 x 7?  "},
    {"role": "assistant", "content": "", "tool_calls": [
        {"id": "1", "type": "function", "function": {"name": "multiply", "arguments": {"a": 6, "b": "7"}}}]},
    {"role": "tool", "content": "42", "tool_call_id": "1"},
    {"role": "user", "content": "Thanks"},
]
TOOLS = [{"type": "function", "function": {"name": "multiply", "description": "a x b",
                                           "parameters": {"type": "object", "properties": {"a": {}, "b": {}}}}}]


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dirs: dict[str, Path]):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny_model_dirs["llama"]))


@pytest.fixture(scope="module")
def renderer() -> ChatTemplateRenderer:
    return ChatTemplateRenderer(MAX_CHARS, MAX_STEPS)


@pytest.mark.parametrize("template", [CHAT_TEMPLATE, TOOLS_TEMPLATE], ids=["tiny model's", "tools"])
@pytest.mark.parametrize("switches", [(True, False), (False, False), (False, True)],
                         ids=["generation prompt", "none", "continue final message"])
@pytest.mark.parametrize("kwargs", [{}, {"tools": TOOLS, "enable_thinking": False}], ids=["plain", "tools"])
def test_templates_render_as_transformers_apply_chat_template(tokenizer, renderer, template, switches, kwargs):
    add_generation_prompt, continue_final_message = switches
    messages = MESSAGES + ([{"role": "assistant", "content": "It is "}] if continue_final_message else [])
    expected = tokenizer.apply_chat_template(messages, chat_template=template, tokenize=False,
                                             add_generation_prompt=add_generation_prompt,
                                             continue_final_message=continue_final_message, **kwargs)
    rendered = renderer.render(template, messages, add_generation_prompt, continue_final_message,
                               {**tokenizer.special_tokens_map, **kwargs})
    assert rendered == expected


def test_a_long_conversation_renders_as_transformers_within_the_default_steps(tokenizer):
    messages = MESSAGES * 800  # 4,000 messages, near the server's 4,096
    renderer = ChatTemplateRenderer(MAX_CHARS * 8, 1_000_000)
    expected = tokenizer.apply_chat_template(messages, chat_template=TOOLS_TEMPLATE, tokenize=False,
                                             add_generation_prompt=True, tools=TOOLS)
    assert renderer.render(TOOLS_TEMPLATE, messages, True, False,
                           {**tokenizer.special_tokens_map, "tools": TOOLS}) == expected


def test_a_rendered_prefix_is_the_texts_start(tokenizer, renderer):
    variables = {**tokenizer.special_tokens_map, "tools": TOOLS}
    whole = renderer.render(TOOLS_TEMPLATE, MESSAGES, True, False, variables)
    assert renderer.render(TOOLS_TEMPLATE, MESSAGES, True, False, variables, prefix_chars=50) == whole[:50]


# case: (template, what the error says)
HOSTILE = {
    "nested ranges of 10**5 x 10**5": (
        "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}", "too many steps"),
    "a loop over a long list, 10**5 times": (
        "{% set items = range(50000)|list %}{% for i in range(100000) %}{% for x in items %}{% endfor %}{% endfor %}",
        "too many steps"),
    "'x' * 10**10": ("{{ 'x' * 10**10 }}", "repeated string"),
    "a literal 'x' * 10000000000 (folded while compiling)": ("{{ 'x' * 10000000000 }}", "repeated string"),
    "a list * 10**9": ("{{ ([1] * 1000000000) | length }}", "repeated string or list"),
    "a macro calling itself": ("{% macro f(n) %}{{ f(n) }}{% endmacro %}{{ f(1) }}", "recursed too deeply"),
    "a macro calling itself twice, 60 deep": (
        "{% macro f(n) %}{% if n > 0 %}{{ f(n - 1) }}{{ f(n - 1) }}{% endif %}{% endmacro %}{{ f(60) }}",
        "too many steps"),
    "a string doubled 60 times with ~": (
        "{% set ns = namespace(s='x') %}{% for i in range(60) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}",
        "a string of"),
    "a string doubled 60 times with +": (
        "{% set ns = namespace(s='x') %}{% for i in range(60) %}{% set ns.s = ns.s + ns.s %}{% endfor %}",
        "joined string"),
    "a list joined with itself 60 times": (
        "{% set ns = namespace(s=['x']) %}{% for i in range(60) %}{% set ns.s = [ns.s, ns.s]|join %}{% endfor %}",
        "join's value"),
    "str.ljust(10**10)": ("{{ 'x'.ljust(10000000000) }}", "the method ljust"),
    "center(10**10)": ("{{ 'x' | center(10000000000) }}", "the filter center"),
    "a %-format 10**10 wide": ("{{ '%10000000000s' % 'x' }}", "%-format"),
    "indent of 5,000 lines by 5,000": ("{{ ('a\n' * 5000) | indent(5000) }}", "indented string"),
    "2 ** 10 ** 9": ("{{ 2 ** (10 ** 9) }}", "bits"),
    "a block of 5 * 10**6 characters": (
        "{% set s %}{% for i in range(5000) %}" + "y" * 1000 + "{% endfor %}{% endset %}", "block's text"),
    "5 * 10**6 characters of output": ("{% for i in range(5000) %}" + "z" * 1000 + "{% endfor %}", "rendered more"),
    "lipsum": ("{{ lipsum(1000000) }}", "'lipsum' is undefined"),
    "an expression nested 5,000 deep": ("{{ " + "(" * 5000 + "1" + ")" * 5000 + " }}", "nests too deeply"),
}


@pytest.mark.serial  # wall-clock deadline: alone, after the parallel part (scripts/test.sh)
@pytest.mark.parametrize("case", list(HOSTILE))
def test_a_hostile_template_stops_at_a_bound_at_once(renderer, case):
    template, message = HOSTILE[case]
    started = time.monotonic()
    with pytest.raises(ChatTemplateError, match=message):
        renderer.render(template, MESSAGES, True)
    # 100,000 steps take some 0.4 s on a loaded 2-core machine; the bounds stop the others at once.
    assert time.monotonic() - started < 5


def test_the_step_bound_counts_loop_iterations_calls_and_range_items(renderer):
    bounded = ChatTemplateRenderer(MAX_CHARS, 1000)
    # 1 call and 300 items of range, 1 call and 300 iterations of the loop, 300 calls of the method.
    template = "{% for i in range(300) %}{{ 'a'.upper() }}{% endfor %}"
    assert bounded.render(template, MESSAGES) == "A" * 300
    with pytest.raises(ChatTemplateLimitError, match="too many steps"):
        bounded.render(template.replace("300", "400"), MESSAGES)  # 1,602 steps


# Few steps, each much work on request content within the size bounds: every iteration
# sorts the 20,000 characters of the user's message with Jinja's `sort` filter (some 50 ms
# on an idle 2-core machine, 100 ms loaded; 100,000 characters took 0.27-0.5 s, a deadline
# overshoot of that much), 4-5 steps and operations an iteration, so the clock is read at
# least once an iteration and 400 iterations would take 20 s or more.
COSTLY_STEPS = "{% for i in range(400) %}{% set x = messages[0].content|list|sort|join %}{% endfor %}done"
LONG_CONTENT = [{"role": "user", "content": "ab" * 10_000}]


@pytest.mark.serial  # wall-clock deadline: alone, after the parallel part (scripts/test.sh)
def test_a_render_with_few_costly_steps_stops_at_its_deadline():
    """The steps and sizes stay far within their bounds; the time limit stops it."""
    timed = ChatTemplateRenderer(MAX_CHARS, MAX_STEPS, timeout_s=0.5)
    started = time.monotonic()
    with pytest.raises(ChatTemplateTimeoutError, match="did not render within 0.5 s"):
        timed.render(COSTLY_STEPS, LONG_CONTENT)
    # The clock is read every CLOCK_EVERY_OPS operations, at least once an iteration of some
    # 50-150 ms; the whole render would take 20 s or more. 1.5 s of slack: on CI's loaded
    # 2-core machine an iteration has taken several times its idle cost (1.23 s seen with 0.5).
    elapsed = time.monotonic() - started
    assert 0.5 <= elapsed < 0.5 + 1.5
    assert timed.render("{{ messages[0].content|length }}", LONG_CONTENT) == "20000"  # the next renders


def test_invalid_jinja_is_a_template_error_naming_the_line(renderer):
    with pytest.raises(ChatTemplateError, match="not valid Jinja.*line 2"):
        renderer.render("ok\n{% for %}", MESSAGES)


def test_the_sandbox_is_still_a_sandbox(renderer):
    with pytest.raises(ChatTemplateError, match="unsafe|not safely|has no attribute"):
        renderer.render("{{ messages.__class__.__mro__ }}{{ ''.__class__ }}", MESSAGES)
    with pytest.raises(ChatTemplateError, match="underscore"):
        renderer.render("{% set ns = namespace() %}{% set ns._x = 1 %}", MESSAGES)


# ------------------------------------------------------------------- the sandbox
# Each iteration sorts 100,000 characters: within every bound, but minutes of work.
SLOW = "{% set big = 'ab' * 50000 %}{% for i in range(30000) %}{% set x = big|list|sort|join %}{% endfor %}"

@pytest.fixture(scope="module")
def sandbox():
    sandbox = ChatTemplateSandbox(MAX_CHARS, MAX_STEPS, timeout_s=2.0)
    yield sandbox
    sandbox.close()


def render(sandbox: ChatTemplateSandbox, template: str, variables: dict | None = None) -> str:
    return asyncio.run(sandbox.render(template, MESSAGES, True, False, variables or {}))


def test_the_sandbox_renders_as_the_renderer(tokenizer, renderer, sandbox):
    variables = {**tokenizer.special_tokens_map, "tools": TOOLS}
    assert render(sandbox, TOOLS_TEMPLATE, variables) == renderer.render(TOOLS_TEMPLATE, MESSAGES, True, False,
                                                                         variables)


@pytest.mark.serial  # wall-clock deadline: alone, after the parallel part (scripts/test.sh)
def test_a_render_past_the_deadline_is_stopped_there_and_the_next_renders(sandbox):
    # The worker stops SLOW at the time it was given, and renders the next one.
    render(sandbox, "{{ 1 }}")
    workers = sandbox.worker_pids
    threads = threading.active_count()
    started = time.monotonic()
    with pytest.raises(ChatTemplateTimeoutError, match="did not render within 2 s"):
        render(sandbox, SLOW)
    assert 2 <= time.monotonic() - started < 2.5
    assert sandbox.worker_pids == workers  # no process killed, none started
    assert render(sandbox, "{{ messages[1].content }}") == MESSAGES[1]["content"]
    assert threading.active_count() <= threads + 1


@pytest.mark.serial  # wall-clock deadline: alone, after the parallel part (scripts/test.sh)
def test_a_worker_that_does_not_answer_by_the_deadline_is_killed(sandbox):
    """A worker held past the deadline (here stopped by SIGSTOP, as one long C-level call
    would hold it) is killed then, and the next render starts a fresh one."""
    render(sandbox, "{{ 1 }}")
    (pid,) = sandbox.worker_pids
    stopper = threading.Timer(0.3, os.kill, (pid, signal.SIGSTOP))
    stopper.start()
    started = time.monotonic()
    with pytest.raises(ChatTemplateTimeoutError, match="did not render within 2 s"):
        render(sandbox, SLOW)
    assert 2 <= time.monotonic() - started < 3  # killed _KILL_GRACE_S after its deadline
    stopper.join()
    assert wait_gone([pid], 2) == [] and pid not in sandbox.worker_pids
    assert render(sandbox, "{{ 2 }}") == "2"


def test_renders_past_the_queue_bound_are_refused_at_once_and_waiting_counts_against_the_deadline():
    """2 processes, 2 places to wait, 1.5 s each, 7 slow templates at once: 3 are refused at
    once; 2 render and are stopped at their deadline; the 2 that waited had used their
    whole time waiting when a process came free, and end then (not 1.5 s after it)."""
    sandbox = ChatTemplateSandbox(MAX_CHARS, MAX_STEPS, timeout_s=1.5, max_processes=2, max_queued=2)
    try:
        # Both processes started first, so that no start counts in the figures below.
        assert [text for text, _ in asyncio.run(_gather(sandbox, ["{{ 1 }}", "{{ 2 }}"]))] == ["1", "2"]

        outcomes = asyncio.run(_gather(sandbox, [SLOW] * 7))
        refused = [(outcome, took) for outcome, took in outcomes
                   if "--max-queued-chat-template-renders" in str(outcome)]
        assert len(refused) == 3 and all(isinstance(outcome, ChatTemplateBusyError) for outcome, _ in refused)
        assert max(took for _, took in refused) < 0.3
        # The 4 admitted: out of time while rendering (a 400) or, the 2 that waited, maybe
        # before they could start (a 429); the ones that waited say so.
        admitted = [outcome for outcome, _ in outcomes if (outcome, _) not in refused]
        assert all(isinstance(outcome, (ChatTemplateTimeoutError, ChatTemplateBusyError)) for outcome in admitted)
        assert sum("waited" in str(outcome) for outcome in admitted) == 2, admitted
        assert max(took for _, took in outcomes) < 1.5 + 0.7
        assert sandbox.renders_admitted == 0 and len(sandbox.worker_pids) <= 2
        assert render(sandbox, "{{ 3 }}") == "3"
    finally:
        sandbox.close()


async def _gather(sandbox: ChatTemplateSandbox, templates: list[str]) -> list[tuple[object, float]]:
    """Each template's text or error, and the seconds it took, all asked for at once."""
    async def one(template: str) -> tuple[object, float]:
        started = time.monotonic()
        try:
            outcome: object = await sandbox.render(template, MESSAGES, True, False, {})
        except ChatTemplateError as exc:
            outcome = exc
        return outcome, time.monotonic() - started

    return await asyncio.gather(*(one(template) for template in templates))


def test_a_render_past_the_memory_limit_is_a_template_error(sandbox):
    # A padded str.format allocates 3 GB in one call, past the process's address-space limit.
    with pytest.raises(ChatTemplateLimitError, match="ran out of memory"):
        render(sandbox, "{{ '{:>3000000000}'.format('x') }}")
    assert render(sandbox, "{{ 2 }}") == "2"


def test_the_sandbox_reports_the_templates_own_errors(sandbox):
    with pytest.raises(ChatTemplateError, match="no such thing"):
        render(sandbox, "{{ raise_exception('no such thing') }}")
    with pytest.raises(ChatTemplateLimitError, match="too many steps"):
        render(sandbox, HOSTILE["nested ranges of 10**5 x 10**5"][0])


# ------------------------------------------------------------------- closing the sandbox
@pytest.mark.serial  # wall-clock deadline: alone, after the parallel part (scripts/test.sh)
def test_close_kills_every_worker_and_a_render_after_it_fails_at_once():
    sandbox = ChatTemplateSandbox(MAX_CHARS, MAX_STEPS, timeout_s=30.0)
    assert render(sandbox, "{{ 1 }}") == "1"
    failures: list[BaseException] = []
    rendering = threading.Thread(target=lambda: failures.extend(_render_failure(sandbox, SLOW)))
    rendering.start()
    deadline = time.monotonic() + 10
    while not sandbox.rendering_pids and time.monotonic() < deadline:  # SLOW took the idle worker
        time.sleep(0.02)
    # A second worker starts for this one (had it run first, SLOW could take its worker after it).
    assert render(sandbox, "{{ 2 }}") == "2"
    pids = sandbox.worker_pids
    assert len(pids) == 2
    started = time.monotonic()
    sandbox.close()
    sandbox.close()  # idempotent
    rendering.join(5)
    assert not rendering.is_alive() and time.monotonic() - started < 2
    assert [type(f) for f in failures] == [ChatTemplateUnavailableError]
    assert "shutting down" in str(failures[0])
    assert wait_gone(pids, 2) == []
    started = time.monotonic()
    with pytest.raises(ChatTemplateUnavailableError, match="shutting down"):
        render(sandbox, "{{ 1 }}")
    assert time.monotonic() - started < 1 and sandbox.worker_pids == []


def _render_failure(sandbox: ChatTemplateSandbox, template: str) -> list[BaseException]:
    try:
        render(sandbox, template)
    except BaseException as exc:  # noqa: BLE001 - the test looks at it
        return [exc]
    return []


def test_a_servers_shutdown_ends_its_request_template_processes(llama_dir):
    """`raylm serve`'s app over a real engine on a real port: once uvicorn has stopped (its
    lifespan shutdown), the processes that rendered request templates are gone, while this
    process (the server's) lives on."""
    import httpx
    from raylm.deploy.server_args import ServerArgs
    from raylm.engine import AsyncLLMEngine, EngineArgs
    from server_process import InProcessServer

    engine = AsyncLLMEngine.from_engine_args(EngineArgs(model=str(llama_dir), max_model_len=128,
                                                        num_gpu_blocks_override=64, disable_log_stats=True))
    try:
        server = InProcessServer(engine, ServerArgs(trust_request_chat_template=True))
        with server as base_url:
            others = sandbox_pids()  # this module's own sandbox, say
            reply = httpx.post(f"{base_url}/v1/chat/completions", timeout=60, json={
                "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2,
                "chat_template": "{% for m in messages %}{{ m.content }}{% endfor %}"})
            assert reply.status_code == 200, reply.text
            pids = sandbox_pids() - others
            assert pids
        assert wait_gone(list(pids), 2) == []
    finally:
        engine.shutdown()


def sandbox_pids() -> set[int]:
    """The chat-template worker processes below this one."""
    return {pid for pid, command in descendants(os.getpid()).items() if "chat_template_sandbox" in command}
