"""`RequestLimits`: the most one request to the OpenAI server may ask for, in one place.

Every size a request names is bounded, and checked before anything is tokenized or
allocated for it: past a limit the answer is a 400 whose OpenAI error body names the
field (`param`) and the limit. Where vLLM has a limit raylm keeps it, where vLLM has it:
`n` / `best_of` (at most RAYLM_MAX_N_SEQUENCES, 16384, engine/sampling_params.py) and
`logprobs` / `prompt_logprobs` / `top_logprobs` (the engine argument `max_logprobs`, 20).
The limits below are the server's own, part of `ServerArgs`: each field is a `raylm serve`
flag (`max_stop_strings` is `--max-stop-strings`) and a Ray Serve app key, with the
field's help. The structured-output limits bound what a grammar's compile time grows with
(a constraint's size, a JSON schema's nesting) and the compile time itself.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any

from raylm.deploy.errors import OpenAIError
from raylm.engine.arg_fields import setting

# Characters of text allowed per token of context before tokenizing, when
# --max-prompt-chars is not given. Text averages 3 to 5 characters per token and few
# tokens are longer than 16 characters, so a prompt past this could never fit the
# context; the bound keeps a huge prompt from costing seconds of tokenizer time first.
PROMPT_CHARS_PER_TOKEN = 32
# What one token held for a response costs the server, each logprob alternative counting as
# one: 200 to 700 bytes measured on `raylm serve` (a token's id and text in the request, its
# output and the response; a Logprob and its text per alternative).
RESPONSE_TOKEN_BYTES = 512
# Each of a request's sequences (its n, or best_of) holds a copy of the prompt's token ids,
# some 8 bytes a token (2,048 sequences of a 16,000-token prompt grew the server by 235 MB):
# a copied prompt token counts as 1/64 of a response token.
PROMPT_COPY_SHARE = RESPONSE_TOKEN_BYTES // 8
# A prompt token id returned with return_token_ids, in each of the n choices (completions)
# or chunks that open them (streamed chat), costs some 32 bytes: the choice's list of ids,
# its dump, and its JSON text. It counts as 1/16 of a response token.
RETURNED_PROMPT_ID_SHARE = RESPONSE_TOKEN_BYTES // 32
# chat_template_kwargs nested deeper than this are refused (JSON's own nesting: some parsers
# stop at 100, Python's recursion sooner in the code that walks them).
MAX_TEMPLATE_KWARGS_DEPTH = 64
# chat_template_kwargs keys the request's own fields set (vLLM refuses the first two).
RESERVED_TEMPLATE_KWARGS = ("chat_template", "tokenize", "messages", "add_generation_prompt",
                            "continue_final_message")


@dataclass(frozen=True)
class RequestLimits:
    """The server's bounds on one request (vLLM has none of these)."""

    max_prompts_per_request: int = field(default=1024, metadata=setting(
        "Most prompts in one /v1/completions request (a list of texts or of token-id lists)."))
    max_stop_strings: int = field(default=64, metadata=setting(
        "Most strings in a request's `stop` (OpenAI allows 4); each is searched for in the text at every token."))
    max_stop_string_chars: int = field(default=256, metadata=setting("Most characters in one stop string."))
    max_stop_token_ids: int = field(default=1024, metadata=setting("Most ids in a request's `stop_token_ids`."))
    max_logit_bias: int = field(default=1024, metadata=setting("Most entries in a request's `logit_bias`."))
    max_chat_messages: int = field(default=4096, metadata=setting("Most messages in one chat request."))
    max_prompt_chars: int | None = field(default=None, metadata=setting(
        f"Most characters of one text prompt, or of a chat request's messages together, before tokenization; "
        f"default: {PROMPT_CHARS_PER_TOKEN} x max_model_len (longer text could not fit the context)."))
    max_response_tokens: int = field(default=1 << 22, metadata=setting(
        "Most tokens one request's response may hold, logprobs counted, checked before it runs: its prompts x "
        "best_of x max_tokens generated tokens, each counting 1 + logprobs, and with prompt_logprobs (or echo with "
        "logprobs) each prompt token counting 1 + prompt_logprobs in each of its n choices; each sequence's copy of "
        "its prompt counts 1/64 token a prompt token, and with return_token_ids each of the n choices' copy of the "
        "prompt's ids 1/16 token an id. Bounds what one request holds in memory (some 200-700 bytes "
        "a token) and its share of the engine."))
    # Structured outputs and tools: what a grammar's compile time grows with.
    max_structured_output_chars: int = field(default=65536, metadata=setting(
        "Most characters of a request's structured-output constraint (its JSON schema as JSON, regex, grammar or "
        "choices together), and of its tools' definitions together."))
    max_json_schema_depth: int = field(default=64, metadata=setting(
        "Deepest nesting of objects and arrays in a JSON schema (response_format, structured_outputs, a tool's "
        "parameters); compile time grows with the cube of a schema's nesting."))
    max_tools: int = field(default=128, metadata=setting("Most tools in one chat request."))
    max_grammar_compile_seconds: float = field(default=10.0, metadata=setting(
        "Seconds a request's grammar may take to compile before the request is answered 400 (its compile, which "
        "runs in a process of its own, is stopped then; the engine keeps serving meanwhile)."))
    # Chat templates (deploy/chat_template.py): a template is code, and a request's content its input.
    max_chat_template_chars: int = field(default=65536, metadata=setting(
        "Most characters of a chat_template sent in a request (with --trust-request-chat-template)."))
    max_chat_template_kwargs_chars: int = field(default=65536, metadata=setting(
        f"Most characters of a request's chat_template_kwargs, as JSON; they may nest at most "
        f"{MAX_TEMPLATE_KWARGS_DEPTH} levels deep."))
    max_chat_template_steps: int = field(default=1_000_000, metadata=setting(
        "Most steps one chat template render may take, every template (the model's, --chat-template's, a "
        "request's): each loop iteration, each call (macros, methods) and each item of a range is one; past it the "
        "request is answered 400. The rendered text, and every string or list made on the way, may hold at most "
        "--max-prompt-chars characters or items."))
    max_chat_template_render_seconds: float = field(default=5.0, metadata=setting(
        "Seconds one chat template render may take, every template (the model's, --chat-template's, a "
        "request's), before the request is answered 400; the render checks its clock as it counts its steps. A "
        "chat_template sent in a request renders in a process of its own, killed at this deadline, with an "
        "address-space limit of 512 MiB + 32 bytes a prompt character; the time it waits for such a process "
        "counts (--max-queued-chat-template-renders). The server keeps serving meanwhile."))

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if value is None:
                continue
            if isinstance(f.default, float):
                if not isinstance(value, (int, float)) or not value > 0:
                    raise ValueError(f"{f.name} must be a positive number, got {value!r}.")
            elif not isinstance(value, int) or value < 1:
                raise ValueError(f"{f.name} must be a positive integer, got {value!r}.")

    def prompt_chars(self, max_model_len: int) -> int:
        return self.max_prompt_chars or PROMPT_CHARS_PER_TOKEN * max_model_len

    # ---------------------------------------------------------------- checks
    def check_sampling(self, request: Any) -> None:
        """`stop`, `stop_token_ids` and `logit_bias` of a completions or chat request."""
        stops = [request.stop] if isinstance(request.stop, str) else list(request.stop or ())
        _check_count(len(stops), self.max_stop_strings, "stop", "strings", "max_stop_strings")
        longest = max((len(stop) for stop in stops), default=0)
        if longest > self.max_stop_string_chars:
            raise OpenAIError(f"stop strings may have at most {self.max_stop_string_chars} characters "
                              f"(--max-stop-string-chars), got one of {longest}.", param="stop")
        _check_count(len(request.stop_token_ids or ()), self.max_stop_token_ids, "stop_token_ids", "ids",
                     "max_stop_token_ids")
        _check_count(len(request.logit_bias or {}), self.max_logit_bias, "logit_bias", "entries", "max_logit_bias")

    def check_num_prompts(self, count: int, param: str = "prompt") -> None:
        _check_count(count, self.max_prompts_per_request, param, "prompts", "max_prompts_per_request")

    def check_prompt_chars(self, chars: int, max_model_len: int, param: str = "prompt") -> None:
        limit = self.prompt_chars(max_model_len)
        if chars > limit:
            raise OpenAIError(f"The {param} has {chars} characters; at most {limit} are allowed before tokenization "
                              f"(--max-prompt-chars; this model's maximum context length is {max_model_len} "
                              f"tokens).", param=param)

    def check_structured_output(self, text: str, depth: int, param: str) -> None:
        """A constraint's size (`text`: its JSON schema as JSON, regex, grammar or choices)
        and, for a JSON schema, its nesting `depth`."""
        if len(text) > self.max_structured_output_chars:
            raise OpenAIError(f"{param} is {len(text)} characters long; at most {self.max_structured_output_chars} "
                              f"are allowed (--max-structured-output-chars).", param=param)
        if depth > self.max_json_schema_depth:
            raise OpenAIError(f"{param}: the JSON schema nests {depth} levels deep; at most "
                              f"{self.max_json_schema_depth} are allowed (--max-json-schema-depth).", param=param)

    def check_response_size(self, prompts: list[tuple[int, Any]], prompt_logprobs_param: str = "prompt_logprobs",
                            returns_prompt_ids: bool = False) -> int:
        """What the response to a request may hold, from each prompt's length and its
        SamplingParams (max_tokens resolved): n, best_of and max_tokens multiply, every
        logprob asked for is one more entry per token, each sequence copies its prompt, and
        with `returns_prompt_ids` (return_token_ids) each of the n choices carries the
        prompt's ids. Returns that count; past the limit, a 400 naming the field that weighs
        most: max_tokens, the one that asked for the prompt's logprobs
        (`prompt_logprobs_param`: completions' echo asks with logprobs), or n (best_of) for
        the prompt's copies."""
        generated = scored = copies = returned = 0
        for prompt_len, params in prompts:
            generated += params.best_of * params.max_tokens * (1 + (params.logprobs or 0))
            copies += params.best_of * prompt_len
            if params.prompt_logprobs is not None:
                scored += params.n * prompt_len * (1 + params.prompt_logprobs)
            if returns_prompt_ids:
                returned += params.n * prompt_len
        copied = -(-copies // PROMPT_COPY_SHARE) + -(-returned // RETURNED_PROMPT_ID_SHARE)
        total = generated + scored + copied
        if total <= self.max_response_tokens:
            return total
        params = prompts[0][1]
        prompt_tokens = sum(length for length, _ in prompts)
        parts = [f"{len(prompts)} prompt(s) x best_of {params.best_of} x max_tokens {params.max_tokens} x "
                 f"(1 + logprobs {params.logprobs or 0}) = {generated:,}"]
        if scored:
            parts.append(f"{prompt_tokens:,} prompt tokens x (1 + prompt_logprobs {params.prompt_logprobs}) x "
                         f"n {params.n} = {scored:,}")
        returned_part = (f" and returned as ids in each of n {params.n} choices (return_token_ids), "
                         f"1/{RETURNED_PROMPT_ID_SHARE} each" if returns_prompt_ids else "")
        parts.append(f"{prompt_tokens:,} prompt tokens copied into each of best_of {params.best_of} sequences, "
                     f"1/{PROMPT_COPY_SHARE} each{returned_part} = {copied:,}")
        heaviest = max(generated, scored, copied)
        param = ("max_tokens" if heaviest == generated else prompt_logprobs_param if heaviest == scored
                 else "best_of" if params.best_of > params.n else "n")
        raise OpenAIError(f"This request's response would hold {total:,} tokens, logprobs counted "
                          f"({'; '.join(parts)}); at most {self.max_response_tokens:,} are allowed "
                          f"(--max-response-tokens). Ask for fewer samples, tokens or logprobs.", param=param)

    def check_chat_template(self, template: str | None, template_kwargs: dict[str, Any] | None) -> None:
        """A request's chat_template (its length) and chat_template_kwargs (their keys, nesting
        and size as JSON), before anything renders."""
        if template is not None and len(template) > self.max_chat_template_chars:
            raise OpenAIError(f"chat_template is {len(template)} characters long; at most "
                              f"{self.max_chat_template_chars} are allowed (--max-chat-template-chars).",
                              param="chat_template")
        if not template_kwargs:
            return
        from raylm.deploy.structured_outputs import json_depth

        reserved = sorted(set(RESERVED_TEMPLATE_KWARGS) & template_kwargs.keys())
        if reserved:
            raise OpenAIError(f"chat_template_kwargs may not set {', '.join(reserved)}: "
                              f"{', '.join(RESERVED_TEMPLATE_KWARGS)} are the request's own fields or the server's.",
                              param="chat_template_kwargs")
        depth = json_depth(template_kwargs)
        if depth > MAX_TEMPLATE_KWARGS_DEPTH:
            raise OpenAIError(f"chat_template_kwargs nest {depth} levels deep; at most {MAX_TEMPLATE_KWARGS_DEPTH} "
                              f"are allowed.", param="chat_template_kwargs")
        chars = len(json.dumps(template_kwargs, ensure_ascii=False))
        if chars > self.max_chat_template_kwargs_chars:
            raise OpenAIError(f"chat_template_kwargs are {chars} characters long as JSON; at most "
                              f"{self.max_chat_template_kwargs_chars} are allowed (--max-chat-template-kwargs-chars).",
                              param="chat_template_kwargs")

    def check_messages(self, messages: list[Any], max_model_len: int) -> None:
        """The number of chat messages and the characters of their content together."""
        _check_count(len(messages), self.max_chat_messages, "messages", "messages", "max_chat_messages")
        self.check_prompt_chars(sum(_content_chars(m.content) + len(_reasoning_of(m)) for m in messages),
                                max_model_len, "messages")


def _check_count(count: int, limit: int, param: str, noun: str, flag: str) -> None:
    if count > limit:
        raise OpenAIError(f"{param} may have at most {limit} {noun} (--{flag.replace('_', '-')}), got {count}.",
                          param=param)


def _reasoning_of(message: Any) -> str:
    """An assistant turn's reasoning, which templates may render into the prompt too."""
    reasoning_text = getattr(message, "reasoning_text", None)
    return (reasoning_text() or "") if reasoning_text is not None else ""


def _content_chars(content: Any) -> int:
    """Characters of a message's content: a string, or the text of its content parts."""
    if content is None:
        return 0
    if isinstance(content, str):
        return len(content)
    texts = (part.get("text") for part in content)
    return sum(len(text) for text in texts if isinstance(text, str))
