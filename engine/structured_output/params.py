"""`StructuredOutputsParams`: what a request's output must match (vLLM's names and meaning).

Plain data, no xgrammar: workers import it with the sampling parameters. The engine's
`StructuredOutputManager` turns it into a compiled grammar.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

# Whitespace characters JSON output may hold between two elements, unless
# `disable_any_whitespace`. JSON lets a model put any amount there, and a weak or
# random-weight one can spend its whole max_tokens on it (vLLM's only remedy is no
# whitespace at all). 20 still fits `json.dumps(indent=2)` nine levels deep and
# `indent=4` four levels deep (a newline plus the indentation).
DEFAULT_MAX_WHITESPACE = 20

# The constraint kinds, in the order vLLM lists them; exactly one is set per request.
KINDS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")


class StructuredOutputsError(ValueError):
    """A structured-outputs constraint that cannot be used (malformed, or rejected by the
    grammar compiler); `param` names the field, as `ParameterError` does."""

    def __init__(self, message: str, param: str = "structured_outputs") -> None:
        super().__init__(message)
        self.param = param


class CompileCrashedError(StructuredOutputsError):
    """A compile whose process crashed or was killed (a compiler bug the grammar met, or the
    kernel's OOM killer): refused like any bad constraint, but not remembered, since a
    signal may have had nothing to do with it; sent again, the constraint compiles again."""


class GrammarCompilerUnavailableError(RuntimeError):
    """The grammar compile worker cannot compile right now (it did not start, died, or is
    waiting before it starts again): no fault of the constraint, which may compile once the
    worker is back (the server answers 503). Never cached."""


@dataclass
class StructuredOutputsParams:
    """Constrains a request's output to a JSON schema, a regex, one of given strings or a
    grammar (vLLM's `StructuredOutputsParams`; exactly one of the first six fields is set).

    Args:
        json: A JSON schema (a dict or its JSON text): the output is one JSON value that
            validates against it. Properties come in the schema's order.
        regex: A regular expression the whole output matches.
        choice: The output is exactly one of these strings.
        grammar: A context-free grammar, in EBNF (GBNF, ``root ::= ...``) or Lark syntax.
        json_object: True: the output is any JSON object (OpenAI's ``json_object`` mode).
        structural_tag: An xgrammar structural tag (a dict or its JSON text):
            ``{"type": "structural_tag", "format": {...}}``, or vLLM's legacy form
            ``{"structures": [{"begin", "schema", "end"}, ...], "triggers": [...]}`` (free
            text until a trigger, then one of the structures whose begin starts with it: its
            begin, JSON valid against its schema, its end).
        disable_any_whitespace: JSON without any whitespace between elements beyond
            single spaces after ``,`` and ``:``.
        max_whitespace: raylm's bound on the whitespace JSON output may hold between two
            elements (default `DEFAULT_MAX_WHITESPACE`); None lifts it (vLLM's behaviour).
        reasoning_end_token_id: The token that ends a reasoning model's reasoning (``</think>``):
            the output is free until it, and the constraint holds from the token after it
            (vLLM's structured outputs under ``--reasoning-parser``). None: from the first
            output token. The server sets it for its reasoning parser; it is no part of the
            grammar.
        reasoning_implicit_end_token_id: A second token that ends the reasoning where it
            comes before ``reasoning_end_token_id`` (Qwen3.5's ``<tool_call>`` written in
            unclosed thinking, as vLLM's Qwen3 parser ends it); the constraint holds from the
            token after it. Only with ``reasoning_end_token_id`` or ``reasoning_end_token_ids``.
        reasoning_end_token_ids: The tokens that end the reasoning where its end is several
            (gpt-oss's header ``<|channel|>final<|message|>``): the constraint holds from the
            token after the output first writes them in this order. Instead of
            ``reasoning_end_token_id`` (one token is a sequence of one).
    """

    json: str | dict[str, Any] | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: str | dict[str, Any] | None = None
    disable_any_whitespace: bool = False
    max_whitespace: int | None = DEFAULT_MAX_WHITESPACE
    # Set by whoever builds the params from a request, to name the request's field in
    # errors (the server: "response_format", "tool_choice", "guided_json", ...).
    source: str = field(default="structured_outputs", compare=False, repr=False)
    reasoning_end_token_id: int | None = None
    reasoning_implicit_end_token_id: int | None = None
    reasoning_end_token_ids: list[int] | None = None

    def __post_init__(self) -> None:
        kinds = [kind for kind in KINDS if getattr(self, kind) not in (None, False)]
        if len(kinds) != 1:
            found = f"got {', '.join(kinds)}" if kinds else "got none"
            raise StructuredOutputsError(f"{self.source} must set exactly one of {', '.join(KINDS)}; {found}.",
                                         self.source)
        if self.choice is not None:
            # A string or a dict is iterable too, but its characters or keys are no choices.
            if not isinstance(self.choice, (list, tuple)) or not self.choice \
                    or not all(isinstance(c, str) for c in self.choice):
                raise StructuredOutputsError(f"{self.source}: choice must be a non-empty list of strings, got "
                                             f"{self.choice!r}.", self.source)
            self.choice = list(self.choice)
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise StructuredOutputsError(f"{self.source}: {name} must be a non-empty string, got {value!r}.",
                                             self.source)
        for name in ("json_object", "disable_any_whitespace"):
            if not isinstance(getattr(self, name), (bool, type(None))):
                raise StructuredOutputsError(f"{self.source}: {name} must be true or false, got "
                                             f"{getattr(self, name)!r}.", self.source)
        for name in ("reasoning_end_token_id", "reasoning_implicit_end_token_id"):
            end = getattr(self, name)
            if end is not None and (not isinstance(end, int) or isinstance(end, bool) or end < 0):
                raise StructuredOutputsError(f"{self.source}: {name} must be a token id (an integer >= 0) or None, "
                                             f"got {end!r}.", self.source)
        if self.reasoning_end_token_ids is not None:
            ids = self.reasoning_end_token_ids
            if not isinstance(ids, (list, tuple)) or not ids or not all(
                    isinstance(end, int) and not isinstance(end, bool) and end >= 0 for end in ids):
                raise StructuredOutputsError(f"{self.source}: reasoning_end_token_ids must be a non-empty list of "
                                             f"token ids (integers >= 0) or None, got {ids!r}.", self.source)
            if self.reasoning_end_token_id is not None:
                raise StructuredOutputsError(f"{self.source}: give reasoning_end_token_id or reasoning_end_token_ids, "
                                             f"not both.", self.source)
            self.reasoning_end_token_ids = list(ids)
        if self.reasoning_implicit_end_token_id is not None and self.reasoning_end_sequence is None:
            raise StructuredOutputsError(f"{self.source}: reasoning_implicit_end_token_id needs "
                                         f"reasoning_end_token_id or reasoning_end_token_ids.", self.source)
        if self.max_whitespace is not None and (not isinstance(self.max_whitespace, int)
                                                or isinstance(self.max_whitespace, bool) or self.max_whitespace < 1):
            raise StructuredOutputsError(f"{self.source}: max_whitespace must be a positive integer or None, got "
                                         f"{self.max_whitespace!r}.", self.source)
        if isinstance(self.json, str):
            self.json = _parse_json(self.json, "json", self.source)
        if isinstance(self.structural_tag, str):
            self.structural_tag = _parse_json(self.structural_tag, "structural_tag", self.source)
        if self.structural_tag is not None:
            if not isinstance(self.structural_tag, dict):
                raise StructuredOutputsError(f"{self.source}: structural_tag must be an object, got "
                                             f"{type(self.structural_tag).__name__}.", self.source)
            if is_legacy_structural_tag(self.structural_tag):
                _check_legacy_structural_tag(self.structural_tag, self.source)
        if self.json is not None and not isinstance(self.json, (dict, bool)):
            raise StructuredOutputsError(f"{self.source}: json must be a JSON schema (an object), got "
                                         f"{type(self.json).__name__}.", self.source)
        # The compile worker is sent the cache key as UTF-8: a key that cannot be written so
        # (a lone surrogate in a regex, a schema's key, ...) failed the worker's writer, which
        # then took every client's constrained requests for a worker that cannot start.
        try:
            self.cache_key().encode()
        except UnicodeEncodeError:
            raise StructuredOutputsError(f"{self.source} holds a lone UTF-16 surrogate, which is not Unicode text.",
                                         self.source) from None
        except (TypeError, ValueError, RecursionError) as exc:
            raise StructuredOutputsError(f"{self.source}: the {self.kind} is not JSON the grammar compiler can read "
                                         f"({type(exc).__name__}: {exc}).", self.source) from None

    @property
    def reasoning_end_sequence(self) -> tuple[int, ...] | None:
        """The tokens whose run in the output ends the reasoning (one or several); None where
        the constraint holds from the first output token."""
        if self.reasoning_end_token_ids is not None:
            return tuple(self.reasoning_end_token_ids)
        return None if self.reasoning_end_token_id is None else (self.reasoning_end_token_id,)

    @property
    def kind(self) -> str:
        return next(kind for kind in KINDS if getattr(self, kind) not in (None, False))

    def cache_key(self) -> str:
        """What the compiled grammar depends on, as one string (the cache's key). Keys keep
        their order: the grammar follows the schema's property order."""
        value = getattr(self, self.kind)
        return json.dumps([self.kind, value, self.disable_any_whitespace, self.max_whitespace],
                          ensure_ascii=False, separators=(",", ":"))


def _parse_json(text: str, name: str, source: str) -> Any:
    try:
        return json.loads(text)
    except (ValueError, RecursionError) as exc:
        raise StructuredOutputsError(f"{source}: {name} is not valid JSON: {exc}.", source) from None


# The keys of vLLM's legacy structural tag and of each of its structures.
_LEGACY_TAG_KEYS = frozenset({"type", "structures", "triggers"})
_LEGACY_STRUCTURE_KEYS = frozenset({"begin", "schema", "end"})


def is_legacy_structural_tag(tag: dict[str, Any]) -> bool:
    """vLLM's legacy structural tag (`structures` and `triggers`), which xgrammar compiles
    through its own conversion (manager.py); the other form has `format`."""
    return "structures" in tag


def _check_legacy_structural_tag(tag: dict[str, Any], source: str) -> None:
    """The legacy tag's shape, as xgrammar will need it: non-empty triggers, non-empty
    structures, each with a begin that starts with exactly one trigger, an end and a schema
    (an object or a boolean; what is in it is the compiler's to check)."""
    def fail(what: str) -> None:
        raise StructuredOutputsError(f"{source}: structural_tag{what}.", source)

    unknown = set(tag) - _LEGACY_TAG_KEYS
    if unknown:
        fail(f" (legacy: structures and triggers) has unknown field(s) {', '.join(sorted(unknown))}")
    if tag.get("type", "structural_tag") != "structural_tag":
        fail(f'.type must be "structural_tag", got {tag["type"]!r}')
    if "format" in tag:
        fail(" has both format and structures: give one form")
    triggers, structures = tag.get("triggers"), tag["structures"]
    if not isinstance(triggers, list) or not triggers or not all(isinstance(t, str) and t for t in triggers):
        fail(f".triggers must be a non-empty list of non-empty strings, got {triggers!r}")
    if not isinstance(structures, list) or not structures:
        fail(f".structures must be a non-empty list of {{begin, schema, end}} objects, got {structures!r}")
    trigger_set = set(triggers)
    for index, structure in enumerate(structures):
        where = f".structures[{index}]"
        if not isinstance(structure, dict):
            fail(f"{where} must be a {{begin, schema, end}} object, got {type(structure).__name__}")
        unknown = set(structure) - _LEGACY_STRUCTURE_KEYS
        missing = _LEGACY_STRUCTURE_KEYS - set(structure)
        if unknown or missing:
            fail(f"{where} must have exactly begin, schema and end; "
                 + "; ".join(part for part in (f"unknown: {', '.join(sorted(unknown))}" if unknown else "",
                                               f"missing: {', '.join(sorted(missing))}" if missing else "") if part))
        begin, end, schema = structure["begin"], structure["end"], structure["schema"]
        if not isinstance(begin, str) or not begin:
            fail(f"{where}.begin must be a non-empty string, got {begin!r}")
        if not isinstance(end, str):
            fail(f"{where}.end must be a string, got {end!r}")
        if not isinstance(schema, (dict, bool)):
            fail(f"{where}.schema must be a JSON schema (an object or a boolean), got {type(schema).__name__}")
        # Each begin's prefixes looked up, not each trigger tried: linear in the tag's size.
        matching = [begin[:length] for length in range(1, len(begin) + 1) if begin[:length] in trigger_set]
        if len(matching) != 1:
            fail(f"{where}.begin {begin!r} must start with exactly one of the triggers; it starts with "
                 + (f"{len(matching)} ({', '.join(map(repr, matching))})" if matching else "none"))
