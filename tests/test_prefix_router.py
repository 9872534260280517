"""Prefix-aware routing across Ray Serve replicas (deploy/prefix_router.py).

The policy (`decide`) is checked on hand-built cases; the rest runs one real two-replica
Serve app on the session's Ray: requests sharing a prefix reach the replica that caches
it (its prefix-cache hits count every repeated block), a new prefix goes to the least
loaded replica, a replica holding the prefix but overloaded is bypassed, the decisions and
each replica's reported counters are on the ingress's /metrics, the router's keys are the
very hashes the replicas report for text, chat and salted prompts, and a killed replica is
replaced while requests keep being answered and routed.

Which replica served a request is read from the replicas themselves: each reports the
hashes of the blocks it caches (`record_routing_stats`, read here from the replica actors).
"""

from __future__ import annotations

import json
import re
import threading
import time
from pathlib import Path

import httpx
import pytest

from server_process import free_port

ray = pytest.importorskip("ray")
serve = pytest.importorskip("ray.serve")

from raylm.deploy.prefix_router import (LOAD_IMBALANCE, NO_MATCH, PREFIX_MATCH, Candidate,  # noqa: E402
                                        decide)

APP = "raylm-router-test"
ENGINE = "RaylmDeployment"
BLOCK = 16
IMBALANCE = 2
PREFIX_BLOCKS = 4
MODEL = "router-llama"
# The replicas' --chat-template (a file): the tiny model's, with the request's tools named
# in a system turn ahead of the messages, as tool-calling templates put them.
TOOLS_TEMPLATE = ("{% if tools %}<|system|>\nTools:{% for tool in tools %} {{ tool.function.name }}{% endfor %}"
                  "<|end|>\n{% endif %}{% for message in messages %}<|{{ message['role'] }}|>\n"
                  "{{ message['content'] }}<|end|>\n{% endfor %}{% if add_generation_prompt %}<|assistant|>\n"
                  "{% endif %}")


# ------------------------------------------------------------------ policy
def _c(name: str, matched: int, load: int, footprint: int = 0) -> Candidate:
    return Candidate(name, matched, load, footprint)


def test_the_longest_match_wins_and_ties_go_to_the_less_loaded():
    decision = decide([_c("a", 3, 0), _c("b", 5, 2), _c("c", 5, 1)], 6, imbalance_threshold=4, min_match_ratio=0.1)
    assert (decision.kind, decision.ranked[0]) == (PREFIX_MATCH, "c")
    assert decision.ranked[1:] == ("a", "b")  # the fallbacks, least loaded first


def test_a_prefix_nobody_holds_goes_to_the_least_loaded_then_the_emptiest():
    decision = decide([_c("a", 0, 1, 0), _c("b", 0, 0, 50), _c("c", 0, 0, 10)], 6, 4, 0.1)
    assert (decision.kind, decision.ranked[0]) == (NO_MATCH, "c")


def test_a_match_below_the_ratio_counts_as_none():
    decision = decide([_c("a", 1, 3), _c("b", 0, 0)], 20, imbalance_threshold=8, min_match_ratio=0.1)
    assert (decision.kind, decision.ranked[0]) == (NO_MATCH, "b")
    decision = decide([_c("a", 2, 3), _c("b", 0, 0)], 20, imbalance_threshold=8, min_match_ratio=0.1)
    assert (decision.kind, decision.ranked[0]) == (PREFIX_MATCH, "a")


def test_the_best_replica_is_bypassed_only_past_the_imbalance_threshold():
    at_threshold = decide([_c("a", 6, 4), _c("b", 0, 2)], 6, imbalance_threshold=2, min_match_ratio=0.1)
    assert (at_threshold.kind, at_threshold.ranked[0]) == (PREFIX_MATCH, "a")
    past = decide([_c("a", 6, 5), _c("b", 0, 2), _c("c", 2, 2)], 6, imbalance_threshold=2, min_match_ratio=0.1)
    # The least loaded, and of those the one holding more of the prefix.
    assert (past.kind, past.ranked[0]) == (LOAD_IMBALANCE, "c")


# --------------------------------------------------- keys, reports, settings
def test_the_routers_block_hashes_are_the_kv_cache_managers():
    from raylm.deploy.prefix_key import KEY_HASH_BYTES, block_hash_key
    from raylm.engine.kv_cache_manager import KVCacheManager
    from raylm.engine.request import Request
    from raylm.engine.sampling_params import SamplingParams

    prompt = list(range(5, 5 + 3 * BLOCK + 7))
    for salt in (None, "tenant-a"):
        request = Request("r", prompt, SamplingParams(max_tokens=4), 0.0, cache_salt=salt)
        KVCacheManager(num_blocks=16, block_size=BLOCK)._update_block_hashes(request)
        assert len(request.block_hashes) == 3
        assert block_hash_key(prompt, BLOCK, salt) == tuple(h[:KEY_HASH_BYTES] for h in request.block_hashes)
    assert block_hash_key(prompt, BLOCK, None, max_blocks=2) == block_hash_key(prompt, BLOCK)[:2]


def test_a_lora_adapters_prompt_is_another_prefix_for_the_router_and_the_replicas(tmp_path):
    """With LoRA on, the router keys a request for an adapter (a `model` that is neither the
    base model nor its alias) with the adapter's name: two adapters' and the base model's
    identical prompts are three prefixes, as the replicas' block hashes (which key the
    adapter by id, name and folder) make them; the base model's keys stay the replicas' own,
    salted or not, and with LoRA off every name keys as the base."""
    from raylm.deploy.prefix_key import PrefixKeyer
    from raylm.engine.kv_cache_manager import KVCacheManager
    from raylm.engine.lora_request import LoRARequest
    from raylm.engine.request import Request
    from raylm.engine.sampling_params import SamplingParams

    prompt = list(range(5, 5 + 3 * BLOCK))
    keyer = PrefixKeyer(None, BLOCK, max_blocks=64, base_model_names=["base", "/models/base"])

    def key(model: str | None, salt: str | None = None) -> tuple[bytes, ...]:
        body = {"prompt": prompt} | ({"model": model} if model else {}) | ({"cache_salt": salt} if salt else {})
        return keyer.key("/v1/completions", json.dumps(body).encode()).block_hashes

    def replica_hashes(lora: LoRARequest | None, salt: str | None = None) -> tuple[bytes, ...]:
        request = Request("r", prompt, SamplingParams(max_tokens=4), 0.0, cache_salt=salt, lora_request=lora)
        KVCacheManager(num_blocks=16, block_size=BLOCK)._update_block_hashes(request)
        return tuple(h[:len(key(None)[0])] for h in request.block_hashes)

    sql, chat = LoRARequest("sql", 1, str(tmp_path / "sql")), LoRARequest("chat", 2, str(tmp_path / "chat"))
    assert key(None) == key("base") == key("/models/base") == replica_hashes(None)
    assert key("base", "tenant") == replica_hashes(None, "tenant") != key("base")
    assert len({key("base"), key("sql"), key("chat"), key("sql", "tenant")}) == 4
    assert len({replica_hashes(None), replica_hashes(sql), replica_hashes(chat), replica_hashes(sql, "tenant")}) == 4
    # Every later block chains on the first: none of an adapter's blocks is the base's.
    assert not set(key("sql")) & set(key("base"))
    lora_off = PrefixKeyer(None, BLOCK, max_blocks=64)
    assert lora_off.key("/v1/completions", json.dumps({"model": "sql", "prompt": prompt}).encode()).block_hashes \
        == key("base")


def test_a_replica_reports_its_cached_blocks_most_recently_used_first():
    from raylm.engine.block_pool import BlockPool

    pool = BlockPool(num_blocks=6, enable_caching=True)
    blocks = pool.get_new_blocks(5)
    for index, block in enumerate(blocks):
        pool.cache_full_block(block, bytes([index]) * 32)
    pool.free_blocks([blocks[1], blocks[0]])  # freed: 1, then 0 (0 is the later)
    pool.free_blocks([blocks[3]])
    # Held ones first (2 and 4), then the free ones from the most recently freed: 3, 0, 1.
    recent = pool.recent_cached_hashes(limit=10)
    assert sorted(recent[:2]) == [bytes([2]) * 32, bytes([4]) * 32]
    assert recent[2:] == [bytes([3]) * 32, bytes([0]) * 32, bytes([1]) * 32]
    assert len(pool.recent_cached_hashes(limit=3)) == 3
    pool.get_new_blocks(2)  # evicts the least recently freed cached block (1) and takes the uncached one
    assert bytes([1]) * 32 not in pool.recent_cached_hashes(limit=10)


def test_the_router_settings_reach_serve(llama_dir):
    from raylm.deploy.prefix_router import PrefixAwareRouter
    from raylm.deploy.serve_app import app_arguments, deployment_options

    parsed = app_arguments({"model": str(llama_dir), "num_replicas": "3", "request_router": "prefix_aware",
                            "router_imbalance_threshold": "4", "router_min_match_ratio": "0.5",
                            "router_stats_period_s": "2"})
    config = deployment_options(1, parsed.deployment)["request_router_config"]
    assert config.get_request_router_class().__name__ == PrefixAwareRouter.__name__
    assert config.request_router_kwargs == {"imbalance_threshold": 4, "min_match_ratio": 0.5, "retention_s": 60.0}
    assert config.request_routing_stats_period_s == 2.0
    default = app_arguments({"model": str(llama_dir), "request_router": "power_of_two"}).deployment
    assert deployment_options(1, default)["request_router_config"].is_default_request_router()
    with pytest.raises(ValueError, match="request_router must be one of prefix_aware, power_of_two, got 'random'"):
        app_arguments({"model": str(llama_dir), "request_router": "random"})
    with pytest.raises(ValueError, match=r"router_min_match_ratio \(--router-min-match-ratio\) must lie in"):
        app_arguments({"model": str(llama_dir), "router_min_match_ratio": "1.5"})


# ------------------------------------------------------------- a real app
@pytest.fixture(scope="module")
def router_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Llama with a long context, so that a held stream can run for many seconds."""
    from tiny_models import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("router") / MODEL, "llama", seed=3, max_position_embeddings=8192)


@pytest.fixture(scope="module")
def chat_template_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("router_template") / "tools_template.jinja"
    path.write_text(TOOLS_TEMPLATE)
    return path


@pytest.fixture(scope="module")
def served(ray_cluster, router_model: Path, chat_template_file: Path):
    from raylm.deploy.serve_app import build_serve_app

    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    app = build_serve_app({"model": str(router_model), "num_gpu_blocks_override": 2048, "device": "cpu"},
                          {"served_model_name": [MODEL], "chat_template": str(chat_template_file)}, num_replicas=2,
                          replica_cpus=0.25, ingress_cpus=0.1, router_imbalance_threshold=IMBALANCE,
                          router_stats_period_s=0.3, health_check_period_s=1.0)
    serve.run(app, name=APP, route_prefix="/")
    yield f"http://127.0.0.1:{port}"
    serve.delete(APP)
    serve.shutdown()


def _replica_actors() -> dict[str, object]:
    """The engine replicas' actors by replica id."""
    found = {}
    for entry in ray.util.list_named_actors(all_namespaces=True):
        name = entry["name"] if isinstance(entry, dict) else entry
        if name.startswith(f"SERVE_REPLICA::{APP}#{ENGINE}#"):
            found[name.rsplit("#", 1)[1]] = ray.get_actor(name, namespace="serve")
    return found


def _reports() -> dict[str, dict]:
    """Each live engine replica's report: its prefix-cache counters and cached block hashes."""
    reports = {}
    for replica_id, actor in _replica_actors().items():
        try:
            reports[replica_id] = ray.get(actor.record_routing_stats.remote(), timeout=30)
        except ray.exceptions.RayError:
            continue  # dead, or still starting
    return reports


def _cached(report: dict) -> set[bytes]:
    blob, width = report["cached_block_hashes"], report["key_hash_bytes"]
    return {blob[i:i + width] for i in range(0, len(blob), width)}


def _holders(token_ids: list[int]) -> set[str]:
    """The replicas whose prefix caches hold every full block of `token_ids`."""
    from raylm.deploy.prefix_key import block_hash_key

    key = set(block_hash_key(token_ids, BLOCK))
    return {replica for replica, report in _reports().items() if key <= _cached(report)}


def _prefix(seed: int) -> list[int]:
    return [(seed * 7919 + i * 31) % 500 + 5 for i in range(PREFIX_BLOCKS * BLOCK)]


def _complete(url: str, prompt: list[int] | str, **fields) -> dict:
    response = httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 2,
                                                          **fields}, timeout=60)
    assert response.status_code == 200, response.text
    return response.json()


def _decisions(url: str) -> dict[str, float]:
    text = httpx.get(url + "/metrics", timeout=30).text
    return {kind: float(value) for kind, value in re.findall(r'raylm:router_requests_total\{decision="(\w+)"\} (\S+)',
                                                             text)}


def _delta(before: dict[str, float], after: dict[str, float], kind: str) -> float:
    return after.get(kind, 0.0) - before.get(kind, 0.0)


class _HeldStream:
    """A long streaming completion (thousands of tokens) read in a thread until `close()`:
    one request in flight at its replica for as long as a test needs."""

    def __init__(self, url: str, prompt: list[int]) -> None:
        self.started = threading.Event()
        self._stop = threading.Event()
        body = {"model": MODEL, "prompt": prompt, "max_tokens": 3000, "ignore_eos": True, "stream": True}
        self._thread = threading.Thread(target=self._read, args=(url, body), daemon=True)
        self._thread.start()
        assert self.started.wait(60), "the held stream never started"

    def _read(self, url: str, body: dict) -> None:
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as response:
            for _ in response.iter_lines():
                self.started.set()
                if self._stop.is_set():
                    return  # leaving closes the connection: the request is aborted

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=30)


def _wait_idle(url: str) -> None:
    """Until Serve counts no request in flight at any replica (held streams aborted)."""
    deadline = time.monotonic() + 30
    while True:
        text = httpx.get(url + "/metrics", timeout=30).text
        loads = [float(v) for v in re.findall(r"raylm:router_replica_ongoing_requests\{[^}]*\} (\S+)", text)]
        # The /metrics request itself is in flight at one replica.
        if loads and sum(loads) <= 1:
            return
        assert time.monotonic() < deadline, f"requests still in flight: {loads}"
        time.sleep(0.2)


def _wait_for(condition, what: str, timeout: float = 10.0):
    deadline = time.monotonic() + timeout
    while not (value := condition()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)
    return value


def test_requests_sharing_a_prefix_go_to_the_same_replica(served):
    url = served
    before, hits_before = _decisions(url), sum(r["prefix_cache_hits"] for r in _reports().values())
    prefixes = [_prefix(seed) for seed in range(4)]
    for repeat in range(3):
        for index, prefix in enumerate(prefixes):
            _complete(url, prefix + [repeat + 1, index + 1, 3, 4, 5, 6, 7, 8])
    after = _decisions(url)
    assert _delta(before, after, NO_MATCH) == 4 and _delta(before, after, PREFIX_MATCH) == 8, after
    holders = [_wait_for(lambda p=p: _holders(p), "the replicas' reports") for p in prefixes]
    assert all(len(h) == 1 for h in holders), holders  # each prefix on one replica only
    assert len(set().union(*holders)) == 2  # and the prefixes spread over both
    # Each repeat found the whole prefix cached: 2 repeats x 4 prefixes x 4 blocks.
    hits = sum(r["prefix_cache_hits"] for r in _reports().values()) - hits_before
    assert hits == 2 * 4 * PREFIX_BLOCKS * BLOCK


def test_a_new_prefix_goes_to_the_least_loaded_replica(served):
    url = served
    held_prefix = _prefix(10)
    stream = _HeldStream(url, held_prefix)
    try:
        (busy,) = _wait_for(lambda: _holders(held_prefix), "the held stream's replica")
        new_prefix = _prefix(11)
        before = _decisions(url)
        _complete(url, new_prefix + [1, 2, 3])
        assert _delta(before, _decisions(url), NO_MATCH) == 1
        (chosen,) = _wait_for(lambda: _holders(new_prefix), "the new prefix's replica")
        assert chosen != busy
    finally:
        stream.close()
    _wait_idle(url)


def test_an_overloaded_best_replica_is_bypassed(served):
    url = served
    prefix = _prefix(20)
    _complete(url, prefix + [1])
    (owner,) = _wait_for(lambda: _holders(prefix), "the prefix's replica")
    # IMBALANCE + 1 requests in flight at the owner: each still within the threshold when sent.
    streams = [_HeldStream(url, prefix + [2, suffix]) for suffix in range(IMBALANCE + 1)]
    try:
        before = _decisions(url)
        _complete(url, prefix + [3])
        assert _delta(before, _decisions(url), LOAD_IMBALANCE) == 1
        assert len(_wait_for(lambda: _holders(prefix) if len(_holders(prefix)) == 2 else None,
                             "the other replica to hold the prefix")) == 2
    finally:
        for stream in streams:
            stream.close()
    _wait_idle(url)


def test_metrics_show_decisions_and_each_replicas_reported_counters(served):
    url = served
    _complete(url, _prefix(30) + [1])
    reports = {replica: float(r["prefix_cache_hits"]) for replica, r in _reports().items()}

    def router_view() -> tuple[str, dict[str, float]]:
        text = httpx.get(url + "/metrics", timeout=30).text
        return text, {replica: float(value) for replica, value in
                      re.findall(r'raylm:router_replica_prefix_cache_hits_total\{replica="(\w+)"\} (\S+)', text)}

    # The router's view becomes what the replicas say (no request runs after the one above)
    # at their next report: a period (0.3 s here) after the request, or later on a loaded
    # machine, where Serve's poll of the replicas waits for a core too.
    text, reported = _wait_for(lambda: (view := router_view())[1] == reports and view,
                               "the router to show the replicas' counters")
    assert "raylm:prefix_cache_hits_total" in text  # an engine replica's own metrics come first
    assert set(reported) == set(reports) and reports
    assert sum(_decisions(url).values()) > 0


def test_the_routers_keys_are_the_hashes_the_replicas_report(served, router_model, chat_template_file):
    """Text, chat (rendered with the replicas' --chat-template file), chat with tools (which
    the template renders ahead of the messages: they change the prefix) and salted prompts."""
    from raylm.deploy.serve_ingress import _build_keyer

    url = served
    # The ingress's keyer, built from what keyer_arguments passes it.
    keyer = _build_keyer(tokenizer=str(router_model), trust_remote_code=False, revision=None, tokenizer_mode="auto",
                         block_size=BLOCK, max_blocks=64, chat_template=str(chat_template_file),
                         trust_request_chat_template=False)
    text = "the quick brown fox jumps over the lazy dog " * 12
    chat = {"model": MODEL, "messages": [{"role": "system", "content": text}, {"role": "user", "content": "hi"}],
            "max_tokens": 2}
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
    tools_text = "a lazy dog sleeps under the old oak tree all day " * 12
    chat_with_tools = {**chat, "messages": [{"role": "system", "content": tools_text},
                                            {"role": "user", "content": "hi"}],
                       "tools": [tool], "tool_choice": "none"}
    without_tools = {key: value for key, value in chat_with_tools.items() if key not in ("tools", "tool_choice")}
    assert (keyer.key("/v1/chat/completions", json.dumps(chat_with_tools).encode()).block_hashes[0]
            != keyer.key("/v1/chat/completions", json.dumps(without_tools).encode()).block_hashes[0])
    requests = [("/v1/completions", {"model": MODEL, "prompt": text, "max_tokens": 2}),
                ("/v1/chat/completions", chat),
                ("/v1/chat/completions", chat_with_tools),
                ("/v1/completions", {"model": MODEL, "prompt": _prefix(40), "max_tokens": 2, "cache_salt": "tenant"})]
    for route, body in requests:
        response = httpx.post(url + route, json=body, timeout=60)
        assert response.status_code == 200, response.text
        key = keyer.key(route, response.request.content)
        assert key is not None and len(key.block_hashes) >= 3
        _wait_for(lambda: any(set(key.block_hashes) <= _cached(r) for r in _reports().values()),
                  f"a replica to report the blocks of the {route} request")


def test_a_killed_replica_is_replaced_and_routing_continues(served):
    url = served
    prefix = _prefix(50)
    _complete(url, prefix + [1])
    (owner,) = _wait_for(lambda: _holders(prefix), "the prefix's replica")
    ray.kill(_replica_actors()[owner], no_restart=True)
    # Answered at once, by the survivor (the ingress sends again a request the dead one got).
    _complete(url, prefix + [2])
    replicas = _wait_for(lambda: (lambda ids: ids if len(ids) == 2 and owner not in ids else None)(
        set(_replica_actors())), "Serve to replace the replica", timeout=120)
    _wait_for(lambda: len(_reports()) == 2, "the new replica to report", timeout=120)
    before = _decisions(url)
    for suffix in range(3, 6):
        _complete(url, prefix + [suffix])
    assert _delta(before, _decisions(url), PREFIX_MATCH) == 3
    (holder,) = _holders(prefix)
    assert holder in replicas


def test_a_chat_past_the_default_message_limit_is_not_rendered_for_a_key(llama_dir):
    """The ingress keys requests on one thread: a conversation the replica will refuse (more
    messages than the default limit) gets no key instead of being rendered (200k messages
    took 1.4 s there)."""
    from transformers import AutoTokenizer

    from raylm.deploy.limits import RequestLimits
    from raylm.deploy.prefix_key import PrefixKeyer

    template = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    keyer = PrefixKeyer(AutoTokenizer.from_pretrained(str(llama_dir)), BLOCK, max_blocks=64, chat_template=template)

    def key(num_messages: int):
        messages = [{"role": "user", "content": f"message {i}"} for i in range(num_messages)]
        return keyer.key("/v1/chat/completions", json.dumps({"messages": messages}).encode())

    limit = RequestLimits().max_chat_messages
    assert key(limit) is not None and key(limit).block_hashes
    assert key(limit + 1) is None


@pytest.mark.serial  # wall-clock deadline: alone, after the parallel part (scripts/test.sh)
def test_the_router_renders_no_request_template_and_keys_the_servers_as_transformers(llama_dir):
    """A request's own template is code: the key thread never runs it (the request goes
    without a key), nor a template over chat_template_kwargs past the default limits. The
    server's template is keyed on the text transformers renders, cut at the keyed blocks."""
    from transformers import AutoTokenizer

    from raylm.deploy.prefix_key import PrefixKeyer, block_hash_key

    template = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }} {{ note }}\n{% endfor %}"
    tokenizer = AutoTokenizer.from_pretrained(str(llama_dir))
    keyer = PrefixKeyer(tokenizer, BLOCK, max_blocks=4, chat_template=template, trust_request_chat_template=True)
    messages = [{"role": "user", "content": f"message number {i}"} for i in range(40)]

    def key(**fields):
        return keyer.key("/v1/chat/completions", json.dumps({"messages": messages, **fields}).encode())

    hostile = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
    started = time.monotonic()
    assert key(chat_template=hostile) is None
    assert key(chat_template_kwargs={"note": "x" * 100_000}) is None
    assert time.monotonic() - started < 1
    text = tokenizer.apply_chat_template(messages, chat_template=template, tokenize=False, add_generation_prompt=True,
                                         note="ok")
    expected = block_hash_key(tokenizer.encode(text, add_special_tokens=False), BLOCK, None, 4)
    assert key(chat_template_kwargs={"note": "ok"}).block_hashes == expected


# A template that reads each message's content as OpenAI's list of parts ("openai" content
# format, as vLLM's "auto" detects it).
PARTS_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{% for part in m['content'] %}[{{ part['text'] }}]"
                  "{% endfor %}\n{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}")


@pytest.mark.parametrize("content_format, template", [("auto", PARTS_TEMPLATE), ("openai", PARTS_TEMPLATE),
                                                      ("auto", TOOLS_TEMPLATE), ("string", TOOLS_TEMPLATE)])
def test_a_string_and_its_text_part_key_as_the_prompt_the_template_renders(llama_dir, content_format, template):
    """The ingress's keyer (built as the Serve app builds it) hands the template each
    message's content in the form the replica does (--chat-template-content-format), so a
    string and the same text as one text part key as the prompt they both render: the
    hashes of transformers' rendering of the parts, tokenized."""
    from transformers import AutoTokenizer

    from raylm.deploy.prefix_key import block_hash_key
    from raylm.deploy.serve_app import keyer_arguments
    from raylm.deploy.serve_ingress import _build_keyer
    from raylm.deploy.server_args import PREFIX_AWARE_ROUTER, DeploymentArgs, ServerArgs
    from raylm.engine.arg_utils import EngineArgs

    arguments = keyer_arguments(EngineArgs(model=str(llama_dir), block_size=BLOCK),
                                ServerArgs(chat_template=template, chat_template_content_format=content_format),
                                DeploymentArgs(num_replicas=2, request_router=PREFIX_AWARE_ROUTER))
    keyer = _build_keyer(**arguments)
    text = "where do the workers of a cluster go when the head node restarts"
    as_string = [{"role": "system", "content": text}, {"role": "user", "content": text}]
    as_parts = [{"role": m["role"], "content": [{"type": "text", "text": m["content"]}]} for m in as_string]

    def key(messages):
        return keyer.key("/v1/chat/completions", json.dumps({"messages": messages}).encode()).block_hashes

    tokenizer = AutoTokenizer.from_pretrained(str(llama_dir))
    reference = as_parts if "part in" in template else as_string
    prompt = tokenizer.apply_chat_template(reference, chat_template=template, tokenize=False,
                                           add_generation_prompt=True)
    assert text in prompt
    expected = block_hash_key(tokenizer.encode(prompt, add_special_tokens=False), BLOCK, None,
                              arguments["max_blocks"])
    assert key(as_string) == key(as_parts) == expected
