"""gpt-oss's harmony response format, read from a reply's text a delta at a time.

A gpt-oss reply is a run of messages, each a header and a body:

    <|channel|>analysis<|message|>The user asks for Rome's weather.<|end|>
    <|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city":"Rome"}<|call|>

The prompt ends with `<|start|>assistant`, so the first header starts with `<|channel|>`;
later ones repeat `<|start|>` and the role. The header names the channel (`analysis`: the
chain of thought; `commentary`: tool calls and preambles; `final`: the answer), the
recipient of a tool call (`to=functions.NAME`, after the role or after the channel) and the
body's format (`<|constrain|>json`, or a bare word after the channel). A body ends with
`<|end|>`, or with `<|call|>` / `<|return|>`, which are end-of-sequence tokens (the engine
stops there, and their text may or may not be in the reply's text).

The markers are special tokens of the gpt-oss tokenizer: the server keeps them in the text
(`skip_special_tokens` off) so that the scan reads them. The scan works on the text, as
openai_harmony's StreamableParser works on the tokens (its o200k_harmony vocabulary cannot
be fetched here, and raylm serves the model's own tokenizer): a tail of a delta that may be
the start of a marker is held back until the next delta tells.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Literal

START = "<|start|>"
CHANNEL = "<|channel|>"
MESSAGE = "<|message|>"
CONSTRAIN = "<|constrain|>"
END = "<|end|>"
CALL = "<|call|>"
RETURN = "<|return|>"
# What ends a body: its end tokens, or the start of the next message without one.
BODY_ENDS = (END, CALL, RETURN, START)
# The recipient prefix of the request's function tools (vLLM's `functions.` namespace).
FUNCTIONS = "functions."

_RECIPIENT = re.compile(r"\bto=([^\s<]+)")
_CHANNEL_WORDS = re.compile(re.escape(CHANNEL) + r"\s*([^\s<]+)(?:\s+([^\s<]+))?")
_CONSTRAINT = re.compile(re.escape(CONSTRAIN) + r"\s*([^\s<]+)")


@dataclass(frozen=True)
class HarmonyHeader:
    """A message's header: its channel, its recipient (`functions.NAME` for a call to one of
    the request's tools) and its body's format (`json`), each None where not written."""

    channel: str | None = None
    recipient: str | None = None
    content_type: str | None = None

    @classmethod
    def parse(cls, text: str) -> HarmonyHeader:
        """The header whose text (between the message's start and `<|message|>`) is `text`."""
        recipient = _RECIPIENT.search(text)
        channel = _CHANNEL_WORDS.search(text)
        constraint = _CONSTRAINT.search(text)
        content_type = constraint.group(1) if constraint else None
        if content_type is None and channel is not None and channel.group(2) and \
                not channel.group(2).startswith("to="):
            content_type = channel.group(2)  # `<|channel|>commentary json`
        return cls(channel.group(1) if channel else None, recipient.group(1) if recipient else None, content_type)

    @property
    def function_name(self) -> str | None:
        """The tool this message calls (`to=functions.NAME`), None for any other message."""
        if self.recipient is None or not self.recipient.startswith(FUNCTIONS):
            return None
        return self.recipient[len(FUNCTIONS):]


@dataclass(frozen=True)
class HarmonyEvent:
    """What a delta of the reply holds: a message opening (its header read), text of the open
    message's body, or the open message closing."""

    kind: Literal["open", "text", "close"]
    header: HarmonyHeader
    text: str = ""


def held_back_markers(text: str, markers: tuple[str, ...]) -> int:
    """How many characters at the end of `text` could start one of `markers` (they are held
    back until the next text tells). tool_parsers.base.held_back for several markers; not
    imported from there, which imports this module's readers."""
    longest = min(max(len(marker) for marker in markers) - 1, len(text))
    for length in range(longest, 0, -1):
        if any(marker.startswith(text[-length:]) for marker in markers):
            return length
    return 0


class HarmonyScanner:
    """One reply's messages, a delta at a time. `feed` returns the events the delta brings:
    each message's opening once its header is complete, its body's text as it comes (a tail
    that may start a marker held back until the next delta, or the reply's end), its closing.

    Args:
        in_body: the prompt already opened a message (it ends with `<|message|>`), whose
            header is `header`; otherwise the reply starts with a header (the prompt ends
            with `<|start|>assistant`).
    """

    def __init__(self, in_body: bool = False, header: HarmonyHeader | None = None) -> None:
        self.phase: Literal["header", "body"] = "body" if in_body else "header"
        self.header = header or HarmonyHeader()
        self._pending = ""  # text read but not yet decided (a header, or a possible marker)

    def feed(self, delta: str, final: bool) -> list[HarmonyEvent]:
        events: list[HarmonyEvent] = []
        text = self._pending + delta
        # A header held from earlier deltas was searched already, up to a possible start of
        # `<|message|>` at its end: a long header costs its own length once.
        searched = max(len(self._pending) - len(MESSAGE) + 1, 0) if self.phase == "header" else 0
        self._pending = ""
        position = 0
        while position < len(text) or (final and self.phase == "body"):
            if self.phase == "header":
                at = text.find(MESSAGE, max(position, searched))
                if at == -1:
                    if not final:
                        self._pending = text[position:]
                    return events  # a header cut off by the reply's end opens nothing
                self.header = HarmonyHeader.parse(text[position:at])
                self.phase, position = "body", at + len(MESSAGE)
                events.append(HarmonyEvent("open", self.header))
                continue
            ends = [(at, marker) for marker in BODY_ENDS if (at := text.find(marker, position)) != -1]
            if ends:
                at, marker = min(ends)
                if at > position:
                    events.append(HarmonyEvent("text", self.header, text[position:at]))
                events.append(HarmonyEvent("close", self.header))
                # The markers are dropped: the next header is read from after them.
                position, self.phase = at + len(marker), "header"
                continue
            keep = 0 if final else held_back_markers(text[position:], BODY_ENDS)
            body = text[position:len(text) - keep]
            if body:
                events.append(HarmonyEvent("text", self.header, body))
            self._pending = text[len(text) - keep:]
            if final:
                events.append(HarmonyEvent("close", self.header))
                self.phase = "header"
            return events
        return events


def forced_call_structural_tag(functions: list[tuple[str, dict[str, Any]]], max_whitespace: int | None
                               ) -> dict[str, Any]:
    """An xgrammar structural tag for a reply that must call one of `functions` ((name,
    parameters schema) pairs): an analysis message (optional), its body free text, then
    `<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>` and JSON valid
    against NAME's parameters, which an end-of-sequence token (`<|call|>`) closes: xgrammar
    takes the stop tokens only as the grammar's end, never as a tag's text. The reply starts
    with a header (the prompt ends with `<|start|>assistant`), each later one with
    `<|start|>assistant`. One analysis message, not any number: the call must follow the
    reasoning's end (a model that wrote analysis message after analysis message would never
    have to call)."""
    analysis = {"type": "tag", "begin": f"{CHANNEL}analysis{MESSAGE}", "content": {"type": "any_text"},
                "end": f"{END}{START}assistant"}
    calls = [{"type": "tag", "begin": f"{CHANNEL}commentary to={FUNCTIONS}{name} {CONSTRAIN}json{MESSAGE}",
              "content": {"type": "json_schema", "json_schema": parameters, "max_whitespace_cnt": max_whitespace},
              "end": ""} for name, parameters in functions]
    call = calls[0] if len(calls) == 1 else {"type": "or", "elements": calls}
    return {"type": "structural_tag",
            "format": {"type": "sequence", "elements": [{"type": "optional", "content": analysis}, call]}}
