"""`mistral`: Mistral tool calls after the `[TOOL_CALLS]` token, in either of its formats:

    [TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}]     (v3 tokenizers)
    [TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}                           (v11 and later)

The content is the text before the first `[TOOL_CALLS]`. Tool call ids are 9 letters and
digits, as Mistral's chat templates require. `[TOOL_CALLS]` is a special token, so requests
with tools keep special tokens in their text.
"""

from __future__ import annotations

import json

from raylm.deploy.tool_parsers.base import ParsedCall, ParsedToolOutput, ToolParser, held_back, \
    random_alphanumeric_id, scan_call_array, skip_whitespace, value_end
from raylm.deploy.tool_parsers.incremental import CallArrayScan, CallView, IncrementalParse, JsonValueScan, \
    ParseView, find_marker

TOOL_CALLS = "[TOOL_CALLS]"
ARGS = "[ARGS]"


class MistralToolParser(ToolParser):
    name = "mistral"

    def adjust_skip_special_tokens(self) -> bool | None:
        return False

    def make_tool_call_id(self) -> str:
        return random_alphanumeric_id()

    def parse(self, text: str, final: bool) -> ParsedToolOutput:
        first = text.find(TOOL_CALLS)
        if first == -1:
            keep = len(text) if final else len(text) - held_back(text, TOOL_CALLS)
            return ParsedToolOutput(text[:keep])
        calls: list[ParsedCall] = []
        try:
            start = skip_whitespace(text, first + len(TOOL_CALLS))
            if start < len(text) and text[start] == "[":
                scan_call_array(text, start, final, calls)
            else:
                self._parse_named(text, first, final, calls)
        except ValueError:
            if final:
                return ParsedToolOutput(text)
        return ParsedToolOutput(text[:first], calls)

    @staticmethod
    def _parse_named(text: str, pos: int, final: bool, calls: list[ParsedCall]) -> None:
        """`[TOOL_CALLS]name[ARGS]{...}`, once per call."""
        while pos != -1:
            name_start = pos + len(TOOL_CALLS)
            args = text.find(ARGS, name_start)
            if args == -1:
                if final:
                    raise ValueError("a tool call without [ARGS]")
                return
            name = text[name_start:args].strip()
            start = skip_whitespace(text, args + len(ARGS))
            if start >= len(text):
                calls.append(ParsedCall(name))
                return
            end = value_end(text, start, final)
            if end is None:
                calls.append(ParsedCall(name, text[start:]))
                return
            json.loads(text[start:end])
            calls.append(ParsedCall(name, text[start:end], True))
            pos = text.find(TOOL_CALLS, end)

    def incremental(self) -> IncrementalParse:
        return MistralIncrementalParse()


class MistralIncrementalParse(IncrementalParse):
    """`parse`, a delta at a time: the content up to the first [TOOL_CALLS], then either a
    list of calls or calls by name."""

    def __init__(self) -> None:
        super().__init__()
        # content, form (after the first [TOOL_CALLS]), array; name, arguments_ws, arguments, between
        self.phase = "content"
        self._first = 0
        self._name_start = 0
        self._name = ""
        self._array: CallArrayScan | None = None
        self._value: JsonValueScan | None = None

    def _advance(self, window: str, base: int) -> None:
        i, phase = self.pos - base, self.phase
        if phase in ("content", "between", "name"):
            found, i = find_marker(window, i, ARGS if phase == "name" else TOOL_CALLS)
            self.pos = base + i
            if found is None:
                return
            if phase == "name":
                self._name = self.log.slice(self._name_start, base + found).strip()
                self.phase = "arguments_ws"
                return
            if phase == "content":
                self._first = base + found
            self._name_start = self.pos
            self.phase = "form" if phase == "content" else "name"
        elif phase == "form":
            i = skip_whitespace(window, i)
            self.pos = base + i
            if i < len(window):
                if window[i] == "[":
                    self.phase, self._array = "array", CallArrayScan(self.log, self.pos, self.completed)
                else:
                    self.phase = "name"
        elif phase == "array":
            self._array.advance(window, base)
            self.pos = self._array.pos
        elif phase == "arguments_ws":
            i = skip_whitespace(window, i)
            self.pos = base + i
            if i < len(window):
                self.phase, self._value = "arguments", JsonValueScan(self.log, self.pos)
        else:  # arguments
            self._value.advance(window, base)
            self.pos = self._value.pos
            if self._value.end is not None:
                self.completed.append(CallView(self._name, self._value.start, self._value.end))
                self.phase = "between"

    def _view(self, text_end: int, final: bool) -> ParseView | None:
        if self.phase == "content":
            return ParseView(text_end if final else self.pos)
        try:
            active = None
            if self.phase in ("form", "name") and final:
                raise ValueError("a tool call without [ARGS]")
            if self.phase == "array":
                active = self._array.view(text_end, final)
            elif self.phase == "arguments_ws":
                active = CallView(self._name, text_end)
            elif self.phase == "arguments":
                active = CallView(self._name, self._value.start, self._value.end_at(text_end, final))
        except ValueError:
            if final:
                return None
            active = None
        return ParseView(self._first, len(self.completed), active)
