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
