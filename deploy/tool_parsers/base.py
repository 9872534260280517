"""What every tool-call parser shares: the parse of a model's text into content and calls,
and the scanning of one JSON call object as its text grows.

A parser reads the whole text so far (`parse(text, final)`) and returns its content and its
calls, each call's name once complete and its arguments as the raw JSON text generated so
far. While `final` is False the parse holds back what more text could still change (a
half-written tool-call marker, an object that may or may not turn out to be a call), so
that content and arguments only ever grow: a stream sends their new ends as deltas
(`ToolCallStreamer`), and the deltas add up to what the whole text parses to.
"""

from __future__ import annotations

import json
import re
import secrets
import string
import uuid
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from raylm.deploy.tool_parsers.incremental import IncrementalParse

_DECODER = json.JSONDecoder()
_WHITESPACE = re.compile(r"\s*")
# The keys under which a call object may hold its arguments: "arguments" (Hermes, Mistral)
# or "parameters" (Llama 3.1's JSON calls).
ARGUMENT_KEYS = ("arguments", "parameters")


@dataclass
class ParsedCall:
    """One tool call: its name (None until complete), its arguments' JSON text so far, and
    whether the arguments are complete."""

    name: str | None
    arguments: str = ""
    complete: bool = False


@dataclass
class ParsedToolOutput:
    content: str
    calls: list[ParsedCall] = field(default_factory=list)

    @property
    def tools_called(self) -> bool:
        return bool(self.calls)


class ToolParser:
    """A model family's tool-call format (vLLM's `--tool-call-parser NAME`)."""

    name = ""
    # Whether it reads gpt-oss's calls as the openai_gptoss reasoning parser passes them on
    # in the content (the `openai` parser); other formats' calls are in the model's text.
    reads_harmony_calls = False

    def __init__(self, tools: list[dict[str, Any]] | None = None) -> None:
        # The request's tools, as the chat template is given them (a format whose values
        # are untyped text reads their types from them: qwen3_coder).
        self.tools = tools or []

    def parse(self, text: str, final: bool) -> ParsedToolOutput:
        raise NotImplementedError

    def incremental(self) -> IncrementalParse:
        """`parse` of one streamed reply, a delta at a time (tool_parsers/incremental.py)."""
        raise NotImplementedError

    def adjust_skip_special_tokens(self) -> bool | None:
        """The skip_special_tokens that requests with tools need (the tool-call marker is a
        special token for some of the family's tokenizers), or None to leave it."""
        return None

    def make_tool_call_id(self) -> str:
        return random_tool_call_id()


def random_tool_call_id() -> str:
    """vLLM's tool call id."""
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


def random_alphanumeric_id(length: int = 9) -> str:
    """Mistral's tool call ids: 9 letters and digits (its chat template checks them)."""
    alphabet = string.ascii_letters + string.digits
    return "".join(secrets.choice(alphabet) for _ in range(length))


def skip_whitespace(text: str, pos: int) -> int:
    return _WHITESPACE.match(text, pos).end()


def value_end(text: str, pos: int, final: bool) -> int | None:
    """Where the JSON value starting at `pos` ends. None while the text may still complete
    it (not `final`): the text ends inside it, or is not JSON yet, or ends in a number that
    may gain digits. With `final`, a value that is not there raises ValueError."""
    try:
        _, end = _DECODER.raw_decode(text, pos)
    except json.JSONDecodeError as exc:
        if final:
            raise ValueError(f"no JSON value at {pos}: {exc.msg}") from None
        return None
    except RecursionError:
        # Nested past what the decoder follows: not calls this server can read.
        raise ValueError(f"a JSON value at {pos} nested too deeply to decode") from None
    if end == len(text) and not final and text[pos] in "-0123456789":
        return None
    return end


@dataclass
class ScannedCall:
    """One call object of a model's text: its name, where its arguments' text lies (or,
    when the arguments came before the name, their JSON written again), and its end."""

    name: str | None
    arguments_start: int | None = None
    arguments_end: int | None = None
    # The index after the object's closing brace; None while it is open.
    end: int | None = None
    rewritten_arguments: str | None = None

    def parsed(self, text: str) -> ParsedCall:
        """The ParsedCall: its arguments' text so far."""
        if self.rewritten_arguments is not None:
            return ParsedCall(self.name, self.rewritten_arguments, True)
        if self.arguments_start is None:
            return ParsedCall(self.name)
        end = self.arguments_end if self.arguments_end is not None else len(text)
        return ParsedCall(self.name, text[self.arguments_start:end], self.arguments_end is not None)


# `{"name": "<string>", "<key>": ` with any whitespace: a call written name first.
_CALL_HEAD = re.compile(r'\{\s*"name"\s*:\s*(?P<name>"(?:[^"\\]|\\.)*")\s*,\s*"(?P<key>[A-Za-z_]+)"\s*:\s*')


def scan_call(text: str, pos: int, final: bool, argument_keys: tuple[str, ...] = ARGUMENT_KEYS
              ) -> ScannedCall:
    """Scans the call object `{"name": ..., "arguments": {...}}` starting at `pos` (a "{").
    Written name first (as models and the grammars here write it), its name and its
    arguments' start are known as soon as they are written; otherwise once the object is
    complete. Raises ValueError when the text there is not a call object."""
    head = _CALL_HEAD.match(text, pos)
    if head is None or head.group("key") not in argument_keys:
        end = value_end(text, pos, final)
        if end is None:
            return ScannedCall(None)
        value = json.loads(text[pos:end])
        if not isinstance(value, dict) or not isinstance(value.get("name"), str) \
                or not any(key in value for key in argument_keys):
            raise ValueError("not a tool call object")
        arguments = next(value[key] for key in argument_keys if key in value)
        return ScannedCall(value["name"], end=end, rewritten_arguments=json.dumps(arguments, ensure_ascii=False))
    name = json.loads(head.group("name"))
    start = head.end()
    arguments_end = value_end(text, start, final)
    if arguments_end is None:
        return ScannedCall(name, start)
    close = skip_whitespace(text, arguments_end)
    if close >= len(text):
        if final:
            raise ValueError("an unclosed tool call object")
        return ScannedCall(name, start, arguments_end)
    if text[close] != "}":
        raise ValueError("a tool call object with more members")
    return ScannedCall(name, start, arguments_end, close + 1)


def scan_call_into(text: str, pos: int, final: bool, calls: list[ParsedCall],
                   argument_keys: tuple[str, ...] = ARGUMENT_KEYS) -> int | None:
    """`scan_call`, for a parse of several calls: appends the call to `calls` once its name
    is known (with its arguments so far) and returns the object's end, None while it is
    open."""
    scanned = scan_call(text, pos, final, argument_keys)
    if scanned.name is not None:
        calls.append(scanned.parsed(text))
    return scanned.end


def held_back(text: str, marker: str) -> int:
    """How many characters at the end of `text` could be the start of `marker` (they are
    held back from the content until the next text tells)."""
    for length in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-length:]):
            return length
    return 0


def scan_call_array(text: str, pos: int, final: bool, calls: list[ParsedCall],
                    argument_keys: tuple[str, ...] = ARGUMENT_KEYS) -> None:
    """`[{"name": ..., "arguments": ...}, ...]` from text[pos] == "[": appends each call
    scanned so far to `calls`; raises ValueError on a malformed array, or (when final) an
    unclosed one."""
    pos = skip_whitespace(text, pos + 1)
    while pos < len(text):
        if text[pos] == "]":
            return
        end = scan_call_into(text, pos, final, calls, argument_keys)
        if end is None:
            return
        pos = skip_whitespace(text, end)
        if pos < len(text) and text[pos] == ",":
            pos = skip_whitespace(text, pos + 1)
        elif pos < len(text) and text[pos] != "]":
            raise ValueError("expected ',' or ']' between tool calls")
    if final:
        raise ValueError("an unclosed list of tool calls")
