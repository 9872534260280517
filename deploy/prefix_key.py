"""What the prefix-aware router knows of a request: the hashes of its prompt's blocks.

The router matches requests to replicas on the same block hashes that the replicas'
KV-cache managers compute (`hash_block_tokens`: each full block of `block_size` tokens,
chained on the hash of everything before it, the request's cache_salt in the first), so
that what a replica reports it holds (`RaylmDeployment.record_routing_stats`) and what the
router remembers sending it are one kind of thing: a hash in a request's key names the
prefix up to that block.

Computing them takes the prompt's token ids, so the router's ingress tokenizes as the
replica will (the chat template rendered the same way, from the same messages and tools,
each message's content in the form the template reads: --chat-template-content-format, or
the one "auto" detects, so that a string and the same text as a list of parts key as the
prompt they render).
That costs more than hashing the prompt's characters in chunks, as Ray Serve LLM's and
SGLang's routers do, but it is what lets the replicas' own reports, evictions included,
be read without a second tree of guesses; `cluster/benchmarks/bench_prefix_routing.py`
measures both. Only the first `max_blocks` blocks are keyed (long prompts are cut before
tokenizing), which bounds the router's cost whatever the prompt's length.

A request for a LoRA adapter (`model` naming neither the base model nor one of its aliases,
with LoRA on) is keyed with the adapter's name in its first block, so two adapters'
requests, or an adapter's and the base model's, with the same prompt never count as the same
prefix. The replicas hash an adapter by its engine id, name, folder and files' SHA-256, which the
router does not know: their reports never match an adapter request's key, and such requests follow
only what the router remembers sending where (`router_retention_s`).

An embeddings request (`/v1/embeddings`: a prompt with no chat template, prefilled as a
completion's is) is keyed as a completion by its input: with LAST pooling a replica's prefix
cache serves the instruction prefix that decoder embedding models put before every query.
(A pooling engine with MEAN or CLS pooling caches nothing, and its app keys nothing:
deploy/serve_app.keyer_arguments.)

A request the key cannot be computed for (a body that is no completion, a malformed one, a
server without a tokenizer) gets no key; the router then sends it to the least loaded
replica and the replica answers it as it would without the router (a 400 for bad input).
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from typing import Any

from raylm.deploy.chat_template import ChatTemplateRenderer
from raylm.deploy.limits import RequestLimits
from raylm.engine.block_pool import first_block_extra_key, hash_block_tokens

logger = logging.getLogger(__name__)

# Bytes of each block hash the router keeps: 2**-64 odds that two prefixes look alike to
# it (a routing slip, never a wrong answer: the replicas match on whole hashes).
KEY_HASH_BYTES = 8
# Characters tokenized per keyed token at most: a prompt longer than max_blocks blocks is
# cut at max_blocks * block_size * this before tokenizing (no tokenizer packs more).
_MAX_CHARS_PER_TOKEN = 16

# A chat request is rendered to be keyed only within the server's default request limits:
# the ingress's one key thread would otherwise render any conversation a 16 MiB body holds.
_MAX_KEYED_MESSAGES = RequestLimits.max_chat_messages
_MAX_KEYED_TOOLS = RequestLimits.max_tools
# The longest text a template may make on the way while keying (the replicas bound it by
# their model's prompt limit, which the router does not know): a 16 MiB body's worth.
_MAX_KEYED_TEMPLATE_CHARS = 1 << 24

COMPLETIONS_ROUTE = "/v1/completions"
CHAT_ROUTE = "/v1/chat/completions"
EMBEDDINGS_ROUTE = "/v1/embeddings"
RESPONSES_ROUTE = "/v1/responses"


@dataclass(frozen=True)
class PrefixKey:
    """A request's routing key: the truncated hashes of its prompt's first full blocks."""

    block_hashes: tuple[bytes, ...]
    # The prompt's tokens the key covers (its full blocks, at most max_blocks of them).
    num_tokens: int


def block_hash_key(token_ids: list[int], block_size: int, cache_salt: str | None = None,
                   max_blocks: int | None = None, adapter_key: bytes | None = None) -> tuple[bytes, ...]:
    """The truncated hashes of the full blocks of `token_ids`, as the KV-cache manager
    chains them (kv_cache_manager.KVCacheManager._update_block_hashes); `adapter_key`
    marks a LoRA adapter's request (see `adapter_key_of`)."""
    num_blocks = len(token_ids) // block_size
    if max_blocks is not None:
        num_blocks = min(num_blocks, max_blocks)
    hashes: list[bytes] = []
    parent: bytes | None = None
    for index in range(num_blocks):
        block = token_ids[index * block_size:(index + 1) * block_size]
        extra_key = first_block_extra_key(cache_salt, adapter_key) if index == 0 else b""
        parent = hash_block_tokens(parent, block, extra_key)
        hashes.append(parent[:KEY_HASH_BYTES])
    return tuple(hashes)


def adapter_key_of(model: Any, base_model_names: frozenset[str] | None) -> bytes | None:
    """The router's key of the LoRA adapter a request's `model` names: None for the base
    model (no `model`, one of `base_model_names`, or any name when LoRA is off:
    base_model_names None), else the name's bytes."""
    if base_model_names is None or not isinstance(model, str) or not model or model in base_model_names:
        return None
    return b"model\x00" + model.encode()


class PrefixKeyer:
    """Turns a completions or chat request body into its `PrefixKey`, with the tokenizer
    and chat template the replicas use. `base_model_names`: with LoRA on, the names that
    mean the base model (any other `model` is an adapter's); None with LoRA off.
    `chat_template_content_format`: the replicas' --chat-template-content-format."""

    def __init__(self, tokenizer: Any, block_size: int, max_blocks: int, chat_template: str | None = None,
                 trust_request_chat_template: bool = False, base_model_names: list[str] | None = None,
                 chat_template_content_format: str = "auto") -> None:
        self.tokenizer = tokenizer
        self.chat_template_content_format = chat_template_content_format
        self.base_model_names = None if base_model_names is None else frozenset(base_model_names)
        self.block_size = block_size
        self.max_blocks = max_blocks
        self.chat_template = chat_template
        self.trust_request_chat_template = trust_request_chat_template
        self._max_chars = max_blocks * block_size * _MAX_CHARS_PER_TOKEN
        self._limits = RequestLimits()
        self._renderer = ChatTemplateRenderer(_MAX_KEYED_TEMPLATE_CHARS, self._limits.max_chat_template_steps,
                                              self._limits.max_chat_template_render_seconds)

    def key(self, route: str, body: bytes) -> PrefixKey | None:
        """The key of a POST to `route` with `body`, or None where there is none to compute."""
        try:
            if route == COMPLETIONS_ROUTE:
                return self._completion_key(json.loads(body))
            if route == CHAT_ROUTE:
                return self._chat_key(json.loads(body))
            if route == EMBEDDINGS_ROUTE:
                return self._embedding_key(json.loads(body))
            if route == RESPONSES_ROUTE:
                return self._responses_key(json.loads(body))
        except Exception as exc:  # noqa: BLE001 - the replica answers a bad body; the router only routes it
            logger.debug("No prefix key for a %s request: %r", route, exc)
        return None

    def _completion_key(self, body: dict[str, Any]) -> PrefixKey | None:
        if body.get("truncate_prompt_tokens") is not None:
            return None  # the prompt's last tokens run: its leading blocks are never prefilled
        if body.get("prompt_embeds") is not None:
            return None  # its first prompt is embeddings, whose blocks no token key names
        prompt = body["prompt"]
        # A request of several prompts goes where its first prompt's prefix is.
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]
        if isinstance(prompt, str):
            token_ids = self._tokenize(prompt, bool(body.get("add_special_tokens", True)))
        elif isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            token_ids = prompt
        else:
            return None
        return self._key(token_ids, body.get("cache_salt"), body.get("model"))

    def _embedding_key(self, body: dict[str, Any]) -> PrefixKey | None:
        """An embedding request's input is a prompt with no template, prefilled as a
        completion's is: keyed as one, by its first input. Not with truncate_prompt_tokens,
        which keeps the input's last tokens: its leading blocks are never prefilled."""
        if body.get("truncate_prompt_tokens") is not None:
            return None
        return self._completion_key({"prompt": body["input"], "model": body.get("model"),
                                     "add_special_tokens": body.get("add_special_tokens", True)})

    def _responses_key(self, body: dict[str, Any]) -> PrefixKey | None:
        """A Responses request is served as the chat request it translates to: keyed as that."""
        from raylm.deploy.protocol_responses import ResponsesRequest
        from raylm.deploy.serving_responses import chat_request_of

        return self._chat_key(chat_request_of(ResponsesRequest.model_validate(body)).model_dump(exclude_unset=True))

    def _chat_key(self, body: dict[str, Any]) -> PrefixKey | None:
        from raylm.deploy.protocol import ChatCompletionToolsParam, ChatMessage
        from raylm.deploy.serving_chat import resolve_content_format, template_message
        from raylm.deploy.tool_calls import template_tools

        if self.tokenizer is None or body.get("truncate_prompt_tokens") is not None:
            return None
        if body.get("chat_template"):
            # A request's own template is code: only the replica runs it, in its sandbox. Such
            # a request is routed without a key.
            return None
        if len(body["messages"]) > _MAX_KEYED_MESSAGES or len(body.get("tools") or ()) > _MAX_KEYED_TOOLS:
            return None  # past the default limits (the replica refuses it): not rendered on the key thread
        template_kwargs = body.get("chat_template_kwargs") or {}
        if body.get("reasoning_effort") is not None:  # as ChatCompletionRequest folds it in
            template_kwargs = {**template_kwargs, "reasoning_effort": body["reasoning_effort"]}
        self._limits.check_chat_template(None, template_kwargs)  # past the default limits: no key
        # As OpenAIServingChat.render does, with the request's own switches; the tools go
        # into the template (whatever tool_choice says), so they are part of the prefix.
        variables = {**self.tokenizer.special_tokens_map, **template_kwargs}
        if body.get("tools"):
            variables["tools"] = template_tools([ChatCompletionToolsParam.model_validate(tool)
                                                 for tool in body["tools"]])
        template = self.tokenizer.get_chat_template(self.chat_template, variables.get("tools"))
        content_format = resolve_content_format(self.chat_template_content_format, template)
        conversation = [template_message(ChatMessage.model_validate(m), content_format) for m in body["messages"]]
        # Only the first max_blocks blocks are keyed: the render stops past their characters.
        text = self._renderer.render(template, conversation, bool(body.get("add_generation_prompt", True)),
                                     bool(body.get("continue_final_message", False)), variables,
                                     prefix_chars=self._max_chars + 1)
        return self._key(self._tokenize(text, bool(body.get("add_special_tokens", False))), body.get("cache_salt"),
                         body.get("model"))

    def _tokenize(self, text: str, add_special_tokens: bool) -> list[int]:
        if self.tokenizer is None:
            return []
        if len(text) <= self._max_chars:
            return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)
        # Cut: the tokens near the cut may differ from the whole text's, so one block's
        # worth of them is dropped.
        token_ids = self.tokenizer.encode(text[:self._max_chars], add_special_tokens=add_special_tokens)
        return token_ids[:max(0, len(token_ids) - self.block_size)]

    def _key(self, token_ids: list[int], cache_salt: Any, model: Any) -> PrefixKey | None:
        salt = cache_salt if isinstance(cache_salt, str) and cache_salt else None
        hashes = block_hash_key(token_ids, self.block_size, salt, self.max_blocks,
                                adapter_key_of(model, self.base_model_names))
        if not hashes:
            return None
        return PrefixKey(hashes, len(hashes) * self.block_size)
